"""Local max/average pooling kernels against PyTorch CPU (float64 to 1e-10).

Every check runs on both max-pooling paths: the compiled kernel (``_cconv``, where the extension is built)
and the NumPy path (the fallback of an install without a C compiler)."""
from __future__ import annotations

import itertools
import shutil
import sysconfig
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.layers.kernels import pool as kpool
from lbannpy.layers.kernels import (avg_pool_backward, avg_pool_forward, max_pool_backward, max_pool_forward,
                                    pad_spatial)

SPATIAL = {2: (17, 23), 3: (7, 9, 11)}


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def max_pool_path(request, monkeypatch):
    """Every test on both max-pooling paths. A missing extension where a C compiler is present is a failed
    build (pip only warns), which must not pass as a skip."""
    if request.param == "compiled" and kpool._cconv is None:
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        if shutil.which(cc):
            pytest.fail(f"the compiled kernels are not built although the C compiler {cc!r} is present")
        pytest.skip("no C compiler in this install: the compiled kernels cannot be built")
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
