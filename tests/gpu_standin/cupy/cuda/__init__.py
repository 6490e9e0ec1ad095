"""Stand-in for ``cupy.cuda``: devices (current device per thread), streams and events that belong to a
device, with stream order tracked by vector clocks (see ``cupy._standin``)."""
import itertools
import os

from cupy import _standin
from cupy.cuda import runtime  # noqa: F401
from cupy.cuda.pinned_memory import (PinnedMemoryPointer, PinnedMemoryPool,  # noqa: F401
                                     alloc_pinned_memory)

_uids = itertools.count(1)


def _check_id(i):
    n = _standin.device_count()
    if not isinstance(i, int) or not 0 <= i < n:
        raise runtime.CUDARuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {i} (count {n})")
    return i


class Device:
    """A CUDA device; ``use()`` makes it current for the calling thread only."""

    def __init__(self, device=None):
        self.id = _standin.local.device if device is None else _check_id(int(device))
        self._stack = []

    def use(self):
        _standin.local.device = self.id

    def __enter__(self):
        self._stack.append(_standin.local.device)
        self.use()
        return self

    def __exit__(self, *exc):
        _standin.local.device = self._stack.pop()

    def synchronize(self):
        """Host waits for every stream of this device."""
        _standin.count_sync("Device.synchronize", device=self.id)
        for s in list(_all_streams):
            if s.device_id == self.id:
                _standin.host_observes(s._clock)

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


import weakref  # noqa: E402

_all_streams = weakref.WeakSet()


class Stream:
    """A stream of the device current at construction; ``ptr`` is an int (0 for the legacy null stream)."""

    null = None  # set below

    def __init__(self, null=False, non_blocking=False, ptds=False):
        self.device_id = _standin.local.device
        self.non_blocking = non_blocking
        self._uid = next(_uids)
        self._clock = {}
        self.ptr = 0 if null else (0x7000_0000 + self._uid * 16)
        self._null = null
        self._prev = []
        _all_streams.add(self)

    def _check_device(self, what):
        if _standin.local.device != self.device_id:
            raise runtime.CUDARuntimeError(
                f"cudaErrorInvalidResourceHandle: {what} on {self!r} of device {self.device_id} while device "
                f"{_standin.local.device} is current")

    def record(self, event=None):
        if event is None:
            event = Event()
        event._record(self)
        return event

    def wait_event(self, event):
        """Later work on this stream waits for ``event``.

        The stand-in refuses an event of another device; CUDA itself allows cross-device waits, but our
        code never needs them and they hide a wrong current device."""
        self._check_device("wait_event")
        if event.device_id != self.device_id:
            raise runtime.CUDARuntimeError(
                f"wait_event: event of device {event.device_id} waited on {self!r} of device "
                f"{self.device_id}")
        if (_standin._active or event._capture is not None) and _graph.on_wait(self, event):
            return
        if event._clock is not None:
            _standin.merge(self._clock, event._clock)

    def synchronize(self):
        _standin.count_sync("Stream.synchronize", stream=self)
        _standin.host_observes(self._clock)

    @property
    def done(self):
        if _standin._active:
            _graph.on_query("Stream.done", stream=self)
        _standin.host_observes(self._clock)  # NumPy work is complete at launch
        return True

    # stream capture (cupy.cuda._graph)
    def begin_capture(self, mode=None):
        _graph.begin_capture(self, mode)

    def end_capture(self):
        return _graph.end_capture(self)

    def is_capturing(self):
        return _graph.is_capturing(self)

    def use(self):
        _standin.local.streams[_standin.local.device] = self
        return self

    def __enter__(self):
        self._prev.append(get_current_stream())
        self.use()
        return self

    def __exit__(self, *exc):
        self._prev.pop().use()

    def __repr__(self):
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


