"""Instance, group and layer norm's local pieces against torch.nn.functional (float64 to 1e-10), on the
compiled path (``_cnorm``) and the array path, with the block cut along a spatial dimension
as split ranks would cut it (the partial sums added in place of the allreduce); float32 keeps its precision
far from zero; the layers refuse what they cannot build; on the CUDA stand-in they make no host sync."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close, require_built
from lbannpy.layers.kernels import norm as K

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["compiled", "array"])
def path(request, monkeypatch):
    if request.param == "compiled":
        require_built(K._cnorm, "_cnorm")
    monkeypatch.setattr(K, "USE_COMPILED", request.param == "compiled")
    return request.param


def _data(shape, affine_shape, offset=0.0, zero_scale=False):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape) * 2.0 + offset
    dy = rng.standard_normal(shape)
    gamma = rng.standard_normal(affine_shape) if affine_shape else None
    beta = rng.standard_normal(affine_shape) if affine_shape else None
    if zero_scale:
        gamma[0] = 0.0
    return x, dy, gamma, beta


def _torch(fn, x, dy, gamma, beta):
    xt = torch.tensor(x, requires_grad=True)
    gt = None if gamma is None else torch.tensor(gamma, requires_grad=True)
    bt = None if beta is None else torch.tensor(beta, requires_grad=True)
    y = fn(xt, gt, bt)
    y.backward(torch.tensor(dy))
    return (y.detach().numpy(), xt.grad.numpy(), None if gt is None else gt.grad.numpy(),
            None if bt is None else bt.grad.numpy())


def _pieces(a, pieces):
    return np.array_split(a, pieces, axis=2)


def _group_norm(x, dy, gamma, beta, groups, pieces, eps=1e-5, dtype=np.float64):
    """The layer's steps on ``pieces`` blocks along H; returns (y, dx, dgamma, dbeta) whole."""
    c = x.shape[1]
    count = (c // groups) * np.prod(x.shape[2:])
    xs = [np.ascontiguousarray(b, dtype=dtype) for b in _pieces(x, pieces)]
    dys = [np.ascontiguousarray(b, dtype=dtype) for b in _pieces(dy, pieces)]
    g = None if gamma is None else gamma.astype(dtype)
    b = None if beta is None else beta.astype(dtype)
    tot = sum(K.group_totals(xb, groups) for xb in xs)
    mean, var = K.moments(tot, float(count))
    ys = [K.group_forward(xb, mean, var, g, b, eps) for xb in xs]
    gg, gb = np.zeros(c, dtype), np.zeros(c, dtype)
    sums = [K.group_backward_sums(d, xb, mean, var, eps) for d, xb in zip(dys, xs)]
    for s in sums:
        K.add_param_grads(s, gg, gb)
    btot = sum(K.group_backward_totals(s, g, groups) for s in sums)
    dxs = [K.group_backward_data(d, xb, mean, var, g, eps, btot, float(count)) for d, xb in zip(dys, xs)]
    return np.concatenate(ys, 2), np.concatenate(dxs, 2), gg, gb


@pytest.mark.parametrize("shape,groups,pieces,affine", [
    ((3, 6, 17, 23), 6, 1, True), ((3, 6, 17, 23), 6, 3, False), ((3, 6, 17, 23), 3, 2, True),
    ((3, 6, 17, 23), 1, 2, True), ((2, 4, 5, 7, 9), 2, 2, True), ((3, 6, 17, 23), 2, 3, False)])
def test_group_and_instance_norm_match_pytorch(path, shape, groups, pieces, affine):
    x, dy, gamma, beta = _data(shape, shape[1] if affine else None)
    want = _torch(lambda a, w, b: F.group_norm(a, groups, w, b, eps=1e-5), x, dy, gamma, beta)
    got = _group_norm(x, dy, gamma, beta, groups, pieces)
    for ours, ref in zip(got, want):
        if ref is not None:
            assert_close(ours, ref)


def test_a_zero_scale_in_a_group(path):
    """A channel whose scale is 0 still passes the gradient of its group's statistics to its input."""
    shape = (3, 6, 9, 11)
    x, dy, gamma, beta = _data(shape, 6, zero_scale=True)
    want = _torch(lambda a, w, b: F.group_norm(a, 3, w, b), x, dy, gamma, beta)
    for ours, ref in zip(_group_norm(x, dy, gamma, beta, 3, 2), want):
        assert_close(ours, ref)


def test_float32_keeps_its_precision_far_from_zero(path):
    """Values around 1000 with spread 2: the statistics of the pieces still give float32's precision."""
    shape = (2, 4, 64, 48)
    x, dy, gamma, beta = _data(shape, 4, offset=1000.0)
    want = _torch(lambda a, w, b: F.group_norm(a, 2, w, b), x, dy, gamma, beta)
    got = _group_norm(x, dy, gamma, beta, 2, 2, dtype=np.float32)
    for ours, ref in zip(got, want):
        assert_close(ours, ref, rtol=5e-5)


@pytest.mark.parametrize("affine,pieces", [(True, 1), (True, 3), (False, 2)])
def test_layer_norm_matches_pytorch(path, affine, pieces):
    shape = (3, 4, 13, 10)
    x, dy, gamma, beta = _data(shape, shape[1:] if affine else None)
    want = _torch(lambda a, w, b: F.layer_norm(a, shape[1:], w, b), x, dy, gamma, beta)
    xs, dys = _pieces(x, pieces), _pieces(dy, pieces)
    gs = _pieces(gamma[None], pieces) if affine else [None] * pieces
    bs = _pieces(beta[None], pieces) if affine else [None] * pieces
    count = float(np.prod(shape[1:]))
    xs, dys = [np.ascontiguousarray(b) for b in xs], [np.ascontiguousarray(b) for b in dys]
    gs = [None if g is None else np.ascontiguousarray(g[0]) for g in gs]
    bs = [None if b is None else np.ascontiguousarray(b[0]) for b in bs]
    tot = sum(K.group_totals(xb, 1) for xb in xs)
    mean, var = K.moments(tot, count)
    ys = [K.layer_forward(xb, mean, var, g, b, 1e-5) for xb, g, b in zip(xs, gs, bs)]
    ggs = [None if g is None else np.zeros_like(g) for g in gs]
    gbs = [None if g is None else np.zeros_like(g) for g in gs]
    back = [K.layer_backward(d, xb, mean, var, 1e-5, g, gg, gb)
            for d, xb, g, gg, gb in zip(dys, xs, gs, ggs, gbs)]
    btot = sum(t for t, _ in back)
    dxs = [K.layer_backward_data(d, xb, mean, var, 1e-5, g, btot, count, work)
           for d, xb, g, (_, work) in zip(dys, xs, gs, back)]
    assert_close(np.concatenate(ys, 2), want[0])
    assert_close(np.concatenate(dxs, 2), want[1])
    if affine:
        assert_close(np.concatenate(ggs, 1), want[2])
        assert_close(np.concatenate(gbs, 1), want[3])


def test_layer_norm_float32_far_from_zero(path):
    shape = (2, 4, 32, 24)
    x, dy, gamma, beta = _data(shape, shape[1:], offset=1000.0)
    want = _torch(lambda a, w, b: F.layer_norm(a, shape[1:], w, b), x, dy, gamma, beta)
    f = np.float32
    x32, dy32, g32, b32 = x.astype(f), dy.astype(f), gamma.astype(f), beta.astype(f)
    count = float(np.prod(shape[1:]))
    mean, var = K.moments(K.group_totals(x32, 1), count)
    y = K.layer_forward(x32, mean, var, g32, b32, 1e-5)
    gg, gb = np.zeros_like(g32), np.zeros_like(g32)
    tot, work = K.layer_backward(dy32, x32, mean, var, 1e-5, g32, gg, gb)
    dx = K.layer_backward_data(dy32, x32, mean, var, 1e-5, g32, tot, count, work)
    for ours, ref in zip((y, dx, gg, gb), want):
        assert_close(ours, ref, rtol=5e-5)


def test_running_update_is_pytorchs():
    """The batch's average of each sample's mean and unbiased variance, moved by the momentum."""
    shape = (4, 3, 6, 5)
    x = np.random.default_rng(2).standard_normal(shape) * 3 + 1
    mean, var = K.moments(K.group_totals(x, 3), 30.0)
    rm, rv = np.full(3, 0.5), np.full(3, 2.0)
    K.running_update(mean, var, 30.0, 0.2, rm, rv)
    tm, tv = torch.full((3,), 0.5, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
    F.instance_norm(torch.tensor(x), tm, tv, use_input_stats=True, momentum=0.2)
    assert_close(rm, tm.numpy(), 1e-14)
    assert_close(rv, tv.numpy(), 1e-14)


def test_layers_refuse_what_they_cannot_build():
    from lbannpy.comm.single import SingleCommunicator
    from lbannpy.layers.base import LayerError
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.registry import LayerArgs, ShapeError, layer_spec
    from lbannpy.model import Model

    spec = layer_spec("groupnorm")
    with pytest.raises(ShapeError, match="divisor of the 6 channels"):
        spec.infer(LayerArgs("g", "groupnorm", spec.resolve({"groups": 4}), ("x",), ((2, 6, 5, 5),)))
    # channels split only into blocks of whole groups (tests/test_split_groups.py)
    assert "c" in spec.split_dims and spec.split_check is not None
    assert "c" in layer_spec("layernorm").split_dims
    ctx = LayerContext(SingleCommunicator(), np, "float64")
    with pytest.raises(LayerError, match="groups=4 must be a positive divisor"):
        Model({"input": {"channels": 6, "spatial": [5, 5]},
               "layers": [{"name": "g", "type": "groupnorm", "groups": 4}]}, 2, ctx, {})
    with pytest.raises((LayerError, ShapeError, ValueError), match="image"):
        Model({"input": {"channels": 6, "spatial": []}, "layers": [{"name": "i", "type": "instancenorm"}]},
              2, ctx, {})


def test_facts_the_planner_reads():
    from lbannpy.layers.registry import LayerArgs, layer_spec

    x = (2, 6, 5, 7)
    for name, params, n_params in (("instancenorm", {}, 0), ("instancenorm", {"affine": True}, 12),
                                   ("groupnorm", {"groups": 3}, 12), ("layernorm", {}, 2 * 6 * 35),
                                   ("layernorm", {"affine": False}, 0)):
        spec = layer_spec(name)
        got = spec.infer(LayerArgs("a", name, spec.resolve(params), ("x",), (x,)))
        assert got.out_shape == x and got.n_params == n_params and got.flops >= 5 * np.prod(x)
        assert spec.spatial_statistics and spec.capturable


_SYNCS = """
import numpy as np, cupy
from cupy import _standin
from lbannpy.comm.single import SingleCommunicator
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.tensor import DistTensor
comm = SingleCommunicator()
for layer in ({"name": "i", "type": "instancenorm", "affine": True, "track_running_stats": True},
              {"name": "g", "type": "groupnorm", "groups": 2}, {"name": "l", "type": "layernorm"}):
    ctx = LayerContext(comm, cupy, "float32", seed=1)
    m = Model({"input": {"channels": 4, "spatial": [6, 5]}, "layers": [layer]}, 3, ctx, {})
    host = np.random.default_rng(0).standard_normal((3, 4, 6, 5)).astype(np.float32)
    x = DistTensor.scatter(cupy.asarray(host), m.input_dist, comm)
    dy = DistTensor.scatter(cupy.asarray(host[::-1].copy()), m.output.out_dist, comm)
    m.forward(x)
    m.backward(dy)
    _standin.reset_host_syncs()
    m.forward(x)
    m.backward(dy)
    print(layer["type"], sum(_standin.host_syncs().values()), _standin.host_syncs())
"""


def test_no_host_sync_in_forward_and_backward_on_the_cuda_standin():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "gpu_standin"),
                                                      os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _SYNCS], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" ", 2) for line in out.stdout.splitlines()]
    assert [r[0] for r in rows] == ["instancenorm", "groupnorm", "layernorm"], out.stdout
    assert all(r[1] == "0" for r in rows), out.stdout


