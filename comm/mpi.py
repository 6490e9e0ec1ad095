"""MPI backend: a :class:`~lbannpy.comm.base.Communicator` over an mpi4py communicator.

Arrays travel with the buffer (upper-case) mpi4py calls, which never pickle; only the ``*_obj`` methods
use the pickled (lower-case) calls, and only for small internal metadata. Every non-blocking call returns a
:class:`Handle` that keeps the send and receive buffers alive until ``wait()``.

CuPy arrays are handed to MPI as device pointers, which needs a CUDA-aware MPI. MPI reads and writes that
memory outside any CUDA stream, so the kernels that produced a buffer must have finished first: the caller
passes ``after=``, an event recorded on the producing stream (the overlap engine does, from its thread),
or else the calling thread's current stream *on the buffer's device* is synchronized (right when the
caller is the thread that launched the producers). CuPy's current device and stream are per thread, so
the calling thread's current stream of its current device can be another GPU's, or a stream that never
saw the producer.

On an MPI that is not CUDA-aware (the probe, or ``LBANNPY_CUDA_AWARE_MPI=0``) every operation on CuPy
arrays goes through the host-staged path of :mod:`lbannpy.comm.hoststaged` instead: pinned host buffers,
a copy stream ordered after the producer, MPI posted by a staging thread once the copies are done, and the
copies back on the consumer's stream. The Runtime says so in one line at start, so the cost is never
hidden.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from .hoststaged import StagedOp, process
from .base import CommError, Communicator, Handle, check_counts, check_op

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def thread_level_name(level: int) -> str:
    return _THREAD_LEVELS.get(level, str(level))


ABORT_GRACE_S = 0.3  # seconds between flushing this rank's last words and MPI_Abort


def abort_job(comm, code: int = 1) -> None:
    """Not collective: flush stdout/stderr, give the launcher time to forward them, ``MPI_Abort`` and never
    return.

    The launcher relays a rank's output asynchronously; aborting at once lets Hydra tear the job down
    before it has read what the rank just wrote (about one run in a hundred lost the whole failure
    message). MPICH's ``MPI_Abort`` may also return once the launcher has been told, and the other
    threads of this rank must not go on (or Python print the traceback a second time) while the launcher
    kills the job, hence ``os._exit``.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the abort
            pass
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)
    os._exit(code)


def query_thread() -> str:
    """The thread support level MPI was initialized with ('single' ... 'multiple')."""
    return thread_level_name(MPI.Query_thread())


_cuda_aware: bool | None = None


def cuda_aware_mpi() -> bool:
    """Whether the MPI library accepts CUDA device pointers.

    ``LBANNPY_CUDA_AWARE_MPI=1`` (or ``0``) overrides the probe; otherwise ``MPIX_Query_cuda_support`` is
    asked where the library has it (MPICH, Open MPI). Anything else counts as not CUDA-aware.
    """
    global _cuda_aware
    env = os.environ.get("LBANNPY_CUDA_AWARE_MPI")
    if env is not None:
        return env.strip().lower() in ("1", "yes", "true", "on")
    if _cuda_aware is None:
        _cuda_aware = _probe_cuda_support()
    return _cuda_aware


def _probe_cuda_support() -> bool:
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "libmpi" in line and ".so" in line})
    except OSError:
        libs = []
    for path in libs:
        try:
            fn = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return bool(fn())
    return False


def _is_cupy(buf) -> bool:
    return type(buf).__module__.startswith("cupy")


