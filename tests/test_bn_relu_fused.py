"""Fused batch-norm + ReLU and the in-place ReLU: against PyTorch (``relu(batch_norm(x))``, gradients by
autograd, float64), compiled kernels against the NumPy path, fused models against the layers run one by
one, and the ``overhead`` benchmark's output format."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.comm import SingleCommunicator
from lbannpy.layers import kernels as K
from lbannpy.layers.context import LayerContext
from lbannpy.layers.kernels import batchnorm as B
from lbannpy.model import Model
from lbannpy.tensor import DistTensor

SHAPES = [(3, 5, 17, 23), (4, 6), (2, 3, 5, 7, 4), (2, 2, 1, 1)]
PATHS = [pytest.param(True, id="compiled", marks=pytest.mark.skipif(B._cbn is None, reason="no _cbn")),
         pytest.param(False, id="numpy")]


def _fused(x, dy, gamma, beta, pieces, eps=1e-5):
    """The fused kernels on ``pieces`` contiguous sample blocks (the sums stand in for the allreduce)."""
    xs = [np.ascontiguousarray(b) for b in np.array_split(x, pieces, 0)]
    dys = [np.ascontiguousarray(b) for b in np.array_split(dy, pieces, 0)]
    stats = [K.bn_local_stats(b) for b in xs]
    total, total_sq, count = (sum(s[i] for s in stats) for i in range(3))
    mean, var = K.bn_mean_var(total, total_sq, count)
    ys = [K.bn_forward(b, mean, var, gamma, beta, eps, relu=True) for b in xs]
    parts = [K.bn_backward(d, b, mean, var, gamma, eps, y=y) for d, b, y in zip(dys, xs, ys)]
    sdy, sdyx = sum(p[0] for p in parts), sum(p[1] for p in parts)
    dx = [K.bn_backward_data(d, b, mean, var, gamma, eps, sdy, sdyx, count, y=y)
          for d, b, y in zip(dys, xs, ys)]
    return np.concatenate(ys), np.concatenate(dx), sdyx, sdy


def _data(shape, offset=0.0):
    rng = np.random.default_rng(1)
    c = shape[1]
    return (rng.standard_normal(shape) * 2.0 + offset, rng.standard_normal(shape), rng.standard_normal(c),
            rng.standard_normal(c))


# float32 only where a channel has 4 or more values: with two, dx is all cancellation and no round-off bound
# holds (float64 covers those shapes)
CASES = [(s, np.float64, 1e-10) for s in SHAPES] + [(s, np.float32, 1e-5) for s in SHAPES
                                                    if np.prod(s) // s[1] >= 4]


@pytest.mark.parametrize("compiled", PATHS)
@pytest.mark.parametrize("shape, dtype, rtol", CASES,
                         ids=[f"{'x'.join(map(str, s))}-{np.dtype(d).name}" for s, d, _ in CASES])
def test_fused_kernels_match_torch(monkeypatch, compiled, shape, dtype, rtol):
    monkeypatch.setattr(B, "USE_COMPILED", compiled)
    x, dy, gamma, beta = _data(shape, offset=3.0)
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(gamma, requires_grad=True), torch.tensor(beta, requires_grad=True)
    yt = F.relu(F.batch_norm(xt, None, None, gt, bt, training=True, eps=1e-5))
    yt.backward(torch.tensor(dy))
    y, dx, dgamma, dbeta = _fused(x.astype(dtype), dy.astype(dtype), gamma.astype(dtype), beta.astype(dtype),
                                  min(2, shape[0]))
    assert y.dtype == dx.dtype == dtype
    assert_close(y, yt.detach().numpy(), rtol)
    assert_close(dx, xt.grad.numpy(), rtol)
    assert_close(dgamma, gt.grad.numpy(), rtol)
    assert_close(dbeta, bt.grad.numpy(), rtol)


@pytest.mark.skipif(B._cbn is None, reason="the compiled batch-norm kernels are not built")
@pytest.mark.parametrize("relu", [False, True])
def test_compiled_equals_numpy_path(monkeypatch, relu):
    x, dy, gamma, beta = _data((4, 3, 9, 11), offset=100.0)
    out = {}
    for compiled in (True, False):
        monkeypatch.setattr(B, "USE_COMPILED", compiled)
        s, sq, n = K.bn_local_stats(x)
        mean, var = K.bn_mean_var(s, sq, n)
        y = K.bn_forward(x, mean, var, gamma, beta, 1e-5, relu=relu)
        mask = y if relu else None
        sdy, sdyx = K.bn_backward(dy, x, mean, var, gamma, 1e-5, y=mask)
        dx = K.bn_backward_data(dy, x, mean, var, gamma, 1e-5, sdy, sdyx, n, y=mask)
        out[compiled] = (s, sq, y, sdy, sdyx, dx, K.relu_backward(dy, x))
    for a, b in zip(out[True], out[False]):
        assert_close(a, b, 1e-12)


def test_relu_nan_propagates_and_gradient_at_zero_is_zero(monkeypatch):
    x = np.array([[[np.nan, -1.0, 0.0, 2.0]]])
    dy = np.ones_like(x)
    for compiled in ([True, False] if B._cbn is not None else [False]):
        monkeypatch.setattr(B, "USE_COMPILED", compiled)
        y = K.bn_forward(x, np.zeros(1), np.ones(1) - 1e-5, np.ones(1), np.zeros(1), 1e-5, relu=True)
        assert np.isnan(y[0, 0, 0]) and list(y[0, 0, 1:]) == [0.0, 0.0, 2.0]
        assert list(K.relu_backward(dy, x)[0, 0]) == [0.0, 0.0, 0.0, 1.0]


def _model(layers, dtype, fuse, shape=(3, 4, 9, 7)):
    ctx = LayerContext(SingleCommunicator(), np, dtype, seed=3, fuse=fuse)
    spec = {"input": {"channels": shape[1], "spatial": list(shape[2:])}, "layers": layers}
    return Model(spec, shape[0], ctx, {})


def _run(model, shape=(3, 4, 9, 7)):
    rng = np.random.default_rng(5)
    dt = model.ctx.dtype
    x = DistTensor(rng.standard_normal(shape).astype(dt), shape, model.input_dist, 0)
    y = model.forward(x)
    y_copy = y.local.copy()
    out = model.output
    dy = DistTensor(rng.standard_normal(out.out_shape).astype(dt), out.out_shape, out.out_dist, 0)
    dx = model.backward(dy)
    return [y_copy, dx.local] + [p.grad.copy() for p in model.params]


NET = [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
       {"name": "s0", "type": "sum", "parents": ["c1", "x"]}, {"name": "r0", "type": "relu"},
       {"name": "b1", "type": "batchnorm"}, {"name": "r1", "type": "relu"},
       {"name": "c2", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
       {"name": "b2", "type": "batchnorm", "sync": "global"}, {"name": "r2", "type": "relu"},
       {"name": "s", "type": "sum", "parents": ["r2", "r1"]}]


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_fused_model_equals_unfused(dtype, rtol):
    fused, alone = _model(NET, dtype, True), _model(NET, dtype, False)
    layers = {layer.name: layer for layer in fused.layers}
    assert layers["b1"].fuse_relu and layers["b2"].fuse_relu and layers["r0"].inplace
    assert not any(getattr(layer, "fuse_relu", False) or getattr(layer, "inplace", False)
                   for layer in alone.layers)
    for step in range(2):  # a second step reuses whatever the first one set up
        for a, b in zip(_run(fused), _run(alone)):
            assert_close(a, b, rtol)


def test_nothing_fused_where_another_layer_reads_the_batchnorm():
    layers = [{"name": "b", "type": "batchnorm"}, {"name": "r", "type": "relu"},
              {"name": "s", "type": "sum", "parents": ["r", "b"]},
              {"name": "p", "type": "pool", "kernel": 1}, {"name": "r2", "type": "relu"}]
    model = _model(layers, "float64", True)
    by = {layer.name: layer for layer in model.layers}
    assert not by["b"].fuse_relu and not by["r"].inplace  # b has two readers
    assert not by["r2"].inplace  # a pooling layer may keep its output
    unfused = _model(layers, "float64", False)
    for a, b in zip(_run(model), _run(unfused)):
        assert_close(a, b, 1e-12)


def test_overhead_bench_quick_format(capsys):
    from lbannpy.bench import overhead

    assert overhead.main(["--quick", "--kinds", "relu,batchnorm,batchnorm+relu", "--size", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "target 60 us per layer" in lines[0]
    assert lines[1].split() == ["layer", "us/layer", "target"]
    rows = lines[2:-1]
    assert [r.split()[0] for r in rows] == ["relu", "batchnorm", "batchnorm+relu"]
    for r in rows:
        assert re.match(r"^\S+\s+-?\d+\.\d\s+(ok|over)", r), r
    assert re.match(r"^step: mesh_tiny 8x8 batch 1: \d+\.\d{3} ms forward \+ backward, \d+ layers, "
                    r"-?\d+\.\d us per layer", lines[-1]), lines[-1]


@pytest.mark.parametrize("net", [NET, [{"name": "b", "type": "batchnorm"}, {"name": "r", "type": "relu"},
                                       {"name": "s", "type": "sum", "parents": ["r", "b"]},
                                       {"name": "p", "type": "pool", "kernel": 1},
                                       {"name": "r2", "type": "relu"},
                                       {"name": "s2", "type": "sum", "parents": ["r2", "p"]},
                                       {"name": "r3", "type": "relu"},
                                       {"name": "f", "type": "fc", "units": 2}]],
                         ids=["fused-and-inplace", "readers-and-pool"])
def test_the_memory_estimate_shares_what_the_model_shares(net):
    """The strategy's memory estimate counts no array of its own for exactly the activations the model
    runs inside their batch-norm or in place (one rule for both)."""
    from lbannpy.strategy.graph import build_graph
    from lbannpy.strategy.planner import _shares_parent_output

    model = _model(net, "float64", True)
    by = {layer.name: layer for layer in model.layers}
    shared = {name for name, layer in by.items()
              if getattr(layer, "inplace", False)
              or any(by[p].fuse_relu for p in model.parents[name] if getattr(by.get(p), "fuse_relu", False))}
    assert shared, "the net shares nothing: the comparison would be empty"
    spec = {"input": {"channels": 4, "spatial": [9, 7]}, "layers": net}
    graph = build_graph(spec, 3)
    assert _shares_parent_output(graph, {name: layer.out_dist for name, layer in by.items()}) == shared
