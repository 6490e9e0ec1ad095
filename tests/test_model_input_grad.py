"""Training skips the gradient w.r.t. the model input: layers reading only the input (conv, fc) compute
no data gradient, and every weight gradient is the same as with it."""
from __future__ import annotations

import numpy as np
import pytest

from lbannpy.comm import SingleCommunicator
from lbannpy.layers import kernels as K
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.tensor import DistTensor

SPECS = {
    "conv": {"input": {"channels": 3, "spatial": [9, 11]},
             "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                        {"name": "r1", "type": "relu"},
                        {"name": "f1", "type": "fc", "units": 5}]},
    "fc": {"input": {"channels": 3, "spatial": [4, 4]},
           "layers": [{"name": "f0", "type": "fc", "units": 6}, {"name": "r0", "type": "relu"},
                      {"name": "f1", "type": "fc", "units": 5}]},
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_training_backward_skips_the_input_gradient(kind, monkeypatch):
    grads = {}
    calls = []
    for input_grad in (True, False):
        ctx = LayerContext(SingleCommunicator(), np, "float64", seed=3)
        model = Model(SPECS[kind], 2, ctx, {})
        x = np.random.default_rng(0).standard_normal(model.input_shape)
        y = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        dy = DistTensor(np.random.default_rng(1).standard_normal(y.local.shape), y.global_shape, y.dist, 0)
        # the package's names, the conv module's (which the own kernel set calls) and the small
        # convolutions' plan (a layer's passes with their arguments worked out once)
        for mod, name, key in ((K, "conv_backward_data", None), (K.conv, "conv_backward_data", None),
                               (K.conv._small.Plan, "backward_data", "conv_backward_data"),
                               (K, "fc_backward_data", None)):
            orig = getattr(mod, name)
            monkeypatch.setattr(mod, name,
                                lambda *a, _o=orig, _n=key or name, **k: calls.append(_n) or _o(*a, **k))
        dx = model.backward(dy, input_grad=input_grad)
        monkeypatch.undo()
        assert (dx is None) == (not input_grad)
        grads[input_grad] = {p.name: p.grad.copy() for p in model.params}
        first = "conv_backward_data" if kind == "conv" else "fc_backward_data"
        if not input_grad:
            # only f1 (not the first layer) computed a data gradient
            assert calls.count(first) == (0 if kind == "conv" else 1), calls
        else:  # the counting sees the first layer's data gradient when it is asked for
            assert calls.count(first) == (1 if kind == "conv" else 2), calls
        calls.clear()
    for name, g in grads[True].items():
        np.testing.assert_array_equal(grads[False][name], g)
    assert all(layer.needs_input_grad for layer in model.layers[1:])


def test_only_the_layer_reading_the_input_keeps_its_window_between_steps():
    """The first conv is back-propagated last, so its window is alive through every backward: it reuses one
    buffer from step to step. Every other conv keeps no window at all between its forward and backward, only
    a reference to its input block (its parent's output), and rebuilds the window in its backward."""
    spec = {"input": {"channels": 3, "spatial": [9, 11]},
            "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                       {"name": "c2", "type": "conv", "filters": 4, "kernel": 3, "padding": 1}]}
    ctx = LayerContext(SingleCommunicator(), np, "float64", seed=3)
    model = Model(spec, 2, ctx, {})
    c1, c2 = model.layers
    assert c1.keeps_window and not c2.keeps_window
    seen, outs = [], []
    for step in range(2):
        x = np.random.default_rng(step).standard_normal(model.input_shape)
        y = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        seen.append(c1._window)
        assert c2._window is None and c2._x is model._acts["c1"].local
        outs.append(y.local.copy())
        model.backward(DistTensor(np.ones_like(y.local), y.global_shape, y.dist, 0), input_grad=False)
        assert c1._window is None and c2._window is None and c2._window_buf is None and c2._x is None
    assert seen[0] is seen[1]
    assert not np.array_equal(outs[0], outs[1])  # the reused window holds the new input


def test_gradients_of_a_tensor_read_twice_are_summed_into_one_planned_buffer():
    """A residual net (c1 read by r1 and s1; s1 reads r1 and c1): the summed gradients live in a buffer
    planned at the first step and written in place after (a captured step keeps writing the same one),
    and every weight gradient equals PyTorch's autograd of the same net, at every step."""
    import torch

    spec = {"input": {"channels": 3, "spatial": [5, 6]},
            "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                       {"name": "r1", "type": "relu"}, {"name": "s1", "type": "sum", "parents": ["r1", "c1"]},
                       {"name": "t1", "type": "sum", "parents": ["s1", "c1"]},
                       {"name": "f1", "type": "fc", "units": 5}]}
    model = Model(spec, 2, LayerContext(SingleCommunicator(), np, "float64", seed=3), {})
    w = {p.name: torch.tensor(p.value.copy(), requires_grad=True) for p in model.params}
    rng = np.random.default_rng(2)
    buffers = None
    for _ in range(3):
        x = rng.standard_normal(model.input_shape)
        y = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        dy = rng.standard_normal(y.local.shape)
        for p in model.params:
            p.grad[...] = 0
        model.backward(DistTensor(dy, y.global_shape, y.dist, 0), input_grad=False)
        c = torch.nn.functional.conv2d(torch.tensor(x), w["c1.weight"], w["c1.bias"], padding=1)
        t = torch.relu(c) + c + c
        out = t.reshape(2, -1) @ w["f1.weight"].T + w["f1.bias"]
        for v in w.values():
            v.grad = None
        out.backward(torch.tensor(dy))
        for p in model.params:
            np.testing.assert_allclose(p.grad, w[p.name].grad.numpy(), rtol=1e-12, atol=1e-12)
        now = {k: (id(b), b.ctypes.data) for k, b in model._grad_sums.items()}
        assert sorted(k[0] for k in now) == ["c1"]  # c1: read by r1, s1 and t1; the others once
        assert buffers is None or now == buffers
        buffers = now
    # the model input read twice: its summed gradient is the caller's, a new array every backward
    spec = {"input": {"channels": 2, "spatial": [3, 3]},
            "layers": [{"name": "r1", "type": "relu"}, {"name": "s1", "type": "sum", "parents": ["r1", "x"]}]}
    model = Model(spec, 1, LayerContext(SingleCommunicator(), np, "float64", seed=3), {})
    x = rng.standard_normal(model.input_shape)
    got = []
    for k in range(2):
        y = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        got.append(model.backward(DistTensor(np.full(y.local.shape, k + 1.0), y.global_shape, y.dist, 0)))
    np.testing.assert_array_equal(got[0].local, 1.0 + (x > 0))
    np.testing.assert_array_equal(got[1].local, 2.0 * (1.0 + (x > 0)))
