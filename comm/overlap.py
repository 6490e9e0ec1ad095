"""The overlap engine: gradient buckets reduced while backprop continues.

Set-up (collective, identical on every rank): parameters are taken in *reverse layer order* (the order
backprop produces their gradients), grouped by the communicator that reduces them, and cut into buckets
of at most ``bucket_bytes`` (the first one ``first_bucket_bytes``, so communication starts early). With
``chunk_layers=k`` (Lee et al.'s two-chunk mode) the cut is instead: the parameters of the last ``k``
layers, then everything else. The bucket order is fixed here and is the order in which buckets are
posted, so no collective is ever issued in a different order on different ranks.

Each group communicator is duplicated for the engine, so its messages never mix with the main thread's
(halo exchanges, shuffles, batch-norm statistics) and, on NCCL, its reductions run on their own stream.

During backprop the trainer calls :meth:`OverlapEngine.layer_done` after each layer's backward. Once
every parameter of a bucket (and of every bucket before it) is done, the bucket is posted. How it is
reduced depends on the communicator:

- NCCL (as DDP and ChainerMN do): no thread. The main thread enqueues the bucket's allreduce on the
  communicator's own stream at once, ordered after the compute stream by an event recorded there; the
  host never waits. NCCL can deadlock when operations on several communicators are issued concurrently
  in different orders on different ranks; from one thread, the buckets (in plan order) and the halo
  exchanges, shuffles and batch-norm reductions are issued in program order, the same on every rank.
- MPI with more than one rank: a background thread reduces the queued buckets in order (one allreduce
  each), so that the host-side progress of MPI overlaps backprop. That needs ``MPI_THREAD_MULTIPLE``
  (the engine refuses to start the thread without it). On a GPU (CUDA-aware MPI) the thread first makes
  the rank's device current (CuPy's current device is per thread; a new thread starts on device 0) and
  waits on an event recorded on the compute stream at posting, so MPI never reads a gradient that
  backward is still writing, whatever stream backward ran on.
- one rank: nothing to reduce; nothing is started (``runtime.backend: single`` overlaps trivially).

The trainer then calls :meth:`OverlapEngine.finish`, which takes the buckets in completion order (plan
order) and hands each to ``on_bucket`` (the optimizer updates that bucket's parameters) as soon as it is
reduced. On NCCL "reduced" means the compute stream now waits (device side) on the bucket's event, so the
optimizer's kernels, enqueued next on the compute stream, run after the reduction.

Each parameter's ``grad`` is made a view into its bucket's flat buffer at set-up (the layers accumulate
into ``grad`` in place), so a bucket is reduced where the gradients lie: no packing before the reduction
and no unpacking after it. That matters beyond the copies themselves: unpacking a 64 MiB bucket on the
main thread while the communication thread reduces the last one competes with it for the core and the
memory bus, and delayed that last, exposed reduction by several milliseconds. A ``grad`` that someone
rebinds to another array later is still handled, by copying it in and out.

Intervals of every reduction are recorded (``records``) for the overlap report: host times, except on
a GPU with NCCL and ``device_timing``, where the host only launches the allreduce: there they are CUDA
events on the communicator's stream, turned into seconds by :meth:`OverlapEngine.resolve` when a report
is built (never on the step path). The records of the last :data:`RECORD_STEPS` steps are kept (a run of
any length holds a bounded list; older events are dropped unread).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .base import CommError

_STOP = object()
#: steps whose bucket records are kept (the summary's median reduction times are over these)
RECORD_STEPS = 1024


@dataclass
class Bucket:
    """Parameters reduced together by one allreduce over ``comm``; ``buffer`` is packed in ``params``
    order."""

    index: int
    comm: object
    params: list
    offsets: list = field(default_factory=list)
    nbytes: int = 0
    buffer: object = None
    views: list = field(default_factory=list)
    pending: int = 0
    mode: str = "inline"  # "stream" (NCCL, enqueued by the main thread), "thread" (MPI), "inline"
    ready: object = None  # GPU: event recorded on the compute stream when the bucket is posted
    reduced: object = None  # GPU, thread mode: event after the reduction on the thread's stream
    handle: object = None  # stream mode: the allreduce in flight on the communicator's stream
    error: BaseException | None = None
    t_post: float = 0.0
    t_start: object = 0.0  # host seconds, or (``timed``) a CUDA event on the communicator's stream
    t_end: object = 0.0
    timed: bool = False  # GPU + NCCL with device timing: start and end are CUDA events


def plan_buckets(params: Sequence, comms: Sequence, bucket_bytes: int, first_bucket_bytes: int,
                 layer_of: Callable | None = None, chunk_layers: int | None = None) -> list[list[int]]:
    """Indices of ``params`` per bucket, in posting order. Pure: the same on every rank.

    ``params`` are given in forward order; buckets are cut in reverse order. A bucket never mixes
    communicators. With ``chunk_layers=k`` the cut is by layers: the last ``k`` layers (in forward order),
    then the rest (per communicator).
    """
    order = list(range(len(params)))[::-1]
    buckets: list[list[int]] = []
    if chunk_layers:
        layers = []
        for i in order:
            name = layer_of(params[i])
            if name not in layers:
                layers.append(name)
        first = set(layers[:chunk_layers])
        groups = ([i for i in order if layer_of(params[i]) in first],
                  [i for i in order if layer_of(params[i]) not in first])
        for g in groups:
            by_comm: dict[int, list[int]] = {}
            for i in g:
                by_comm.setdefault(id(comms[i]), []).append(i)
            buckets += [b for b in by_comm.values() if b]
        return buckets
    current: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    for i in order:
        key = id(comms[i])
        cap = first_bucket_bytes if not buckets else bucket_bytes
        nbytes = params[i].grad.nbytes
        if key in current and size[key] + nbytes > cap and current[key]:
            buckets.append(current.pop(key))
            size[key] = 0
        current.setdefault(key, []).append(i)
        size[key] = size.get(key, 0) + nbytes
    # flush the open buckets in the order their first parameter appeared (fixed on every rank)
    buckets += sorted(current.values(), key=lambda b: order.index(b[0]))
    return buckets


class OverlapEngine:
    """Collective set-up over every communicator in ``comms``: see the module docstring."""

    def __init__(self, params: Sequence, comms: Sequence, *, bucket_bytes: int = 25 << 20,
                 first_bucket_bytes: int = 1 << 20, overlap: bool = True, chunk_layers: int | None = None,
                 layer_of: Callable | None = None, thread_multiple: bool = True, xp=None,
                 device_timing: bool = False):
        self.params = list(params)
        self.overlap = bool(overlap)
        mod = xp if xp is not None else __import__("numpy")
        self._xp = mod
        # GPU: the rank's device, current in this (the main) thread; the thread selects it too
        self._device_id = mod.cuda.Device().id if mod.__name__.startswith("cupy") else None
        layer_of = layer_of or (lambda p: p.name.rsplit(".", 1)[0])
        plan = plan_buckets(self.params, comms, bucket_bytes, first_bucket_bytes, layer_of, chunk_layers)
        # one duplicate per distinct group communicator, created in plan order (collective, same everywhere)
        dups: dict[int, object] = {}
        self.buckets: list[Bucket] = []
        for b, idx in enumerate(plan):
            comm = comms[idx[0]]
            if id(comm) not in dups:
                dups[id(comm)] = comm.dup() if (self.overlap and comm.size > 1) else comm
            bucket = Bucket(b, dups[id(comm)], [self.params[i] for i in idx])
            off = 0
            for p in bucket.params:
                bucket.offsets.append(off)
                off += p.grad.size
            first = bucket.params[0].grad
            bucket.buffer = mod.empty(off, dtype=first.dtype)
            bucket.nbytes = bucket.buffer.nbytes
            for p, o in zip(bucket.params, bucket.offsets):  # gradients live in the bucket from now on
                view = bucket.buffer[o:o + p.grad.size].reshape(p.grad.shape)
                view[...] = p.grad
                p.grad = view
                bucket.views.append(view)
            if bucket.comm.size > 1 and self.overlap:
                bucket.mode = "stream" if getattr(bucket.comm, "backend", "") == "nccl" else "thread"
            if self._device_id is not None:  # reused every step: recorded at posting, waited on once
                with mod.cuda.Device(self._device_id):
                    bucket.ready = mod.cuda.Event(disable_timing=True)
            self.buckets.append(bucket)
        if any(b.mode == "thread" for b in self.buckets) and not thread_multiple:
            for c in dups.values():
                if c.size > 1 and self.overlap:
                    c.free()
            raise CommError("the overlap engine reduces gradients over MPI on a background thread, which "
                            "needs MPI_THREAD_MULTIPLE; this MPI gives less. Set comm.overlap: false")
        self._owned = [c for c in dups.values() if self.overlap and c.size > 1]
        self._bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
        self._layer_params: dict[str, list] = {}
        for p in self.params:
            self._layer_params.setdefault(layer_of(p), []).append(p)
        self.records: list[tuple] = []  # bucket, bytes, post, start, end (see :meth:`resolve`)
        # ``device_timing`` on a GPU: an NCCL bucket's start and end are timing events recorded on the
        # communicator's stream around its allreduce (host time there measures the launch). Nothing reads
        # them on the step path; :meth:`resolve` turns them into seconds when a report is built. MPI
        # reductions block the host until done, so their host times are the reduction's.
        self._events = self._device_id is not None and bool(device_timing)
        for bucket in self.buckets:
            bucket.timed = (self._events and bucket.comm.size > 1
                            and getattr(bucket.comm, "backend", "") == "nccl")
        self.clock = "cuda-events" if any(b.timed for b in self.buckets) else "host"
        self._resolved = 0  # records before this index hold seconds
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        self._completed: queue.Queue = queue.Queue()
        if any(b.mode == "thread" for b in self.buckets):
            self._thread = threading.Thread(target=self._run, name="lbannpy-grad-comm", daemon=True)
            self._thread.start()

    # -- the communication thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if self._device_id is not None:  # a new thread starts on device 0: select the rank's GPU first
            self._xp.cuda.Device(self._device_id).use()
        while True:
            bucket = self._queue.get()
            if bucket is _STOP:
                return
            self._reduce(bucket)
            self._completed.put(bucket)

    def _reduce(self, bucket: Bucket) -> None:
        """Blocking reduction (on the thread, or inline without overlap); on a GPU ordered after the
        compute stream by ``bucket.ready`` (MPI waits for it on the host, NCCL on its stream)."""
        bucket.t_start = time.perf_counter()
        try:
            if bucket.timed:  # NCCL without overlap: enqueued, then the compute stream waits on it
                self._nccl_allreduce(bucket).wait()
                with self._xp.cuda.Device(self._device_id):
                    self._xp.cuda.get_current_stream().wait_event(bucket.t_end)
                return
            if bucket.comm.size > 1:
                if bucket.ready is not None:
                    bucket.comm.allreduce(bucket.buffer, out=bucket.buffer, after=bucket.ready)
                    if bucket.mode == "thread":  # a host-staged MPI copied the sums back on this thread's
                        cuda = self._xp.cuda     # stream: the compute stream waits for it in finish()
                        bucket.reduced = bucket.reduced or cuda.Event(disable_timing=True)
                        bucket.reduced.record(cuda.get_current_stream())
                else:
                    bucket.comm.allreduce(bucket.buffer, out=bucket.buffer)
        except BaseException as exc:  # handed to the main thread, which raises it
            bucket.error = exc
        bucket.t_end = time.perf_counter()

    def _nccl_allreduce(self, bucket: Bucket):
        """Enqueue the bucket's allreduce on its NCCL communicator's stream, ordered after ``bucket.ready``;
        with ``bucket.timed`` between two timing events recorded on that stream, the start one after the
        stream waits for the gradients (so it marks when the reduction can begin, not the launch)."""
        if not bucket.timed:
            return bucket.comm.iallreduce(bucket.buffer, out=bucket.buffer, after=bucket.ready)
        cuda = self._xp.cuda
        with cuda.Device(self._device_id):
            stream = bucket.comm.stream
            start, end = cuda.Event(), cuda.Event()
            stream.wait_event(bucket.ready)
            stream.record(start)
            handle = bucket.comm.iallreduce(bucket.buffer, out=bucket.buffer, after=bucket.ready)
            stream.record(end)
        bucket.t_start, bucket.t_end = start, end
        return handle

    def resolve(self, seconds: Callable) -> None:
        """Turn the CUDA events of the records so far into seconds with ``seconds(event)`` (the step
        clock's, so bucket and backward times share a time base). Call only when every recorded event is
        complete: after the step clock settled on a mark recorded after :meth:`finish` (the compute stream
        waited there on each bucket's end event). A host-clock engine's records stay as they are."""
        for i in range(self._resolved, len(self.records)):
            b, nbytes, post, s, e = self.records[i]
            if not isinstance(s, float):
                self.records[i] = (b, nbytes, post, float(seconds(s)), float(seconds(e)))
            elif self.clock != "host":  # a one-rank bucket beside timed ones: no reduction, and host
                self.records[i] = (b, nbytes, post, 0.0, 0.0)  # seconds would not share their time base
        self._resolved = len(self.records)

    # -- the main thread ------------------------------------------------------------------------------------
    def start_step(self) -> None:
        while not self._completed.empty():  # posted by a step that was abandoned (a failed capture)
            self._completed.get_nowait()
        keep = RECORD_STEPS * max(len(self.buckets), 1)
        if len(self.records) >= 2 * keep:  # trimmed every RECORD_STEPS steps: a slice, not a shift a step
            cut = len(self.records) - keep
            del self.records[:cut]
            self._resolved = max(0, self._resolved - cut)
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.handle = None
            bucket.error = None
        self._next = 0  # index of the next bucket to post: buckets go out strictly in plan order

    def layer_done(self, layer_name: str) -> None:
        """Backprop finished ``layer_name``: its parameters' gradients are final on this rank."""
        for p in self._layer_params.get(layer_name, ()):
            bucket = self._bucket_of[id(p)]
            bucket.pending -= 1
        self._post_ready()

    def _post_ready(self) -> None:
        """Post every bucket whose gradients are all final, in plan order: a bucket that is complete
        before an earlier one (a layer's parameters split across two buckets) waits for it."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._post(self.buckets[self._next])
            self._next += 1

    def _post(self, bucket: Bucket) -> None:
        for p, off, view in zip(bucket.params, bucket.offsets, bucket.views):
            if getattr(p, "stale", False):  # no contribution this step (see Param.settle)
                p.settle()
            if p.grad is not view:  # rebound elsewhere: copy in (and out in finish)
                bucket.buffer[off:off + p.grad.size] = p.grad.reshape(-1)
        if bucket.ready is not None:  # the gradients are final once the compute stream gets here
            with self._xp.cuda.Device(self._device_id):
                self._xp.cuda.get_current_stream().record(bucket.ready)
        bucket.t_post = time.perf_counter()
        if bucket.mode == "thread":
            self._queue.put(bucket)
            return
        if bucket.mode == "stream":  # enqueued on the communicator's stream; the host does not wait
            bucket.t_start = bucket.t_post
            try:
                bucket.handle = self._nccl_allreduce(bucket)
            except BaseException as exc:
                bucket.error = exc
            if not bucket.timed:
                bucket.t_end = time.perf_counter()
        else:
            self._reduce(bucket)
        self._completed.put(bucket)

    def finish(self, on_bucket: Callable[[list], None] | None = None) -> None:
        """Post what is left (in plan order), then wait for every bucket; unpack each reduced bucket into
        its parameters' gradients and call ``on_bucket(params)`` as soon as it completes."""
        for bucket in self.buckets:  # parameters that backprop never reached (unused layers): post as is
            bucket.pending = 0
        self._post_ready()
        for _ in self.buckets:
            bucket = self._completed.get()
            if bucket.handle is not None:
                handle, bucket.handle = bucket.handle, None
                try:
                    handle.wait()  # NCCL: the compute stream waits on the bucket's event (device side)
                    if bucket.timed:  # ... and on its end event, so a later mark there implies it done
                        with self._xp.cuda.Device(self._device_id):
                            self._xp.cuda.get_current_stream().wait_event(bucket.t_end)
                except BaseException as exc:
                    bucket.error = exc
            if bucket.error is not None:
                raise CommError(f"gradient reduction of bucket {bucket.index} failed: {bucket.error}") \
                    from bucket.error
            if bucket.reduced is not None:
                with self._xp.cuda.Device(self._device_id):
                    self._xp.cuda.get_current_stream().wait_event(bucket.reduced)
            for p, off, view in zip(bucket.params, bucket.offsets, bucket.views):
                if p.grad is not view:
                    p.grad.reshape(-1)[...] = bucket.buffer[off:off + p.grad.size]
            self.records.append((bucket.index, bucket.nbytes, bucket.t_post, bucket.t_start, bucket.t_end))
            if on_bucket is not None:
                on_bucket(bucket.params)

    def close(self, join_s: float = 5.0) -> bool:
        """Stop the thread (sentinel, join) and free the duplicated communicators. Idempotent; safe after
        an exception elsewhere. A thread still alive after ``join_s`` seconds (stuck in a collective, left
        to the job's abort) may still use its communicators: they are not freed, and False is returned
        (True when everything was closed); a later call tries again."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=join_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        for c in self._owned:
            try:
                c.free()
            except Exception:
                pass
        self._owned = []
        return True


def hidden_fraction(comm_intervals: Sequence[tuple[float, float]],
                    compute_intervals: Sequence[tuple[float, float]]) -> float:
    """Share of communication time that overlapped computation (Lee et al.'s R as a fraction)."""
    total = sum(max(0.0, e - s) for s, e in comm_intervals)
    if total <= 0:
        return 0.0
    comp = sorted(compute_intervals)
    hidden = 0.0
    for s, e in comm_intervals:
        for cs, ce in comp:
            if ce <= s:
                continue
            if cs >= e:
                break
            hidden += max(0.0, min(e, ce) - max(s, cs))
    return min(1.0, hidden / total)
