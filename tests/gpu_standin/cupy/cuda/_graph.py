"""Stream capture for the stand-in: ``Stream.begin_capture`` / ``end_capture`` -> ``cupy.cuda.Graph``, and
what CUDA refuses while a stream captures.

Model. While a stream captures, every operation issued to it (or to a stream that joined the capture by
waiting on an event recorded in it) becomes a node of the capture: its buffers, its name for the launch
counter and a replay closure over the buffers' memory. For the shapes of later operations, the stand-in
runs captured NumPy work on the device memory while capturing (NCCL calls are not run), and at
``end_capture`` rolls every buffer the capture wrote back to its contents before the capture and fills the
buffers allocated in the capture with 0xFF bytes: after ``end_capture`` nothing the capture computed is
visible until ``Graph.launch`` replays the nodes, in issue order, on the buffers' current contents, each
as one launch on the launch stream (stream order and launch counts checked as for eager work). The graph
holds its buffers' memory, but a pool block it uses returns to its pool when its last array is freed, as
on a GPU, where the graph would keep writing it: handing such a block to another allocation while the
graph is alive is refused.

Stream order inside the capture is checked with the capture's own vector clocks (an operation on a joined
stream that reads what the origin stream wrote must be ordered by an event), so a graph's internal order is
proven at capture time and its order against outside work at launch time.

Refused while capturing, naming the caller's ``file:line``, as the CUDA 13.2 runtime and CuPy 14.2 refused
on an H200 (tests/gpu_standin/capture_parity_check.py):
- by CUDA, invalidating the capture (``end_capture`` then raises cudaErrorStreamCaptureInvalidated):
  stream, event and device synchronisations and ``done`` queries that involve the capture (CuPy's
  ``done`` returns there without raising; the stand-in raises), a wait in the capture on an event
  recorded outside it, the legacy default stream while a blocking stream captures;
- by CuPy (``RuntimeError``; the capture goes on): device-to-host reads on a capturing current stream
  (``get``, ``item``, ``float`` ... and everything else counted as a host sync without a stream) and every
  host-to-device copy into a capturing stream, from pinned memory too; an elapsed time of a captured event
  (cudaErrorCapturedEvent, not invalidating);
- by the stand-in, as hazards CUDA does not catch (invalidating): allocations on a capturing stream not
  served by the capture's pool (the ``MemoryPool`` whose ``malloc`` is the current allocator,
  ``cupy.cuda.using_allocator(pool.malloc)``, when ``begin_capture`` is called), work on a stream outside
  the capture that touches a buffer the capture writes, and (``RaceError``) a freed pool block of a live
  graph handed to a new allocation. Capture modes are accepted and not told apart.
"""
import weakref

import numpy

from cupy import _standin
from cupy.cuda import runtime

_by_stream = {}     # stream uid -> the active Capture that stream belongs to
_launching = []     # streams of the graph launches in progress (a child graph replays on its parent's)


class _Node:
    __slots__ = ("what", "reads", "writes", "replay", "event", "count")

    def __init__(self, what, reads, writes, replay, event=None, count=True):
        self.what, self.reads, self.writes, self.replay = what, reads, writes, replay
        self.event, self.count = event, count


class Capture:
    def __init__(self, origin, mode, pool):
        self.origin = origin
        self.device = origin.device_id
        self.mode = mode
        self.pool = pool
        self.site = _standin._caller()
        self.streams = {origin._uid: origin}
        self.clocks = {origin._uid: {}}
        self.nodes = []
        self.last_write = {}      # Allocation -> (stream uid, seq, stream repr), inside the capture
        self.snap = {}            # Allocation -> its bytes before the capture first wrote it
        self.born = set()         # Allocations made on a capturing stream during the capture
        self.events = []
        self.invalid = None       # the first refusal: end_capture raises with it

    def describe(self):
        return f"the capture begun on {self.origin!r} at {self.site}"


def capture_of(stream):
    return _by_stream.get(stream._uid)


def _fail(cap, msg, exc=None):
    """Refuse an operation: invalidate ``cap`` (when given) and raise, naming the caller outside the
    stand-in."""
    full = f"{msg} (at {_standin._caller()})"
    if cap is not None and cap.invalid is None:
        cap.invalid = full
    raise (exc or runtime.CUDARuntimeError)(full)


def _check_valid(cap, what):
    if cap.invalid is not None:
        _fail(None, f"cudaErrorStreamCaptureInvalidated: {what} on a stream of {cap.describe()}, which an "
                    f"earlier error invalidated: {cap.invalid}")


