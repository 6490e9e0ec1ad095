"""The small-convolution path (``_conv_small``, one compiled call per pass, padding inside) against PyTorch,
its dispatch by size, its buffer checks; and the compiled average pooling against the NumPy path, bit for
bit."""
from __future__ import annotations

import numpy as np
import pytest

from lbannpy.layers.kernels import _conv_small
from lbannpy.layers.kernels import conv as kconv
from lbannpy.layers.kernels import pool as kpool
from lbannpy.layers.kernels.padding import pad_spatial

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytestmark = pytest.mark.skipif(_conv_small._csmall is None or kpool._csmall is None,
                                reason="the compiled extension is not built")

# (N, C, F, spatial, kernel, stride, dilation, padding, groups): 1-3-D, strides, dilation, groups, padding
# wider than the kernel's reach on one side, outputs thinner than the taps
CASES = [
    (1, 4, 4, (4, 4), 3, 1, 1, 1, 1),
    (2, 4, 6, (5, 7), 3, 2, 1, 1, 2),
    (2, 3, 4, (9,), 3, 1, 2, 2, 1),
    (1, 2, 2, (3, 4, 5), 3, 1, 1, 1, 1),
    (2, 4, 4, (6, 6), 3, 3, 1, 2, 1),
    (1, 3, 5, (7, 7), 5, 2, 1, 2, 1),
    (2, 3, 5, (7, 8), 3, 2, 2, 3, 1),
    (1, 4, 4, (4, 4), 3, 1, 1, 0, 1),
    (3, 2, 3, (2, 2), 3, 1, 1, 1, 1),
    (1, 6, 6, (5, 5), (1, 3), (2, 1), 1, (0, 1), 3),
]


