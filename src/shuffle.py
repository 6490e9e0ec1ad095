"""Redistribution (shuffle) of a tensor between two distributions over the same ranks, and its adjoint.

A :class:`ShufflePlan` intersects this rank's source block with every destination block and its
destination block with every source block (Dryden et al. 2019, III-C), and executes as one ``ialltoallv``
on flat packed buffers whose counts, displacements and pack/unpack slices are planned once.

Who sends: every destination rank (each replica of each destination block) receives its whole block.
A piece of source block ``b`` destined for rank ``q`` comes from ``q`` itself when ``q`` holds ``b`` under
the source distribution (no copy over the network), otherwise from source replica
``dst.copy_index(q) % src.copies`` of ``b``: deterministic, computable by sender and receiver alike, and
spread over the source replicas. A plan in which every rank only keeps part of its own block
(``local_only``, the same on every rank) moves no data over the network and calls no collective.

Adjoint under replicated semantics (a decision, recorded here): a replicated tensor's gradient is itself
replicated, i.e. every replica holds the full, identical gradient (a layer that consumes replicated data
makes its gradients agree, e.g. by the allreduce of a model-parallel layer). Under that convention the
adjoint of the shuffle ``src -> dst`` is the shuffle ``dst -> src`` (:meth:`ShufflePlan.reverse`): each
source replica receives the gradient of its block from one destination replica; nothing is summed over
replicas. The dot-product test holds for it when inner products count each logical element once (the
ranks of replica 0 speak for their block) and the replicas of ``y`` agree.
"""
from __future__ import annotations

import functools
from typing import Sequence

from lbannpy.backend import array_module
from lbannpy.comm.base import Communicator, Handle
from lbannpy.dist import (Box, Distribution, DistributionError, box_contains, box_shape, empty_block,
                          intersect, relative_slices, shape_str)
from lbannpy.packing import Segment, check_array, check_comm, pack, packed_size, segments, unpack


def check_shuffle(src_dist: Distribution, dst_dist: Distribution, global_shape: Sequence[int]) -> None:
    """Refuse a redistribution that cannot work. Pure and rank-independent (loops over every rank), so
    every rank raises the same error without communication."""
    what = f"redistribution of {shape_str(global_shape)} from {src_dist} to {dst_dist}"
    if src_dist.ranks != dst_dist.ranks:
        raise DistributionError(
            f"{what}: the source is laid on {src_dist.ranks} ranks and the destination on {dst_dist.ranks}; "
            f"both must use every rank of the communicator (Distribution.with_ranks)")
    if not len(global_shape) == src_dist.ndim == dst_dist.ndim:
        raise DistributionError(
            f"{what}: tensor has {len(global_shape)} dimensions, source {src_dist.ndim}, destination "
            f"{dst_dist.ndim}; use distributions of the tensor's rank")
    if any(n < 1 for n in global_shape):
        raise DistributionError(f"{what}: every extent must be >= 1")
    for dist, side in ((src_dist, "source"), (dst_dist, "destination")):
        bad = empty_block(dist, global_shape)
        if bad is not None:
            r, d = bad
            name = dist.dim_names[d]
            raise DistributionError(
                f"{what}: rank {r} (block {dist.coords(r)}) would hold an empty {side} block along "
                f"'{name}' (extent {global_shape[d]} split {dist.parts[d]} ways); lower the '{name}' degree "
                f"of the {side} to at most {global_shape[d]}")


def _sender(src: Distribution, dst: Distribution, q: int, coords: tuple[int, ...]) -> int:
    """The rank that sends destination rank ``q`` its piece of source block ``coords``."""
    if src.coords(q) == tuple(coords):
        return q
    return src.rank_of(coords, dst.copy_index(q) % src.copies)


