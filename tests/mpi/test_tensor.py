"""DistTensor at any rank count: scatter -> gather and from_root are the identity for every grid (every
factorization of the rank count over the tensor's dimensions, leftover ranks and replicated axes
included), on uneven 2-D to 5-D shapes; bad input is refused on every rank."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from lbannpy.backend import to_numpy
from lbannpy.dist import Distribution, DistributionError, empty_block
from lbannpy.tensor import DistTensor
from tensor_util import from_root
from mpi_util import assert_all, raises_all


def grids(ndim: int, ranks: int, replicate_variants: bool = True) -> list[Distribution]:
    """Every split whose product divides ``ranks`` (the rest replicate), plus each split with its first
    split axis replicated instead of partitioned."""
    out = []
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    for split in itertools.product(divisors, repeat=ndim):
        if ranks % math.prod(split):
            continue
        out.append(Distribution(split, ranks))
        first = next((i for i in range(ndim) if split[i] > 1), None)
        if replicate_variants and first is not None:
            out.append(Distribution(split, ranks, (first,)))
    return out


@dataclass(frozen=True)
class ShapeCase:
    name: str
    shape: tuple

    @property
    def id(self) -> str:
        return f"{self.name}-{'x'.join(map(str, self.shape))}"


SHAPES = [  # at 8 ranks only the 3-D one: the 4-D and 5-D grids there number in the hundreds
    ShapeCase("image", (5, 3, 17, 23)),
    ShapeCase("volume", (3, 2, 7, 9, 11)),
    ShapeCase("matrix", (7, 5)),
    pytest.param(ShapeCase("signal", (3, 4, 13)), marks=pytest.mark.ranks8),
]


def global_array(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: c.id)
def test_scatter_gather_identity_on_every_grid(comm, xp, case):
    g = global_array(case.shape)
    gx = xp.asarray(g)
    failures, tried = [], 0
    for dist in grids(len(case.shape), comm.size):
        if empty_block(dist, case.shape) is not None:
            continue  # refused identically everywhere; covered by test_refusals
        tried += 1
        t = DistTensor.scatter(gx, dist, comm)
        box = dist.box(case.shape, comm.rank)
        if not np.array_equal(to_numpy(t.local), g[tuple(slice(a, b) for a, b in box)]):
            failures.append(f"{dist}: scatter kept the wrong block")
        if not np.array_equal(to_numpy(t.gather(comm)), g):
            failures.append(f"{dist}: gather on every rank")
        for root in sorted({0, comm.size - 1}):
            got = t.gather(comm, root=root)
            if comm.rank == root and not np.array_equal(to_numpy(got), g):
                failures.append(f"{dist}: gather to root {root}")
            if comm.rank != root and got is not None:
                failures.append(f"{dist}: gather to root {root} returned data on a non-root rank")
        root = comm.size - 1
        f = from_root(gx if comm.rank == root else None, dist, comm, root=root)
        if not np.array_equal(to_numpy(f.local), to_numpy(t.local)) or f.global_shape != case.shape:
            failures.append(f"{dist}: from_root({root})")
    assert_all(comm, not failures and tried > 0, f"{tried} grids tried; " + "; ".join(failures[:10]))


def test_gather_of_non_contiguous_local_and_dtypes(comm, xp):
    shape = (4, 3, 9, 10)
    dist = Distribution.make(4, ranks=comm.size, w=comm.size)
    failures = []
    for dtype in ("float32", "int64"):
        g = (np.arange(math.prod(shape)) % 97).reshape(shape).astype(dtype)
        t = DistTensor.scatter(xp.asarray(g), dist, comm)
        # a transposed copy viewed back: same values, non-contiguous memory
        odd = xp.ascontiguousarray(xp.swapaxes(t.local, 0, 3))
        t2 = DistTensor(xp.swapaxes(odd, 0, 3), shape, dist, comm.rank)
        got = to_numpy(t2.gather(comm))
        if got.dtype != g.dtype or not np.array_equal(got, g):
            failures.append(f"{dtype}: {got.dtype}")
    assert_all(comm, not failures, "; ".join(failures))


def test_refusals(comm, xp):
    g = xp.asarray(global_array((3, 2, 5, 4)))
    wrong_ranks = Distribution.whole(4, comm.size + 1)
    raises_all(comm, DistributionError, DistTensor.scatter, g, wrong_ranks, comm, match="communicator has")
    raises_all(comm, DistributionError, from_root, None, Distribution.whole(4, comm.size),
               comm, match="passed no array")
    local = xp.zeros((1, 1, 1, 1))
    raises_all(comm, DistributionError, DistTensor, local, (3, 2, 5, 4),
               Distribution.whole(4, comm.size), comm.rank, match="expected (3, 2, 5, 4)")
    if comm.size >= 2:
        # more blocks along h than rows: every rank names the same first empty rank
        dist = Distribution.make(4, ranks=comm.size, h=comm.size)
        exc = raises_all(comm, DistributionError, from_root,
                         global_array((3, 2, comm.size - 1, 4)) if comm.rank == 0 else None, dist, comm,
                         match=f"rank {comm.size - 1} would hold an empty block along 'h'")
        msgs = comm.allgather_obj(str(exc))
        assert_all(comm, len(set(msgs)) == 1 and str(dist) in msgs[0], f"messages differ: {msgs}")
