"""Stand-in for ``cupy.cuda.runtime`` (device count from LBANNPY_STANDIN_DEVICES, default 4)."""
from cupy import _standin


class CUDARuntimeError(RuntimeError):
    pass


# stream capture (CuPy's names; cupy.cuda._graph models the capture)
streamCaptureModeGlobal = 0
streamCaptureModeThreadLocal = 1
streamCaptureModeRelaxed = 2
streamCaptureStatusNone = 0
streamCaptureStatusActive = 1
streamCaptureStatusInvalidated = 2


def _stream_of(stream):
    from cupy import cuda
    if not isinstance(stream, int):
        raise TypeError(f"stream must be a pointer (int), got {type(stream).__name__}")
    dev = _standin.local.device
    if stream == 0:
        return cuda._null_streams.get(dev)
    for s in list(cuda._all_streams):
        if s.ptr == stream and s.device_id == dev:
            return s
    raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: stream {stream:#x} is not a stream of device "
                           f"{dev}")


def streamBeginCapture(stream, mode=streamCaptureModeRelaxed):
    _stream_of(stream).begin_capture(mode)


def streamIsCapturing(stream):
    from cupy.cuda import _graph
    return _graph.is_capturing(_stream_of(stream))


def getDeviceCount():
    return _standin.device_count()


def getDevice():
    return _standin.local.device


def setDevice(device):
    from cupy.cuda import Device
    Device(device).use()


def deviceSynchronize():
    from cupy.cuda import Device
    Device().synchronize()


def memGetInfo():
    total = 80 << 30
    used = sum(a.nbytes for a in list(_standin._allocs.values()) if a.device == _standin.local.device)
    return (total - used, total)


def runtimeGetVersion():
    return 12040
