"""The one narrow communicator interface every backend implements (MPI, NCCL, single rank).

Buffers are NumPy or CuPy arrays (whichever the backend was built for). Every method is collective over
the communicator unless its docstring says otherwise ("point to point"). Non-blocking variants return a
:class:`Handle` that keeps every buffer it touches alive until :meth:`Handle.wait`; waiting twice is an
error, so a result can never be read from a buffer that was already recycled.

Counts and displacements of the ``v`` variants are in elements, not bytes; flat (1-D, contiguous) buffers
are used for them so that the packing is visible to the caller and planned once.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

REDUCE_OPS = ("sum", "max", "min", "prod")


class CommError(RuntimeError):
    """Misuse of a communicator or handle (wrong sizes, waiting twice, a backend that cannot do it)."""


class Handle:
    """An operation in flight. ``wait()`` completes it once and returns its result.

    ``buffers`` holds references to every send and receive buffer so that they outlive the operation even
    if the caller drops its own references. ``finish`` runs after completion (e.g. unpacking) and its return
    value is the result of ``wait()``.
    """

    __slots__ = ("_wait", "_test", "_finish", "_buffers", "_done", "_result", "label")

    def __init__(self, wait: Callable[[], Any], test: Callable[[], bool] | None = None,
                 finish: Callable[[], Any] | None = None, buffers: Sequence[Any] = (), label: str = ""):
        self._wait = wait
        self._test = test
        self._finish = finish
        self._buffers = tuple(buffers)
        self._done = False
        self._result = None
        self.label = label

    @classmethod
    def completed(cls, result: Any = None, label: str = "") -> "Handle":
        """A handle for an operation that finished at once (single rank, empty messages)."""
        return cls(lambda: None, lambda: True, (lambda: result), (), label)

    @property
    def done(self) -> bool:
        return self._done

    def test(self) -> bool:
        """True once the operation has completed (does not finish it; call ``wait()`` for that)."""
        if self._done:
            raise CommError(f"handle {self.label or ''} was already waited on")
        return True if self._test is None else bool(self._test())

    def wait(self) -> Any:
        if self._done:
            raise CommError(f"handle {self.label or ''} was already waited on; waiting twice is an error")
        self._wait()
        self._done = True
        result = self._finish() if self._finish is not None else None
        self._buffers = ()
        self._wait = self._test = self._finish = None
        return result


def wait_all(handles: Sequence[Handle]) -> list:
    """Wait for every handle, in order; returns their results."""
    return [h.wait() for h in handles]


class Communicator(abc.ABC):
    """A group of ranks that talk to each other. Created by a :class:`~lbannpy.comm.Runtime` or ``split``."""

    backend: str = "abstract"

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    def host(self) -> "Communicator":
        """The communicator over the same ranks that reduces host (NumPy) arrays: this one, except where
        collectives take device arrays only (NCCL: the MPI communicator it was bootstrapped on)."""
        return self

    # -- management --------------------------------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: int, key: int | None = None) -> "Communicator":
        """Collective: ranks with equal ``color`` form a new communicator, ordered by ``key`` (default rank).
        A negative color returns ``None`` on that rank (it joins no group)."""

    def group(self, members) -> "Communicator":
        """Collective: the communicator of ``members``, the group of ranks (this one among them) that this
        rank joins, every rank passing its own group of one partition of the ranks; ranked by rank.
        ``members`` is a list of ranks or a :class:`lbannpy.dist.GroupSpec` (its colour is the group's
        smallest rank, computed without listing the members)."""
        color = getattr(members, "color", None)
        return self.split(min(members) if color is None else color, self.rank)

    @abc.abstractmethod
    def dup(self) -> "Communicator":
        """Collective: a communicator over the same ranks whose messages never mix with this one's."""

    def free(self) -> None:
        """Collective: release the communicator (idempotent)."""

    def flush(self) -> None:
        """Not collective: start point-to-point operations a backend may defer to batch them (NCCL groups
        its sends and receives). Call after posting a set of ``isend``/``irecv`` that should progress while
        the caller computes. Backends that start every operation when it is posted do nothing."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: returns when every rank has entered."""

    @abc.abstractmethod
    def abort(self, code: int = 1) -> None:
        """Not collective: end every rank of the job with exit code ``code``."""

    # -- collectives on buffers -----------------------------------------------------------------------
    @abc.abstractmethod
    def iallreduce(self, buf, op: str = "sum", out=None, after=None) -> Handle:
        """Collective: reduce ``buf`` over all ranks into ``out`` (``out is buf`` reduces in place; default a
        new array). ``wait()`` returns ``out``. ``after`` (GPU buffers): an event recorded on the stream
        that wrote ``buf``; by default the calling thread's current stream is taken to be that stream."""

    def allreduce(self, buf, op: str = "sum", out=None, after=None):
        """Collective: blocking :meth:`iallreduce`."""
        return self.iallreduce(buf, op, out, after).wait()

    @abc.abstractmethod
    def iallgather(self, buf) -> Handle:
        """Collective: every rank's ``buf`` (same shape everywhere); ``wait()`` returns ``(size, *shape)``."""

    def allgather(self, buf):
        return self.iallgather(buf).wait()

    @abc.abstractmethod
    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        """Collective: concatenate the flat ``buf`` of every rank (rank ``i`` gives ``counts[i]`` elements);
        ``wait()`` returns a flat array of ``sum(counts)`` elements in rank order."""

    def allgatherv(self, buf, counts: Sequence[int]):
        return self.iallgatherv(buf, counts).wait()

    @abc.abstractmethod
    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        """Collective: reduce the flat ``buf`` (``sum(counts)`` elements) over all ranks; rank ``i`` receives
        elements ``[sum(counts[:i]), sum(counts[:i+1]))`` of the result."""

    def reduce_scatter(self, buf, counts: Sequence[int], op: str = "sum"):
        return self.ireduce_scatter(buf, counts, op).wait()

    @abc.abstractmethod
    def ialltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts: Sequence[int], out=None) -> Handle:
        """Collective: flat ``sendbuf`` holds ``sendcounts[j]`` elements for rank ``j``, in rank order;
        ``wait()`` returns a flat buffer with ``recvcounts[j]`` elements from rank ``j``, in rank order."""

    def alltoallv(self, sendbuf, sendcounts: Sequence[int], recvcounts: Sequence[int], out=None):
        return self.ialltoallv(sendbuf, sendcounts, recvcounts, out).wait()

    def alltoall(self, sendbuf):
        """Collective: ``sendbuf`` of shape ``(size, ...)``; row ``j`` goes to rank ``j``. Returns the rows
        received, same shape."""
        n = sendbuf.shape[0]
        if n != self.size:
            raise CommError(f"alltoall needs a leading dimension of {self.size}, got shape {sendbuf.shape}")
        per = sendbuf.size // n
        out = self.alltoallv(sendbuf.reshape(-1), [per] * n, [per] * n)
        return out.reshape(sendbuf.shape)

    @abc.abstractmethod
    def ibcast(self, buf, root: int = 0) -> Handle:
        """Collective: ``buf`` on ``root`` is copied into ``buf`` on every rank (in place)."""

    def bcast(self, buf, root: int = 0):
        return self.ibcast(buf, root).wait()

    # -- point to point --------------------------------------------------------------------------------
    @abc.abstractmethod
    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        """Point to point: send the contiguous ``buf`` to ``dest``."""

    @abc.abstractmethod
    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        """Point to point: receive into the contiguous ``buf`` from ``source``; ``wait()`` returns ``buf``."""

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Point to point (both directions at once): returns ``recvbuf``."""
        r = self.irecv(recvbuf, source, tag)
        s = self.isend(sendbuf, dest, tag)
        s.wait()
        return r.wait()

    # -- small Python values (internal metadata and verdicts only; never user files) -------------------
    @abc.abstractmethod
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Collective: ``root``'s object on every rank."""

    @abc.abstractmethod
    def allgather_obj(self, obj: Any) -> list:
        """Collective: list of every rank's object, in rank order."""

    def allreduce_obj(self, value, op: str = "sum"):
        """Collective: reduce a Python number (or bool, with ``op='and'``/``'or'``) over all ranks."""
        vals = self.allgather_obj(value)
        if op == "sum":
            return sum(vals)
        if op == "max":
            return max(vals)
        if op == "min":
            return min(vals)
        if op == "and":
            return all(vals)
        if op == "or":
            return any(vals)
        raise CommError(f"unknown reduction {op!r}; use sum, max, min, and, or")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise CommError(f"unknown reduction {op!r}; use one of {', '.join(REDUCE_OPS)}")
    return op


def check_counts(counts: Sequence[int], size: int, where: str, what: str, total: int | None = None,
                 total_name: str = "buffer") -> list[int]:
    """Per-rank element counts of a v-collective, as ints: one per rank, none negative and, with ``total``,
    summing to it. ``where`` names the calling rank in the error (``rank R of P``)."""
    counts = [int(c) for c in counts]
    if len(counts) != size:
        raise CommError(f"{where}: {what}: {len(counts)} counts given for {size} ranks")
    if any(c < 0 for c in counts):
        raise CommError(f"{where}: {what}: negative count in {counts}")
    if total is not None and sum(counts) != total:
        raise CommError(f"{where}: {what}: counts {counts} sum to {sum(counts)} but the {total_name} holds "
                        f"{total} elements")
    return counts
