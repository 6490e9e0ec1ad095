"""NCCL backend: a :class:`~lbannpy.comm.base.Communicator` over ``cupy.cuda.nccl`` for CuPy arrays.

Bootstrap: NCCL has no launcher of its own. ``ncclCommInitRank`` needs the same ``ncclUniqueId`` (128
bytes that hold rank 0's bootstrap socket address) on every rank, so rank 0 creates it with
``nccl.get_unique_id()`` and broadcasts it over the MPI communicator the job already has. MPI stays the
out-of-band channel afterwards: the ``*_obj`` methods, ``split``, ``dup`` and the teardown barrier use it.

Devices: the communicator belongs to one GPU (the one current when it is built, normally chosen by
:func:`~lbannpy.comm.make_communicator` from the node-local rank; children inherit it). CuPy's current
device and stream are per thread (a new thread starts on device 0), so every CUDA call here runs inside
``with self._device``, whichever thread makes it.

Ordering, without host synchronization: every NCCL call is enqueued on this communicator's own
non-blocking stream after that stream waits (device side) on an event: the caller's ``after=`` event
(recorded on the stream that wrote the inputs) or one recorded on the calling thread's current stream of
this device. A handle records an event after its operation; ``wait()`` makes the caller's current stream
wait on it (device side) and returns at once: the host never blocks, so the launch queue stays full.
Events are made with ``disable_timing=True`` (cheaper to record and wait on), and reused: a stream wait
takes the event's state when it is enqueued, so the ordering event of each calling thread is recorded
again by every call, and a handle's event goes back to the communicator once every waiter is enqueued.
Steps that repeat their operations make no events after the first (a captured step keeps the same ones).

Point to point: an ``ncclSend`` blocks its stream until the peer posts the matching ``ncclRecv``, so a
send and a receive posted one after the other on two ranks that exchange data would deadlock. Sends and
receives are therefore queued and launched together in one ``groupStart``/``groupEnd`` at the first
``wait()``/``test()`` of any of them, before any collective, or on :meth:`NCCLCommunicator.flush`. Call
``flush()`` after posting the sends and receives of an exchange to start them before computing on
something else. NCCL matches messages between two ranks in the order they were posted; ``tag`` is
accepted for interface compatibility and used only in error messages.

CuPy is imported lazily (in the constructor and in functions), so ``import lbannpy.comm.nccl`` works on
machines without CuPy.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

from .base import CommError, Communicator, Handle, check_counts, check_op
from .mpi import MPICommunicator

_OP_NAMES = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN"}
_DTYPE_NAMES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16",
}


def _nccl():
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or CUDA failing while CuPy loads
        raise CommError(f"the NCCL backend needs CuPy built with NCCL ({exc}); install lbannpy[gpu] on a GPU "
                        f"node or use the 'mpi' backend") from exc
    if not getattr(nccl, "available", True):
        raise CommError("CuPy was built without NCCL; use the 'mpi' backend or a CuPy wheel with NCCL")
    return nccl


class NCCLCommunicator(Communicator):
    """Collective over ``bootstrap`` (an :class:`MPICommunicator`, whose ranks become the NCCL ranks):
    an NCCL communicator on the current CUDA device. It takes ownership of ``bootstrap`` and frees it in
    :meth:`free`. Buffers must be CuPy arrays on that device."""

    backend = "nccl"

    @property
    def host(self) -> MPICommunicator:
        """Host integers (votes, flags) are reduced over the MPI communicator NCCL was bootstrapped on."""
        return self._mpi

    def __init__(self, bootstrap: MPICommunicator, device: int | None = None):
        if not isinstance(bootstrap, MPICommunicator):
            raise CommError(f"NCCLCommunicator is bootstrapped over an MPICommunicator, got "
                            f"{type(bootstrap).__name__}")
        nccl = _nccl()
        import cupy
        self._cupy = cupy
        self._nccl_mod = nccl
        self._mpi = bootstrap
        self._rank = bootstrap.rank
        self._size = bootstrap.size
        # the rank's device (make_communicator selected it), or the parent's for a split/dup
        self._device = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        # Rank 0 makes the id; everyone must pass the identical 128 bytes to ncclCommInitRank (see module
        # docstring). The id is a tuple of small ints: internal metadata, fine for a pickled bcast.
        uid = nccl.get_unique_id() if self._rank == 0 else None
        uid = bootstrap.bcast_obj(uid, root=0)
        try:
            with self._device:
                self._comm = nccl.NcclCommunicator(self._size, uid, self._rank)
        except Exception as exc:
            raise CommError(f"rank {self._rank} of {self._size}: ncclCommInitRank failed on CUDA device "
                            f"{self._device.id}: {exc}; every rank needs its own GPU (check "
                            f"CUDA_VISIBLE_DEVICES and the ranks per node)") from exc
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pending: list[tuple] = []  # queued point-to-point ops: (kind, array, peer, tag, handle_state)
        self._spare_events: list = []  # handle events whose waits are all enqueued: recorded again
        self._orderers = threading.local()  # per calling thread: the event _begin orders this stream after
        self._children: list[Communicator] = []
        self._freed = False

    # -- identity -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def stream(self):
        """The CuPy stream every NCCL operation of this communicator runs on."""
        return self._stream

    def _where(self) -> str:
        return f"rank {self._rank} of {self._size}"

    def _live(self):
        if self._freed:
            raise CommError(f"{self._where()}: NCCL communicator was already freed")
        return self._comm

    # -- management -----------------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> "NCCLCommunicator | None":
        """Collective: split the MPI bootstrap, then build an NCCL communicator on each part."""
        self.flush()
        sub = self._mpi.split(color, key)
        if sub is None:
            return None
        child = NCCLCommunicator(self._mpi.release(sub), device=self._device.id)  # it owns ``sub`` now
        self._children.append(child)
        return child

    def dup(self) -> "NCCLCommunicator":
        self.flush()
        child = NCCLCommunicator(self._mpi.release(self._mpi.dup()), device=self._device.id)
        self._children.append(child)
        return child

    def free(self) -> None:
        """Collective, ordered teardown: children first, then finish this stream's work, wait for every
        rank (so no peer still has an operation in flight towards us), destroy NCCL, free MPI.
        Idempotent."""
        if self._freed:
            return
        for child in reversed(self._children):
            child.free()
        self._children.clear()
        self._launch_pending()
        self._stream.synchronize()
        self._mpi.barrier()
        with self._device:
            self._comm.destroy()
        self._freed = True
        self._mpi.free()

    def barrier(self) -> None:
        """Collective: all NCCL work queued so far on this rank has finished and every rank got here."""
        self.flush()
        self._stream.synchronize()
        self._mpi.barrier()

    def abort(self, code: int = 1) -> None:
        """Not collective: abort NCCL (so no kernel waits for a peer forever), then the MPI job."""
        try:
            if not self._freed:
                self._comm.abort()
        finally:
            self._mpi.abort(code)

    # -- helpers --------------------------------------------------------------------------------------
    def _check_array(self, buf, what: str):
        cp = self._cupy
        if not isinstance(buf, cp.ndarray):
            raise CommError(f"{self._where()}: {what} on the NCCL backend needs a CuPy array, got "
                            f"{type(buf).__module__}.{type(buf).__name__}; use the 'mpi' backend for host "
                            f"arrays")
        if buf.device.id != self._device.id:
            raise CommError(f"{self._where()}: {what}: array lives on GPU {buf.device.id} but this "
                            f"communicator uses GPU {self._device.id}")
        return buf

    def _contig(self, buf, what: str, writable: bool = False):
        buf = self._check_array(buf, what)
        if buf.flags.c_contiguous:
            return buf
        if writable:
            raise CommError(f"{self._where()}: {what} writes into a non-contiguous array of shape "
                            f"{buf.shape}; pass a contiguous buffer")
        with self._device:  # a copy on this thread's current stream, which _begin orders NCCL after
            return self._cupy.ascontiguousarray(buf)

    def _dtype(self, dtype, what: str) -> int:
        name = _DTYPE_NAMES.get(str(dtype))
        code = getattr(self._nccl_mod, name, None) if name else None
        if code is None:
            raise CommError(f"{self._where()}: {what}: NCCL has no datatype for {dtype}; use float16/32/64 "
                            f"or (u)int8/32/64")
        return code

    def _op(self, op: str) -> int:
        return getattr(self._nccl_mod, _OP_NAMES[check_op(op)])

    def _event(self):
        """An event of this device free to record (a spare one, else a new one); no timing (cheaper to
        record and to wait on)."""
        try:
            return self._spare_events.pop()
        except IndexError:
            with self._device:
                return self._cupy.cuda.Event(disable_timing=True)

    def _begin(self, after=None):
        """Order this stream after the inputs' producers: ``after`` (an event recorded on the stream that
        wrote them) or else the calling thread's current stream on this device. Device side only."""
        self._live()
        with self._device:
            if after is None:  # the wait below is enqueued at once: the thread's one event is reused
                ev = getattr(self._orderers, "event", None)
                if ev is None:
                    ev = self._orderers.event = self._cupy.cuda.Event(disable_timing=True)
                after = self._cupy.cuda.get_current_stream().record(ev)
            self._stream.wait_event(after)
        return self._stream

    def _consume(self, ev) -> None:
        """The calling thread's current stream on this device waits (device side) for ``ev``."""
        with self._device:
            self._cupy.cuda.get_current_stream().wait_event(ev)

    def _handle(self, what: str, buffers, finish=None) -> Handle:
        ev = self._stream.record(self._event())

        def wait():
            self._consume(ev)
            self._spare_events.append(ev)  # its one wait is enqueued: free to record again

        return Handle(wait, lambda: ev.done, finish, buffers, what)

    def _empty(self, like, shape):
        with self._device:
            return self._cupy.empty(shape, dtype=like.dtype)

    def _nccl_call(self, what: str, fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # NcclError, CUDA errors
            raise CommError(f"{self._where()}: NCCL {what} failed: {exc}") from exc

    @staticmethod
    def _ptr(arr, offset_elems: int = 0) -> int:
        return arr.data.ptr + offset_elems * arr.itemsize

    def _check_counts(self, counts, what: str, total=None, total_name: str = "buffer") -> list[int]:
        return check_counts(counts, self._size, self._where(), what, total, total_name)

    # -- collectives ----------------------------------------------------------------------------------
    def iallreduce(self, buf, op: str = "sum", out=None, after=None) -> Handle:
        """Collective: elementwise reduction into ``out`` (``out is buf``: in place). ``after``: an event
        recorded on the stream that wrote ``buf`` (default: the calling thread's current stream)."""
        code = self._op(op)
        self.flush()
        if after is not None and out is not buf \
                and not self._check_array(buf, "allreduce").flags.c_contiguous:
            self._consume(after)  # the contiguous copy made below (on the current stream) reads ``buf``
            after = None
        if out is buf:
            send = out = self._contig(buf, "allreduce (in place)", writable=True)
        else:
            send = self._contig(buf, "allreduce")
            if out is None:
                out = self._empty(send, send.shape)
            out = self._contig(out, "allreduce (output)", writable=True)
            if out.size != send.size or out.dtype != send.dtype:
                raise CommError(f"{self._where()}: allreduce: output has {out.size} elements of {out.dtype}, "
                                f"needs {send.size} of {send.dtype}")
        dt = self._dtype(send.dtype, "allreduce")
        s = self._begin(after)
        self._nccl_call("allreduce", self._comm.allReduce, send.data.ptr, out.data.ptr, send.size, dt, code,
                        s.ptr)
        return self._handle("allreduce", (send, out), lambda: out)

    def iallgather(self, buf) -> Handle:
        """Collective: same-shape ``buf`` from every rank; ``wait()`` returns ``(size, *shape)``."""
        self.flush()
        send = self._contig(buf, "allgather")
        out = self._empty(send, (self._size,) + tuple(send.shape))
        dt = self._dtype(send.dtype, "allgather")
        s = self._begin()
        self._nccl_call("allgather", self._comm.allGather, send.data.ptr, out.data.ptr, send.size, dt, s.ptr)
        return self._handle("allgather", (send, out), lambda: out)

    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        """Collective: NCCL has no allgatherv; one grouped broadcast per rank (rank i's ``counts[i]``
        elements into their place in the result)."""
        self.flush()
        counts = self._check_counts(counts, "allgatherv")
        if buf.size != counts[self._rank]:
            raise CommError(f"{self._where()}: allgatherv: this rank gives {buf.size} elements but "
                            f"counts[{self._rank}] = {counts[self._rank]} (counts {counts})")
        send = self._contig(buf.reshape(-1), "allgatherv")
        out = self._empty(send, (sum(counts),))
        dt = self._dtype(send.dtype, "allgatherv")
        s = self._begin()
        nccl = self._nccl_mod
        nccl.groupStart()
        try:
            off = 0
            for root, c in enumerate(counts):
                if c:
                    self._nccl_call("allgatherv", self._comm.broadcast, send.data.ptr, self._ptr(out, off),
                                    c, dt, root, s.ptr)
                off += c
        finally:
            nccl.groupEnd()
        return self._handle("allgatherv", (send, out), lambda: out)

    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        """Collective: ncclReduceScatter when all counts are equal; otherwise an allreduce of the whole
        buffer and a slice (NCCL has no reduce_scatterv; this costs ``size`` times the receive volume)."""
        code = self._op(op)
        self.flush()
        counts = self._check_counts(counts, "reduce_scatter", buf.size)
        send = self._contig(buf.reshape(-1), "reduce_scatter")
        dt = self._dtype(send.dtype, "reduce_scatter")
        even = len(set(counts)) == 1
        # outputs first: allocating writes on the current stream, which _begin orders the NCCL stream after
        out = self._empty(send, (counts[0],) if even else send.shape)
        s = self._begin()
        if even:
            self._nccl_call("reduce_scatter", self._comm.reduceScatter, send.data.ptr, out.data.ptr,
                            counts[0], dt, code, s.ptr)
            return self._handle("reduce_scatter", (send, out), lambda: out)
        full = out
        self._nccl_call("reduce_scatter", self._comm.allReduce, send.data.ptr, full.data.ptr, send.size, dt,
                        code, s.ptr)
        lo = sum(counts[:self._rank])
        with self._device, s:
            out = full[lo:lo + counts[self._rank]].copy()
        return self._handle("reduce_scatter", (send, full, out), lambda: out)

    def ialltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts: Sequence[int], out=None) -> Handle:
        """Collective: grouped send/recv with every peer (the self part is a device copy)."""
        self.flush()
        sendcounts = self._check_counts(sendcounts, "alltoallv (send)", sendbuf.size, "send buffer")
        recvcounts = self._check_counts(recvcounts, "alltoallv (recv)")
        send = self._contig(sendbuf.reshape(-1), "alltoallv")
        if out is None:
            out = self._empty(send, (sum(recvcounts),))
        out = self._contig(out, "alltoallv (output)", writable=True)
        if out.size != sum(recvcounts) or out.dtype != send.dtype:
            raise CommError(f"{self._where()}: alltoallv: output has {out.size} elements of {out.dtype}, "
                            f"needs {sum(recvcounts)} of {send.dtype}")
        dt = self._dtype(send.dtype, "alltoallv")
        s = self._begin()
        flat = out.reshape(-1)
        sdis, rdis = _displs(sendcounts), _displs(recvcounts)
        me = self._rank
        if sendcounts[me] != recvcounts[me]:
            raise CommError(f"{self._where()}: alltoallv: sends {sendcounts[me]} elements to itself but "
                            f"expects {recvcounts[me]}")
        if sendcounts[me]:
            with self._device, s:
                flat[rdis[me]:rdis[me] + recvcounts[me]] = send[sdis[me]:sdis[me] + sendcounts[me]]
        nccl = self._nccl_mod
        nccl.groupStart()
        try:
            for peer in range(self._size):
                if peer == me:
                    continue
                if sendcounts[peer]:
                    self._nccl_call("alltoallv send", self._comm.send, self._ptr(send, sdis[peer]),
                                    sendcounts[peer], dt, peer, s.ptr)
                if recvcounts[peer]:
                    self._nccl_call("alltoallv recv", self._comm.recv, self._ptr(flat, rdis[peer]),
                                    recvcounts[peer], dt, peer, s.ptr)
        finally:
            nccl.groupEnd()
        return self._handle("alltoallv", (send, out), lambda: out)

    def ibcast(self, buf, root: int = 0) -> Handle:
        """Collective: ``root``'s ``buf`` into ``buf`` on every rank (in place)."""
        self._check_rank(root, "bcast root")
        self.flush()
        arr = self._contig(buf, "bcast", writable=True)
        dt = self._dtype(arr.dtype, "bcast")
        s = self._begin()
        self._nccl_call("bcast", self._comm.bcast, arr.data.ptr, arr.size, dt, root, s.ptr)
        return self._handle("bcast", (arr,), lambda: buf)

    # -- point to point (queued, launched as one group) -----------------------------------------------
    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self._size:
            raise CommError(f"{self._where()}: {what} {r} does not exist (ranks 0..{self._size - 1})")

    def _queue(self, kind: str, arr, peer: int, tag: int, result) -> Handle:
        state: dict[str, Any] = {}
        self._pending.append((kind, arr, peer, tag, state))
        what = f"{kind} {'to' if kind == 'send' else 'from'} {peer} (tag {tag})"

        def wait():
            self._launch_pending()
            self._consume(state["event"])
            group = state["group"]
            group[0] -= 1
            if group[0] == 0:  # every operation of the group waited on: its event is free again
                self._spare_events.append(state["event"])

        def test():
            self._launch_pending()
            return state["event"].done

        return Handle(wait, test, (lambda: result), (arr,), what)

    def flush(self) -> None:
        """Launch the queued sends and receives now, as one NCCL group (non-blocking for the host)."""
        self._launch_pending()

    def _launch_pending(self) -> None:
        if not self._pending:
            return
        ops, self._pending = self._pending, []
        s = self._begin()
        nccl = self._nccl_mod
        nccl.groupStart()
        try:
            for kind, arr, peer, tag, _ in ops:
                if peer == self._rank:
                    raise CommError(f"{self._where()}: NCCL cannot {kind} to itself (tag {tag}); copy "
                                    f"locally")
                dt = self._dtype(arr.dtype, kind)
                fn = self._comm.send if kind == "send" else self._comm.recv
                self._nccl_call(f"{kind} with {peer} (tag {tag})", fn, arr.data.ptr, arr.size, dt, peer,
                                s.ptr)
        finally:
            nccl.groupEnd()
        ev = s.record(self._event())
        group = [len(ops)]  # handles not yet waited on
        for *_, state in ops:
            state["event"], state["group"] = ev, group

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Point to point (queued until a wait/test/flush or the next collective)."""
        self._check_rank(dest, "destination")
        self._live()
        return self._queue("send", self._contig(buf, "send"), dest, tag, None)

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Point to point (queued until a wait/test/flush or the next collective); NCCL needs the
        receive size to equal the send size."""
        self._check_rank(source, "source")
        self._live()
        return self._queue("recv", self._contig(buf, "recv", writable=True), source, tag, buf)

    # -- small Python values over the MPI bootstrap ---------------------------------------------------
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        return self._mpi.bcast_obj(obj, root)

    def allgather_obj(self, obj: Any) -> list:
        return self._mpi.allgather_obj(obj)


def _displs(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
