"""Serial property tests of the pure index math: block partitions, boxes, ownership, distributions,
redistribution plans, and the whole-tensor moves on a single rank."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbannpy.comm.single import SingleCommunicator
from lbannpy.dist import (Distribution, DistributionError, block_owner, block_range, block_starts,
                          box_contains, box_shape, box_size, box_subtract, clip_box, empty_block, intersect)
from lbannpy.shuffle import ShufflePlan, shuffle_plan
from lbannpy.tensor import DistTensor, Segment, pack, segments, unpack
from tensor_util import from_root

SETTINGS = settings(max_examples=100, deadline=None)


# --------------------------------------------------------------------------------------------------------
# strategies


@st.composite
def distributions(draw, ndim=None, max_degree=3, max_outer=2):
    """A distribution with random split degrees, replicated axes and leftover replicas."""
    ndim = draw(st.sampled_from([2, 3, 4, 5])) if ndim is None else ndim
    split = tuple(draw(st.integers(1, max_degree)) for _ in range(ndim))
    replicate = tuple(i for i in range(ndim) if split[i] > 1 and draw(st.booleans()) and draw(st.booleans()))
    outer = draw(st.integers(1, max_outer))
    return Distribution(split, math.prod(split) * outer, replicate)


@st.composite
def dist_and_shape(draw, ndim=None):
    """A distribution and a global shape that leaves no block empty."""
    dist = draw(distributions(ndim))
    shape = tuple(draw(st.integers(p, p + 9)) for p in dist.parts)
    return dist, shape


def boxes(ndim, lo=-6, hi=12):
    pair = st.tuples(st.integers(lo, hi), st.integers(lo, hi)).map(lambda t: (min(t), max(t)))
    return st.tuples(*[pair] * ndim)


def coverage(outer, parts):
    """How many of ``parts`` cover each element of ``outer`` (an int array of ``outer``'s shape)."""
    count = np.zeros(box_shape(outer), dtype=np.int64)
    origin = [lo for lo, _ in outer]
    for b in parts:
        assert box_contains(outer, b), f"{b} sticks out of {outer}"
        count[tuple(slice(a - o, z - o) for (a, z), o in zip(b, origin))] += 1
    return count


# --------------------------------------------------------------------------------------------------------
# one-dimensional blocks


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 40))
def test_blocks_tile_the_extent_evenly(extent, parts):
    starts = block_starts(extent, parts)
    assert starts[0] == 0 and starts[-1] == extent
    sizes = [block_range(extent, parts, i)[1] - block_range(extent, parts, i)[0] for i in range(parts)]
    assert [block_range(extent, parts, i)[0] for i in range(parts)] == starts[:-1]
    assert sum(sizes) == extent
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True), "larger blocks come first"


@SETTINGS
@given(st.integers(1, 200), st.integers(1, 40), st.data())
def test_block_owner_holds_the_element(extent, parts, data):
    i = data.draw(st.integers(0, extent - 1))
    lo, hi = block_range(extent, parts, block_owner(extent, parts, i))
    assert lo <= i < hi


def test_block_owner_refuses_outside():
    with pytest.raises(IndexError):
        block_owner(5, 2, 5)
    with pytest.raises(IndexError):
        block_owner(5, 2, -1)


# --------------------------------------------------------------------------------------------------------
# boxes


@SETTINGS
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(boxes(n), boxes(n))))
def test_box_subtract_tiles_the_difference(pair):
    outer, inner = pair
    pieces = box_subtract(outer, inner)
    assert all(box_size(p) > 0 for p in pieces)
    count = coverage(outer, pieces)
    cut = intersect(outer, inner)
    if cut is not None:
        count += coverage(outer, [cut])
    if box_size(outer):
        assert (count == 1).all()
    assert len(pieces) <= 2 * len(outer)


@SETTINGS
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(boxes(n), boxes(n))))
def test_intersect_and_contains_agree(pair):
    a, b = pair
    cut = intersect(a, b)
    if cut is None:
        assert any(min(a1, b1) <= max(a0, b0) for (a0, a1), (b0, b1) in zip(a, b))
    else:
        assert box_contains(a, cut) and box_contains(b, cut)
        assert box_size(cut) > 0
    assert box_contains(a, a)


@SETTINGS
@given(boxes(3), st.tuples(*[st.integers(1, 9)] * 3))
def test_clip_box_is_the_part_inside(box, shape):
    clipped = clip_box(box, shape)
    full = tuple((0, n) for n in shape)
    assert clipped == intersect(box, full)
    if clipped is not None:
        assert box_contains(full, clipped) and box_contains(box, clipped)


