"""The activation kernels (sigmoid, tanh, GELU exact and tanh, SiLU, ELU, PReLU, softmax over channels,
product) against PyTorch: float64 forward and input gradient (and PReLU's weight gradient) on random
values and on the edges (zeros of both signs, tiny, large where exp overflows or the tails underflow,
infinities, NaN), to 1e-12 of the largest value; float32 to float32 round-off; and the NumPy path's block
boundaries (an array of several blocks with a partial last one) and non-contiguous arguments. Sigmoid, SiLU
and exact GELU run on both paths, compiled (``_cact``) and NumPy, which agree to float round-off."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close, require_built
from lbannpy.layers.kernels import activation as K

EDGES = np.array([0.0, -0.0, 1e-300, -1e-300, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 8.0, -8.0,
                  20.0, -20.0, 30.0, -30.0, 38.0, -38.0, 100.0, -100.0, 750.0, -750.0, 1e4, -1e4, 1e30,
                  -1e30, 1e300, -1e300])
SPECIAL = np.array([np.inf, -np.inf, np.nan])


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """Both paths of the kernels with a compiled form (the others ignore it)."""
    if request.param == "compiled":
        require_built(K._cact, "_cact")
    monkeypatch.setattr(K, "USE_COMPILED", request.param == "compiled")
    return request.param


def _input(special: bool, shape=(3, 5, 17, 23), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 3
    flat = x.reshape(-1)
    edges = np.concatenate([EDGES, SPECIAL]) if special else EDGES
    flat[:edges.size] = edges
    return x, rng.standard_normal(shape)


def _torch(fn, x, dy):
    xt = torch.tensor(x, requires_grad=True)
    y = fn(xt)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy()


def _ours(name, x, dy, **kw):
    if name in ("sigmoid", "tanh"):
        fwd, bwd = getattr(K, f"{name}_forward"), getattr(K, f"{name}_backward")
        y = fwd(x)
        return y, bwd(dy, y)
    if name == "elu":
        y = K.elu_forward(x, kw["alpha"])
        return y, K.elu_backward(dy, y, kw["alpha"])
    if name == "silu":
        y, saved = K.silu_forward(x)
        return y, K.silu_backward(dy, saved)
    y, saved = K.gelu_forward(x, kw["approximate"])
    return y, K.gelu_backward(dy, saved, kw["approximate"])


UNARY = [
    ("sigmoid", {}, torch.sigmoid),
    ("tanh", {}, torch.tanh),
    ("silu", {}, F.silu),
    ("gelu", {"approximate": "none"}, F.gelu),
    ("gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh")),
    ("elu", {"alpha": 1.0}, F.elu),
    ("elu", {"alpha": 0.4}, lambda x: F.elu(x, 0.4)),
    ("elu", {"alpha": 2.5}, lambda x: F.elu(x, 2.5)),
    ("elu", {"alpha": 0.0}, lambda x: F.elu(x, 0.0)),
]
IDS = [f"{n}-{'-'.join(str(v) for v in kw.values())}".rstrip("-") for n, kw, _ in UNARY]


def _same_nonfinite(ours, ref, what):
    """Where PyTorch gives inf or NaN, the same; returns the mask of the finite reference values."""
    fin = np.isfinite(ref)
    assert np.array_equal(np.isnan(ours), np.isnan(ref)), f"{what}: NaN at other places"
    assert np.array_equal(ours[np.isinf(ref)], ref[np.isinf(ref)]), f"{what}: infinities differ"
    return fin


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("name,kw,ref", UNARY, ids=IDS)
def test_unary_matches_torch_float64_edges_included(name, kw, ref):
    x, dy = _input(special=False)
    y, dx = _ours(name, x, dy, **kw)
    ty, tdx = _torch(ref, x, dy)
    for what, a, b in (("output", y, ty), ("gradient", dx, tdx)):
        fin = _same_nonfinite(a, b, what)  # PyTorch's NaN where x**3 overflows (GELU's tanh form)
        assert_close(a[fin], b[fin], 1e-12)
    # the output elementwise where it is not tiny: the tails keep their relative accuracy (not GELU's tanh
    # form, whose 1 + tanh(z) for z near -inf loses them in any implementation, PyTorch's included)
    big = np.isfinite(ty) & (np.abs(ty) > 1e-200)
    if kw.get("approximate") != "tanh":
        np.testing.assert_allclose(y[big], ty[big], rtol=1e-12, atol=0)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("name,kw,ref", UNARY, ids=IDS)
def test_unary_infinities_and_nan_as_torch(name, kw, ref):
    x = np.concatenate([EDGES, SPECIAL]).reshape(1, 1, 1, -1)
    dy = np.ones_like(x)
    y, dx = _ours(name, x, dy, **kw)
    ty, tdx = _torch(ref, x, dy)
    for what, a, b in (("output", y, ty), ("gradient", dx, tdx)):
        fin = _same_nonfinite(a, b, what)
        # ELU's gradient from its output: y + alpha where y is -alpha to round-off (x below -20) is
        # PyTorch's own result-based formula, exact to 1e-16 absolute, not relative
        atol = 4e-16 * kw.get("alpha", 1.0) if name == "elu" and what == "gradient" else 1e-300
        np.testing.assert_allclose(a[fin], b[fin], rtol=1e-12, atol=atol, err_msg=what)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("name,kw,ref", UNARY, ids=IDS)
def test_unary_float32(name, kw, ref):
    x, dy = _input(special=False, seed=1)
    x.reshape(-1)[:EDGES.size] = np.clip(EDGES, -100, 100)  # within float32's range, also cubed
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    y, dx = _ours(name, x32, dy32, **kw)
    assert y.dtype == dx.dtype == np.float32
    ty, tdx = _torch(ref, x32.astype(np.float64), dy32.astype(np.float64))
    assert_close(y, ty, 2e-6)
    assert_close(dx, tdx, 2e-6)


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("name,kw,ref", UNARY, ids=IDS)
def test_unary_over_blocks_and_strided_arguments(name, kw, ref):
    """Several NumPy blocks with a partial last one, and a non-contiguous input and gradient."""
    rng = np.random.default_rng(2)
    base = rng.standard_normal((2, 3, K._BLOCK // 7 + 5, 10)) * 4
    x = base[:, :, :, ::2]             # strided
    dy = rng.standard_normal(base.shape)[:, :, :, 1::2]
    y, dx = _ours(name, x, dy, **kw)
    ty, tdx = _torch(ref, np.ascontiguousarray(x), np.ascontiguousarray(dy))
    assert_close(y, ty, 1e-12)
    assert_close(dx, tdx, 1e-12)


@pytest.mark.usefixtures("path")
def test_gelu_without_gradient_keeps_nothing():
    x, _ = _input(special=False)
    for approximate in ("none", "tanh"):
        y, saved = K.gelu_forward(x, approximate, grad=False)
        assert saved is None
        assert_close(y, F.gelu(torch.tensor(x), approximate=approximate).numpy(), 1e-12)
    y, saved = K.silu_forward(x, grad=False)
    assert saved is None
    assert_close(y, F.silu(torch.tensor(x)).numpy(), 1e-12)


@pytest.mark.parametrize("channels", [False, True], ids=["one-weight", "per-channel"])
@pytest.mark.parametrize("shape", [(3, 5, 17, 23), (2, 5, 4, 6, 7), (7, 5)], ids=["2d", "3d", "flat"])
def test_prelu_matches_torch(channels, shape):
    x, dy = _input(special=False, shape=shape)
    x.reshape(-1)[:3] = 0.0  # the kink: the slope there is the weight's, as in PyTorch
    rng = np.random.default_rng(3)
    w = rng.uniform(-0.5, 0.5, shape[1] if channels else 1)
    grad = np.zeros_like(w)
    y = K.prelu_forward(x, w)
    dx = K.prelu_backward(dy, x, w, grad)
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt = F.prelu(xt, wt)
    yt.backward(torch.tensor(dy))
    assert_close(y, yt.detach().numpy(), 1e-12)
    assert_close(dx, xt.grad.numpy(), 1e-12)
    assert_close(grad, wt.grad.numpy(), 1e-12)
    dx2 = K.prelu_backward(dy, x, w, grad)  # the weight gradient adds up (the optimizer zeroes it)
    assert_close(grad, 2 * wt.grad.numpy(), 1e-12)
    assert_close(dx2, dx, 0)


@pytest.mark.parametrize("shape", [(3, 5, 17, 23), (2, 4, 3, 5, 6), (6, 10), (2, 7, 40, 300)],
                         ids=["2d", "3d", "flat", "blocks"])
def test_softmax_matches_torch(shape):
    x, dy = _input(special=False, shape=shape)
    x.reshape(-1)[:EDGES.size] = np.clip(EDGES, -700, 700)  # large logits: the shift by the maximum
    y = K.softmax_forward(x)
    dx = K.softmax_backward(dy, y)
    ty, tdx = _torch(lambda t: F.softmax(t, dim=1), x, dy)
    assert_close(y, ty, 1e-12)
    assert_close(dx, tdx, 1e-12)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-14)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_mul_matches_torch(k):
    rng = np.random.default_rng(k)
    xs = [rng.standard_normal((3, 5, 7, 6)) for _ in range(k)]
    dy = rng.standard_normal(xs[0].shape)
    y = K.mul_forward(xs)
    dxs = K.mul_backward(dy, xs)
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    yt = ts[0]
    for t in ts[1:]:
        yt = yt * t
    yt.backward(torch.tensor(dy))
    assert_close(y, yt.detach().numpy(), 1e-14)
    for d, t in zip(dxs, ts):
        assert_close(d, t.grad.numpy(), 1e-14)


@pytest.mark.usefixtures("path")
def test_gelu_tail_coefficients_reach_their_precision():
    """The normal CDF behind exact GELU against math.erfc over the whole line (the fit's stated error)."""
    import math

    x = np.concatenate([np.linspace(-37, 37, 40001), np.linspace(-1, 1, 4001)])
    phi = np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
    y, _ = K.gelu_forward(x, "none", grad=False)
    with np.errstate(invalid="ignore", divide="ignore"):
        cdf = np.where(x != 0, y / x, 0.5)
    assert np.abs(cdf - phi).max() < 5e-16
    y32, _ = K.gelu_forward(x.astype(np.float32), "none", grad=False)
    with np.errstate(invalid="ignore", divide="ignore"):
        cdf32 = np.where(x != 0, y32.astype(np.float64) / x.astype(np.float32), 0.5)
    assert np.abs(cdf32 - phi).max() < 3e-7


COMPILED = [n for n in IDS if n.split("-")[0] in ("sigmoid", "silu") or n == "gelu-none"]


def _both(name, kw, x, dy, monkeypatch):
    """Forward output, backward result and (SiLU, GELU) the no-gradient forward, compiled then NumPy."""
    res = []
    for compiled in (True, False):
        monkeypatch.setattr(K, "USE_COMPILED", compiled)
        out = list(_ours(name, x, dy, **kw))
        if name == "silu":
            out.append(K.silu_forward(x, grad=False)[0])
        elif name == "gelu":
            out.append(K.gelu_forward(x, kw["approximate"], grad=False)[0])
        res.append(out)
    return res


@pytest.mark.parametrize("dtype,rtol,ulps", [(np.float64, 1e-15, 4), (np.float32, 5e-7, 4)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("name,kw,ref", [u for u, i in zip(UNARY, IDS) if i in COMPILED], ids=COMPILED)
def test_compiled_matches_numpy_path(name, kw, ref, dtype, rtol, ulps, monkeypatch):
    """The compiled loops are the NumPy path's formulas in its order with another exp: to round-off
    (relative to the largest value; the forward outputs of sigmoid and SiLU elementwise, within ``ulps``),
    on inputs of every magnitude, odd sizes (vector remainders) and strided arguments; the same infinities
    and NaN at the edges."""
    require_built(K._cact, "_cact")
    rng = np.random.default_rng(7)
    for scale, shape in ((3, (3, 5, 17, 23)), (30, (2, 3, 7, 11)), (300, (1, 1, 1, 13))):
        x = (rng.standard_normal(shape) * scale).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        ours, numpy_path = _both(name, kw, x, dy, monkeypatch)
        for i, (a, b) in enumerate(zip(ours, numpy_path)):
            assert a.dtype == b.dtype == dtype and a.shape == b.shape
            assert_close(a, b, rtol)
        if name in ("sigmoid", "silu"):
            y, ty = ours[0], numpy_path[0]
            fin = np.abs(ty) >= np.finfo(dtype).tiny
            assert np.all(np.abs(y[fin] - ty[fin]) <= ulps * np.finfo(dtype).eps * np.abs(ty[fin]))
    x = (np.concatenate([EDGES, SPECIAL]) if dtype == np.float64 else
         np.concatenate([EDGES[np.abs(EDGES) <= 1e30], [88.7, -88.7, 104.0, -104.0], SPECIAL]))
    x = np.repeat(x.astype(dtype).reshape(1, 1, 1, -1), 2, axis=-1)[..., ::2]  # strided
    ours, numpy_path = _both(name, kw, x, np.full(x.shape, 1.5, dtype=dtype), monkeypatch)
    for i, (a, b) in enumerate(zip(ours, numpy_path)):
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"output {i}: NaN at other places"
        assert np.array_equal(a[~np.isfinite(b)], b[~np.isfinite(b)], equal_nan=True), f"output {i}"
        fin = np.isfinite(b)
        assert_close(a[fin], b[fin], rtol)


def test_compiled_kernels_check_their_arguments():
    require_built(K._cact, "_cact")
    x = np.zeros(8)
    with pytest.raises(ValueError, match="item size"):
        K._cact.sigmoid_fwd(2, x, 8, np.empty(8))
    with pytest.raises(ValueError, match="bytes"):
        K._cact.sigmoid_fwd(8, x, 9, np.empty(9))
    with pytest.raises(ValueError, match="coefficients"):
        K._cact.gelu_fwd(8, x, 8, np.empty(8), None, None)
    with pytest.raises(ValueError, match="contiguous"):
        K._cact.sigmoid_fwd(8, x[::2], 4, np.empty(4))


def test_other_dtypes_take_the_numpy_path(monkeypatch):
    """float16 (no compiled loop) goes the NumPy way, compiled kernels or not."""
    x = np.linspace(-6, 6, 101).astype(np.float16)
    monkeypatch.setattr(K, "USE_COMPILED", True)
    y = K.sigmoid_forward(x)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, torch.sigmoid(torch.tensor(x, dtype=torch.float32)).numpy(), atol=1e-3)