# ---------------------------------------------------------------- begin / end
def begin_capture(stream, mode):
    if stream.ptr in (0, 1):
        raise RuntimeError("cannot capture on the default (legacy) stream")
    stream._check_device("begin_capture")
    if mode is None:
        mode = runtime.streamCaptureModeRelaxed
    if mode not in (runtime.streamCaptureModeGlobal, runtime.streamCaptureModeThreadLocal,
                    runtime.streamCaptureModeRelaxed):
        raise runtime.CUDARuntimeError(f"cudaErrorInvalidValue: capture mode {mode!r}")
    cap = capture_of(stream)
    if cap is not None:
        raise runtime.CUDARuntimeError(f"cudaErrorIllegalState: {stream!r} is already in {cap.describe()}")
    from cupy.cuda import memory
    cap = Capture(stream, mode, memory._current_pool())
    _by_stream[stream._uid] = cap
    _standin._active.append(cap)


def end_capture(stream):
    cap = capture_of(stream)
    if cap is None:
        raise runtime.CUDARuntimeError(f"cudaErrorIllegalState: end_capture on {stream!r}, which is not "
                                       f"capturing")
    if stream is not cap.origin:
        raise runtime.CUDARuntimeError(f"cudaErrorStreamCaptureUnmatched: end_capture on {stream!r}, but "
                                       f"{cap.describe()} must be ended there")
    for uid in cap.streams:
        _by_stream.pop(uid, None)
    _standin._active.remove(cap)
    _roll_back(cap)
    if cap.invalid is not None:
        raise runtime.CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: {cap.describe()} was "
                                       f"invalidated: {cap.invalid}")
    joined = cap.clocks[cap.origin._uid]
    for uid, s in cap.streams.items():
        own = cap.clocks[uid].get(uid, 0)
        if s is not cap.origin and joined.get(uid, 0) < own:
            raise runtime.CUDARuntimeError(
                f"cudaErrorStreamCaptureUnjoined: {s!r} joined {cap.describe()} and has captured work "
                f"that was not joined back into {cap.origin!r} (record an event on {s!r} after its last "
                f"work and wait_event it on {cap.origin!r} before end_capture)")
    return Graph._from(cap)


def is_capturing(stream):
    """CuPy's ``runtime.streamIsCapturing``: True while capturing; RuntimeError once invalidated."""
    cap = capture_of(stream)
    if cap is None:
        return False
    if cap.invalid is not None:
        raise RuntimeError("the stream was capturing, but an error has invalidated the capture sequence")
    return True


def _roll_back(cap):
    """Nothing the capture computed stays visible: written buffers get their contents back, buffers made in
    the capture get garbage (as fresh device memory would hold)."""
    for a, saved in cap.snap.items():
        a.buf[...] = saved
    for a in cap.born:
        a.buf.fill(0xFF)
    for e in cap.events:
        if e._capture is cap:  # recorded by the capture only: as if never recorded until a launch
            e._capture, e._clock, e._time = None, None, None


# ---------------------------------------------------------------- hooks from the stand-in
def on_launch(stream, reads, writes, what, replay, covered, count):
    """Called by ``_standin.launch`` while a capture is active. Returns True when the operation was
    recorded into a capture (the caller's work is a capture-time run only)."""
    cap = capture_of(stream)
    if cap is None:
        _check_outside(stream, list(reads) + list(writes), what)
        return False
    _check_valid(cap, what)
    if replay is None and not covered and writes and what not in _standin._NOT_KERNELS:
        raise AssertionError(f"stand-in: {what} was issued during capture without a replay")
    clock = cap.clocks[stream._uid]
    for a in list(reads) + list(writes):
        if a is None:
            continue
        lw = cap.last_write.get(a)
        if lw is not None and lw[0] != stream._uid and clock.get(lw[0], 0) < lw[1]:
            _fail(cap, f"{what} on {stream!r} touches buffer {a.ptr:#x} ({a.nbytes} bytes) written in "
                       f"{cap.describe()} on {lw[2]} with no event ordering them inside the capture",
                  _standin.RaceError)
    seq = clock[stream._uid] = clock.get(stream._uid, 0) + 1
    for a in writes:
        if a is not None:
            _written(cap, a, stream, seq)
    cap.nodes.append(_Node(what, [a for a in reads if a is not None], [a for a in writes if a is not None],
                           replay, count=count))
    return True


def _written(cap, a, stream, seq, before=None):
    if a not in cap.snap and a not in cap.born:
        cap.snap[a] = a.buf.copy() if before is None else before
    cap.last_write[a] = (stream._uid, seq, repr(stream))


