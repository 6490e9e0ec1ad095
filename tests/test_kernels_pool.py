"""Local max/average pooling kernels against PyTorch CPU (float64 to 1e-10).

Every check runs on both max-pooling paths: the compiled kernel (``_cconv``, where the extension is built)
and the NumPy path (the fallback of an install without a C compiler)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close, require_built
from lbannpy.layers.kernels import pool as kpool
from lbannpy.layers.kernels import (avg_pool_backward, avg_pool_forward, max_pool_backward, max_pool_forward,
                                    pad_spatial)

SPATIAL = {2: (17, 23), 3: (7, 9, 11)}


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def max_pool_path(request, monkeypatch):
    """Every test on both max-pooling paths. A missing extension where a C compiler is present is a failed
    build (pip only warns), which must not pass as a skip."""
    if request.param == "compiled":
        require_built(kpool._cconv, "_cconv")
    monkeypatch.setattr(kpool, "USE_COMPILED", request.param == "compiled")
    return request.param


@dataclass(frozen=True)
class PoolCase:
    mode: str
    nsp: int
    kernel: int
    stride: int
    pad: int
    dilation: int = 1
    count_include_pad: bool = True

    @property
    def id(self) -> str:
        extra = "" if self.count_include_pad else "-exclpad"
        return f"{self.mode}-{self.nsp}d-k{self.kernel}-s{self.stride}-p{self.pad}-d{self.dilation}{extra}"


def _cases():
    out = []
    for mode, nsp, k, s in itertools.product(("max", "avg"), (2, 3), (1, 2, 3, 5), (1, 2)):
        for pad in sorted({0, k // 2}):
            out.append(PoolCase(mode, nsp, k, s, pad))
    out += [PoolCase("max", 2, 3, 2, 1, dilation=2), PoolCase("max", 3, 2, 1, 1, dilation=2),
            PoolCase("avg", 2, 3, 2, 1, count_include_pad=False),
            PoolCase("avg", 3, 3, 1, 1, count_include_pad=False)]
    return out


def _reference(case, x, dy_seed=1):
    xt = torch.tensor(x, requires_grad=True)
    if case.mode == "max":
        fn = F.max_pool2d if case.nsp == 2 else F.max_pool3d
        yt = fn(xt, case.kernel, case.stride, case.pad, case.dilation)
    else:
        fn = F.avg_pool2d if case.nsp == 2 else F.avg_pool3d
        yt = fn(xt, case.kernel, case.stride, case.pad, count_include_pad=case.count_include_pad)
    dy = np.random.default_rng(dy_seed).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(dy))
    return yt.detach().numpy(), dy, xt.grad.numpy()


def _ours(case, x, dy):
    p = ((case.pad, case.pad),) * case.nsp
    if case.mode == "max":
        xw = pad_spatial(x, p, value=-np.inf)
        y, arg = max_pool_forward(xw, case.kernel, case.stride, case.dilation)
        dxw = max_pool_backward(dy, arg, xw.shape, case.kernel, case.stride, case.dilation)
    else:
        xw = pad_spatial(x, p)
        valid = None if case.count_include_pad else pad_spatial(np.ones((1, 1) + x.shape[2:]), p)
        y = avg_pool_forward(xw, case.kernel, case.stride, valid=valid)
        dxw = avg_pool_backward(dy, xw.shape, case.kernel, case.stride, valid=valid)
    sl = (slice(None), slice(None)) + tuple(slice(case.pad, case.pad + n) for n in x.shape[2:])
    return y, dxw[sl]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_pool_matches_torch(case):
    x = np.random.default_rng(0).standard_normal((3, 5) + SPATIAL[case.nsp])
    y_ref, dy, dx_ref = _reference(case, x)
    y, dx = _ours(case, x, dy)
    assert_close(y, y_ref)
    assert_close(dx, dx_ref)


@pytest.mark.parametrize("nsp", [2, 3])
def test_max_pool_ties_route_to_first_max_like_torch(nsp):
    """Quantised inputs make many ties; the gradient must go to the same (first) input as PyTorch's."""
    x = np.random.default_rng(5).integers(0, 3, (2, 3) + SPATIAL[nsp]).astype(np.float64)
    case = PoolCase("max", nsp, 3, 1, 1)
    y_ref, dy, dx_ref = _reference(case, x)
    y, dx = _ours(case, x, dy)
    assert_close(y, y_ref)
    assert_close(dx, dx_ref)


