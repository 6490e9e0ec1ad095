"""Host-staged GPU communication: CuPy arrays over an MPI that is not CUDA-aware (Aluminum's HostTransfer).

The MPI backend hands device arrays here when the probe (or ``LBANNPY_CUDA_AWARE_MPI=0``) says that MPI
cannot take device pointers. Staging is this explicit path of the backend, announced once at start-up by
the Runtime, never a copy hidden inside a primitive. Every operation runs in four steps:

1. on the calling thread: a *copy stream* of the buffer's device waits on the producer's event (``after=``,
   or one recorded on the calling thread's current stream) and copies each send buffer into pinned host
   memory (``ndarray.get(stream=..., out=pinned, blocking=False)``); an event is recorded after the copies;
2. on the *staging thread* (one per process, operations in posting order): it sleeps on the event (a
   blocking-sync event: no polling, and no other thread waits for the GPU here) until the copies are done,
   then posts the non-blocking MPI call on the pinned buffers;
3. ``wait()`` on the consumer's thread completes the MPI request (as the MPI backend does for host arrays);
4. the consumer's stream (the current stream of the thread that waits) copies the received pinned buffers
   into the device arrays (``ndarray.set(pinned, stream=...)``) and records a completion event, which the
   pinned buffers carry back to the pool: they are reused once it is done.

On a real GPU ``wait()`` of a staged operation blocks the waiting thread until MPI is done, and MPI starts
only once the copy down is: unlike NCCL, the host waits for the device there (the staging thread on the copy
event, the waiting thread on MPI). The staging thread is stopped (a sentinel) and joined by :func:`finalize`,
which the Runtime calls at teardown.

Collectives on one communicator are posted by the staging thread in the order they were issued. An
operation that the MPI backend issues directly on the same communicator (host arrays, pickled metadata,
split) first waits until every staged operation issued before it is posted, so that no two ranks can see
that communicator's collectives in different orders. Needs ``MPI_THREAD_MULTIPLE``.
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from .base import CommError, Handle

_STOP = object()  # the staging thread's sentinel
JOIN_S = 10.0  # seconds finalize waits for the staging thread to end
POOL_KEEP = 64  # free pinned buffers kept for reuse; older ones are released


class _Job:
    __slots__ = ("owner", "copied", "post", "req", "error", "posted")

    def __init__(self, owner, copied, post):
        self.owner, self.copied, self.post = owner, copied, post
        self.req = None
        self.error: BaseException | None = None
        self.posted = threading.Event()


class _Process:
    """What every host-staged communicator of this process shares: copy streams (one per device), the pinned
    buffer pool and the staging thread."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.lock = threading.Lock()
        self.unposted = threading.Condition(self.lock)
        self.streams: dict[int, object] = {}
        self.free: list[tuple[int, object, object]] = []  # (bytes, pinned memory, event or None)
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="lbannpy-host-staging", daemon=True)
        self.thread.start()

    # -- streams and pinned buffers -------------------------------------------------------------------
    def copy_stream(self, device_id: int):
        with self.lock:
            s = self.streams.get(device_id)
            if s is None:
                with self.cupy.cuda.Device(device_id):
                    s = self.streams[device_id] = self.cupy.cuda.Stream(non_blocking=True)
            return s

    def take(self, nbytes: int):
        """Pinned memory of at least ``nbytes``: a pooled buffer whose last device copy is done (asked
        without blocking), else a new one (sizes rounded up to a power of two, so that buffers are reused)."""
        with self.lock:
            for i, (size, mem, ev) in enumerate(self.free):
                if size >= nbytes and (ev is None or ev.done):
                    del self.free[i]
                    return mem, size
        size = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        return self.cupy.cuda.alloc_pinned_memory(size), size

    def give(self, bufs, event) -> None:
        with self.lock:
            self.free.extend((size, mem, event) for mem, size in bufs)
            del self.free[:-POOL_KEEP]

    # -- the staging thread ---------------------------------------------------------------------------
    def submit(self, job: _Job) -> None:
        with self.lock:
            job.owner.unposted += 1
        self.queue.put(job)

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is _STOP:
                return
            if job.copied is not None:  # a blocking-sync event: this thread sleeps until the copies are done
                job.copied.synchronize()
            try:
                job.req = job.post()
            except BaseException as exc:  # handed to the thread that waits
                job.error = exc
            with self.lock:
                job.owner.unposted -= 1
                self.unposted.notify_all()
            job.posted.set()

    def close(self, join_s: float = JOIN_S) -> bool:
        """Stop the staging thread after the operations already submitted (sentinel, join). False when it
        is still alive after ``join_s`` seconds (stuck in an MPI call, left to the job's end)."""
        self.queue.put(_STOP)
        self.thread.join(timeout=join_s)
        return not self.thread.is_alive()

    def drain(self, owner) -> None:
        """Block until every staged operation of ``owner`` issued so far is posted (not on the staging
        thread itself, which posts them)."""
        if threading.current_thread() is self.thread:
            return
        with self.lock:
            while owner.unposted:
                self.unposted.wait()


