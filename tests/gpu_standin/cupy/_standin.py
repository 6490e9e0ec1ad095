"""State of the strict CuPy stand-in: devices, allocator, streams, race checker, host-sync counter.

Only the test suite sees this package (``tests/gpu_standin`` first on ``sys.path``). Everything here is
NumPy-backed; the strictness (device ownership, stream order, host syncs) is what NumPy-only code lacks.
"""
import collections
import os
import sys
import threading

import numpy

_HERE = os.path.dirname(os.path.abspath(__file__))  # the stand-in package: call sites are outside it


def device_count():
    return int(os.environ.get("LBANNPY_STANDIN_DEVICES", "4"))


class _Local(threading.local):
    def __init__(self):
        self.device = 0          # a new thread starts on device 0, as with the CUDA runtime
        self.streams = {}        # device id -> current Stream of this thread


local = _Local()
_lock = threading.RLock()

# ---------------------------------------------------------------- host synchronisations by call site
# Counted per thread. A synchronisation blocks the thread that makes it: on a thread that submits GPU work
# (launches, copies, event records) it holds back every later submission, which is what the step's budget
# counts; a thread that never submits (a host-staging thread sleeping on a copy event before an MPI call)
# delays no submission, so its waits are reported apart (waiter_syncs). A thread counts as submitting from
# its first submission on, and every sync it made before that is counted with it.
_syncs = {}                # thread ident -> Counter {(kind, 'file:line'): count}
_submitters = set()        # idents of the threads that ever submitted GPU work


def note_submitter():
    """Called at every modelled submission (kernel launch, copy, event record)."""
    _submitters.add(threading.get_ident())


def _caller():
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_HERE):
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def count_sync(kind, stream=None, event=None, device=None):
    """Count a host synchronisation (refused while it involves an active stream capture: the stream, the
    current stream when none is given, an event recorded in a capture, or the device)."""
    if _active:
        from cupy.cuda import _graph
        _graph.on_host_sync(kind, stream, event, device)
    with _lock:
        _syncs.setdefault(threading.get_ident(), collections.Counter())[(kind, _caller())] += 1


def _total(submitting: bool) -> dict:
    out = collections.Counter()
    with _lock:
        for ident, counts in _syncs.items():
            if (ident in _submitters) == submitting:
                out.update(counts)
    return dict(out)


def host_syncs():
    """{(kind, 'file:line'): count} of host synchronisations since the last reset on threads that submit
    GPU work (see above)."""
    return _total(True)


def waiter_syncs():
    """{(kind, 'file:line'): count} of synchronisations since the last reset on threads that never
    submitted GPU work (waits that delay no submission)."""
    return _total(False)


def reset_host_syncs():
    with _lock:
        _syncs.clear()  # a thread that submitted before stays a submitting thread


# ---------------------------------------------------------------- allocator
class Allocation:
    __slots__ = ("ptr", "nbytes", "device", "buf", "last_write", "pool", "pool_key", "lease", "graphs",
                 "__weakref__")

    def __init__(self, ptr, nbytes, device):
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.buf = numpy.zeros(max(nbytes, 1), dtype=numpy.uint8)
        self.last_write = None   # (stream uid, seq, stream repr)
        self.pool = self.pool_key = self.lease = self.graphs = None  # pool blocks (cupy.cuda.memory)


import weakref  # noqa: E402

_allocs = weakref.WeakValueDictionary()  # base ptr -> Allocation, freed with its last array
_next_ptr = [1 << 32]


def allocate(nbytes, device):
    """A fresh allocation of the plain allocator (no pool)."""
    cap = capture_allocation(nbytes, device, None)
    a = new_allocation(nbytes, device)
    if cap is not None:
        cap.born.add(a)
    return a


def capture_allocation(nbytes, device, pool):
    """The capture an allocation belongs to (refused there unless ``pool`` is the capture's), or None."""
    if not _active:
        return None
    from cupy.cuda import _graph
    return _graph.on_allocate(nbytes, device, pool)


