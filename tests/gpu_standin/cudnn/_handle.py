"""``cudnn.Handle`` of the stand-in: the device current at ``create_handle`` and the stream set on it."""
import itertools

_ids = itertools.count(0x6000_0000, 16)


class DeviceInfo:
    """The little of the real ``cudnn.DeviceInfo`` the stand-in has: the device ordinal."""

    def __init__(self, ordinal):
        self.ordinal = ordinal

    def __repr__(self):
        return f"DeviceInfo(cuda:{self.ordinal})"


class Handle:
    """A cuDNN handle: ``backend_handle`` (an int; None once destroyed), its device, and ``stream`` (the
    stream pointer work on this handle is enqueued on; 0, the legacy default stream, until ``set_stream``)."""

    def __init__(self, backend_handle, ordinal=None, stream=None):
        self.backend_handle = None if backend_handle is None else int(backend_handle)
        self._ordinal = ordinal
        self.stream = stream

    @property
    def device(self):
        return DeviceInfo(self._ordinal)

    def __repr__(self):
        backend = "None" if self.backend_handle is None else f"0x{self.backend_handle:x}"
        return f"cudnn.Handle(backend_handle={backend}, cuda:{self._ordinal})"


def new_backend_handle():
    return next(_ids)