class ShufflePlan:
    """Rank ``rank``'s part of the redistribution ``src_dist -> dst_dist`` of a ``global_shape`` tensor.

    ``sends`` / ``recvs``: one :class:`~lbannpy.tensor.Segment` per peer, in rank order (``slices`` into
    the source / destination local block, ``offset`` into the packed buffer); ``sendcounts`` /
    ``recvcounts``: elements per rank for the alltoallv; ``src_local_shape`` / ``dst_local_shape``.
    """

    def __init__(self, src_dist: Distribution, dst_dist: Distribution, global_shape: Sequence[int],
                 rank: int):
        global_shape = tuple(int(n) for n in global_shape)
        check_shuffle(src_dist, dst_dist, global_shape)
        if not 0 <= rank < src_dist.ranks:
            raise DistributionError(f"shuffle plan: rank {rank} outside the {src_dist.ranks} ranks")
        self.src_dist, self.dst_dist, self.global_shape, self.rank = src_dist, dst_dist, global_shape, rank
        src, dst, shape = src_dist, dst_dist, global_shape
        nranks = src.ranks
        self.src_box: Box = src.box(shape, rank)
        self.dst_box: Box = dst.box(shape, rank)
        self.src_local_shape = box_shape(self.src_box)
        self.dst_local_shape = box_shape(self.dst_box)

        recv_pieces = []
        for coords in src.blocks_meeting(shape, self.dst_box):
            peer = _sender(src, dst, rank, coords)
            recv_pieces.append((peer, intersect(self.dst_box, src.box(shape, peer))))
        my_coords = src.coords(rank)
        send_pieces = []
        for coords in dst.blocks_meeting(shape, self.src_box):
            for d in range(dst.copies):
                q = dst.rank_of(coords, d)
                if _sender(src, dst, q, my_coords) == rank:
                    send_pieces.append((q, intersect(self.src_box, dst.box(shape, q))))
        self.recvs: tuple[Segment, ...] = segments(sorted(recv_pieces), [lo for lo, _ in self.dst_box])
        self.sends: tuple[Segment, ...] = segments(sorted(send_pieces), [lo for lo, _ in self.src_box])
        self.sendcounts = [0] * nranks
        self.recvcounts = [0] * nranks
        for s in self.sends:
            self.sendcounts[s.peer] = s.size
        for s in self.recvs:
            self.recvcounts[s.peer] = s.size
        # what the collective moves: the piece a rank keeps for itself is copied straight from its source
        # block into its destination block, not packed and passed through the alltoallv
        own_send = [x for x in self.sends if x.peer == rank]
        own_recv = [x for x in self.recvs if x.peer == rank]
        self._own = (own_send[0].slices, own_recv[0].slices) if own_send and own_recv else None
        self._sends = segments([(x.peer, x.box) for x in self.sends if x.peer != rank],
                               [lo for lo, _ in self.src_box])
        self._recvs = segments([(x.peer, x.box) for x in self.recvs if x.peer != rank],
                               [lo for lo, _ in self.dst_box])
        self._sendcounts = [0 if q == rank else c for q, c in enumerate(self.sendcounts)]
        self._recvcounts = [0 if q == rank else c for q, c in enumerate(self.recvcounts)]
        # every rank's destination block inside its own source block: no rank talks to another
        self.local_only = local_only(src, dst, shape)
        self.keep_slices = (relative_slices(self.dst_box, [lo for lo, _ in self.src_box])
                            if self.local_only else None)

    def __repr__(self) -> str:
        return (f"ShufflePlan(rank {self.rank}, {shape_str(self.global_shape)}: {self.src_dist} -> "
                f"{self.dst_dist}, {len(self.sends)} sends, {len(self.recvs)} receives"
                f"{', local only' if self.local_only else ''})")

    @property
    def send_segments(self) -> tuple:
        """The packed segments this rank sends to other ranks (its own piece is copied, not sent)."""
        return self._sends

    @property
    def recv_segments(self) -> tuple:
        """The packed segments this rank receives from other ranks."""
        return self._recvs

    def reverse(self) -> "ShufflePlan":
        """The plan ``dst_dist -> src_dist``: the adjoint under replicated semantics (module docstring)."""
        return shuffle_plan(self.dst_dist, self.src_dist, self.global_shape, self.rank)

    def start(self, comm: Communicator, local, out=None) -> Handle:
        """Collective over ``comm`` (all ``dst_dist.ranks`` ranks; one ialltoallv, none when
        ``local_only``). ``local`` is this rank's source block; ``wait()`` returns its destination block,
        written into ``out`` when given."""
        check_comm(comm, self.src_dist, self.rank, "redistribution")
        check_array(local, self.src_local_shape, f"redistribution input block ({self.src_dist})", self.rank)
        xp = array_module(local)
        if out is None:
            result = xp.empty(self.dst_local_shape, dtype=local.dtype)
        else:
            check_array(out, self.dst_local_shape, f"redistribution output block ({self.dst_dist})",
                        self.rank, local.dtype)
            result = out
        if self.local_only:
            result[...] = local[self.keep_slices]
            return Handle.completed(result, f"shuffle rank {self.rank}")
        # a single piece that is contiguous in its block goes without packing (sent from / received into
        # the block itself); otherwise pieces are packed into flat buffers
        sendbuf = _contiguous_piece(local, self._sends)
        if sendbuf is None:
            sendbuf = pack(local, self._sends)
        direct = _contiguous_piece(result, self._recvs)
        recvbuf = direct if direct is not None else xp.empty(packed_size(self._recvs), dtype=local.dtype)
        # the rank's own piece goes while the collective is in flight, except when the collective receives
        # into the block itself: on a GPU the collective's stream then writes the block, so the own copy
        # goes first (ordered before the collective by the communicator's event)
        own_first = self._own is not None and direct is not None
        if own_first:
            result[self._own[1]] = local[self._own[0]]
        handle = comm.ialltoallv(sendbuf, self._sendcounts, self._recvcounts, out=recvbuf)
        if self._own is not None and not own_first:
            result[self._own[1]] = local[self._own[0]]
        received = []

        def finish():
            return result if direct is not None else unpack(received[0], self._recvs, result)

        return Handle(lambda: received.append(handle.wait()), handle.test, finish,
                      (sendbuf, recvbuf, result, local), f"shuffle rank {self.rank}")


