"""Distributed tensors: a local block (NumPy or CuPy), the global shape and the Distribution it belongs to.

Moving whole tensors (``scatter``, ``gather``) is meant for tests, checkpoints and data loading; layers
move data with halo plans (:mod:`lbannpy.halo`) and shuffle plans (:mod:`lbannpy.shuffle`).

Boxes are packed into flat, contiguous buffers as :mod:`lbannpy.packing` plans them (its names are
re-exported here).

Replicated distributions hold each logical element on ``dist.copies`` ranks. Whenever a reduction must
count each logical element once (``gather``) the ranks of replica 0 speak for their block.
"""
from __future__ import annotations

import functools
from typing import Sequence

from lbannpy.backend import array_module
from lbannpy.comm.base import Communicator
from lbannpy.dist import Box, Distribution, DistributionError, empty_block, shape_str
from lbannpy.packing import (Segment, check_array, check_comm, pack, packed_size,  # noqa: F401 (re-exported)
                             segments, unpack)
from lbannpy.shuffle import shuffle_plan

# --------------------------------------------------------------------------------------------------------
# global shapes and blocks


def _check_global(dist: Distribution, global_shape: Sequence[int], what: str) -> tuple[int, ...]:
    global_shape = tuple(int(n) for n in global_shape)
    _validate(dist, global_shape, what)
    return global_shape


@functools.lru_cache(maxsize=4096)
def _validate(dist: Distribution, global_shape: tuple, what: str) -> None:
    """Refuse a (distribution, shape) pair once; cached, so a tensor built every step is not re-checked
    (an error is not cached: a bad pair raises every time)."""
    if len(global_shape) != dist.ndim:
        dist.check_shape(global_shape, what)  # refuses the dimension mismatch
    bad = empty_block(dist, global_shape)
    if bad is not None:
        r, d = bad
        raise DistributionError(
            f"{what} of shape {shape_str(global_shape)} under {dist}: rank {r} would hold an empty block "
            f"along '{dist.dim_names[d]}' (extent {global_shape[d]} split {dist.parts[d]} ways); lower that "
            f"degree to at most {global_shape[d]}")


@functools.lru_cache(maxsize=8192)
def block_shape(dist: Distribution, global_shape: tuple, rank: int) -> tuple[int, ...]:
    """``dist.local_shape(global_shape, rank)``, cached: the shape a rank's block must have, looked up
    once per step per tensor instead of recomputed from the grid."""
    return dist.local_shape(global_shape, rank)


def clear_caches() -> None:
    """Forget the memoised layout checks and block shapes (a benchmark's cold start)."""
    _validate.cache_clear()
    block_shape.cache_clear()


def block_shapes(dist: Distribution, global_shape: Sequence[int]) -> set[tuple[int, ...]]:
    """Every block shape that occurs in ``dist`` (O(ndim) per shape: each dimension has at most two block
    lengths, and every combination of them occurs)."""
    per_dim = []
    for n, p in zip(global_shape, dist.parts):
        q, r = divmod(int(n), p)
        per_dim.append({q, q + 1} if r else {q})
    out = [()]
    for lengths in per_dim:
        out = [s + (m,) for s in out for m in sorted(lengths)]
    return set(out)


# --------------------------------------------------------------------------------------------------------
# the tensor


