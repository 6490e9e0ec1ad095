"""Batch-norm local pieces against torch.nn.functional.batch_norm(training=True) (float64 to 1e-10)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.layers.kernels import (bn_backward, bn_backward_data, bn_backward_params, bn_forward,
                                    bn_local_stats, bn_mean_var)


@dataclass(frozen=True)
class BNCase:
    shape: tuple
    pieces: int  # the batch is split into this many blocks along H (as spatially distributed ranks would)
    offset: float = 0.0

    @property
    def id(self) -> str:
        tail = f"-offset{self.offset:g}" if self.offset else ""
        return f"{'x'.join(map(str, self.shape))}-split{self.pieces}{tail}"


CASES = [BNCase((3, 5, 17, 23), 1), BNCase((3, 5, 17, 23), 3), BNCase((3, 5, 7, 9, 11), 2),
         BNCase((4, 6), 1), BNCase((3, 5, 17, 23), 2, offset=100.0)]


def _run(case, dtype=np.float64, rtol=1e-10):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(case.shape) * 2.0 + case.offset
    c = case.shape[1]
    gamma, beta = rng.standard_normal(c), rng.standard_normal(c)
    dy = rng.standard_normal(case.shape)
    eps = 1e-5
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(gamma, requires_grad=True), torch.tensor(beta, requires_grad=True)
    yt = F.batch_norm(xt, None, None, gt, bt, training=True, eps=eps)
    yt.backward(torch.tensor(dy))

    xd, dyd = x.astype(dtype), dy.astype(dtype)
    axis = 2 if x.ndim > 2 else 0
    xs, dys = np.array_split(xd, case.pieces, axis), np.array_split(dyd, case.pieces, axis)
    stats = [bn_local_stats(b) for b in xs]  # per "rank"; the sums below stand in for the allreduce
    total, total_sq, count = (sum(s[i] for s in stats) for i in range(3))
    assert count == x.size // c
    mean, var = bn_mean_var(total, total_sq, count)
    g, bb = gamma.astype(dtype), beta.astype(dtype)
    y = np.concatenate([bn_forward(b, mean, var, g, bb, eps) for b in xs], axis)
    assert y.dtype == dtype
    assert_close(y, yt.detach().numpy(), rtol)
    parts = [bn_backward(d, b, mean, var, g, eps) for d, b in zip(dys, xs)]
    sum_dy, sum_dy_xhat = sum(p[0] for p in parts), sum(p[1] for p in parts)
    dx = np.concatenate([bn_backward_data(d, b, mean, var, g, eps, sum_dy, sum_dy_xhat, count)
                         for d, b in zip(dys, xs)], axis)
    assert dx.dtype == dtype
    assert_close(dx, xt.grad.numpy(), rtol)
    dgamma, dbeta = bn_backward_params(sum_dy, sum_dy_xhat)
    assert_close(dgamma, gt.grad.numpy(), rtol)
    assert_close(dbeta, bt.grad.numpy(), rtol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_batchnorm_float64_matches_torch(case):
    _run(case)


@pytest.mark.parametrize("case", CASES[:3] + CASES[4:], ids=lambda c: c.id)
def test_batchnorm_float32_matches_torch(case):
    _run(case, np.float32, 1e-5)
