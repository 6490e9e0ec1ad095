"""Test helpers on distributed tensors: a tensor sent out from one rank, and the dot-product test of an
operator and its adjoint (replicated pieces counted once: the ranks of replica 0 speak for their block)."""
from __future__ import annotations

import math

import numpy as np

from lbannpy.backend import array_module, get_xp
from lbannpy.dist import DistributionError
from lbannpy.packing import check_comm, pack, segments
from lbannpy.tensor import DistTensor


def from_root(global_array, dist, comm, root: int = 0) -> DistTensor:
    """Collective over ``comm``: ``root`` holds the global array (others pass ``None``) and sends every rank
    its block (all replicas receive) in one alltoallv. Shape, dtype and array backend come from ``root``;
    an error found on ``root`` (no array, bad shape) is raised on every rank."""
    if comm.rank == root:
        meta = (None if global_array is None else
                (tuple(global_array.shape), np.dtype(global_array.dtype).str,
                 "numpy" if array_module(global_array) is np else "cupy"))
    else:
        meta = None
    meta = comm.bcast_obj(meta, root)
    if meta is None:
        raise DistributionError(f"from_root: root rank {root} passed no array; give it the global array")
    shape, dtype, backend = meta
    check_comm(comm, dist, None, "from_root")
    xp = get_xp(backend)
    nranks = comm.size
    sizes = [math.prod(dist.local_shape(shape, r)) for r in range(nranks)]
    if comm.rank == root:
        segs = segments([(r, dist.box(shape, r)) for r in range(nranks)], (0,) * len(shape))
        sendbuf = pack(global_array, segs)
        sendcounts = sizes
    else:
        sendbuf = xp.empty(0, dtype=dtype)
        sendcounts = [0] * nranks
    recvcounts = [sizes[comm.rank] if r == root else 0 for r in range(nranks)]
    flat = comm.alltoallv(sendbuf, sendcounts, recvcounts)
    # the constructor refuses a bad shape (an empty block) with the same message on every rank
    return DistTensor(flat.reshape(dist.local_shape(shape, comm.rank)), shape, dist, comm.rank)


def adjoint_gap(comm, fx, y, x, aty, fwd_counted: bool = True, adj_counted: bool = True) -> float:
    """Collective over ``comm``: the dot-product test of a linear operator ``F`` and its adjoint ``F*``.

    Given ``fx = F x`` and ``aty = F* y`` (local pieces), returns the relative gap
    ``|<F x, y> - <x, F* y>| / max(|<F x, y>|, |<x, F* y>|)``, inner products summed over ranks. Ranks whose
    pieces duplicate another rank's (replicas other than 0) pass ``fwd_counted`` / ``adj_counted`` False
    so that each logical element counts once. Zero for a correct adjoint up to rounding (~1e-15 in
    float64 for well-scaled data); 0.0 when both products vanish.
    """
    xp = array_module(fx)
    lhs = float(xp.vdot(fx.reshape(-1), y.reshape(-1))) if fwd_counted and fx.size else 0.0
    rhs = float(xp.vdot(x.reshape(-1), aty.reshape(-1))) if adj_counted and x.size else 0.0
    lhs, rhs = (float(v) for v in comm.allreduce(xp.asarray([lhs, rhs], dtype=np.float64)))
    scale = max(abs(lhs), abs(rhs))
    return 0.0 if scale == 0.0 else abs(lhs - rhs) / scale