_process: _Process | None = None
_process_lock = threading.Lock()


def process(cupy) -> _Process:
    global _process
    with _process_lock:
        if _process is None:
            _process = _Process(cupy)
        return _process


def finalize() -> bool:
    """Stop and join the staging thread, if one was started (the Runtime's teardown, after the last staged
    operation was waited for). A later staged operation starts a new one. False when the thread did not
    end (see :meth:`_Process.close`)."""
    global _process
    with _process_lock:
        p, _process = _process, None
    return True if p is None else p.close()


def pinned_view(mem, shape, dtype) -> np.ndarray:
    return np.ndarray(tuple(shape), dtype=dtype, buffer=mem)


class StagedOp:
    """One host-staged operation being set up on the calling thread: ``send(array)`` stages a device array
    down and returns its pinned host view; ``recv(device_array)`` gives the pinned host view MPI writes and
    that lands in ``device_array`` at ``wait()``; ``start(post, result)`` hands the MPI call to the
    staging thread and returns the :class:`Handle`."""

    def __init__(self, owner, what: str, device_id: int, after=None):
        import cupy

        self.cupy = cupy
        self.p = process(cupy)
        self.owner, self.what, self.device_id = owner, what, device_id
        self.after = after
        self.sends: list = []  # (pinned memory, bytes)
        self.recvs: list = []  # (device array, host view, pinned memory, bytes)
        self.copied = None

    def send(self, arr) -> np.ndarray:
        cuda = self.cupy.cuda
        mem = self.p.take(arr.nbytes)
        host = pinned_view(mem[0], arr.shape, arr.dtype)
        with cuda.Device(self.device_id):
            stream = self.p.copy_stream(self.device_id)
            if not self.sends:  # the copies start after the producer's kernels
                producer = self.after
                if producer is None:
                    producer = cuda.Event(disable_timing=True)
                    producer.record(cuda.get_current_stream())
                stream.wait_event(producer)
            if not arr.flags.c_contiguous:  # packed on the copy stream, after the producer
                with stream:
                    arr = self.cupy.ascontiguousarray(arr)
            arr.get(stream=stream, out=host, blocking=False)
        self.sends.append(mem)
        return host

    def recv(self, arr, host: np.ndarray | None = None) -> np.ndarray:
        """Pinned host view for ``arr`` (or land ``host``, an already staged view, in ``arr``)."""
        mem = None
        if host is None:
            mem = self.p.take(arr.nbytes)
            host = pinned_view(mem[0], arr.shape, arr.dtype)
        self.recvs.append((arr, host, mem))
        return host

    def start(self, post, result, status=None) -> Handle:
        cuda = self.cupy.cuda
        if self.sends:
            with cuda.Device(self.device_id):
                self.copied = cuda.Event(block=True, disable_timing=True)  # the staging thread sleeps on it
                self.copied.record(self.p.copy_stream(self.device_id))
        job = _Job(self.owner, self.copied, post)
        self.p.submit(job)
        where, what = self.owner.where(), self.what
        completed = [False]

        def posted():
            job.posted.wait()
            if job.error is not None:
                err = job.error
                text = err.Get_error_string() if hasattr(err, "Get_error_string") else str(err)
                raise CommError(f"{where}: host-staged {what} failed to start: {text}") from err

        def wait():
            posted()
            if completed[0]:
                return
            try:
                job.req.Wait(status)
            except Exception as exc:
                text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
                raise CommError(f"{where}: MPI {what} failed: {text}; the ranks probably passed "
                                f"inconsistent sizes") from exc
            completed[0] = True

        def test():
            if completed[0]:
                return True
            if not job.posted.is_set():
                return False
            posted()
            completed[0] = bool(job.req.Test(status))
            return completed[0]

        def finish():
            out = result()
            landed = None
            if self.recvs:
                with cuda.Device(self.device_id):
                    # no wait on the copy down, even in place: the staging thread saw it done before MPI
                    consumer = cuda.get_current_stream()
                    for arr, host, _ in self.recvs:
                        arr.set(host, stream=consumer)
                    landed = cuda.Event(disable_timing=True)
                    landed.record(consumer)
            # the sends' copies were done before MPI was posted and MPI is done with them
            self.p.give(self.sends, None)
            self.p.give([r[2] for r in self.recvs if r[2] is not None], landed)
            self.sends, self.recvs = [], []
            return out

        return Handle(wait, test, finish, (), f"host-staged {what}")