# --------------------------------------------------------------------------------------------------------
# distributions


@SETTINGS
@given(dist_and_shape())
def test_each_replica_tiles_the_tensor(ds):
    dist, shape = ds
    full = tuple((0, n) for n in shape)
    by_replica: dict[int, list] = {}
    for r in range(dist.ranks):
        by_replica.setdefault(dist.copy_index(r), []).append(dist.box(shape, r))
        assert dist.local_shape(shape, r) == box_shape(dist.box(shape, r))
        assert dist.rank_of(dist.coords(r), dist.copy_index(r)) == r
    assert sorted(by_replica) == list(range(dist.copies))
    first = sorted(by_replica[0])
    for rep, bs in by_replica.items():
        assert len(bs) == dist.nblocks
        assert (coverage(full, bs) == 1).all()
        assert sorted(bs) == first, "every replica holds the same blocks"


@SETTINGS
@given(dist_and_shape(), st.data())
def test_owner_coords_hold_the_element(ds, data):
    dist, shape = ds
    index = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    for r in dist.block_ranks(dist.owner_coords(shape, index)):
        assert all(lo <= i < hi for i, (lo, hi) in zip(index, dist.box(shape, r)))


@SETTINGS
@given(dist_and_shape(), boxes(5, -3, 14))
def test_blocks_meeting_are_exactly_the_intersecting_blocks(ds, box):
    dist, shape = ds
    box = box[:dist.ndim]
    meeting = set(dist.blocks_meeting(shape, box))
    expect = {dist.coords(r) for r in range(dist.ranks) if intersect(box, dist.box(shape, r)) is not None}
    assert meeting == expect


@SETTINGS
@given(distributions(), st.data())
def test_empty_block_agrees_with_check_shape(dist, data):
    shape = tuple(data.draw(st.integers(1, 4)) for _ in range(dist.ndim))
    bad = empty_block(dist, shape)
    if bad is None:
        dist.check_shape(shape)
    else:
        r, d = bad
        assert box_shape(dist.box(shape, r))[d] == 0
        assert all(min(box_shape(dist.box(shape, q))) > 0 for q in range(r)), "the first offending rank"
        with pytest.raises(DistributionError):
            dist.check_shape(shape)


# --------------------------------------------------------------------------------------------------------
# packing


@SETTINGS
@given(dist_and_shape(), st.data())
def test_pack_unpack_round_trip(ds, data):
    dist, shape = ds
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    g = rng.standard_normal(shape)
    segs = segments([(r, dist.box(shape, r)) for r in range(dist.ranks)], (0,) * len(shape))
    assert [s.offset for s in segs] == [sum(x.size for x in segs[:i]) for i in range(len(segs))]
    flat = pack(g, segs)
    assert flat.shape == (sum(s.size for s in segs),)
    out = np.zeros(shape)
    unpack(flat, segs, out)
    assert np.array_equal(out, g)
    twice = np.zeros(shape)
    unpack(flat, segs, twice, add=True)  # every replica's copy adds once
    assert np.allclose(twice, dist.copies * g)


def test_segment_geometry():
    s = Segment(3, ((2, 4), (1, 4)), (slice(1, 3), slice(0, 3)), 10)
    assert (s.shape, s.size, s.stop) == ((2, 3), 6, 16)


# --------------------------------------------------------------------------------------------------------
# redistribution plans (pure geometry, all ranks)


@st.composite
def shuffle_cases(draw):
    src = draw(distributions(4, max_degree=3, max_outer=2))
    ranks = src.ranks
    # a destination over the same ranks: random degrees whose product divides ranks
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    split, left = [], ranks
    for _ in range(3):
        opts = [d for d in divisors if left % d == 0 and d <= 3]
        d = draw(st.sampled_from(opts))
        split.append(d)
        left //= d
    split.append(draw(st.sampled_from([d for d in divisors if left % d == 0 and d <= 3])))
    order = draw(st.permutations(range(4)))
    split = tuple(split[i] for i in order)
    replicate = tuple(i for i in range(4) if split[i] > 1 and draw(st.booleans()) and draw(st.booleans()))
    dst = Distribution(split, ranks, replicate)
    shape = tuple(draw(st.integers(max(a, b), max(a, b) + 7)) for a, b in zip(src.parts, dst.parts))
    return src, dst, shape


