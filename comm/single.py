"""Single-rank backend: every collective is a copy. Used when lbannpy runs without MPI (one process)."""
from __future__ import annotations

import sys
from typing import Any, Sequence

from .base import CommError, Communicator, Handle, check_op



def array_module(buf):
    """NumPy or CuPy, whichever owns ``buf`` (CuPy only when it is already imported)."""
    return sys.modules["cupy"] if type(buf).__module__.startswith("cupy") else sys.modules["numpy"]

class SingleCommunicator(Communicator):
    backend = "single"

    def __init__(self):
        self._pending: dict[int, list] = {}  # tag -> queued self-sends (point to point to oneself)

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def split(self, color: int, key: int | None = None):
        return None if color is not None and color < 0 else SingleCommunicator()

    def dup(self):
        return SingleCommunicator()

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> None:
        sys.stderr.flush()
        raise SystemExit(code)

    _xp = staticmethod(array_module)

    def iallreduce(self, buf, op: str = "sum", out=None, after=None) -> Handle:
        check_op(op)
        if after is not None:  # the copy below runs on this thread's current stream: after the producer
            sys.modules["cupy"].cuda.get_current_stream().wait_event(after)
        if out is None:
            out = buf.copy()
        elif out is not buf:
            out[...] = buf
        return Handle.completed(out, "allreduce")

    def iallgather(self, buf) -> Handle:
        return Handle.completed(buf.reshape((1,) + buf.shape).copy(), "allgather")

    def iallgatherv(self, buf, counts: Sequence[int]) -> Handle:
        _check_counts(counts, 1, buf.size, "allgatherv")
        return Handle.completed(buf.reshape(-1).copy(), "allgatherv")

    def ireduce_scatter(self, buf, counts: Sequence[int], op: str = "sum") -> Handle:
        check_op(op)
        _check_counts(counts, 1, buf.size, "reduce_scatter")
        return Handle.completed(buf.reshape(-1).copy(), "reduce_scatter")

    def ialltoallv(self, sendbuf, sendcounts, recvcounts, out=None) -> Handle:
        _check_counts(sendcounts, 1, sendbuf.size, "alltoallv")
        if list(sendcounts) != list(recvcounts):
            raise CommError(f"alltoallv on one rank: send counts {list(sendcounts)} != recv counts "
                            f"{list(recvcounts)}")
        if out is None:
            out = sendbuf.reshape(-1).copy()
        else:
            out.reshape(-1)[...] = sendbuf.reshape(-1)
        return Handle.completed(out, "alltoallv")

    def ibcast(self, buf, root: int = 0) -> Handle:
        _check_root(root)
        return Handle.completed(buf, "bcast")

    def isend(self, buf, dest: int, tag: int = 0) -> Handle:
        _check_root(dest)
        self._pending.setdefault(tag, []).append(buf.copy())
        return Handle.completed(None, "send")

    def irecv(self, buf, source: int, tag: int = 0) -> Handle:
        _check_root(source)

        def finish():
            queue = self._pending.get(tag)
            if not queue:
                raise CommError(f"rank 0 waits for a message with tag {tag} from itself that was never sent")
            msg = queue.pop(0)
            if msg.size != buf.size:
                raise CommError(f"message of {msg.size} elements received into a buffer of {buf.size}")
            buf.reshape(-1)[...] = msg.reshape(-1)
            return buf

        return Handle(lambda: None, lambda: bool(self._pending.get(tag)), finish, (buf,), "recv")

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        _check_root(root)
        return obj

    def allgather_obj(self, obj: Any) -> list:
        return [obj]


def _check_root(r: int) -> None:
    if r != 0:
        raise CommError(f"rank {r} does not exist in a single-rank communicator")


def _check_counts(counts, size: int, n: int, what: str) -> None:
    if len(counts) != size:
        raise CommError(f"{what}: {len(counts)} counts given for {size} ranks")
    if sum(counts) != n and what != "allgatherv":
        raise CommError(f"{what}: counts {list(counts)} sum to {sum(counts)}, buffer holds {n} elements")
