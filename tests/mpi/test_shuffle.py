"""Redistribution at any rank count: random pairs of distributions (replicated axes and leftover replicas
on either side) against the global re-blocking, the reverse plan, and the dot-product test.

Replicated distributions: inputs are cut from one global array, so replicas agree, and inner products
count each logical element once (ranks of replica 0 only), as :func:`tensor_util.adjoint_gap` says.
Under replicated semantics (see :mod:`lbannpy.shuffle`) the adjoint of ``src -> dst`` is ``dst -> src``.
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import numpy as np
import pytest

from lbannpy.backend import array_module, to_numpy
from lbannpy.dist import Distribution, DistributionError, empty_block
from lbannpy.shuffle import ShufflePlan, shuffle_plan
from lbannpy.tensor import DistTensor, pack, unpack
from tensor_util import adjoint_gap
from mpi_util import assert_all, raises_all

ADJOINT_RTOL = 1e-12


def all_dists(ndim: int, ranks: int) -> list[Distribution]:
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    out = []
    for split in itertools.product(divisors, repeat=ndim):
        if ranks % math.prod(split) == 0:
            out.append(Distribution(split, ranks))
            out += [Distribution(split, ranks, (i,)) for i in range(ndim) if split[i] > 1][:1]
    return out


@dataclass(frozen=True)
class PairSet:
    """``count`` random (source, destination) pairs for a tensor of ``shape`` (seeded: same on all ranks)."""

    name: str
    shape: tuple
    count: int
    seed: int

    @property
    def id(self) -> str:
        return f"{self.name}-{'x'.join(map(str, self.shape))}"

    def pairs(self, ranks: int) -> list[tuple[Distribution, Distribution]]:
        dists = [d for d in all_dists(len(self.shape), ranks) if empty_block(d, self.shape) is None]
        rng = random.Random(self.seed * 1000 + ranks)
        pairs = [(rng.choice(dists), rng.choice(dists)) for _ in range(self.count)]
        # always include the extremes: replicated <-> fully split, and a distribution onto itself
        rep = Distribution.whole(len(self.shape), ranks)
        split = max(dists, key=lambda d: d.nblocks)
        return pairs + [(rep, split), (split, rep), (split, split)]


PAIR_SETS = [
    pytest.param(PairSet("image", (5, 3, 17, 23), 24, 1), marks=pytest.mark.ranks8),
    PairSet("volume", (3, 2, 7, 9, 11), 12, 2),
    PairSet("matrix", (7, 5), 12, 3),
]


def global_array(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def block(g, dist, rank):
    return g[tuple(slice(a, b) for a, b in dist.box(g.shape, rank))]


@pytest.mark.parametrize("pairs", PAIR_SETS, ids=lambda p: p.id)
def test_redistribution_matches_global_reblocking_and_its_adjoint(comm, xp, pairs):
    gx = global_array(pairs.shape, 5)
    gy = global_array(pairs.shape, 6)
    failures = []
    for src, dst in pairs.pairs(comm.size):
        plan = shuffle_plan(src, dst, pairs.shape, comm.rank)
        x = xp.asarray(block(gx, src, comm.rank))
        fx = plan.start(comm, x).wait()
        if not np.array_equal(to_numpy(fx), block(gx, dst, comm.rank)):
            failures.append(f"{src} -> {dst}: wrong block")
        y = xp.asarray(block(gy, dst, comm.rank))
        aty = plan.reverse().start(comm, y).wait()
        if not np.array_equal(to_numpy(aty), block(gy, src, comm.rank)):
            failures.append(f"{dst} -> {src} (reverse): wrong block")
        gap = adjoint_gap(comm, fx, y, x, aty, dst.copy_index(comm.rank) == 0, src.copy_index(comm.rank) == 0)
        if not gap <= ADJOINT_RTOL:
            failures.append(f"{src} -> {dst}: dot-product gap {gap:.2e}")
    assert_all(comm, not failures, "; ".join(failures[:8]))


@pytest.mark.ranks8
def test_dist_tensor_redistribute_and_local_only_plans(comm, xp):
    shape = (4, 3, 9, 10)
    g = global_array(shape, 8)
    rep = Distribution.whole(4, comm.size)
    split = Distribution.make(4, ranks=comm.size, w=comm.size)
    t = DistTensor.scatter(xp.asarray(g), rep, comm)
    s = t.redistribute(split, comm)
    back = s.redistribute(rep, comm)
    ok = (np.array_equal(to_numpy(s.local), block(g, split, comm.rank)) and s.dist == split
          and np.array_equal(to_numpy(back.local), g))
    # replicated -> split keeps a slice on every rank: no collective, the same decision everywhere
    local_only = [shuffle_plan(rep, split, shape, r).local_only for r in range(comm.size)]
    gathers = shuffle_plan(split, rep, shape, comm.rank)
    ok = ok and all(local_only) and (comm.size == 1 or not gathers.local_only)
    assert_all(comm, ok, f"redistribute round trip or local-only planning wrong (local_only {local_only})")


def reverse_variant(plan: ShufflePlan, comm, y, mode: str):
    """The reverse shuffle rebuilt from the plan's public segments, correct or with a defect:
    ``forget_own`` leaves out the piece a rank keeps for itself (a sendrecv-to-peers bug)."""
    rev = plan.reverse()
    flat = comm.alltoallv(pack(y, rev.sends), rev.sendcounts, rev.recvcounts)
    out = array_module(y).zeros(rev.dst_local_shape)
    segs = [s for s in rev.recvs if not (mode == "forget_own" and s.peer == comm.rank)]
    return unpack(flat, segs, out)


def test_negative_control_dot_product_check_catches_a_wrong_reverse(comm, xp):
    shape = (4, 3, 9, 10)
    src = Distribution.make(4, ranks=comm.size, n=math.gcd(comm.size, 4))
    dst = Distribution.make(4, ranks=comm.size, h=comm.size)
    plan = shuffle_plan(src, dst, shape, comm.rank)
    x = xp.asarray(block(global_array(shape, 9), src, comm.rank))
    y = xp.asarray(block(global_array(shape, 10), dst, comm.rank))
    fx = plan.start(comm, x).wait()
    gaps = {}
    for mode in ("correct", "forget_own"):
        aty = reverse_variant(plan, comm, y, mode)
        gaps[mode] = adjoint_gap(comm, fx, y, x, aty, dst.copy_index(comm.rank) == 0,
                                 src.copy_index(comm.rank) == 0)
    assert_all(comm, gaps["correct"] <= ADJOINT_RTOL and gaps["forget_own"] > 1e-3,
               f"gaps {gaps}: the rebuilt reverse must pass and 'forget_own' must fail")


def test_redistributions_that_cannot_work_fail_on_every_rank(comm, xp):
    p = comm.size
    a = Distribution.make(4, ranks=p, h=p)
    raises_all(comm, DistributionError, ShufflePlan, a, Distribution.make(4, ranks=p + 1, w=1), (2, 2, 8, 8),
               comm.rank, match=f"{p} ranks and the destination on {p + 1}")
    if p >= 2:
        shape = (2, 2, 8, p - 1)
        dst = Distribution.make(4, ranks=p, w=p)
        exc = raises_all(comm, DistributionError, ShufflePlan, a, dst, shape, comm.rank,
                         match=f"rank {p - 1} (block (0, 0, 0, {p - 1})) would hold an empty destination "
                               f"block")
        msgs = comm.allgather_obj(str(exc))
        assert_all(comm, len(set(msgs)) == 1 and str(dst) in msgs[0] and "2×2×8×" in msgs[0], str(msgs))
    plan = ShufflePlan(a, a, (2, 2, max(p, 3), 3), comm.rank)
    raises_all(comm, DistributionError, plan.start, comm, xp.zeros((1, 1, 1, 1)), match="expected")