class MPICommunicator(Communicator):
    """A communicator over an mpi4py ``Intracomm``.

    ``owned=True`` (the default for communicators made by ``dup``/``split`` or a :class:`Runtime`) means
    :meth:`free` releases the MPI communicator; a wrapped ``COMM_WORLD`` is never freed.
    ``check=True`` makes the ``v`` collectives agree on their counts across ranks first (one small
    allgather each), so that inconsistent counts raise the same :class:`CommError` on every rank instead
    of truncating or hanging; meant for tests and debugging.
    """

    backend = "mpi"

    def __init__(self, comm: "MPI.Intracomm", owned: bool = False, check: bool = False):
        if comm == MPI.COMM_NULL:
            raise CommError("cannot build a communicator from MPI.COMM_NULL")
        self._comm = comm
        self._owned = owned and comm not in (MPI.COMM_WORLD, MPI.COMM_SELF)
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._freed = False
        self.check = check
        self._children: list[Communicator] = []
        self.unposted = 0  # host-staged operations issued but not yet posted to MPI (hoststaged.py)
        # CuPy arrays through host memory: None follows the probe (cuda_aware_mpi); True forces it (the
        # benchmarks compare it with device pointers or NCCL on the same ranks)
        self.host_staged: bool | None = None

    # -- identity -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def where(self) -> str:
        """``rank R of P``: how the errors of this communicator (and of its host staging) name it."""
        return f"rank {self._rank} of {self._size}"

    @property
    def mpi4py_comm(self) -> "MPI.Intracomm":
        """The mpi4py communicator underneath, for a library that takes one (parallel HDF5's ``mpio``
        driver); the one sanctioned way to the raw handle. Its collectives follow this communicator's."""
        return self._live()

    def _live(self) -> "MPI.Intracomm":
        if self._freed:
            raise CommError(f"{self.where()}: communicator was already freed")
        return self._comm

    # -- management -----------------------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> "MPICommunicator | None":
        """Collective: ranks with equal non-negative ``color`` form a new communicator ordered by ``key``."""
        c = MPI.UNDEFINED if color is None or color < 0 else int(color)
        sub = self._call("split", self._live().Split, c, self._rank if key is None else int(key))
        if sub == MPI.COMM_NULL:
            return None
        child = MPICommunicator(sub, owned=True, check=self.check)
        self._children.append(child)
        return child

    def dup(self) -> "MPICommunicator":
        """Collective: same ranks, separate message space."""
        child = MPICommunicator(self._call("dup", self._live().Dup), owned=True, check=self.check)
        self._children.append(child)
        return child

    def release(self, child: "MPICommunicator") -> "MPICommunicator":
        """Not collective: hand ``child`` (made by this communicator's ``split``/``dup``) over to the
        caller, who frees it from now on (e.g. an NCCL communicator bootstrapped over it); :meth:`free`
        no longer frees it with this one."""
        try:
            self._children.remove(child)
        except ValueError:
            raise CommError(f"{self.where()}: release: {child!r} was not split or duplicated from this "
                            f"communicator, or was released already") from None
        return child

    def free(self) -> None:
        """Collective: free this communicator and any still-live ones split or duplicated from it, newest
        first. Idempotent; does nothing after ``MPI.Finalize``."""
        if self._freed:
            return
        for child in reversed(self._children):
            child.free()
        self._children.clear()
        self._freed = True
        if self._owned and not MPI.Is_finalized():
            self._drain()
            self._comm.Free()

    @property
    def freed(self) -> bool:
        return self._freed

    def barrier(self) -> None:
        self._call("barrier", self._live().Barrier)

    def abort(self, code: int = 1) -> None:
        """Not collective: end every rank of the job (of ``MPI.COMM_WORLD``) with ``code``."""
        abort_job(self._comm if not self._freed else MPI.COMM_WORLD, code)

    # -- helpers --------------------------------------------------------------------------------------
    def _drain(self) -> None:
        # a direct call must not overtake this communicator's staged operations issued before it
        if self.unposted:
            process(sys.modules["cupy"]).drain(self)

    def _staged(self, buf) -> bool:
        """Whether ``buf`` travels through pinned host memory (a CuPy array on an MPI that is not
        CUDA-aware)."""
        if not _is_cupy(buf):
            return False
        return not cuda_aware_mpi() if self.host_staged is None else self.host_staged

    def _stage(self, what: str, buf, after=None):
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            raise CommError(f"{self.where()}: host-staged {what} posts MPI from a staging thread, which "
                            f"needs MPI_THREAD_MULTIPLE; this MPI gives {query_thread()}")
        return StagedOp(self, what, buf.device.id, after)

    def _writable_device(self, out, what: str):
        if not out.flags.c_contiguous:
            raise CommError(f"{self.where()}: {what} writes into a non-contiguous array of shape "
                            f"{out.shape}; pass a contiguous buffer (e.g. xp.ascontiguousarray)")
        return out

    def _call(self, what: str, fn, *args):
        self._drain()
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise CommError(f"{self.where()}: MPI {what} failed: {exc.Get_error_string()}") from exc

    def _request(self, what: str, req: "MPI.Request", finish=None, buffers=(), status=None) -> Handle:
        # Once Test() has completed the request, MPI has freed it: a later Wait() would see a null request
        # and overwrite ``status`` with an empty one, so completion is remembered here.
        completed = [False]

        def wait():
            if completed[0]:
                return
            try:
                req.Wait(status)
            except MPI.Exception as exc:
                raise CommError(f"{self.where()}: MPI {what} failed: {exc.Get_error_string()}; "
                                f"the ranks probably passed inconsistent sizes") from exc
            completed[0] = True

        def test():
            if completed[0]:
                return True
            try:
                completed[0] = req.Test(status)
            except MPI.Exception as exc:
                raise CommError(f"{self.where()}: MPI {what} failed: {exc.Get_error_string()}") from exc
            return completed[0]

        return Handle(wait, test, finish, buffers, what)

    def _prepare(self, buf, what: str, writable: bool = False, after=None):
        """Buffer spec ``(array, datatype)`` for MPI. Send-only buffers that are not contiguous are
        copied; buffers MPI writes into must already be contiguous. ``after``: see the module docstring."""
        if _is_cupy(buf):
            if not cuda_aware_mpi():
                raise CommError(
                    f"{self.where()}: {what} was given a CuPy array but this MPI is not CUDA-aware "
                    f"(MPIX_Query_cuda_support() is 0); use the 'nccl' backend for GPU arrays, build MPI "
                    f"with CUDA support, or set LBANNPY_CUDA_AWARE_MPI=1 if the probe is wrong")
            import cupy
            # MPI touches device memory outside any stream: finish the producer's kernels first, on the
            # buffer's device (not this thread's current one).
            with buf.device:
                if after is not None:
                    after.synchronize()
                else:
                    cupy.cuda.get_current_stream().synchronize()
                contiguous = buf.flags.c_contiguous
                if not contiguous and not writable:
                    buf = cupy.ascontiguousarray(buf)
                    cupy.cuda.get_current_stream().synchronize()
        else:
            if not isinstance(buf, np.ndarray):
                raise CommError(f"{self.where()}: {what} needs a NumPy or CuPy array, got "
                                f"{type(buf).__name__}")
            contiguous = buf.flags.c_contiguous
            if not contiguous and not writable:
                buf = np.ascontiguousarray(buf)
        if writable and not buf.flags.c_contiguous:
            raise CommError(f"{self.where()}: {what} writes into a non-contiguous array of shape "
                            f"{buf.shape}; pass a contiguous buffer (e.g. xp.ascontiguousarray)")
        if writable and not _is_cupy(buf) and not buf.flags.writeable:
            raise CommError(f"{self.where()}: {what} writes into a read-only array of shape {buf.shape}")
        return buf, self._datatype(buf.dtype, what)

    def _datatype(self, dtype, what: str) -> "MPI.Datatype":
        # Predefined datatypes only: reductions (MPI_SUM...) are not defined on derived ones.
        try:
            return MPI.Datatype.fromcode(np.dtype(dtype).char)
        except (KeyError, ValueError) as exc:
            raise CommError(f"{self.where()}: {what}: MPI has no predefined datatype for {dtype}; "
                            f"convert to float32/float64/int32/int64 first") from exc

    def _check_like(self, out, buf, what: str, shape=None) -> None:
        want_size = buf.size if shape is None else int(np.prod(shape))
        if out.dtype != buf.dtype or out.size != want_size:
            raise CommError(f"{self.where()}: {what}: output buffer has {out.size} elements of {out.dtype}, "
                            f"needs {want_size} elements of {buf.dtype}")
        if _is_cupy(out) != _is_cupy(buf):
            raise CommError(f"{self.where()}: {what}: input and output must both be NumPy or both CuPy")

    def _check_counts(self, counts: Sequence[int], what: str, total: int | None = None,
                      total_name: str = "buffer") -> list[int]:
        return check_counts(counts, self._size, self.where(), what, total, total_name)

    def _agree(self, what: str, mine, rule) -> None:
        """With ``check`` on: gather every rank's count metadata and apply ``rule(all) -> error or None``
        identically on every rank, so all raise together."""
        if not self.check:
            return
        every = self.allgather_obj(mine)
        err = rule(every)
        if err:
            raise CommError(f"{self.where()}: {what}: {err}")

    @staticmethod
    def _empty(buf, shape):
        if not _is_cupy(buf):
            return np.empty(shape, dtype=buf.dtype)
        with buf.device:  # on the buffer's GPU, whichever device is current in this thread
            return sys.modules["cupy"].empty(shape, dtype=buf.dtype)

    # -- collectives ----------------------------------------------------------------------------------
    def iallreduce(self, buf, op: str = "sum", out=None, after=None) -> Handle:
        """Collective: elementwise reduction of ``buf`` over all ranks into ``out`` (``out is buf``:
        in place). ``wait()`` returns ``out``. ``after``: for CuPy buffers, an event recorded on the
        stream that wrote ``buf`` (see the module docstring)."""
        check_op(op)
        comm = self._live()
        if self._staged(buf):
            st, dt = self._stage("allreduce", buf, after), self._datatype(buf.dtype, "allreduce")
            if out is buf:
                host = st.send(self._writable_device(buf, "allreduce (in place)"))
                st.recv(buf, host)
                return st.start(lambda: comm.Iallreduce(MPI.IN_PLACE, [host, dt], _OPS[op]), lambda: out)
            if out is None:
                out = self._empty(buf, buf.shape)
            self._check_like(out, buf, "allreduce")
            send, recv = st.send(buf), st.recv(self._writable_device(out, "allreduce (output)"))
            return st.start(lambda: comm.Iallreduce([send, dt], [recv, dt], _OPS[op]), lambda: out)
        if out is buf:
            out, dt = self._prepare(buf, "allreduce (in place)", writable=True, after=after)
            req = self._call("allreduce", comm.Iallreduce, MPI.IN_PLACE, [out, dt], _OPS[op])
            return self._request("allreduce", req, lambda: out, (out,))
        send, dt = self._prepare(buf, "allreduce", after=after)
        if out is None:
            out = self._empty(send, send.shape)
        self._check_like(out, send, "allreduce")
        out, _ = self._prepare(out, "allreduce (output)", writable=True)
        req = self._call("allreduce", comm.Iallreduce, [send, dt], [out, dt], _OPS[op])
        return self._request("allreduce", req, lambda: out, (send, out))

    def iallgather(self, buf) -> Handle:
        """Collective: ``buf`` has the same shape on every rank; ``wait()`` returns ``(size, *shape)``."""
        comm = self._live()
        send, dt = (buf, None) if self._staged(buf) else self._prepare(buf, "allgather")
        self._agree("allgather", (tuple(send.shape), str(send.dtype)),
                    lambda every: None if len(set(every)) == 1 else
                    f"ranks give different shapes/dtypes {every}; every rank must give the same")
        if self._staged(buf):
            st, dt = self._stage("allgather", buf), self._datatype(buf.dtype, "allgather")
            out = self._empty(buf, (self._size,) + tuple(buf.shape))
            send, recv = st.send(buf), st.recv(out)
            return st.start(lambda: comm.Iallgather([send, dt], [recv, dt]), lambda: out)
        out = self._empty(send, (self._size,) + tuple(send.shape))
        out, _ = self._prepare(out, "allgather (output)", writable=True)
        req = self._call("allgather", comm.Iallgather, [send, dt], [out, dt])
        return self._request("allgather", req, lambda: out, (send, out))

    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        """Collective: flat concatenation of every rank's ``buf`` (``counts[i]`` elements from rank i)."""
        comm = self._live()
        counts = self._check_counts(counts, "allgatherv")
        if buf.size != counts[self._rank]:
            raise CommError(f"{self.where()}: allgatherv: this rank gives {buf.size} elements but "
                            f"counts[{self._rank}] = {counts[self._rank]} (counts {counts})")
        self._agree("allgatherv", counts, lambda every: None if all(c == every[0] for c in every) else
                    f"ranks disagree on counts: {every}")
        if self._staged(buf):
            st, dt = self._stage("allgatherv", buf), self._datatype(buf.dtype, "allgatherv")
            out = self._empty(buf, (sum(counts),))
            send, recv = st.send(buf.reshape(-1)), st.recv(out)
            return st.start(lambda: comm.Iallgatherv([send, dt], [recv, (counts, _displs(counts)), dt]),
                            lambda: out)
        send, dt = self._prepare(buf.reshape(-1), "allgatherv")
        out = self._empty(send, (sum(counts),))
        out, _ = self._prepare(out, "allgatherv (output)", writable=True)
        displs = _displs(counts)
        req = self._call("allgatherv", comm.Iallgatherv, [send, dt], [out, (counts, displs), dt])
        return self._request("allgatherv", req, lambda: out, (send, out))

    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        """Collective: reduce the flat ``buf`` over all ranks; rank i keeps its ``counts[i]`` elements."""
        check_op(op)
        comm = self._live()
        counts = self._check_counts(counts, "reduce_scatter", buf.size)
        self._agree("reduce_scatter", counts, lambda every: None if all(c == every[0] for c in every) else
                    f"ranks disagree on counts: {every}")
        if self._staged(buf):
            st, dt = self._stage("reduce_scatter", buf), self._datatype(buf.dtype, "reduce_scatter")
            out = self._empty(buf, (counts[self._rank],))
            send, recv = st.send(buf.reshape(-1)), st.recv(out)
            return st.start(lambda: comm.Ireduce_scatter([send, dt], [recv, dt], counts, _OPS[op]),
                            lambda: out)
        send, dt = self._prepare(buf.reshape(-1), "reduce_scatter")
        out = self._empty(send, (counts[self._rank],))
        out, _ = self._prepare(out, "reduce_scatter (output)", writable=True)
        req = self._call("reduce_scatter", comm.Ireduce_scatter, [send, dt], [out, dt], counts, _OPS[op])
        return self._request("reduce_scatter", req, lambda: out, (send, out))

    def ialltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts: Sequence[int], out=None) -> Handle:
        """Collective: ``sendcounts[j]`` elements of the flat ``sendbuf`` go to rank j; ``wait()`` returns
        the flat receive buffer (``recvcounts[j]`` elements from rank j, in rank order)."""
        comm = self._live()
        sendcounts = self._check_counts(sendcounts, "alltoallv (send)", sendbuf.size, "send buffer")
        recvcounts = self._check_counts(recvcounts, "alltoallv (recv)")

        def rule(every):
            n = len(every)
            bad = [(i, j, every[i][0][j], every[j][1][i]) for i in range(n) for j in range(n)
                   if every[i][0][j] != every[j][1][i]]
            if bad:
                i, j, s, r = bad[0]
                return (f"rank {i} sends {s} elements to rank {j}, which expects {r} "
                        f"({len(bad)} mismatched pairs)")
            return None

        self._agree("alltoallv", (sendcounts, recvcounts), rule)
        if self._staged(sendbuf):
            st, dt = self._stage("alltoallv", sendbuf), self._datatype(sendbuf.dtype, "alltoallv")
            if out is None:
                out = self._empty(sendbuf, (sum(recvcounts),))
            self._check_like(out, sendbuf, "alltoallv", shape=(sum(recvcounts),))
            send = st.send(sendbuf.reshape(-1))
            recv = st.recv(self._writable_device(out, "alltoallv (output)")).reshape(-1)
            return st.start(lambda: comm.Ialltoallv([send, (sendcounts, _displs(sendcounts)), dt],
                                                    [recv, (recvcounts, _displs(recvcounts)), dt]),
                            lambda: out)
        send, dt = self._prepare(sendbuf.reshape(-1), "alltoallv")
        if out is None:
            out = self._empty(send, (sum(recvcounts),))
        self._check_like(out, send, "alltoallv", shape=(sum(recvcounts),))
        out, _ = self._prepare(out, "alltoallv (output)", writable=True)
        flat = out.reshape(-1)
        req = self._call("alltoallv", comm.Ialltoallv, [send, (sendcounts, _displs(sendcounts)), dt],
                         [flat, (recvcounts, _displs(recvcounts)), dt])
        return self._request("alltoallv", req, lambda: out, (send, out))

    def ibcast(self, buf, root: int = 0) -> Handle:
        """Collective: ``root``'s ``buf`` is copied into ``buf`` on every rank (in place); ``wait()``
        returns ``buf``."""
        self._check_rank(root, "bcast root")
        comm = self._live()
        self._agree("bcast", (buf.size, str(buf.dtype)),
                    lambda every: None if len(set(every)) == 1 else
                    f"ranks give buffers of different sizes/dtypes {every}")
        if self._staged(buf):
            st, dt = self._stage("bcast", buf), self._datatype(buf.dtype, "bcast")
            self._writable_device(buf, "bcast")
            host = st.send(buf) if self._rank == root else st.recv(buf)
            return st.start(lambda: comm.Ibcast([host, dt], root), lambda: buf)
        arr, dt = self._prepare(buf, "bcast", writable=True)
        req = self._call("bcast", comm.Ibcast, [arr, dt], root)
        return self._request("bcast", req, lambda: buf, (arr,))

    # -- point to point -------------------------------------------------------------------------------
    def _check_rank(self, r: int, what: str) -> None:
        if not isinstance(r, (int, np.integer)) or not 0 <= r < self._size:
            raise CommError(f"{self.where()}: {what} {r} does not exist (ranks 0..{self._size - 1})")

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Point to point: send ``buf`` (copied first if not contiguous) to ``dest``."""
        self._check_rank(dest, "destination")
        if self._staged(buf):
            st, dt = self._stage(f"send to {dest}", buf), self._datatype(buf.dtype, "send")
            host = st.send(buf)
            return st.start(lambda: self._live().Isend([host, dt], dest, tag), lambda: None)
        send, dt = self._prepare(buf, "send")
        req = self._call("send", self._live().Isend, [send, dt], dest, tag)
        return self._request(f"send to {dest}", req, None, (send,))

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Point to point: receive exactly ``buf.size`` elements from ``source`` into the contiguous
        ``buf``; a shorter or longer message is a :class:`CommError`."""
        self._check_rank(source, "source")
        if self._staged(buf):
            st, dt = self._stage(f"recv from {source}", buf), self._datatype(buf.dtype, "recv")
            host = st.recv(self._writable_device(buf, "recv"))
            status = MPI.Status()

            def landed():
                got = status.Get_count(dt)
                if got != buf.size:
                    raise CommError(f"{self.where()}: received {got} elements from rank {source} "
                                    f"(tag {tag}) into a buffer of {buf.size}; sender and receiver sizes "
                                    f"must match")
                return buf

            return st.start(lambda: self._live().Irecv([host, dt], source, tag), landed, status)
        arr, dt = self._prepare(buf, "recv", writable=True)
        status = MPI.Status()
        req = self._call("recv", self._live().Irecv, [arr, dt], source, tag)

        def finish():
            got = status.Get_count(dt)
            if got != arr.size:
                raise CommError(f"{self.where()}: received {got} elements from rank {source} (tag {tag}) "
                                f"into a buffer of {arr.size}; sender and receiver sizes must match")
            return buf

        return self._request(f"recv from {source}", req, finish, (arr,), status)

    # -- small Python values --------------------------------------------------------------------------
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Collective (pickled): ``root``'s object on every rank. Internal metadata only."""
        self._check_rank(root, "bcast_obj root")
        return self._call("bcast_obj", self._live().bcast, obj, root)

    def allgather_obj(self, obj: Any) -> list:
        """Collective (pickled): every rank's object, in rank order. Internal metadata only."""
        return self._call("allgather_obj", self._live().allgather, obj)

    def flush(self) -> None:
        """Start any deferred operations. MPI starts every operation when it is posted: nothing to do."""


def _displs(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