def _check_outside(stream, allocs, what):
    """Work on a stream outside every capture must not touch what a capture writes: the values are not
    there until the graph is launched, and a launch would overwrite the work's results. The legacy default
    stream synchronises with every blocking stream, so it may not be used while one of them captures."""
    for cap in list(_standin._active):
        if cap.device != stream.device_id:
            continue
        if stream.ptr == 0 and any(not s.non_blocking for s in cap.streams.values()):
            _fail(cap, f"cudaErrorStreamCaptureImplicit (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT): {what} on the "
                       f"legacy default stream while a blocking stream is in {cap.describe()} (capture on "
                       f"Stream(non_blocking=True))")
        for a in allocs:
            if a is not None and a in cap.last_write:
                _fail(cap, f"{what} on {stream!r}, which did not join {cap.describe()}, touches buffer "
                           f"{a.ptr:#x} ({a.nbytes} bytes) that the capture writes; join the stream to the "
                           f"capture (wait_event on an event recorded in it) or use another buffer",
                      _standin.RaceError)


def before_call(stream, allocs):
    """The contents of the buffers a NumPy function reads, before a capture-time run of it (a function such
    as copyto writes an argument it does not declare as an output)."""
    cap = capture_of(stream)
    return cap, {a: a.buf.copy() for a in allocs if a is not None}


def after_call(stream, state):
    cap, before = state
    node = cap.nodes[-1]
    seq = cap.clocks[stream._uid][stream._uid]
    for a, saved in before.items():
        if not numpy.array_equal(a.buf, saved) and a not in node.writes:
            if not node.writes:  # counted as eagerly: by the declared outputs only
                node.count = False
            node.writes.append(a)
            _written(cap, a, stream, seq, before=saved)


def on_host_sync(kind, stream=None, event=None, device=None, invalidate=True):
    """A host synchronisation while a capture is active: refused when it involves a capture. With no
    stream, event or device it is a device-to-host read on the current stream, which CuPy itself refuses
    on a capturing stream (RuntimeError, the capture goes on); CUDA refuses the others and invalidates the
    capture, except an elapsed time of a captured event (``invalidate=False``)."""
    if device is not None:
        caps = [c for c in _standin._active if c.device == device]
        for cap in caps[1:]:  # every capture on the device is invalidated; the first one is named
            cap.invalid = cap.invalid or f"{kind} (at {_standin._caller()})"
        if caps:
            _fail(caps[0], f"cudaErrorStreamCaptureUnsupported: {kind} while {caps[0].describe()} is active")
        return
    if event is not None:
        cap = event._capture
        if cap is not None and cap in _standin._active:
            _fail(cap if invalidate else None,
                  f"cudaErrorCapturedEvent: {kind} of an event recorded in {cap.describe()}")
        return
    if stream is None:
        from cupy import cuda
        cap = capture_of(cuda.get_current_stream())
        if cap is not None:
            _fail(None, f"the current stream is capturing, so D2H transfers are disallowed ({kind} during "
                        f"{cap.describe()})", RuntimeError)
        return
    cap = capture_of(stream)
    if cap is not None:
        _fail(cap, f"cudaErrorStreamCaptureUnsupported: {kind} on {stream!r} during {cap.describe()}")


def on_host_to_device(stream, what):
    """CuPy refuses every host-to-device copy into a capturing stream, from pinned memory too (its
    ``copy_from_host_async`` checks the stream; the capture goes on): a graph's input is copied into its
    static buffer before the launch, outside the graph."""
    cap = capture_of(stream)
    if cap is not None:
        _fail(None, f"the current stream is capturing, so H2D transfers are disallowed ({what} on {stream!r} "
                    f"during {cap.describe()}; copy into the graph's input buffer before launching it)",
              RuntimeError)


def on_host_access(allocs, what):
    for cap in list(_standin._active):
        for a in allocs:
            if a in cap.last_write:
                _fail(cap, f"{what} touches buffer {a.ptr:#x} ({a.nbytes} bytes) on the host while "
                           f"{cap.describe()} writes it", _standin.RaceError)


def on_allocate(nbytes, device, pool):
    """An allocation by a thread whose current stream captures must come from the capture's pool."""
    from cupy import cuda
    cap = capture_of(cuda.get_current_stream(device))
    if cap is None:
        return None
    _check_valid(cap, "allocation")
    if cap.pool is None or pool is not cap.pool:
        where = "the default allocator" if pool is None else f"another pool ({pool!r})"
        own = "no pool was current at begin_capture" if cap.pool is None else f"its pool is {cap.pool!r}"
        _fail(cap, f"allocation of {nbytes} bytes on device {device} from {where} during {cap.describe()} "
                   f"({own}); make a cupy.cuda.MemoryPool current with "
                   f"cupy.cuda.using_allocator(pool.malloc) before begin_capture")
    return cap


def on_reuse(block, pool):
    """A pool block freed by its arrays is handed out again: refused while a live graph uses it."""
    # only a string in this frame: an error's traceback must not keep the graph alive
    site = next((g._site for g in list(block.graphs or ()) if g._alive), None)
    if site is not None:
        from cupy import cuda
        cap = capture_of(cuda.get_current_stream(block.device))
        _fail(cap, f"pool block {block.ptr:#x} ({block.nbytes} bytes) of {pool!r} is used by a live CUDA "
                   f"graph ({site}) but its arrays were freed, and it is now handed to a new "
                   f"allocation: launching the graph would overwrite it; keep the graph's arrays alive",
              _standin.RaceError)