def _torch_ref(x, w, b, stride, dilation, padding, groups, dy):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[x.ndim - 2]
    xt, wt, bt = (torch.from_numpy(a).requires_grad_() for a in (x, w, b))
    yt = conv(xt, wt, bt, stride, padding, dilation, groups)
    yt.backward(torch.from_numpy(dy))
    return yt.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def _case(case, dtype, rng):
    n, c, f, sp, k, s, d, p, g = case
    nsp = len(sp)
    k = (k,) * nsp if isinstance(k, int) else k
    x = rng.standard_normal((n, c) + sp).astype(dtype)
    w = rng.standard_normal((f, c // g) + k).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    geo, _ = kconv.padded_geometry(x.shape, w.shape, s, d, p)
    dy = rng.standard_normal(geo.out_shape).astype(dtype)
    return x, w, b, s, d, p, g, dy, geo


class Calls:
    """Counts the compiled small kernels' calls."""

    def __init__(self, real):
        self.real, self.n = real, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)

        def counted(*a):
            self.n += 1
            return fn(*a)
        return counted


def _id(c):
    return "x".join(map(str, c[3])) + f"-k{c[4]}s{c[5]}d{c[6]}p{c[7]}g{c[8]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_small_path_equals_pytorch_with_padding_inside(case, dtype, tol, monkeypatch):
    rng = np.random.default_rng(7)
    x, w, b, s, d, p, g, dy, geo = _case(case, dtype, rng)
    assert geo.groups == g and _conv_small.fits(geo)
    calls = Calls(_conv_small._csmall)
    monkeypatch.setattr(_conv_small, "_csmall", calls)
    y_ref, dx_ref, dw_ref = _torch_ref(x, w, b, s, d, p, g, dy)
    scale = max(1.0, float(np.abs(y_ref).max()))
    y = kconv.conv_forward(x, w, b, s, d, padding=p)
    dx = kconv.conv_backward_data(dy, w, x.shape, s, d, padding=p)
    dw = kconv.conv_backward_filter(x, dy, w.shape, s, d, padding=p)
    assert calls.n == 3  # one compiled call per pass
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(dx, dx_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(dw, dw_ref, rtol=tol, atol=tol * scale * x.shape[0] * 10)
    # the same convolution of the padded window (no padding argument) takes the small path too
    xw = pad_spatial(x, p)
    dwin = kconv.conv_backward_data(dy, w, xw.shape, s, d)
    np.testing.assert_allclose(kconv.conv_forward(xw, w, b, s, d), y_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(kconv.crop_spatial(dwin, p), dx_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(kconv.conv_backward_filter(xw, dy, w.shape, s, d), dw_ref, rtol=tol,
                               atol=tol * scale * x.shape[0] * 10)
    assert calls.n == 6


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_plan_equals_pytorch_with_the_bias_gradient_in_the_filter_pass(case, dtype, tol, monkeypatch):
    from lbannpy.layers.kernels.select import own

    rng = np.random.default_rng(17)
    x, w, b, s, d, p, g, dy, geo = _case(case, dtype, rng)
    plan = own().plan(x.shape, w.shape, s, d, p, dtype)
    assert isinstance(plan, _conv_small.Plan) and plan.takes(x)
    calls = Calls(_conv_small._csmall)
    monkeypatch.setattr(_conv_small, "_csmall", calls)
    y_ref, dx_ref, dw_ref = _torch_ref(x, w, b, s, d, p, g, dy)
    db_ref = dy.astype(np.float64).sum(axis=(0,) + tuple(range(2, dy.ndim)))
    scale = max(1.0, float(np.abs(y_ref).max()))
    y = plan.forward(x, w, b)
    dx = plan.backward_data(np.asfortranarray(dy), w)  # a strided dy is made contiguous
    dw, db = plan.backward_params(x, dy, True)
    assert calls.n == 3  # one call per pass, the bias gradient inside the filter pass
    for got, ref, shape in ((y, y_ref, geo.out_shape), (dx, dx_ref, x.shape), (dw, dw_ref, w.shape)):
        assert got.dtype == dtype and got.shape == shape
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(dx, dx_ref, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(dw, dw_ref, rtol=tol, atol=tol * scale * x.shape[0] * 10)
    np.testing.assert_allclose(db, db_ref, rtol=tol, atol=tol * dy.size)
    # into given buffers (a gradient's storage), every element written; no bias: no bias gradient
    dw_into, db_into = np.full(w.shape, np.nan, dtype), np.full(b.shape, np.nan, dtype)
    got_w, got_b = plan.backward_params(x, dy, True, dw_into, db_into)
    assert got_w is dw_into and got_b is db_into
    np.testing.assert_array_equal(dw_into, dw)
    np.testing.assert_array_equal(db_into, db)
    assert plan.backward_params(x, dy, False)[1] is None
    np.testing.assert_allclose(plan.forward(x, w, None), y_ref - b.reshape((1, -1) + (1,) * (x.ndim - 2)),
                               rtol=tol, atol=tol * scale * 2)
    # another block, dtype or array kind is not this plan's
    other = np.float32 if dtype == np.float64 else np.float64
    assert not plan.takes(x.astype(other)) and not plan.takes(x[:, :, :-1]) and not plan.takes(x.tolist())


def test_plans_only_for_what_the_small_path_takes_and_the_bias_buffer_is_checked():
    from lbannpy.layers.kernels.select import conv_kernels, own

    plan = own().plan
    assert plan((1, 4, 4, 4), (4, 4, 3, 3), 1, 1, (1, 1), np.float32) is not None
    assert plan((8, 64, 32, 32), (64, 64, 3, 3), 1, 1, (1, 1), np.float32) is None  # large: window path
    assert plan((1, 4, 4, 4), (4, 4, 3, 3), 1, 1, (1, 1), np.float16) is None  # no half kernels
    if conv_kernels("auto").name == "aten":
        assert conv_kernels("aten").plan is None
    c = _conv_small._csmall
    x, dy, dw = np.zeros((1, 2, 4, 4)), np.zeros((1, 3, 4, 4)), np.zeros((3, 2, 3, 3))
    geo = (1, 2, 3, 1, 1, 4, 4, 1, 3, 3, 1, 4, 4, 1, 1, 1, 1, 1, 1, 0, 1, 1)
    c.wgrad(8, x, dy, np.zeros(3), dw, *geo)
    with pytest.raises(ValueError, match="bias gradient holds"):
        c.wgrad(8, x, dy, np.zeros(4), dw, *geo)
    with pytest.raises((ValueError, BufferError)):
        c.wgrad(8, x, dy, np.frombuffer(bytes(24)), dw, *geo)  # read-only


def test_small_path_reads_strided_arrays_and_writes_into_buffers():
    rng = np.random.default_rng(3)
    x, w, b, s, d, p, g, dy, geo = _case((2, 4, 6, (5, 7), 3, 2, 1, 1, 2), np.float64, rng)
    y_ref, dx_ref, dw_ref = _torch_ref(x, w, b, s, d, p, g, dy)
    xt, dyt = np.asfortranarray(x), np.asfortranarray(dy)  # not C-contiguous
    big = np.zeros((geo.out_shape[0], geo.out_shape[1] + 2) + geo.out_shape[2:])
    out = big[:, 1:-1]  # a block of a larger output: not contiguous
    assert kconv.conv_forward(xt, w, b, s, d, out=out, padding=p) is out
    np.testing.assert_allclose(out, y_ref, rtol=1e-12, atol=1e-12)
    assert not big[:, 0].any() and not big[:, -1].any()  # nothing written outside the block
    dx = np.full(x.shape, np.nan)  # every element is written
    assert kconv.conv_backward_data(dyt, w, x.shape, s, d, out=dx, padding=p) is dx
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kconv.conv_backward_filter(xt, dyt, w.shape, s, d, padding=p), dw_ref,
                               rtol=1e-12, atol=1e-11)


def test_size_decides_the_path_and_larger_padded_calls_pad_a_window(monkeypatch):
    rng = np.random.default_rng(5)
    case = (2, 8, 16, (12, 12), 3, 1, 1, 1, 1)  # 2*16*8*9*144 = 331 776 multiply-adds per pass
    x, w, b, s, d, p, g, dy, geo = _case(case, np.float64, rng)
    assert _conv_small.macs(geo) > _conv_small.MAX_MACS
    calls = Calls(_conv_small._csmall)
    monkeypatch.setattr(_conv_small, "_csmall", calls)
    y_ref, dx_ref, dw_ref = _torch_ref(x, w, b, s, d, p, g, dy)
    np.testing.assert_allclose(kconv.conv_forward(x, w, b, s, d, padding=p), y_ref, rtol=1e-12, atol=1e-11)
    dx = np.empty_like(x)
    kconv.conv_backward_data(dy, w, x.shape, s, d, out=dx, padding=p)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(kconv.conv_backward_filter(x, dy, w.shape, s, d, padding=p), dw_ref,
                               rtol=1e-12, atol=1e-10)
    assert calls.n == 0
    monkeypatch.setattr(_conv_small, "MAX_MACS", _conv_small.macs(geo))  # now it is small
    kconv.conv_forward(x, w, b, s, d, padding=p)
    assert calls.n == 1
    monkeypatch.setattr(kconv, "USE_COMPILED", False)  # the NumPy path is never diverted
    kconv.conv_forward(x, w, b, s, d, padding=p)
    assert calls.n == 1


def test_own_kernels_pad_only_what_the_small_path_takes(monkeypatch):
    from lbannpy.layers.kernels.select import own

    pads = own().pads
    assert pads((1, 4, 4, 4), (4, 4, 3, 3), 1, 1, (1, 1), np)
    assert not pads((8, 64, 32, 32), (64, 64, 3, 3), 1, 1, (1, 1), np)  # large: the window path

    class NotNumpy:
        __name__ = "cupy"
    assert not pads((1, 4, 4, 4), (4, 4, 3, 3), 1, 1, (1, 1), NotNumpy())  # device arrays: never
    monkeypatch.setattr(kconv, "USE_COMPILED", False)
    assert not pads((1, 4, 4, 4), (4, 4, 3, 3), 1, 1, (1, 1), np)


def test_compiled_kernels_refuse_wrong_buffers():
    c = _conv_small._csmall
    x, w, y = np.zeros((1, 2, 4, 4)), np.zeros((3, 2, 3, 3)), np.zeros((1, 3, 4, 4))
    geo = (1, 2, 3, 1, 1, 4, 4, 1, 3, 3, 1, 4, 4, 1, 1, 1, 1, 1, 1, 0, 1, 1)
    c.fwd(8, x, w, None, y, *geo)  # consistent: runs
    with pytest.raises(ValueError, match="output holds"):
        c.fwd(8, x, w, None, np.zeros((1, 3, 4, 3)), *geo)
    with pytest.raises(ValueError, match="itemsize 2"):
        c.fwd(2, x, w, None, y, *geo)
    with pytest.raises(ValueError, match="holds 256 bytes of 8-byte items, not 128 of 4"):
        c.fwd(4, x, w, None, y, *geo)  # float64 arrays called as float32
    with pytest.raises(ValueError, match="filter holds"):
        c.fwd(8, x, np.zeros((3, 2, 3, 2)), None, y, *geo)
    with pytest.raises((ValueError, BufferError)):
        c.fwd(8, np.zeros((1, 2, 4, 8))[..., ::2], w, None, y, *geo)  # not contiguous
    with pytest.raises(ValueError, match="inconsistent"):
        c.fwd(8, x, w, None, y, 1, 2, 3, 2, *geo[4:])  # 3 filters in 2 groups
    with pytest.raises(ValueError, match="inconsistent"):
        c.avg_fwd(8, x, y, 9.0, 2, 1, 4, 4, 1, 5, 5, 1, 3, 3, 1, 1, 1, 1, 1, 1)  # outputs past the window


AVG = [((2, 3, 6, 6), 3, 1), ((1, 4, 4, 4), 3, 1), ((2, 2, 9, 7), (3, 2), (2, 1)), ((1, 2, 5, 6, 7), 2, None),
       ((3, 1, 8), 3, 2), ((2, 2, 6, 6), 2, None), ((1, 1, 5, 5), (5, 5), 1)]


@pytest.mark.parametrize("shape,kernel,stride", AVG, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_average_pooling_is_the_numpy_path_bit_for_bit(shape, kernel, stride, dtype, monkeypatch):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape).astype(dtype)
    calls = Calls(kpool._csmall)
    monkeypatch.setattr(kpool, "_csmall", calls)
    y = kpool.avg_pool_forward(x, kernel, stride)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = kpool.avg_pool_backward(dy, x.shape, kernel, stride)
    y_t = kpool.avg_pool_forward(np.asfortranarray(x), kernel, stride)
    dx_t = kpool.avg_pool_backward(np.asfortranarray(dy), x.shape, kernel, stride)
    assert calls.n == 4
    monkeypatch.setattr(kpool, "USE_COMPILED", False)
    y_np = kpool.avg_pool_forward(x, kernel, stride)
    dx_np = kpool.avg_pool_backward(dy, x.shape, kernel, stride)
    assert calls.n == 4
    for got in (y, y_t):
        assert got.dtype == dtype and np.array_equal(got, y_np)
    for got in (dx, dx_t):
        assert got.dtype == dtype and np.array_equal(got, dx_np)
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[x.ndim - 2]
    xt = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    yt = pool(xt, kernel, stride)
    yt.backward(torch.from_numpy(dy.astype(np.float64)))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=tol, atol=tol)