class DistTensor:
    """A block of a global tensor held by one rank.

    ``DistTensor(local, global_shape, dist, rank)`` checks that ``local`` has exactly the shape of
    ``rank``'s block. ``rank`` may be left out when the tensor is built before a rank is known (the shape
    is then checked against the block shapes that occur in ``dist``); every constructor below passes it.
    """

    __slots__ = ("local", "global_shape", "dist", "rank")

    def __init__(self, local, global_shape: Sequence[int], dist: Distribution, rank: int | None = None):
        global_shape = _check_global(dist, global_shape, "tensor")
        if rank is not None:
            check_array(local, block_shape(dist, global_shape, rank), f"local block of {dist}", rank)
        else:
            shapes = block_shapes(dist, global_shape)
            if tuple(local.shape) not in shapes:
                raise DistributionError(
                    f"local block of shape {tuple(local.shape)} is not a block of {shape_str(global_shape)} "
                    f"under {dist} (block shapes: {sorted(shapes)})")
        self.local = local
        self.global_shape = global_shape
        self.dist = dist
        self.rank = rank

    @classmethod
    def wrap(cls, local, global_shape: tuple, dist: Distribution, rank: int) -> "DistTensor":
        """Internal constructor for tensors whose (distribution, shape) pair was validated when the layer
        was set up (layer outputs, gradients): no validation, only one comparison of the local shape with
        the cached block shape, so a local kernel that returns a wrong shape is still caught where it
        happens. O(ndim), nothing per rank."""
        want = block_shape(dist, global_shape, rank)
        if local.shape != want:
            check_array(local, want, f"local block of {dist}", rank)
        t = cls.__new__(cls)
        t.local, t.global_shape, t.dist, t.rank = local, global_shape, dist, rank
        return t

    @classmethod
    def trusted(cls, local, global_shape: tuple, dist: Distribution, rank: int, block: tuple) -> "DistTensor":
        """:meth:`wrap` for a caller that looked ``block`` (this rank's block shape, from
        :func:`block_shape`) up once at set-up: one tuple comparison, no cache lookup (a layer's output or
        input gradient on every step)."""
        if local.shape != block:
            check_array(local, block, f"local block of {dist}", rank)
        t = cls.__new__(cls)
        t.local, t.global_shape, t.dist, t.rank = local, global_shape, dist, rank
        return t

    # -- views of the geometry
    @property
    def xp(self):
        return array_module(self.local)

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.local.shape)

    @property
    def box(self) -> Box:
        """Global box of this block (needs ``rank``)."""
        if self.rank is None:
            raise DistributionError("this tensor was built without a rank; pass rank= to know its box")
        return self.dist.box(self.global_shape, self.rank)

    def __repr__(self) -> str:
        return (f"DistTensor({shape_str(self.global_shape)} under {self.dist}, rank {self.rank}, "
                f"local {shape_str(self.local_shape)} {self.dtype})")

    # -- moving whole tensors
    @classmethod
    def scatter(cls, global_array, dist: Distribution, comm: Communicator) -> "DistTensor":
        """Not collective: every rank holds ``global_array`` and keeps a copy of its own block."""
        check_comm(comm, dist, None, "scatter")
        shape = _check_global(dist, global_array.shape, "scattered tensor")
        box = dist.box(shape, comm.rank)
        local = global_array[tuple(slice(lo, hi) for lo, hi in box)].copy()
        return cls(local, shape, dist, comm.rank)

    def gather(self, comm: Communicator, root: int | None = None):
        """Collective over ``comm``: the global array on every rank (``root=None``, one allgatherv) or only
        on ``root`` (one alltoallv; other ranks get ``None``). The blocks of replica 0 are used."""
        rank = comm.rank
        check_comm(comm, self.dist, self.rank, "gather")
        dist, shape = self.dist, self.global_shape
        speakers = [r for r in range(comm.size) if dist.copy_index(r) == 0]
        segs = segments([(r, dist.box(shape, r)) for r in speakers], (0,) * len(shape))
        counts = [0] * comm.size
        for s in segs:
            counts[s.peer] = s.size
        xp = self.xp
        mine = xp.ascontiguousarray(self.local).reshape(-1) if counts[rank] else xp.empty(0, self.dtype)
        if root is None:
            flat = comm.allgatherv(mine, counts)
        else:
            sendcounts = [counts[rank] if r == root else 0 for r in range(comm.size)]
            recvcounts = counts if rank == root else [0] * comm.size
            flat = comm.alltoallv(mine, sendcounts, recvcounts)
            if rank != root:
                return None
        out = self.xp.empty(shape, dtype=self.dtype)
        return unpack(flat, segs, out)

    def redistribute(self, dst_dist: Distribution, comm: Communicator) -> "DistTensor":
        """Collective over ``comm``: this tensor under ``dst_dist`` (a cached :class:`ShufflePlan`)."""
        plan = shuffle_plan(self.dist, dst_dist, self.global_shape, comm.rank)
        return DistTensor(plan.start(comm, self.local).wait(), self.global_shape, dst_dist, comm.rank)
