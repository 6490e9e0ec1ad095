"""Halo exchange at any rank count against a global reference, and its adjoint by the dot-product test.

Every rank can compute every rank's plan and its data (the global input is a pure function of the case,
each window gradient a pure function of the block it belongs to), so every reference is computed locally
and only verdicts are communicated.

Replicated distributions: the window gradient ``y`` of a block is the same on every replica (it is
generated from the block coordinates), and inner products count each logical element once (only the
ranks of replica 0 contribute), as :func:`tensor_util.adjoint_gap` documents.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from lbannpy.backend import array_module, to_numpy
from lbannpy.dist import Distribution, DistributionError, clip_box, relative_slices
from lbannpy.stencil import Stencil
from lbannpy.halo import HaloPlan, check_halo
from lbannpy.halo_boundary import window_of
from lbannpy.tensor import pack, unpack
from tensor_util import adjoint_gap
from mpi_util import assert_all, raises_all

ADJOINT_RTOL = 1e-12


@dataclass(frozen=True)
class HaloCase:
    shape: tuple
    kernel: int
    stride: int
    padding: object  # 0, "same", or per-spatial-dim (lo, hi) pairs
    dilation: int

    @property
    def id(self) -> str:
        pad = self.padding if isinstance(self.padding, (int, str)) else \
            "asym" + "".join(f"{a}{b}" for a, b in self.padding)
        return f"{len(self.shape) - 2}d-k{self.kernel}-s{self.stride}-p{pad}-d{self.dilation}"

    @property
    def stencil(self) -> Stencil:
        return Stencil.conv(len(self.shape), self.kernel, self.stride, self.padding, self.dilation)


IMAGE = (3, 2, 19, 23)
VOLUME = (2, 2, 9, 11, 10)
ASYM = ((0, 2), (3, 1))
# kernel 1: dilation and 'same' change nothing, so those duplicates are left out
CASES = [HaloCase(IMAGE, 1, s, p, 1) for s in (1, 2) for p in (0, ASYM)]
CASES += [HaloCase(IMAGE, k, s, p, d)
          for k in (3, 5, 7) for s in (1, 2) for p in (0, "same", ASYM) for d in (1, 2)]
CASES += [HaloCase(VOLUME, k, s, p, 1)
          for k in (3, 5) for s in (1, 2) for p in ("same", ((1, 0), (0, 2), (2, 1)))]
EIGHT = {"2d-k3-s1-psame-d1", "2d-k5-s2-pasym0231-d1", "2d-k7-s1-p0-d2", "3d-k3-s2-pasym100221-d1"}
PARAMS = [pytest.param(c, marks=pytest.mark.ranks8) if c.id in EIGHT else c for c in CASES]


def halo_grids(ndim: int, ranks: int) -> list[Distribution]:
    """Splits over the sample and spatial dimensions whose product divides ``ranks`` (the rest replicate),
    plus the channel axis split and replicated (copies along c)."""
    names = ("n",) + Distribution.make(ndim, ranks=1).dim_names[2:]
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    out = []
    for degrees in itertools.product(divisors, repeat=len(names)):
        if ranks % math.prod(degrees) == 0:
            out.append(Distribution.make(ndim, ranks=ranks, **dict(zip(names, degrees))))
    if ranks % 2 == 0:
        out.append(Distribution.make(ndim, ranks=ranks, replicate=["c"], c=2, h=ranks // 2))
    return out


def global_input(shape) -> np.ndarray:
    return np.random.default_rng(11).standard_normal(shape)


def window_grad(plan: HaloPlan, dist: Distribution, rank: int) -> np.ndarray:
    """A window gradient that depends only on the block (identical on replicas)."""
    seed = [7] + list(dist.coords(rank))
    return np.random.default_rng(seed).standard_normal(plan.window_shape)


def usable(dist, shape, stencil) -> bool:
    try:
        check_halo(dist, shape, stencil)  # pure: every rank decides alike
        return True
    except DistributionError:
        return False


@pytest.mark.parametrize("case", PARAMS, ids=lambda c: c.id)
def test_exchange_and_accumulate_match_the_global_reference(comm, xp, case):
    g = global_input(case.shape)
    failures, tried = [], 0
    for dist in halo_grids(len(case.shape), comm.size):
        if not usable(dist, case.shape, case.stencil):
            continue
        tried += 1
        plan = HaloPlan(dist, case.shape, case.stencil, comm.rank)
        box = dist.box(case.shape, comm.rank)
        x = g[tuple(slice(a, b) for a, b in box)]
        # forward: the window cut from the zero-padded global array; the interior is ready before wait
        ex = plan.start(comm, xp.asarray(x))
        want = window_of(g, plan.window_box)
        early = to_numpy(ex.window[plan.interior_window_slices]).copy()
        win = to_numpy(ex.wait())
        if not np.array_equal(win, want):
            failures.append(f"{dist}: window differs in {int((win != want).sum())} elements")
        if not np.array_equal(early, want[plan.interior_window_slices]):
            failures.append(f"{dist}: interior inputs were not ready before wait()")
        # the window rebuilt later from the block and the received ghosts alone, into a dirty buffer
        again = xp.full(plan.window_shape, np.nan)
        if not np.array_equal(to_numpy(plan.refill(xp.asarray(x), ex.received, again)), want):
            failures.append(f"{dist}: the refilled window differs from the exchanged one")
        # adjoint against the global reference: the sum of every replica-0 rank's window gradient
        y = window_grad(plan, dist, comm.rank)
        gx = to_numpy(plan.accumulate_start(comm, xp.asarray(y)).wait())
        total = np.zeros(case.shape)
        for r in range(dist.ranks):
            if dist.copy_index(r) != 0:
                continue
            p = HaloPlan(dist, case.shape, case.stencil, r)
            inside = clip_box(p.window_box, case.shape)
            if inside is not None:
                total[tuple(slice(a, b) for a, b in inside)] += window_grad(p, dist, r)[
                    relative_slices(inside, [lo for lo, _ in p.window_box])]
        if not np.allclose(gx, total[tuple(slice(a, b) for a, b in box)], rtol=1e-13, atol=1e-13):
            failures.append(f"{dist}: accumulated gradient differs from the global sum")
        counted = dist.copy_index(comm.rank) == 0
        gap = adjoint_gap(comm, xp.asarray(win), xp.asarray(y), xp.asarray(x), xp.asarray(gx),
                          counted, counted)
        if not gap <= ADJOINT_RTOL:
            failures.append(f"{dist}: dot-product gap {gap:.2e}")
    assert_all(comm, not failures and tried > 0, f"{tried} grids tried; " + "; ".join(failures[:8]))


# --------------------------------------------------------------------------------------------------------
# the dot-product check can fail: deliberately wrong adjoints


def accumulate_variant(plan: HaloPlan, comm, grad_window, mode: str):
    """Halo accumulation rebuilt from the plan's public segments, correct (``mode='correct'``) or with a
    deliberate defect: ``overwrite`` (ghost contributions replace instead of add), ``drop_corners``
    (pieces from diagonal neighbours are ignored), ``shifted`` (owned part copied one element off)."""
    xp = array_module(grad_window)
    grad = xp.zeros(plan.local_shape)
    if plan.owned_box is not None:
        if mode == "shifted":
            src = grad_window[plan.owned_window_slices]
            grad[plan.owned_local_slices] = xp.roll(src, 1, axis=-1)
        else:
            grad[plan.owned_local_slices] = grad_window[plan.owned_window_slices]
    tag = 2 * plan.tag + 1
    recvbuf = xp.empty(plan.send_size)
    handles = [comm.irecv(recvbuf[s.offset:s.stop], s.peer, tag) for s in plan.sends]
    sendbuf = pack(grad_window, plan.recvs)
    handles += [comm.isend(sendbuf[s.offset:s.stop], s.peer, tag) for s in plan.recvs]
    for h in handles:
        h.wait()
    mine = plan.dist.coords(plan.rank)
    segs = plan.sends
    if mode == "drop_corners":
        segs = [s for s in plan.sends if sum(a != b for a, b in zip(plan.dist.coords(s.peer), mine)) < 2]
    return unpack(recvbuf, segs, grad, add=(mode != "overwrite"))


@dataclass(frozen=True)
class WrongAdjoint:
    mode: str
    min_ranks: int  # below this the defect changes nothing (no ghosts, no corners)

    @property
    def id(self) -> str:
        return self.mode


WRONG = [WrongAdjoint("overwrite", 2), WrongAdjoint("drop_corners", 4), WrongAdjoint("shifted", 1)]


@pytest.mark.parametrize("wrong", WRONG, ids=lambda w: w.id)
def test_negative_control_dot_product_check_catches_wrong_adjoints(comm, xp, wrong):
    if comm.size < wrong.min_ranks:
        pytest.skip(f"'{wrong.mode}' changes nothing below {wrong.min_ranks} ranks")
    shape = (2, 2, 12, 14)
    if comm.size >= 4:
        dist = Distribution.make(4, ranks=comm.size, h=2, w=2)
    else:
        dist = Distribution.make(4, ranks=comm.size, h=comm.size)
    plan = HaloPlan(dist, shape, Stencil.conv(4, 3, 1, "same"), comm.rank)
    g = global_input(shape)
    x = xp.asarray(g[tuple(slice(a, b) for a, b in plan.input_box)])
    win = plan.start(comm, x).wait()
    y = xp.asarray(window_grad(plan, dist, comm.rank))
    counted = dist.copy_index(comm.rank) == 0
    gaps = {}
    for mode in ("correct", wrong.mode):
        aty = accumulate_variant(plan, comm, y, mode)
        gaps[mode] = adjoint_gap(comm, win, y, x, aty, counted, counted)
    assert_all(comm, gaps["correct"] <= ADJOINT_RTOL and gaps[wrong.mode] > 1e-3,
               f"gaps {gaps}: the rebuilt correct adjoint must pass and '{wrong.mode}' must fail")


# --------------------------------------------------------------------------------------------------------
# concurrency, buffers, refusals


def test_two_plans_in_flight_with_distinct_tags(comm, xp):
    """An activation halo and an error-signal halo of the same geometry, overlapping, finished in reverse."""
    shape = (2, 3, 11, 13)
    dist = Distribution.make(4, ranks=comm.size, h=comm.size)
    stencil = Stencil.conv(4, 5, 1, "same")
    a = HaloPlan(dist, shape, stencil, comm.rank, tag=100)
    b = HaloPlan(dist, shape, stencil, comm.rank, tag=101)
    g1, g2 = global_input(shape), -3.0 * global_input(shape)
    sl = tuple(slice(lo, hi) for lo, hi in a.input_box)
    out = xp.full(a.window_shape, np.nan)
    ea = a.start(comm, xp.asarray(g1[sl]), out=out)
    eb = b.start(comm, xp.asarray(g2[sl]))
    wb, wa = to_numpy(eb.wait()), to_numpy(ea.wait())
    ok = (np.array_equal(wa, window_of(g1, a.window_box)) and np.array_equal(wb, window_of(g2, b.window_box))
          and ea.window is out)
    assert_all(comm, ok, "concurrent plans mixed their messages or ignored out=")


def _ptr(a) -> int:
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


def test_a_plan_exchanges_through_the_same_buffers_every_step(comm, xp):
    """A layer's plan packs and receives into the buffers of its first exchange at every later one (a
    captured step keeps using them), each window equal to the global reference and each accumulated
    gradient to a shared plan's (which keeps no buffers); an exchange started while another of the same
    plan is in flight gets its own buffers, and both are right."""
    shape = (2, 2, 12, 14)
    dist = Distribution.make(4, ranks=comm.size, h=comm.size)
    stencil = Stencil.conv(4, 3, 1, "same")
    plan, shared = HaloPlan(dist, shape, stencil, comm.rank), HaloPlan(dist, shape, stencil, comm.rank)
    shared.keep_buffers = False
    sl = tuple(slice(a, b) for a, b in plan.input_box)
    failures, received = [], []
    for k in range(3):
        g = global_input(shape) * (k + 1)
        ex = plan.start(comm, xp.asarray(g[sl]))
        if not np.array_equal(to_numpy(ex.wait()), window_of(g, plan.window_box)):
            failures.append(f"exchange {k}: window differs from the global reference")
        received.append(ex.received)
        y = xp.asarray(window_grad(plan, dist, comm.rank) * (k - 1.5))
        got = to_numpy(plan.accumulate_start(comm, y).wait())
        if not np.array_equal(got, to_numpy(shared.accumulate_start(comm, y).wait())):
            failures.append(f"exchange {k}: accumulated gradient differs from the shared plan's")
    if not plan.local and len({_ptr(r) for r in received}) != 1:
        failures.append("the receive buffer changed between exchanges")
    g1, g2 = global_input(shape), -global_input(shape)
    a, b = plan.start(comm, xp.asarray(g1[sl])), plan.start(comm, xp.asarray(g2[sl]))
    wb, wa = to_numpy(b.wait()), to_numpy(a.wait())
    if not (np.array_equal(wa, window_of(g1, plan.window_box))
            and np.array_equal(wb, window_of(g2, plan.window_box))):
        failures.append("two exchanges of one plan in flight mixed their buffers")
    assert_all(comm, not failures, "; ".join(failures))

@dataclass(frozen=True)
class BadPlan:
    name: str
    min_ranks: int

    @property
    def id(self) -> str:
        return self.name


BAD = [BadPlan("kernel-past-padded-input", 1), BadPlan("empty-input-block", 2),
       BadPlan("empty-output-block", 2)]


@pytest.mark.ranks8
@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.id)
def test_plans_that_cannot_work_fail_on_every_rank_without_hanging(comm, bad):
    if comm.size < bad.min_ranks:
        pytest.skip(f"needs {bad.min_ranks} ranks to have an empty block")
    p = comm.size
    if bad.name == "kernel-past-padded-input":
        dist, shape, stencil = Distribution.make(4, ranks=p, n=p), (p, 2, 4, 9), Stencil.conv(4, 7, 1, 1)
        needle = "does not fit the padded input"
    elif bad.name == "empty-input-block":
        dist, shape, stencil = Distribution.make(4, ranks=p, h=p), (2, 2, p - 1, 9), Stencil.conv(4, 1)
        needle = f"rank {p - 1} (block (0, 0, {p - 1}, 0)) would hold an empty input block"
    else:  # stride 2 halves the output: the last ranks get no output rows
        dist, shape, stencil = Distribution.make(4, ranks=p, w=p), (2, 2, 5, p), Stencil.conv(4, 1, 2)
        needle = f"rank {p // 2 + p % 2}"
    exc = raises_all(comm, DistributionError, HaloPlan, dist, shape, stencil, comm.rank, match=needle)
    msgs = comm.allgather_obj(str(exc))
    want = [str(dist), "×".join(map(str, shape))]
    assert_all(comm, len(set(msgs)) == 1 and all(w in msgs[0] for w in want),
               f"every rank must raise the same message naming {want}: {msgs}")
    comm.barrier()  # everybody got here: nobody hangs in a plan's messages