def on_record(event, stream):
    """``Event.record`` on a capturing stream: the event becomes a node of the capture (others join the
    capture by waiting on it). Returns True when recorded into a capture."""
    cap = capture_of(stream)
    if cap is None:
        return False
    _check_valid(cap, "Event.record")
    event._capture = cap
    event._clock = dict(cap.clocks[stream._uid])
    event._time = None
    cap.events.append(event)
    cap.nodes.append(_Node("event record", [], [], None, event=event, count=False))
    return True


def on_wait(stream, event):
    """``Stream.wait_event`` while an event or the stream belongs to a capture. Returns True when handled
    here (joining a capture, ordering inside one)."""
    ecap = event._capture if event._capture in _standin._active else None
    cap = capture_of(stream)
    if ecap is None:
        if cap is not None and event._clock is not None:
            _fail(cap, f"cudaErrorStreamCaptureIsolation: {stream!r} in {cap.describe()} waits on an event "
                       f"recorded outside the capture (a dependency across the capture's boundary)")
        return False
    if cap is None:  # the stream joins the capture
        cap = ecap
        cap.streams[stream._uid] = stream
        cap.clocks[stream._uid] = {}
        _by_stream[stream._uid] = cap
    elif cap is not ecap:
        _fail(cap, f"cudaErrorStreamCaptureIsolation: {stream!r} in {cap.describe()} waits on an event "
                   f"of {ecap.describe()}")
    _check_valid(cap, "wait_event")
    _standin.merge(cap.clocks[stream._uid], event._clock)
    return True


def on_query(what, stream=None, event=None):
    """A non-blocking query (``Stream.done``, ``Event.done``) of a capturing stream or a captured event."""
    if stream is not None and capture_of(stream) is not None:
        cap = capture_of(stream)
        _fail(cap, f"cudaErrorStreamCaptureUnsupported: {what} of {stream!r} during {cap.describe()}")
    if event is not None and event._capture in _standin._active:
        _fail(event._capture, f"cudaErrorCapturedEvent: {what} of an event recorded in "
                              f"{event._capture.describe()}")


# ---------------------------------------------------------------- the graph
class Graph:
    """``cupy.cuda.Graph``: made by ``Stream.end_capture``; ``launch`` replays the captured work."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("currently this class cannot be initiated by the user and must be created "
                                  "via stream capture")

    @classmethod
    def _from(cls, cap):
        g = cls.__new__(cls)
        g._nodes = cap.nodes
        g._device = cap.device
        g._site = cap.describe()
        g._alive = True
        seen = {}
        for n in g._nodes:
            for a in n.reads + n.writes:
                seen[id(a)] = a
        g._allocs = list(seen.values())
        for a in g._allocs:
            if a.pool is not None:
                if a.graphs is None:
                    a.graphs = weakref.WeakSet()
                a.graphs.add(g)
        return g

    def __del__(self):
        self._alive = False

    def _stream(self, stream, what):
        from cupy import cuda
        s = cuda.get_current_stream() if stream is None else stream
        s._check_device(what)
        if s.device_id != self._device:
            raise runtime.CUDARuntimeError(f"cudaErrorInvalidValue: {what} of a graph of device "
                                           f"{self._device} on {s!r}")
        return s

    def launch(self, stream=None):
        s = self._stream(stream, "Graph.launch")
        cap = capture_of(s)
        if cap is not None:  # a child graph node of that capture
            reads = [a for n in self._nodes for a in n.reads]
            writes = [a for n in self._nodes for a in n.writes]
            _standin.launch(s, reads=reads, writes=writes, what="graph", count=False,
                            replay=lambda: self._run(_launching[-1]))
            return
        self._run(s)
        _standin._graph_launches[0] += 1

    def _run(self, stream):
        _launching.append(stream)
        try:
            for n in self._nodes:
                if n.event is not None:
                    n.event._record(stream)
                    continue
                _standin.launch(stream, reads=n.reads, writes=n.writes, what=n.what, count=n.count)
                if n.replay is not None:
                    n.replay()
        finally:
            _launching.pop()

    def upload(self, stream=None):
        """The stand-in has nothing to upload; the stream is checked as for a launch."""
        self._stream(stream, "Graph.upload")


# ---------------------------------------------------------------- replay helpers for the callers
def weak(arrays):
    """Views of ``arrays`` that do not hold their pool blocks (a graph does not own its memory)."""
    from cupy import ndarray
    return [ndarray._view(a._a, a._alloc, own=False) if isinstance(a, ndarray) else a for a in arrays]
