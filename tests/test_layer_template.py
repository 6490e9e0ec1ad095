"""The layer template's shared pieces: one scratch-buffer mechanism for kernels and layers."""
from __future__ import annotations

import numpy as np
import pytest

from lbannpy.layers.context import LayerContext
from lbannpy.layers.kernels import _buffers
from lbannpy.layers.kernels import conv as kconv
from lbannpy.layers.kernels import pool as kpool


def test_scratch_reuses_one_buffer_per_slot_and_grows():
    s = _buffers.Scratch(np)
    a = s.get("x", (4, 5), np.float64)
    b = s.get("x", (2, 3), np.float32)  # smaller: the same memory
    assert a.shape == (4, 5) and b.shape == (2, 3) and b.dtype == np.float32
    assert np.shares_memory(a, b)
    c = s.get("x", (10, 10), np.float64)  # larger: a new buffer
    assert c.shape == (10, 10) and not np.shares_memory(a, c)
    d = s.get("y", (2, 3), np.float32)  # another slot never aliases
    assert not np.shares_memory(c, d)


def test_layers_and_kernels_use_the_same_mechanism():
    ctx = LayerContext(None, np, "float64")
    w = ctx.workspace("conv window gradient", (3, 4), np.float64)
    assert isinstance(ctx._workspace, _buffers.Scratch)
    assert np.shares_memory(w, ctx.workspace("conv window gradient", (2, 2), np.float64))
    assert kconv._scratch is _buffers.scratch
    # the compiled conv kernels take addresses from the shared home; the pool kernels take no addresses at
    # all (arrays go to C through the buffer protocol), so there is no second copy of the helper
    assert kconv._addr is _buffers.addr and not hasattr(kpool, "_addr")
    x = np.arange(6.0)
    assert _buffers.addr(x[2:]) - _buffers.addr(x) == 2 * x.itemsize


def test_stencil_layers_on_one_rank_post_no_halo_exchange(monkeypatch):
    """One rank: the halo plans of conv and pool have nothing to exchange, so a training step neither
    starts an exchange nor an accumulation (the step path's fixed cost), and its numbers are those of the
    exchange path (the padded window, the gradient's owned part)."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.halo import HaloPlan
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    spec = {"input": {"channels": 2, "spatial": [6, 6]},
            "layers": [{"name": "c", "type": "conv", "filters": 3, "kernel": 3, "padding": 1},
                       {"name": "p", "type": "pool", "mode": "max", "kernel": 3, "stride": 1, "padding": 1},
                       {"name": "q", "type": "pool", "mode": "avg", "kernel": 2}]}
    rng = np.random.default_rng(3)
    outs = {}
    for exchange in (True, False):
        model = Model(spec, 2, LayerContext(SingleCommunicator(), np, "float64", seed=1), {})
        stencils = [lay for lay in model.layers if hasattr(lay, "halo")]
        assert len(stencils) == 3 and all(lay.halo.local for lay in stencils)
        if exchange:  # the reference: the same plans made to take the exchange path
            for lay in stencils:
                monkeypatch.setattr(lay.halo, "local", False)
        else:
            for name in ("start", "accumulate_start"):
                monkeypatch.setattr(HaloPlan, name, lambda *a, **k: pytest.fail("halo exchange started"))
        x = rng.standard_normal(model.input_shape) if exchange else outs[True][0]
        y = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        dy = DistTensor(np.ones(y.local.shape), y.global_shape, y.dist, 0)
        dx = model.backward(dy)
        outs[exchange] = (x, y.local.copy(), None if dx is None else dx.local.copy(),
                          model.layers[0].w.grad.copy())
    for a, b in zip(outs[True][1:], outs[False][1:]):
        assert (a is None and b is None) or np.array_equal(a, b)
