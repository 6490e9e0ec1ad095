"""Serial property tests of halo plan geometry, computed for every rank of random distributions, shapes and
stencils (kernels, strides, paddings, dilations), plus the refusals; and execution on a single rank."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lbannpy.comm.base import CommError
from lbannpy.comm.single import SingleCommunicator
from lbannpy.dist import (Distribution, DistributionError, box_contains, box_shape, box_size, clip_box,
                          intersect)
from lbannpy.stencil import Stencil, Window1D
from lbannpy.halo import TAG_LIMIT, HaloPlan, check_halo, halo_plan
from lbannpy.halo_boundary import window_of

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def halo_cases(draw):
    """A distribution that may split every dimension, a stencil on the spatial ones and a shape that
    leaves no input or output block empty."""
    ndim = draw(st.sampled_from([3, 4, 5]))
    # at most three split dimensions keeps the all-ranks checks quadratic in a few dozen ranks
    split_dims = draw(st.sets(st.integers(0, ndim - 1), max_size=3))
    split = tuple(draw(st.integers(2, 3)) if i in split_dims else 1 for i in range(ndim))
    replicate = tuple(i for i in range(ndim) if split[i] > 1 and draw(st.integers(0, 3)) == 0)
    dist = Distribution(split, math.prod(split) * draw(st.integers(1, 2)), replicate)
    big = ndim == 5  # three spatial dimensions: smaller kernels keep the windows small
    windows = [Window1D(), Window1D()]
    for _ in range(ndim - 2):
        windows.append(Window1D(draw(st.integers(1, 3 if big else 7)), draw(st.integers(1, 3)),
                                draw(st.integers(0, 4)), draw(st.integers(0, 4)),
                                draw(st.integers(1, 2 if big else 3))))
    stencil = Stencil(tuple(windows))
    shape = []
    for i, (w, p) in enumerate(zip(windows, dist.parts)):
        # smallest extent whose output still has p elements, then some slack
        n = max(p, w.reach - w.pad_lo - w.pad_hi + (p - 1) * w.stride, 1)
        shape.append(n + draw(st.integers(0, 2 if i < 2 else 8)))
    return dist, tuple(shape), stencil


def count_cover(outer, boxes):
    count = np.zeros(box_shape(outer), dtype=np.int64)
    origin = [lo for lo, _ in outer]
    for b in boxes:
        assert box_contains(outer, b), f"{b} sticks out of {outer}"
        count[tuple(slice(a - o, z - o) for (a, z), o in zip(b, origin))] += 1
    return count


def all_plans(dist, shape, stencil):
    return [HaloPlan(dist, shape, stencil, r) for r in range(dist.ranks)]


@SETTINGS
@given(halo_cases())
def test_window_is_tiled_by_owned_receives_and_padding(case):
    dist, shape, stencil = case
    out_shape = stencil.output_shape(shape)
    for r, p in enumerate(all_plans(dist, shape, stencil)):
        assert p.output_shape == out_shape and p.output_box == dist.box(out_shape, r)
        assert p.window_box == stencil.input_window(p.output_box)
        assert p.window_shape == box_shape(p.window_box)
        pieces = [s.box for s in p.recvs] + list(p.padding_boxes)
        if p.owned_box is not None:
            pieces.append(p.owned_box)
        assert (count_cover(p.window_box, pieces) == 1).all()
        for b in p.padding_boxes:
            assert clip_box(b, shape) is None, "padding lies outside the tensor"
        for w, (lo, hi), n in zip(stencil.dims, p.window_box, shape):
            assert -w.pad_lo <= lo and hi <= n + w.pad_hi, "the window stays within the padded input"


@SETTINGS
@given(halo_cases())
def test_receives_come_from_their_owner_in_the_same_replica(case):
    dist, shape, stencil = case
    for r, p in enumerate(all_plans(dist, shape, stencil)):
        for s in p.recvs:
            assert s.peer != r
            assert dist.copy_index(s.peer) == dist.copy_index(r)
            assert box_contains(dist.box(shape, s.peer), s.box)
            assert intersect(s.box, dist.box(shape, r)) is None
            assert s.shape == box_shape(s.box) and s.size == box_size(s.box)
        assert [s.peer for s in p.recvs] == sorted({s.peer for s in p.recvs}), "one message per peer"
        assert [s.offset for s in p.recvs] == [sum(x.size for x in p.recvs[:i]) for i in range(len(p.recvs))]
        assert p.recv_size == sum(s.size for s in p.recvs) and p.send_size == sum(s.size for s in p.sends)


@SETTINGS
@given(halo_cases())
def test_sends_and_receives_match_pairwise(case):
    dist, shape, stencil = case
    plans = all_plans(dist, shape, stencil)
    sent = {(r, s.peer, s.box) for r, p in enumerate(plans) for s in p.sends}
    received = {(s.peer, r, s.box) for r, p in enumerate(plans) for s in p.recvs}
    assert sent == received
    for r, p in enumerate(plans):
        for s in p.sends:
            assert box_contains(p.input_box, s.box)
            assert p.input_box == dist.box(shape, r)


@SETTINGS
@given(halo_cases())
# a local plan whose interior box is smaller than its block: the last output reads padding only
@example((Distribution((1, 1, 2), 2), (1, 1, 2),
          Stencil((Window1D(1, 1, 0, 0, 1), Window1D(1, 1, 0, 0, 1), Window1D(1, 3, 4, 0, 1)))))
def test_interior_and_boundary_tile_the_output_block(case):
    dist, shape, stencil = case
    for r, p in enumerate(all_plans(dist, shape, stencil)):
        pieces = list(p.boundary_boxes) + ([p.interior_box] if box_size(p.interior_box) else [])
        assert (count_cover(p.output_box, pieces) == 1).all()
        assert box_contains(p.output_box, p.interior_box)
        # a plan with nothing to exchange computes its whole block at once from the window (the layer
        # template relies on it): every output reads only this rank's block and padding. (Its interior box
        # may still be smaller: an output whose reads all fall into padding past an edge the block does not
        # touch is not counted interior, e.g. stride 3 with 4 cells of padding.)
        assert p.local == (not p.recvs and not p.sends)
        if p.local and box_size(p.output_box):
            reads = clip_box(stencil.input_window(p.output_box), shape)
            assert reads is None or box_contains(p.input_box, reads)
        # interior outputs read nothing another rank holds
        if box_size(p.interior_box):
            reads = clip_box(stencil.input_window(p.interior_box), shape)
            assert reads is None or box_contains(p.input_box, reads)
        # and the interior is the largest such box: per dimension, brute force over outputs (an output
        # is interior when its reads stay in the block, or run into padding past an edge the block touches)
        for d, (w, (o0, o1), (lo, hi), n) in enumerate(zip(stencil.dims, p.output_box, p.input_box, shape)):
            local = [o for o in range(o0, o1)
                     if (lo == 0 or o * w.stride - w.pad_lo >= lo)
                     and (hi == n or o * w.stride - w.pad_lo + w.reach <= hi)]
            i0, i1 = p.interior_box[d]
            assert local == list(range(i0, i1))
            assert o0 <= i0 <= i1 <= o1


@SETTINGS
@given(halo_cases(), st.data())
def test_slices_select_the_boxes(case, data):
    dist, shape, stencil = case
    r = data.draw(st.integers(0, dist.ranks - 1))
    p = HaloPlan(dist, shape, stencil, r)
    win = np.zeros(p.window_shape)
    loc = np.zeros(p.local_shape)
    out = np.zeros(p.output_local_shape)
    if p.owned_box is not None:
        assert win[p.owned_window_slices].shape == box_shape(p.owned_box)
        assert loc[p.owned_local_slices].shape == box_shape(p.owned_box)
    for s in p.recvs:
        assert win[s.slices].shape == s.shape
    for s in p.sends:
        assert loc[s.slices].shape == s.shape
    assert out[p.interior_slices].shape == box_shape(p.interior_box)
    for b, sl, wsl in zip(p.boundary_boxes, p.boundary_slices, p.boundary_window_slices):
        assert out[sl].shape == box_shape(b)
        assert win[wsl].shape == box_shape(stencil.input_window(b))


@dataclass(frozen=True)
class Geometry:
    """A hand-checked plan: a 1-D spatial split (n, c, w tensor) and what rank ``rank`` must receive."""

    name: str
    width: int
    parts: int
    window: Window1D
    rank: int
    expect_recv: tuple  # ((peer, (lo, hi)), ...) along w
    expect_owned: tuple | None

    def __str__(self):
        return self.name


GEOMETRIES = [
    Geometry("k3-same-middle", 12, 3, Window1D(3, 1, 1, 1), 1, ((0, (3, 4)), (2, (8, 9))), (4, 8)),
    Geometry("k7-past-neighbour", 8, 4, Window1D(7, 1, 3, 3), 1, ((0, (0, 2)), (2, (4, 6)), (3, (6, 7))),
             (2, 4)),
    Geometry("k1-stride2-not-own-rows", 4, 3, Window1D(1, 2, 1, 0), 1, ((0, (1, 2)),), None),
    Geometry("k1-stride3-not-own-rows", 4, 2, Window1D(1, 3, 2, 0), 1, ((0, (1, 2)),), None),
    Geometry("k2-stride2-non-neighbour", 4, 3, Window1D(2, 2, 3, 0), 2, ((0, (1, 2)), (1, (2, 3))), None),
    Geometry("past-the-end-padding-only", 6, 3, Window1D(1, 1, 0, 12), 2, (), None),
    Geometry("asymmetric-pad", 8, 2, Window1D(4, 1, 0, 3), 1, (), (4, 8)),
    Geometry("dilation2", 10, 2, Window1D(3, 1, 2, 2, 2), 0, ((1, (5, 7)),), (0, 5)),
]


@pytest.mark.parametrize("g", GEOMETRIES, ids=str)
def test_hand_checked_geometry(g):
    dist = Distribution((1, 1, g.parts), g.parts)
    p = HaloPlan(dist, (1, 1, g.width), Stencil((Window1D(), Window1D(), g.window)), g.rank)
    assert tuple((s.peer, s.box[2]) for s in p.recvs) == g.expect_recv
    assert (None if p.owned_box is None else p.owned_box[2]) == g.expect_owned


# --------------------------------------------------------------------------------------------------------
# refusals: identical on every rank, naming rank, shapes and distribution


@dataclass(frozen=True)
class Refusal:
    name: str
    dist: Distribution
    shape: tuple
    stencil: Stencil
    needles: tuple

    def __str__(self):
        return self.name


REFUSALS = [
    Refusal("input-block-empty", Distribution.make(4, ranks=8, h=8), (2, 3, 5, 9), Stencil.conv(4, 3, 1, 1),
            ("rank 5", "empty input block along 'h'", "2×3×5×9", "h8", "at most 5")),
    Refusal("output-block-empty-stride", Distribution.make(4, ranks=4, w=4), (2, 3, 9, 7),
            Stencil.conv(4, 3, 3, 1), ("rank 3", "empty output block along 'w'", "smaller stride", "w4")),
    Refusal("kernel-past-padded-input", Distribution.make(4, ranks=2, n=2), (2, 3, 4, 9),
            Stencil.conv(4, 7, 1, 1), ("'h'", "reach 7", "1+4+1", "n2", "pad more")),
    Refusal("dilated-kernel-too-long", Distribution.make(5, ranks=1), (1, 1, 4, 4, 4),
            Stencil.conv(5, 3, 1, 0, dilation=2), ("'d'", "reach 5", "dilation 2")),
    Refusal("stencil-rank-mismatch", Distribution.make(4, ranks=2, h=2), (2, 3, 8, 8),
            Stencil.conv(5, 3), ("stencil 5", "h2")),
]


@pytest.mark.parametrize("case", REFUSALS, ids=str)
def test_refusals_are_identical_on_every_rank(case):
    messages = set()
    for r in range(case.dist.ranks):
        with pytest.raises(DistributionError) as info:
            HaloPlan(case.dist, case.shape, case.stencil, r)
        messages.add(str(info.value))
    assert len(messages) == 1, "every rank must raise the same error"
    (msg,) = messages
    for needle in case.needles:
        assert needle in msg, f"{needle!r} missing from: {msg}"
    with pytest.raises(DistributionError):
        check_halo(case.dist, case.shape, case.stencil)


def test_bad_rank_and_tag():
    dist = Distribution.make(4, ranks=2, h=2)
    with pytest.raises(DistributionError, match="rank 2 outside"):
        HaloPlan(dist, (1, 1, 8, 8), Stencil.conv(4, 3, 1, 1), 2)
    with pytest.raises(DistributionError, match="tag"):
        HaloPlan(dist, (1, 1, 8, 8), Stencil.conv(4, 3, 1, 1), 0, tag=TAG_LIMIT)


def test_tags_derive_from_geometry_and_plans_are_cached():
    dist = Distribution.make(4, ranks=2, h=2)
    a = halo_plan(dist, (1, 1, 8, 8), Stencil.conv(4, 3, 1, 1), 0)
    b = halo_plan(dist, (1, 1, 8, 8), Stencil.conv(4, 5, 1, 2), 0)
    assert halo_plan(dist, (1, 1, 8, 8), Stencil.conv(4, 3, 1, 1), 0) is a
    assert a.tag != b.tag and 0 <= a.tag < TAG_LIMIT
    assert HaloPlan(dist, (1, 1, 8, 8), Stencil.conv(4, 3, 1, 1), 1).tag == a.tag, "same on every rank"


# --------------------------------------------------------------------------------------------------------
# execution on one rank (padding, owned copy, adjoint, handle rules)


@pytest.mark.parametrize("kernel, stride, padding, dilation", [
    (3, 1, "same", 1), (5, 2, ((2, 0), (1, 3)), 1), (3, 1, 0, 2), (1, 2, 0, 1), (7, 3, "same", 1)])
def test_single_rank_window_and_adjoint(kernel, stride, padding, dilation):
    comm = SingleCommunicator()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 11, 13))
    stencil = Stencil.conv(4, kernel, stride, padding, dilation)
    plan = HaloPlan(Distribution.whole(4, 1), x.shape, stencil, 0)
    ex = plan.start(comm, x)
    win = ex.wait()
    assert win is ex.window
    assert np.array_equal(win, window_of(x, plan.window_box))
    y = rng.standard_normal(plan.window_shape)
    gx = plan.accumulate_start(comm, y).wait()
    # on one rank the adjoint drops the padding: gx is y's part inside the tensor
    ref = np.zeros_like(x)
    inside = clip_box(plan.window_box, x.shape)
    ref[tuple(slice(a, b) for a, b in inside)] = y[tuple(slice(a - lo, b - lo) for (a, b), (lo, _)
                                                         in zip(inside, plan.window_box))]
    assert np.array_equal(gx, ref)
    with pytest.raises(CommError):
        ex.wait()
    # the same window and gradient without the exchange machinery (a new gradient array, not a view)
    assert plan.local
    assert np.array_equal(plan.local_window(x), win)
    lg = plan.local_gradient(y)
    assert np.array_equal(lg, ref) and not np.shares_memory(lg, y)


def test_only_plans_without_messages_are_local():
    stencil = Stencil.conv(4, 3, 1, 1)
    shape = (4, 2, 8, 8)
    assert all(p.local for p in all_plans(Distribution.make(4, ranks=2, n=2), shape, stencil))
    assert all(p.local for p in all_plans(Distribution.make(4, ranks=2, h=2), shape, Stencil.conv(4, 1)))
    assert not any(p.local for p in all_plans(Distribution.make(4, ranks=2, h=2), shape, stencil))


def test_start_refuses_wrong_arrays():
    comm = SingleCommunicator()
    plan = HaloPlan(Distribution.whole(4, 1), (1, 2, 6, 6), Stencil.conv(4, 3, 1, 1), 0)
    with pytest.raises(DistributionError, match=r"shape \(1, 2, 6, 5\)"):
        plan.start(comm, np.zeros((1, 2, 6, 5)))
    with pytest.raises(DistributionError, match="dtype"):
        plan.start(comm, np.zeros((1, 2, 6, 6)), out=np.zeros(plan.window_shape, dtype=np.float32))
    with pytest.raises(DistributionError, match="window gradient"):
        plan.accumulate_start(comm, np.zeros((1, 2, 6, 6)))
    other = HaloPlan(Distribution.make(4, ranks=2, h=2), (1, 2, 6, 6), Stencil.conv(4, 3, 1, 1), 0)
    with pytest.raises(DistributionError, match="communicator has 1"):
        other.start(comm, np.zeros(other.local_shape))
