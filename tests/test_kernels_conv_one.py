"""The one-input-channel forward convolution (``_conv1c``), taken by the own kernels and the ATen set alike:
against PyTorch in float32 and float64, with and without a bias, into a given buffer; what it refuses goes
to the general path with the same result; the extension's own checks."""
import numpy as np
import pytest
import torch
from kernel_util import require_built

from lbannpy.layers.kernels import _conv_one, aten
from lbannpy.layers.kernels import conv as kconv


@pytest.fixture(autouse=True)
def built():
    require_built(_conv_one._conv1c, "_conv1c")


SHAPES = [(32, 32, 32, 6, 5, 5), (4, 40, 37, 8, 5, 3), (3, 20, 13, 7, 3, 3), (2, 9, 12, 4, 2, 2),
          (1, 64, 64, 16, 3, 3), (5, 11, 30, 1, 1, 7)]


def _case(shape, dtype, seed=0):
    n, h, w, f, kh, kw = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 1, h, w)).astype(dtype),
            rng.standard_normal((f, 1, kh, kw)).astype(dtype), rng.standard_normal(f).astype(dtype))


def _torch(x, w, b, **kw):
    return torch.conv2d(torch.from_numpy(x), torch.from_numpy(w), None if b is None else torch.from_numpy(b),
                        **kw).numpy()


@pytest.fixture
def counted(monkeypatch):
    """The item sizes of the one-channel kernel's calls, in order."""
    calls = []
    real = _conv_one._conv1c.fwd
    monkeypatch.setattr(_conv_one, "_conv1c", type("C", (), {"fwd": staticmethod(
        lambda *a: calls.append(a[0]) or real(*a))}))
    return calls


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kernels", ["own", "aten"])
def test_against_pytorch(shape, dtype, kernels, counted):
    x, w, b = _case(shape, dtype)
    fwd = kconv.conv_forward if kernels == "own" else aten.conv_forward
    rtol = 1e-12 if dtype == np.float64 else 2e-6
    for bias in (b, None):
        ref = _torch(x, w, bias)
        y = fwd(x, w, bias)
        assert y.dtype == dtype and y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    n, h, wd, f, kh, kw = shape
    small = kernels == "own" and kconv._small.fits(kconv.ConvGeometry.make(x.shape, w.shape, 1, 1))
    # the own set's one-call small path comes first (a few thousand multiply-adds); the rest take this one
    assert len(counted) == (0 if small else 2)


def test_writes_into_a_given_buffer(counted):
    x, w, b = _case((4, 20, 21, 5, 3, 3), np.float32)
    big = np.full((4, 7, 18, 19), np.nan, np.float32)
    out = big[:, 1:6]  # not contiguous: written from a temporary
    y = kconv.conv_forward(x, w, b, out=out)
    assert y is out and counted == [4]
    np.testing.assert_allclose(big[:, 1:6], _torch(x, w, b), rtol=2e-6, atol=1e-5)
    assert np.isnan(big[:, 0]).all() and np.isnan(big[:, 6]).all()
    dense = np.full((4, 5, 18, 19), np.nan, np.float32)
    assert kconv.conv_forward(x, w, b, out=dense) is dense and counted == [4, 4]
    np.testing.assert_allclose(dense, _torch(x, w, b), rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("what", ["stride", "dilation", "padding", "narrow rows", "strided input",
                                  "two channels"])
def test_what_it_refuses_takes_the_general_path(what, counted):
    x, w, b = _case((2, 24, 24, 4, 3, 3), np.float32)
    kw, tkw = {}, {}
    if what == "stride":
        kw, tkw = {"stride": 2}, {"stride": 2}
    elif what == "dilation":
        kw, tkw = {"dilation": 2}, {"dilation": 2}
    elif what == "padding":
        kw, tkw = {"padding": 1}, {"padding": 1}
    elif what == "narrow rows":
        x = x[..., :9]  # 7 outputs a row: under one vector of floats
        x = np.ascontiguousarray(x)
    elif what == "strided input":
        x = np.repeat(x, 2, axis=3)[..., ::2]
    else:
        x, w = np.concatenate([x, x], axis=1), np.concatenate([w, w], axis=1)
    ref = _torch(np.ascontiguousarray(x), w, b, **tkw)
    for fwd in (kconv.conv_forward, aten.conv_forward):
        np.testing.assert_allclose(fwd(x, w, b, **kw), ref, rtol=2e-6, atol=2e-5)
    # the own set pads into a contiguous scratch window first, which the kernel then takes
    assert counted == ([4] if what == "padding" else [])


def test_switched_off_with_the_compiled_kernels(monkeypatch, counted):
    monkeypatch.setattr(kconv, "USE_COMPILED", False)
    x, w, b = _case((2, 24, 24, 4, 3, 3), np.float32)
    np.testing.assert_allclose(kconv.conv_forward(x, w, b), _torch(x, w, b), rtol=2e-6, atol=2e-5)
    assert not counted


def test_the_extension_checks_its_buffers():
    x, w, b = _case((2, 12, 12, 3, 3, 3), np.float32)
    y = np.empty((2, 3, 10, 10), np.float32)
    c = _conv_one._conv1c
    c.fwd(4, x, 2, 12, 12, w, 3, 3, 3, b, y)  # the control
    np.testing.assert_allclose(y, _torch(x, w, b), rtol=2e-6, atol=2e-5)
    with pytest.raises(ValueError, match="y holds"):
        c.fwd(4, x, 2, 12, 12, w, 3, 3, 3, b, y[:1])
    with pytest.raises(ValueError, match="x holds"):
        c.fwd(4, x.astype(np.float64), 2, 12, 12, w, 3, 3, 3, b, y)
    with pytest.raises(ValueError, match="bias holds"):
        c.fwd(4, x, 2, 12, 12, w, 3, 3, 3, b[:2], y)
    with pytest.raises(ValueError, match="rows of at least"):
        c.fwd(4, x, 2, 12, 12, w, 3, 3, 6, b, y)
    with pytest.raises((ValueError, BufferError, TypeError)):
        c.fwd(4, x, 2, 12, 12, w, 3, 3, 3, b, np.empty((2, 3, 10, 10), np.float32)[..., ::1].T)