def test_max_pool_float32_and_nan_propagates():
    x = np.random.default_rng(6).standard_normal((1, 2, 6, 6)).astype(np.float32)
    x[0, 1, 2, 3] = np.nan
    y, arg = max_pool_forward(x, 2, 2)
    ref = F.max_pool2d(torch.tensor(x), 2, 2).numpy()
    assert y.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    np.testing.assert_array_equal(y[~np.isnan(y)], ref[~np.isnan(ref)])
    assert arg[0, 1, 1, 1] == 1  # input (2, 3) is tap (0, 1) of output (1, 1): flat tap index 1


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_max_pool_of_a_strided_view_and_1d(dtype):
    """A window that is a view into a larger array (the layer's halo window, sliced), and 1-D pooling."""
    big = np.random.default_rng(7).standard_normal((2, 6, 21, 30)).astype(dtype)
    x = big[:, 1:5, 2:19, 3:26]
    case = PoolCase("max", 2, 3, 2, 0)
    y_ref, dy, dx_ref = _reference(case, x.astype(np.float64))
    y, arg = max_pool_forward(x, 3, 2)
    dx = max_pool_backward(dy.astype(dtype), arg, x.shape, 3, 2)
    rtol = 1e-10 if dtype == np.float64 else 1e-5
    assert_close(y, y_ref, rtol)
    assert_close(dx, dx_ref, rtol)
    x1 = np.random.default_rng(8).standard_normal((2, 3, 19))
    xt = torch.tensor(x1, requires_grad=True)
    yt = F.max_pool1d(xt, 4, 3, dilation=2)
    g = np.random.default_rng(9).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(g))
    y1, a1 = max_pool_forward(x1, 4, 3, 2)
    assert_close(y1, yt.detach().numpy())
    assert_close(max_pool_backward(g, a1, x1.shape, 4, 3, 2), xt.grad.numpy())


def test_max_pool_first_nan_wins():
    x = np.zeros((1, 1, 2, 2))
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 1, 0] = np.nan
    y, arg = max_pool_forward(x, 2)
    assert np.isnan(y[0, 0, 0, 0]) and arg[0, 0, 0, 0] == 1


# --- the compiled max pooling against the NumPy path, bit for bit -------------------------------------------
# (kernel, stride, dilation, spatial extents): exact tilings (every gradient element written directly),
# windows with gaps between them, overlapping windows, dilation, 1-D, 3-D, rows longer than the kernel's
# 512-output chunks, and kernels of more than 127 taps (int16 winning taps)
GEOMETRIES = [
    (2, 2, 1, (28, 28)), (2, 2, 1, (10, 10)), (2, 2, 1, (17, 23)), (3, 2, 1, (28, 28)), (3, 2, 1, (17, 23)),
    (3, 1, 1, (9, 12)), ((2, 3), (2, 3), 1, (8, 18)), (1, 2, 1, (9, 9)), (2, 3, 1, (11, 14)),
    (3, 2, 2, (21, 22)), (4, 3, 2, (31,)), (2, 2, 1, (30,)), (3, 1, 1, (27,)),
    (2, 2, 1, (6, 8, 10)), (3, 2, 1, (7, 9, 11)), ((1, 2, 2), (1, 2, 2), 1, (5, 8, 12)),
    (3, 2, 1, (3, 1101)), ((12, 12), (1, 4), 1, (14, 43)), (6, 5, 1, (7, 11, 12)),
]


def _geometry_id(g):
    k, s, d, sp = g
    return f"k{k}-s{s}-d{d}-{'x'.join(map(str, sp))}".replace(" ", "")


def _layouts(x):
    """The same values as a C-contiguous array, a view into a larger array (samples and channels that
    cannot be merged into one plane axis), channels outermost in memory, and every other column."""
    def big():
        shape = tuple(n + 3 for n in x.shape[:2]) + tuple(2 * n + 1 for n in x.shape[2:])
        return np.full(shape, 7.0, x.dtype)

    view = big()[(slice(1, 1 + x.shape[0]), slice(2, 2 + x.shape[1]))
                 + tuple(slice(1, 1 + n) for n in x.shape[2:])]
    cols = big()[(slice(0, x.shape[0]), slice(0, x.shape[1])) + tuple(slice(0, n) for n in x.shape[2:-1])
                 + (slice(0, 2 * x.shape[-1], 2),)]
    view[...] = x
    cols[...] = x
    outer = np.ascontiguousarray(x.swapaxes(0, 1)).swapaxes(0, 1)
    return {"contiguous": x, "view": view, "channels-outer": outer, "every-other-column": cols}