@SETTINGS
@given(shuffle_cases())
def test_shuffle_plans_match_pairwise_and_tile(case):
    src, dst, shape = case
    plans = [ShufflePlan(src, dst, shape, r) for r in range(src.ranks)]
    sent = {(r, s.peer, s.box) for r, p in enumerate(plans) for s in p.sends}
    received = {(s.peer, r, s.box) for r, p in enumerate(plans) for s in p.recvs}
    assert sent == received
    for r, p in enumerate(plans):
        count = coverage(p.dst_box, [s.box for s in p.recvs])
        assert (count == 1).all(), "each destination element arrives exactly once"
        for s in p.recvs:
            assert box_contains(src.box(shape, s.peer), s.box), "the sender holds what it sends"
        assert p.sendcounts == [next((s.size for s in p.sends if s.peer == q), 0) for q in range(src.ranks)]
        assert p.recvcounts == [next((s.size for s in p.recvs if s.peer == q), 0) for q in range(src.ranks)]
        if src.coords(r) in set(src.blocks_meeting(shape, p.dst_box)):
            assert any(s.peer == r for s in p.recvs), "a rank keeps what it already holds"
    only_self = all(s.peer == r for r, p in enumerate(plans) for s in p.sends + p.recvs)
    assert all(p.local_only == only_self for p in plans)


def test_shuffle_sender_choice_spreads_over_source_replicas():
    src = Distribution.whole(4, 4)
    dst = Distribution.make(4, ranks=4, n=2)  # two destination replicas per block
    shape = (4, 2, 3, 3)
    senders = {s.peer for r in range(4) for s in ShufflePlan(src, dst, shape, r).recvs}
    assert senders == {0, 1, 2, 3}, "every rank keeps its own slice of the replicated source"
    src = Distribution.make(4, ranks=4, n=2)
    dst = Distribution.make(4, ranks=4, h=2)
    plan = ShufflePlan(src, dst, shape, 3)
    # rank 3 keeps its own n1 rows; the n0 rows come from rank 2, source replica 1 (= dst replica 1 % 2)
    assert {s.peer for s in plan.recvs} == {2, 3}


def test_shuffle_plan_cache_and_reverse():
    a = Distribution.make(4, ranks=4, n=2, h=2)
    b = Distribution.make(4, ranks=4, w=4)
    p = shuffle_plan(a, b, (4, 3, 5, 7), 2)
    assert shuffle_plan(a, b, (4, 3, 5, 7), 2) is p
    assert p.reverse().src_dist == b and p.reverse().dst_dist == a
    assert p.reverse().reverse() is p


@pytest.mark.parametrize("src, dst, shape, needle", [
    pytest.param(Distribution.make(4, ranks=4, h=4), Distribution.make(4, ranks=2, h=2), (2, 2, 8, 8),
                 "4 ranks and the destination on 2", id="rank-count"),
    pytest.param(Distribution.make(4, ranks=4, h=4), Distribution.make(4, ranks=4, w=4), (2, 2, 8, 3),
                 "rank 3", id="empty-destination-block"),
    pytest.param(Distribution.make(4, ranks=4, h=4), Distribution.make(5, ranks=4, w=4), (2, 2, 8, 8),
                 "dimensions", id="rank-mismatch"),
])
def test_shuffle_refusals_are_identical_on_every_rank(src, dst, shape, needle):
    messages = set()
    for r in range(src.ranks):
        with pytest.raises(DistributionError) as info:
            ShufflePlan(src, dst, shape, r)
        messages.add(str(info.value))
    assert len(messages) == 1
    (msg,) = messages
    assert needle in msg and str(src) in msg


# --------------------------------------------------------------------------------------------------------
# whole-tensor moves on one rank


def test_dist_tensor_on_one_rank():
    comm = SingleCommunicator()
    g = np.arange(2 * 3 * 5, dtype=np.float64).reshape(2, 3, 5)
    dist = Distribution.whole(3, 1)
    t = from_root(g, dist, comm)
    assert np.array_equal(t.gather(comm), g) and np.array_equal(t.gather(comm, root=0), g)
    assert np.array_equal(DistTensor.scatter(g, dist, comm).local, g)
    assert np.array_equal(t.redistribute(dist, comm).local, g)
    with pytest.raises(DistributionError, match="expected"):
        DistTensor(g[:1], g.shape, dist, 0)
    with pytest.raises(DistributionError, match="not a block"):
        DistTensor(g[:1], g.shape, dist)
    with pytest.raises(DistributionError, match="laid on 2 ranks"):
        DistTensor.scatter(g, Distribution.whole(3, 2), comm)
    with pytest.raises(DistributionError, match="passed no array"):
        from_root(None, dist, comm)
