"""Recording backend: one process plays rank ``rank`` of ``size`` ranks and counts what it would send.

It behaves as :class:`~lbannpy.comm.loopback.LoopbackCommunicator` (every operation completes at once,
receives and collectives write zeros or the rank's own contribution), and additionally records, per kind
of operation, how many calls were made and how many bytes this rank would put on the network: the
payload of point-to-point sends, the part of an alltoallv that leaves the rank, the buffer of an
allreduce (with its group size, so a caller can apply the ring factor ``2 (p - 1) / p``), and so on.
Group communicators made from it (``group``, ``dup``) share the parent's :class:`Recorder`, and each
``group`` call is recorded with the group's size.

This is what the rank simulator (``python -m lbannpy.bench scale``) runs the set-up and the plans of a
P-rank job against in one process: no data moves, and nothing here loops over the ranks.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from .base import Handle
from .loopback import LoopbackCommunicator


@dataclass
class Recorder:
    """Calls and bytes per operation kind (``send``, ``alltoallv``, ``allreduce``, ...), summed over every
    communicator that shares it; ``groups`` lists the sizes of the group communicators created."""

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    groups: list = field(default_factory=list)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.nbytes[kind] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.nbytes.clear()

    @property
    def total_bytes(self) -> int:
        return int(sum(self.nbytes.values()))


class RecordingCommunicator(LoopbackCommunicator):
    """Rank ``rank`` of ``size`` ranks, alone, recording its traffic in ``recorder`` (shared with the
    communicators made from it). ``allreduce`` bytes are recorded under ``allreduce`` (buffer bytes) and
    ``allreduce_wire`` (the ring algorithm's ``2 (p - 1) / p`` times that, what leaves the rank)."""

    backend = "recording"

    def __init__(self, size: int, rank: int, recorder: Recorder | None = None):
        super().__init__(size, rank)
        self.recorder = recorder if recorder is not None else Recorder()

    def _child(self, size: int, rank: int) -> "RecordingCommunicator":
        return RecordingCommunicator(size, rank, self.recorder)

    def group(self, members) -> "RecordingCommunicator":
        child = super().group(members)
        self.recorder.groups.append(child.size)
        self.recorder.add("split", 0)
        return self._child(child.size, child.rank)

    def dup(self) -> "RecordingCommunicator":
        self.recorder.add("dup", 0)
        return self._child(self.size, self.rank)

    def iallreduce(self, buf, op: str = "sum", out=None, after=None) -> Handle:
        p = self.size
        self.recorder.add("allreduce", buf.nbytes)
        self.recorder.nbytes["allreduce_wire"] += int(2 * (p - 1) * buf.nbytes // p) if p > 1 else 0
        return super().iallreduce(buf, op, out)

    def iallgather(self, buf) -> Handle:
        self.recorder.add("allgather", buf.nbytes)
        return super().iallgather(buf)

    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        self.recorder.add("allgatherv", buf.nbytes)
        return super().iallgatherv(buf, counts)

    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        self.recorder.add("reduce_scatter", buf.nbytes)
        return super().ireduce_scatter(buf, counts, op)

    def ialltoallv(self, sendbuf, sendcounts, recvcounts, out=None) -> Handle:
        own = int(sendcounts[self.rank])  # what a rank sends itself stays on the rank
        self.recorder.add("alltoallv", (sendbuf.size - own) * sendbuf.itemsize)
        return super().ialltoallv(sendbuf, sendcounts, recvcounts, out)

    def ibcast(self, buf, root: int = 0) -> Handle:
        self.recorder.add("bcast", buf.nbytes if self.rank == root else 0)
        return super().ibcast(buf, root)

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        self.recorder.add("send", buf.nbytes)
        return super().isend(buf, dest, tag)

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        self.recorder.add("recv", 0)
        return super().irecv(buf, source, tag)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self.recorder.add("bcast_obj", 0)
        return super().bcast_obj(obj, root)

    def allgather_obj(self, obj: Any) -> list:
        self.recorder.add("allgather_obj", 0)
        return super().allgather_obj(obj)