class _NullStreams:
    """The legacy default stream, one per device (``Stream.null`` is that of the current device)."""

    def __init__(self):
        self._by_dev = {}

    def get(self, dev):
        s = self._by_dev.get(dev)
        if s is None:
            with Device(dev):
                s = Stream(null=True)
            self._by_dev[dev] = s
        return s

    def __get__(self, obj, cls):
        return self.get(_standin.local.device)


Stream.null = _NullStreams()
_null_streams = Stream.__dict__["null"]
_ptds = {}


def get_current_stream(device_id=None):
    dev = _standin.local.device if device_id is None else device_id
    s = _standin.local.streams.get(dev)
    if s is not None:
        return s
    if os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") == "1":
        import threading
        key = (threading.get_ident(), dev)
        s = _ptds.get(key)
        if s is None:
            with Device(dev):
                s = Stream(ptds=True)
                s.ptr = 2  # cudaStreamPerThread
            _ptds[key] = s
        return s
    return _null_streams.get(dev)


class Event:
    """An event of the device current at construction."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise runtime.CUDARuntimeError("cudaErrorInvalidValue: interprocess event needs disable_timing")
        self.device_id = _standin.local.device
        self.block = block
        self.disable_timing = disable_timing
        self.interprocess = interprocess
        self._clock = None
        self._time = None
        self._capture = None  # the capture that recorded it last (cupy.cuda._graph)
        self.ptr = 0x5000_0000 + next(_uids) * 16

    def _record(self, stream):
        stream._check_device("Event.record")
        if stream.device_id != self.device_id:
            raise runtime.CUDARuntimeError(
                f"Event.record: event of device {self.device_id} recorded on {stream!r}")
        self._capture = None
        _standin.note_submitter()
        if _standin._active and _graph.on_record(self, stream):
            return
        import time
        self._clock = dict(stream._clock)
        self._time = time.perf_counter()

    def record(self, stream=None):
        self._record(get_current_stream() if stream is None else stream)

    def synchronize(self):
        _standin.count_sync("Event.synchronize", event=self)
        if self._clock is not None:
            _standin.host_observes(self._clock)

    @property
    def done(self):
        if _standin._active:
            _graph.on_query("Event.done", event=self)
        if self._clock is not None:
            _standin.host_observes(self._clock)
        return True


def get_elapsed_time(start_event, end_event):
    for e in (start_event, end_event):
        if _standin._active:
            _graph.on_host_sync("get_elapsed_time", event=e, invalidate=False)
        if e.disable_timing:
            raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: event created with "
                                           "disable_timing")
        if e._time is None:
            raise runtime.CUDARuntimeError("cudaErrorInvalidResourceHandle: event not recorded")
    _standin.count_sync("get_elapsed_time", event=end_event)
    return (end_event._time - start_event._time) * 1000.0


class MemoryPointer:
    def __init__(self, alloc, offset, lease=None):
        self.mem = alloc
        self.ptr = alloc.ptr + offset
        self.device_id = alloc.device
        # a pool block stays out of its pool while a pointer to it lives (cupy.cuda.memory)
        self._lease = lease if lease is not None else (alloc.lease() if alloc.lease is not None else None)

    @property
    def device(self):
        return Device(self.device_id)


from cupy.cuda import _graph  # noqa: E402
from cupy.cuda._graph import Graph as Graph  # noqa: E402
from cupy.cuda.memory import MemoryPool as MemoryPool  # noqa: E402
from cupy.cuda.memory import alloc as alloc  # noqa: E402
from cupy.cuda.memory import get_allocator as get_allocator  # noqa: E402
from cupy.cuda.memory import set_allocator as set_allocator  # noqa: E402
from cupy.cuda.memory import using_allocator as using_allocator  # noqa: E402


def __getattr__(name):
    if name == "nccl":
        import importlib
        return importlib.import_module("cupy.cuda.nccl")
    raise AttributeError(f"module 'cupy.cuda' (stand-in) has no attribute {name!r}")