def _contiguous_piece(arr, segs):
    """The flat view of ``arr`` that is the only segment of ``segs``, when that piece is contiguous."""
    if len(segs) != 1:
        return None
    view = arr[segs[0].slices]
    return view.reshape(-1) if view.flags.c_contiguous else None


@functools.lru_cache(maxsize=1024)
def local_only(src: Distribution, dst: Distribution, global_shape: tuple) -> bool:
    """True when every rank's destination block lies inside its own source block (the same answer on every
    rank). A check of every rank, O(P), done once per (source, destination, shape) and cached: a plan and
    its reverse, and every layer with the same redistribution, share it."""
    return all(box_contains(src.box(global_shape, r), dst.box(global_shape, r)) for r in range(src.ranks))


@functools.lru_cache(maxsize=1024)
def same_layout(src: Distribution, dst: Distribution, global_shape: tuple) -> bool:
    """True when every rank holds the same block under ``src`` and ``dst`` (different descriptions of one
    layout); O(P) once per (source, destination, shape), cached."""
    return src == dst or (src.ranks == dst.ranks and local_only(src, dst, global_shape)
                          and local_only(dst, src, global_shape))


@functools.lru_cache(maxsize=1024)
def shuffle_plan(src_dist: Distribution, dst_dist: Distribution, global_shape: tuple,
                 rank: int) -> ShufflePlan:
    """Cached :class:`ShufflePlan` (plans hold no buffers, so sharing one is safe)."""
    return ShufflePlan(src_dist, dst_dist, tuple(global_shape), rank)