def new_allocation(nbytes, device):
    with _lock:
        ptr = _next_ptr[0]
        _next_ptr[0] += ((max(nbytes, 1) + 511) // 512) * 512 + 512
        a = Allocation(ptr, nbytes, device)
        _allocs[ptr] = a
        return a


def free(alloc):
    with _lock:
        _allocs.pop(alloc.ptr, None)


def resolve(ptr, nbytes):
    """The allocation holding [ptr, ptr + nbytes); refuses unknown pointers and out-of-range extents."""
    if not isinstance(ptr, int):
        raise TypeError(f"device pointer must be an int, got {type(ptr).__name__}")
    with _lock:
        for base, a in list(_allocs.items()):
            if base <= ptr < base + max(a.nbytes, 1):
                if ptr + nbytes > base + a.nbytes:
                    raise ValueError(f"range [{ptr:#x}, +{nbytes}) runs past the end of allocation "
                                     f"{base:#x} of {a.nbytes} bytes on device {a.device}")
                return a
    raise ValueError(f"pointer {ptr:#x} is not a live allocation of the stand-in allocator")


# ---------------------------------------------------------------- stream order (vector clocks)
_host_clock = {}        # what the host has observed as complete: stream uid -> seq


class RaceError(RuntimeError):
    """A buffer was read or written on a stream not ordered after its last write on another stream."""


def merge(dst, src):
    for k, v in src.items():
        if dst.get(k, 0) < v:
            dst[k] = v


_launches = collections.Counter()
_graph_launches = [0]
_active = []  # the active stream captures (cupy.cuda._graph.Capture); empty outside capture
_NOT_KERNELS = frozenset({"cupy.empty"})  # allocations launch nothing


def launches():
    """{what: count} of the device operations modelled since the last reset that write memory: kernels,
    copies, NCCL calls (a view, a reshape or an allocation launches nothing on a GPU and is not counted; an
    array expression that makes a new array counts once, an in-place one once)."""
    return dict(_launches)


def reset_launches():
    _launches.clear()
    _graph_launches[0] = 0


def graph_launches():
    """The number of ``cupy.cuda.Graph.launch`` calls (outside a capture) since the last reset_launches()."""
    return _graph_launches[0]


def capturing(stream):
    """Whether ``stream`` belongs to an active capture (its work is recorded into a graph)."""
    if not _active:
        return False
    from cupy.cuda import _graph
    return _graph.capture_of(stream) is not None


def launch(stream, reads=(), writes=(), what="kernel", replay=None, covered=False, count=True):
    """Model one kernel launch on ``stream`` reading/writing the given allocations. Called before the
    operation's work. On a capturing stream the launch is recorded instead: ``replay`` (a callable) redoes
    the work when the graph is launched; ``covered`` says another node's replay does it."""
    _submitters.add(threading.get_ident())
    if _active:
        from cupy.cuda import _graph
        if _graph.on_launch(stream, reads, writes, what, replay, covered, count):
            return
    with _lock:
        if writes and count and what not in _NOT_KERNELS:
            _launches[what] += 1
        merge(stream._clock, _host_clock)
        for a in list(reads) + list(writes):
            if a is None:
                continue
            lw = a.last_write
            if lw is None or lw[0] == stream._uid:
                continue
            if stream._clock.get(lw[0], 0) < lw[1]:
                raise RaceError(
                    f"{what} on {stream!r} touches buffer {a.ptr:#x} ({a.nbytes} bytes, device {a.device}) "
                    f"last written on {lw[2]} (seq {lw[1]}) with no event or synchronisation ordering them; "
                    f"record an event on the writing stream and wait_event it on {stream!r}")
        stream._clock[stream._uid] = stream._clock.get(stream._uid, 0) + 1
        seq = stream._clock[stream._uid]
        for a in writes:
            if a is not None:
                a.last_write = (stream._uid, seq, repr(stream))


def host_access(allocs, what="host access"):
    """Model the host (a CUDA-aware MPI, a copy by pointer) reading or writing the allocations outside any
    stream: every last write must already be complete as the host has observed it (a stream or event
    synchronisation on the writer's stream), or the host would read memory still being written."""
    if _active:
        from cupy.cuda import _graph
        _graph.on_host_access(allocs, what)
    with _lock:
        for a in allocs:
            lw = a.last_write
            if lw is None or a.nbytes == 0:  # nothing to read or write: no race
                continue
            if _host_clock.get(lw[0], 0) < lw[1]:
                raise RaceError(
                    f"{what} touches buffer {a.ptr:#x} ({a.nbytes} bytes, device {a.device}) on the host, "
                    f"but its last write on {lw[2]} (seq {lw[1]}) was never synchronised with the host; "
                    f"synchronize that stream (or an event recorded on it after the write) first")


# asynchronous device-to-host copies not yet seen by the host: (stream uid, seq, land); see defer()
_pending = []


def defer(stream, land):
    """Model an asynchronous copy to host memory just launched on ``stream``: ``land()`` writes the bytes
    once the host observes that launch complete, never earlier (a host reader that did not wait sees the
    old bytes)."""
    with _lock:
        _pending.append((stream._uid, stream._clock[stream._uid], land))


def host_observes(clock):
    with _lock:
        merge(_host_clock, clock)
        if _pending:
            done = [p for p in _pending if _host_clock.get(p[0], 0) >= p[1]]
            _pending[:] = [p for p in _pending if _host_clock.get(p[0], 0) < p[1]]
            for _, _, land in done:
                land()
