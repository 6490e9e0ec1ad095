"""The losses mse, l1, bce_with_logits and dice split over the ranks against PyTorch on the whole batch
(float64, 1e-10 relative): the loss value and the gathered gradient of every rank's block, under sample,
channel, spatial and mixed splits with uneven blocks, and with copies (leftover ranks) of each block."""
from __future__ import annotations

import numpy as np
import pytest

from loss_refs import KINDS, draw, torch_loss
from mpi_util import assert_all
from lbannpy.dist import Distribution
from lbannpy.layers.context import LayerContext
from lbannpy.layers.loss import Loss
from lbannpy.tensor import DistTensor

# (global output shape, degrees) per rank count: every extent uneven under its split
SPLITS = {
    1: [((5, 3, 7, 9), {}), ((5, 3), {})],
    2: [((5, 3, 7, 9), {"n": 2}), ((5, 3, 7, 9), {"h": 2}), ((5, 3, 7, 9), {"w": 2}),
        ((5, 3, 7, 9), {"c": 2}), ((3, 2, 5, 7, 6), {"d": 2}), ((5, 3), {"n": 2}), ((4, 3, 7, 9), {})],
    3: [((5, 3, 7, 9), {"n": 3}), ((5, 3, 7, 9), {"h": 3}), ((5, 3, 7, 9), {"w": 3}),
        ((5, 3, 7, 9), {"c": 3}), ((3, 2, 5, 7, 6), {"d": 3}), ((5, 3), {"n": 3})],
    4: [((5, 3, 7, 9), {"n": 2, "h": 2}), ((5, 3, 7, 9), {"h": 2, "w": 2}), ((5, 3, 7, 9), {"w": 4}),
        ((5, 3, 7, 9), {"c": 2, "h": 2}), ((3, 2, 5, 7, 6), {"d": 2, "w": 2}), ((5, 3, 7, 9), {"h": 2}),
        ((7, 3), {"n": 4})],
}


def _cases(size):
    return [(kind, shape, deg) for shape, deg in SPLITS.get(size, []) for kind in KINDS
            if kind != "dice" or len(shape) > 2]


@pytest.mark.timeout(240)
def test_losses_split_equal_torch_on_the_whole_batch(comm):
    cases = _cases(comm.size)
    bad = []
    for kind, shape, degrees in cases:
        what = f"{kind} {shape} {degrees or 'whole'}"
        try:
            out, labels = draw(kind, shape)
            want, grad = torch_loss(kind, out, labels)
            ctx = LayerContext(comm, np, "float64", seed=0)
            dist = Distribution.make(len(shape), comm.size, **degrees)
            loss = Loss(kind, ctx, shape, dist)
            mine = labels[tuple(slice(a, b) for a, b in loss.label_box())]
            value, metrics = loss.forward(DistTensor.scatter(out, dist, comm), mine)
            g = loss.backward()
            assert g.dist == dist and g.local.shape == dist.local_shape(shape, comm.rank), what
            got = g.gather(comm)
            err = abs(value - want) / abs(want)
            gerr = np.abs(got - grad).max() / np.abs(grad).max()
            if err > 1e-10 or gerr > 1e-10:
                bad.append(f"{what}: loss error {err:.3g}, gradient error {gerr:.3g}")
        except Exception as exc:  # one broken case must not hide the others; every rank reports its own
            bad.append(f"{what}: {type(exc).__name__}: {exc}")
    assert_all(comm, bool(cases) and not bad, "\n".join(bad) or f"no cases at {comm.size} ranks")
