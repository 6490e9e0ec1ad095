"""The periodic halo pattern (a circular boundary) on its own, at any rank count: the exchanged window
equals the global array padded by ``np.pad(mode="wrap")``, the accumulation equals that padding's adjoint
(the window gradients folded back modulo the extent and summed) and passes the dot-product test; the
other boundary maps (reflect, replicate) are checked the same way against ``np.pad``.

Every rank computes every rank's plan and window gradient (pure functions of the case and the block), so
the global references are local and only verdicts travel.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lbannpy.backend import to_numpy
from lbannpy.dist import Distribution, DistributionError
from lbannpy.halo import HaloPlan, check_halo
from lbannpy.stencil import Stencil
from mpi_util import assert_all
from tensor_util import adjoint_gap

ADJOINT_RTOL = 1e-12
NUMPY_MODE = {"circular": "wrap", "reflect": "reflect", "replicate": "edge"}
# (shape, kernel, stride, padding): odd extents, uneven blocks, asymmetric padding, stride 2, and padding
# as deep as a whole block at 4 ranks (rows come from the rank after the next one)
CASES = [((3, 2, 11, 13), 3, 1, 1), ((2, 2, 9, 10), 5, 2, ((2, 1), (0, 2))), ((2, 1, 8, 7), 7, 1, 3),
         ((2, 2, 5, 6, 7), 3, 1, 1)]


def _id(case) -> str:
    shape, k, s, p = case
    return f"{len(shape) - 2}d-k{k}-s{s}-p{p}".replace(" ", "")


def grids(ndim: int, ranks: int) -> list[Distribution]:
    """Splits over samples and space whose product divides ``ranks`` (the rest replicate)."""
    names = ("n",) + Distribution.make(ndim, ranks=1).dim_names[2:]
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    return [Distribution.make(ndim, ranks=ranks, **dict(zip(names, deg)))
            for deg in itertools.product(divisors, repeat=len(names)) if ranks % math.prod(deg) == 0]


def padded_reference(g: np.ndarray, stencil: Stencil, mode: str) -> tuple[np.ndarray, list[int]]:
    """``g`` padded on every side by the stencil's padding with ``np.pad``, and the index of ``g``'s
    element 0 in it."""
    widths = [(w.pad_lo, w.pad_hi) for w in stencil.dims]
    return np.pad(g, widths, mode=NUMPY_MODE[mode]), [w.pad_lo for w in stencil.dims]


def window_grad(plan: HaloPlan, dist: Distribution, rank: int) -> np.ndarray:
    return np.random.default_rng([3] + list(dist.coords(rank))).standard_normal(plan.window_shape)


def folded(total: np.ndarray, shape, origin, mode: str) -> np.ndarray:
    """The adjoint of ``np.pad(mode="wrap")``: a gradient of the padded array folded back onto the
    array (each padded element added to the element it copies, modulo the extent)."""
    assert mode == "circular"
    out = np.zeros(shape)
    idx = [np.arange(n) - o for n, o in zip(total.shape, origin)]
    idx = [i % n for i, n in zip(idx, shape)]
    np.add.at(out, np.ix_(*idx), total)
    return out


def _check(comm, xp, shape, stencil, mode, dist, failures) -> None:
    g = np.random.default_rng(11).standard_normal(shape)
    ref, origin = padded_reference(g, stencil, mode)
    plan = HaloPlan(dist, shape, stencil, comm.rank, boundary=mode)
    box = dist.box(shape, comm.rank)
    x = g[tuple(slice(a, b) for a, b in box)]
    ex = plan.start(comm, xp.asarray(x))
    early = to_numpy(ex.window[plan.interior_window_slices]).copy()
    win = to_numpy(ex.wait())
    want = ref[tuple(slice(a + o, b + o) for (a, b), o in zip(plan.window_box, origin))]
    if not np.array_equal(win, want):
        failures.append(f"{mode} {dist}: window differs from np.pad in {int((win != want).sum())} elements")
    if not np.array_equal(early, want[plan.interior_window_slices]):
        failures.append(f"{mode} {dist}: interior inputs not ready before wait()")
    y = window_grad(plan, dist, comm.rank)
    gx = to_numpy(plan.accumulate_start(comm, xp.asarray(y)).wait())
    if mode == "circular":  # against the global adjoint of np.pad(mode="wrap")
        total = np.zeros(ref.shape)
        for r in range(dist.ranks):
            if dist.copy_index(r) == 0:
                p = HaloPlan(dist, shape, stencil, r, boundary=mode)
                total[tuple(slice(a + o, b + o) for (a, b), o in zip(p.window_box, origin))] += \
                    window_grad(p, dist, r)
        mine = folded(total, shape, origin, mode)[tuple(slice(a, b) for a, b in box)]
        if not np.allclose(gx, mine, rtol=1e-13, atol=1e-13):
            failures.append(f"{mode} {dist}: accumulated gradient differs from the folded global sum")
    counted = dist.copy_index(comm.rank) == 0
    gap = adjoint_gap(comm, xp.asarray(win), xp.asarray(y), xp.asarray(x), xp.asarray(gx), counted, counted)
    if not gap <= ADJOINT_RTOL:
        failures.append(f"{mode} {dist}: dot-product gap {gap:.2e}")


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_periodic_halo_matches_np_pad_and_its_adjoint(comm, xp, case, mode):
    shape, k, s, p = case
    nsp = len(shape) - 2
    stencil = Stencil.conv(len(shape), k, s, p if isinstance(p, int) else list(p)[:nsp], 1)
    failures, tried = [], 0
    for dist in grids(len(shape), comm.size):
        try:
            check_halo(dist, shape, stencil, mode)  # pure: every rank decides alike
        except DistributionError:
            continue
        tried += 1
        _check(comm, xp, shape, stencil, mode, dist, failures)
    assert_all(comm, not failures and tried > 0, f"{tried} grids tried; " + "; ".join(failures[:8]))


def test_one_rank_wraps_locally(comm):
    """Without a split the periodic window is filled from the rank's own block: no message at all."""
    shape, stencil = (2, 1, 6, 5), Stencil.conv(4, 3, 1, 1, 1)
    dist = Distribution.make(4, ranks=comm.size, n=1)
    plan = HaloPlan(dist, shape, stencil, comm.rank, boundary="circular")
    g = np.arange(math.prod(shape), dtype=float).reshape(shape)
    ok = plan.local and plan.wraps and np.array_equal(plan.local_window(g), np.pad(
        g, [(0, 0), (0, 0), (1, 1), (1, 1)], mode="wrap"))
    assert_all(comm, bool(ok), "a plan without a split should wrap locally")