def test_evaluation_with_running_statistics_back_propagates_as_pytorch(path):
    """In evaluation a tracking instance norm is a per-channel affine map of the running statistics: its
    output, input gradient and parameter gradients equal ``InstanceNorm2d.eval()``'s."""
    from lbannpy.comm.single import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    comm = SingleCommunicator()
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 4, 6, 5)) * 2 + 1, rng.standard_normal((3, 4, 6, 5))
    ctx = LayerContext(comm, np, "float64", seed=1)
    layer = {"name": "i", "type": "instancenorm", "affine": True, "track_running_stats": True}
    model = Model({"input": {"channels": 4, "spatial": [6, 5]}, "layers": [layer]}, 3, ctx, {})
    lay = model.layers[0]
    lay.gamma.value[...], lay.beta.value[...] = rng.standard_normal(4), rng.standard_normal(4)
    model.forward(DistTensor.scatter(x, model.input_dist, comm))
    model.set_train(False)
    y = model.forward(DistTensor.scatter(x * 0.5, model.input_dist, comm)).local
    dx = model.backward(DistTensor.scatter(dy, model.output.out_dist, comm), input_grad=True)
    ref = torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True).double()
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(lay.gamma.value))
        ref.bias.copy_(torch.tensor(lay.beta.value))
    ref(torch.tensor(x))
    ref.eval()
    xt = torch.tensor(x * 0.5, requires_grad=True)
    yt = ref(xt)
    yt.backward(torch.tensor(dy))
    assert_close(y, yt.detach().numpy())
    assert_close(dx.local, xt.grad.numpy())
    assert_close(lay.gamma.grad, ref.weight.grad.numpy())
    assert_close(lay.beta.grad, ref.bias.grad.numpy())