def _values(kind, shape, dtype, rng):
    if kind == "random":
        return rng.standard_normal(shape).astype(dtype)
    x = rng.integers(-1, 2, shape).astype(dtype)  # many ties, and +0 against -0
    x[x == 0] = np.where(rng.random(int((x == 0).sum())) < 0.5, -0.0, 0.0)
    if kind == "nan":
        x[rng.random(shape) < 0.1] = np.nan
        x[rng.random(shape) < 0.05] = -np.nan
    return x


def _both_paths(monkeypatch, fn):
    if kpool._cconv is None:
        pytest.skip("no compiled kernels in this install")
    out = []
    for compiled in (True, False):
        monkeypatch.setattr(kpool, "USE_COMPILED", compiled)
        out.append(fn())
    return out


def _at_taps(x, arg, k, s, d):
    """The input element at each output's winning tap (so the maximum, bit for bit, NaN payload and the
    sign of a zero included)."""
    _, _, _, _, at = kpool._plan(x.shape, k, s, d)
    out = np.zeros(arg.shape, x.dtype)
    for t, sl in enumerate(at):
        np.copyto(out, x[sl], where=arg == t)
    return out


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.frombuffer(a.tobytes(), np.uint8), np.frombuffer(b.tobytes(), np.uint8))


@pytest.mark.parametrize("max_pool_path", ["compiled"], indirect=True)  # it compares the two paths itself
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geom", GEOMETRIES, ids=_geometry_id)
def test_compiled_max_pool_is_the_numpy_path_bit_for_bit(geom, dtype, monkeypatch, max_pool_path):
    """Same maxima, same winning taps (ties: the first tap in row-major order; the first NaN wins) and the
    same gradient, for every layout the compiled kernel walks (one call for all samples and channels).
    The maximum of +0 and -0 is the first one, as in PyTorch (the NumPy path's ``maximum`` may give the
    other zero, so its maxima are compared by value)."""
    k, s, d, sp = geom
    rng = np.random.default_rng(len(sp) * 100 + sp[-1])
    for kind in ("random", "ties", "nan"):
        x = _values(kind, (2, 3) + sp, dtype, rng)
        y_ref, arg_ref = _both_paths(monkeypatch, lambda: max_pool_forward(x, k, s, d))[1]
        assert arg_ref.dtype == (np.int8 if np.prod(np.broadcast_to(k, len(sp))) <= 127 else np.int16)
        # small integers (and -0) as dy: every order of accumulating overlapping windows gives the same sum
        dy = rng.integers(-4, 5, y_ref.shape).astype(dtype)
        dy[dy == 0] = -0.0
        dx_ref = _both_paths(monkeypatch, lambda: max_pool_backward(dy, arg_ref, x.shape, k, s, d))[1]
        for xl in _layouts(x).values():
            np.testing.assert_array_equal(xl, x)
            (y, arg), _ = _both_paths(monkeypatch, lambda: max_pool_forward(xl, k, s, d))
            _same_bits(arg, arg_ref)
            _same_bits(y, _at_taps(x, arg_ref, k, s, d))
            np.testing.assert_array_equal(y, y_ref)
        dx, _ = _both_paths(monkeypatch, lambda: max_pool_backward(dy, arg_ref, x.shape, k, s, d))
        _same_bits(dx, dx_ref)


@pytest.mark.parametrize("shape", [(4, 6, 28, 28), (3, 16, 10, 10), (2, 5, 9, 13)])
def test_max_pool_2x2_float32_exactly_as_torch(shape):
    """LeNet's pooling (the vectorised 2x2 stride-2 path): maxima, and gradients that are single copies of
    dy (no sums), exactly as PyTorch's. (No NaN here: of several NaNs in a window PyTorch's CPU kernel
    picks the last, these kernels the first; the NaN cases are compared with the NumPy path above.)"""
    rng = np.random.default_rng(11)
    x = rng.integers(-3, 4, shape).astype(np.float32)  # ties: the first maximum wins in both
    xt = torch.tensor(x, requires_grad=True)
    yt = F.max_pool2d(xt, 2, 2)
    dy = rng.standard_normal(tuple(yt.shape)).astype(np.float32)
    yt.backward(torch.tensor(dy))
    y, arg = max_pool_forward(x, 2, 2)
    _same_bits(y, yt.detach().numpy())
    dx = max_pool_backward(dy, arg, x.shape, 2, 2)
    _same_bits(dx, xt.grad.numpy())
