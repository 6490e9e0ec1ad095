"""Local max/average pooling kernels against PyTorch CPU (float64 to 1e-10)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.layers.kernels import (avg_pool_backward, avg_pool_forward, max_pool_backward, max_pool_forward,
                                    pad_spatial)

SPATIAL = {2: (17, 23), 3: (7, 9, 11)}


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
