"""Loopback backend: one process plays one rank of a larger group, and every operation completes at once.

Nothing is moved between processes: a receive or a collective writes zeros (or the rank's own
contribution) into its result, with the shapes and dtypes the real operation would give. What remains is
exactly the local work of that rank in its real code path (packing halos, splitting a convolution into
interior and boundary, unpacking, the arithmetic around a reduction), which is what the strategy cost
model's measured table wants: communication is priced apart by the α-β model (``lbannpy.bench costmodel``).
The numbers it computes are meaningless; only their timing is.
"""
from __future__ import annotations

from typing import Any, Sequence

from .base import CommError, Communicator, Handle, check_counts, check_op
from .single import SingleCommunicator, array_module


class LoopbackCommunicator(Communicator):
    """Rank ``rank`` of ``size`` ranks, alone. ``split`` would need the other ranks' colours, which a lone
    process does not know; :meth:`group` (what :class:`lbannpy.layers.context.LayerContext` asks for) names
    the members itself."""

    backend = "loopback"

    def __init__(self, size: int, rank: int):
        if not 0 <= int(rank) < int(size):
            raise CommError(f"loopback: rank {rank} outside a group of {size}")
        self._size, self._rank = int(size), int(rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def group(self, members) -> "LoopbackCommunicator":
        """The communicator of ``members`` (world ranks, this rank among them), ranked by world rank as
        ``split(color, key=world rank)`` ranks them. A :class:`lbannpy.dist.GroupSpec` gives size and
        position directly (no member list, O(1) at any rank count)."""
        if hasattr(members, "color"):
            return LoopbackCommunicator(members.size, members.index)
        members = sorted(int(m) for m in members)
        if self._rank not in members:
            raise CommError(f"loopback: rank {self._rank} is not in the group {members}")
        return LoopbackCommunicator(len(members), members.index(self._rank))

    def split(self, color: int, key: int | None = None):
        raise CommError("loopback: split cannot know the other ranks' colours; ask for the group with "
                        "group()")

    def dup(self):
        return LoopbackCommunicator(self._size, self._rank)

    # a lone process does these exactly as the single-rank backend does
    barrier = SingleCommunicator.barrier
    abort = SingleCommunicator.abort
    iallreduce = SingleCommunicator.iallreduce  # this rank's contribution is the "sum"
    _xp = staticmethod(array_module)

    def _peer(self, r: int, what: str) -> None:
        if not 0 <= int(r) < self._size:
            raise CommError(f"loopback {what}: rank {r} does not exist in a group of {self._size}")

    def _counts(self, counts: Sequence[int], what: str) -> list[int]:
        return check_counts(counts, self._size, f"loopback rank {self._rank} of {self._size}", what)

    def iallgather(self, buf) -> Handle:
        xp = self._xp(buf)
        out = xp.zeros((self._size,) + tuple(buf.shape), dtype=buf.dtype)
        out[self._rank] = buf
        return Handle.completed(out, "allgather")

    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        counts = self._counts(counts, "allgatherv")
        xp = self._xp(buf)
        out = xp.zeros(sum(counts), dtype=buf.dtype)
        start = sum(counts[:self._rank])
        out[start:start + counts[self._rank]] = buf.reshape(-1)
        return Handle.completed(out, "allgatherv")

    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        check_op(op)
        counts = self._counts(counts, "reduce_scatter")
        start = sum(counts[:self._rank])
        return Handle.completed(buf.reshape(-1)[start:start + counts[self._rank]].copy(), "reduce_scatter")

    def ialltoallv(self, sendbuf, sendcounts, recvcounts, out=None) -> Handle:
        sendcounts = self._counts(sendcounts, "alltoallv")
        recvcounts = self._counts(recvcounts, "alltoallv")
        xp = self._xp(sendbuf)
        if out is None:
            out = xp.empty(sum(recvcounts), dtype=sendbuf.dtype)
        flat = out.reshape(-1)
        flat[...] = 0
        r = self._rank
        if sendcounts[r] == recvcounts[r] and recvcounts[r]:  # the piece this rank sends itself
            s, d = sum(sendcounts[:r]), sum(recvcounts[:r])
            flat[d:d + recvcounts[r]] = sendbuf.reshape(-1)[s:s + sendcounts[r]]
        return Handle.completed(out, "alltoallv")

    def ibcast(self, buf, root: int = 0) -> Handle:
        self._peer(root, "bcast")
        return Handle.completed(buf, "bcast")

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        self._peer(dest, "send")
        return Handle.completed(None, "send")

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        self._peer(source, "recv")
        buf[...] = 0  # what arrives costs the receiver a write of the buffer, as a real receive does

        return Handle.completed(buf, "recv")

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._peer(root, "bcast")
        return obj

    def allgather_obj(self, obj: Any) -> list:
        return [obj] * self._size
