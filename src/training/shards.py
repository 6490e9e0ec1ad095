"""Optimizer state sharded over the ranks that replicate the parameters (``optimizer.shard_state``:
Rajbhandari et al.'s ZeRO stage 1), one gradient bucket at a time.

After a bucket's allreduce every rank of its group (g > 1 ranks, the replicas of its parameters) holds the
same gradients. Rank r of the group owns the r-th of g equal ranges of the bucket's flat index space (its
parameters one after another, as the bucket's buffer lays out their gradients): it keeps the optimizer state
(momentum, Adam's moments) of that range only and updates only those elements of the parameters; after the
last bucket one allgather a bucket gives every replica the whole update. The parameters come out bitwise
equal to the unsharded update (the same element-wise arithmetic on the same values), the state a rank keeps
is 1/g of its bucketed parameters', and a step moves each bucket's values once more (the allgather: half the
volume of the allreduce before it). Nothing here loops over ranks: a rank's range meets each parameter of
the bucket in at most one piece, and unpacking the gathered bucket is one copy a parameter.

Checkpoints keep their format: :meth:`StateShards.unshard` (collective) gathers the whole state before a save
and :meth:`StateShards.reshard` keeps this rank's range again after it, or after a resume read the whole
state. A bucket whose group is one rank, or an optimizer without state (SGD without momentum), is not
sharded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lbannpy.backend import flat


@dataclass
class BucketShard:
    """This rank's range ``[lo, hi)`` of one bucket's flat index space and the pieces of it."""

    index: int               # the bucket's
    comm: object
    params: list
    offsets: list            # each parameter's start in the bucket's flat space
    size: int                # elements of the bucket
    length: int              # elements of one rank's range (the last rank's padded to it)
    lo: int
    hi: int
    pieces: list = field(default_factory=list)   # (param, a, b, at): elements [a, b) of the flattened
    #                                              parameter, at ``at`` in this rank's range


def plan_shards(buckets) -> list[BucketShard]:
    """The shards of the buckets with more than one rank (pure: from sizes and the group rank)."""
    out = []
    for bucket in buckets:
        comm = bucket.comm
        if comm.size < 2 or not bucket.params:
            continue
        n = sum(p.value.size for p in bucket.params)
        length = -(-n // comm.size)
        lo, hi = min(n, comm.rank * length), min(n, (comm.rank + 1) * length)
        shard = BucketShard(bucket.index, comm, list(bucket.params), list(bucket.offsets), n, length, lo, hi)
        for p, off in zip(bucket.params, bucket.offsets):
            a, b = max(lo, off) - off, min(hi, off + p.value.size) - off
            if a < b:
                shard.pieces.append((p, a, b, off + a - lo))
        out.append(shard)
    return out


class StateShards:
    """Who builds it: every rank, from the overlap engine's buckets (no communication). It attaches itself
    to the optimizer (``optimizer.shards``), whose checkpoints then call :meth:`unshard`/:meth:`reshard`."""

    def __init__(self, buckets, optimizer, xp):
        self.optimizer, self.xp = optimizer, xp
        self.shards = plan_shards(buckets)
        self._by_first = {id(s.params[0]): s for s in self.shards}
        # (parameter, slot) -> this rank's piece of the state: made once, refilled in place by every later
        # reshard, so a captured step (which updates these buffers) never reads a rebound one
        self._pieces: dict = {}
        optimizer.shards = self
        self.reshard()  # the state the optimizer created at set-up, cut to this rank's ranges

    def share(self, index: int) -> float:
        """The part of bucket ``index``'s optimizer state this rank keeps (about 1/g; 1 unsharded)."""
        s = next((s for s in self.shards if s.index == index), None)
        return 1.0 if s is None else (s.hi - s.lo) / s.size

    def on_bucket(self, params) -> None:
        """The overlap engine's ``on_bucket``: update this rank's range of a sharded bucket, the whole of
        any other bucket."""
        shard = self._by_first.get(id(params[0]))
        if shard is None:
            self.optimizer.step_params(params)
        else:
            self.optimizer.step_pieces([(p, a, b) for p, a, b, _ in shard.pieces])

    def gather_values(self) -> None:
        """Who calls: every rank of each sharded bucket's group, after the last bucket's update (the
        communication thread is idle): one allgather a bucket puts every range's updated values into every
        replica, one copy a parameter."""
        for s in self.shards:
            full = self._gather(s, lambda p, a, b: flat(p.value)[a:b])
            for p, off in zip(s.params, s.offsets):
                flat(p.value)[...] = full[off:off + p.value.size]

    def _gather(self, s: BucketShard, part):
        """Every rank's range of bucket ``s`` gathered, as the bucket's flat values (padding cut off);
        ``part(p, a, b)`` is this rank's piece of parameter ``p``."""
        send = self.xp.zeros(s.length, dtype=s.params[0].value.dtype)
        for p, a, b, at in s.pieces:
            send[at:at + b - a] = part(p, a, b)
        return s.comm.allgather(send).reshape(-1)[:s.size]

    def unshard(self) -> None:
        """Who calls: every rank (collective over each sharded bucket's group): the optimizer state of every
        sharded parameter made whole, for a checkpoint; :meth:`reshard` undoes it."""
        state = self.optimizer.state
        # each piece has every slot from set-up on (known on every rank, also one without pieces: no
        # exchange of names)
        slots = self.optimizer.slot_names()
        for s in self.shards:
            for slot in slots:
                full = self._gather(s, lambda p, a, b, slot=slot: flat(state[p.name][slot]))
                for p, off in zip(s.params, s.offsets):
                    state[p.name][slot] = full[off:off + p.value.size].reshape(p.value.shape).copy()

    def reshard(self) -> None:
        """Keep only this rank's range of the optimizer state: after :meth:`unshard`, or after a resume put
        whole state into the optimizer (no communication). State already a piece stays as it is."""
        state = self.optimizer.state
        for s in self.shards:
            mine = {id(p): (a, b) for p, a, b, _ in s.pieces}
            for p in s.params:
                st = state[p.name]
                for slot in list(st):
                    if st[slot].shape != p.value.shape:
                        continue
                    if id(p) in mine:
                        a, b = mine[id(p)]
                        piece = self._pieces.get((p.name, slot))
                        if piece is None or piece.size != b - a or piece.dtype != st[slot].dtype:
                            piece = self._pieces[(p.name, slot)] = flat(st[slot])[a:b].copy()
                        else:
                            piece[...] = flat(st[slot])[a:b]
                        st[slot] = piece
                    else:
                        del st[slot]
