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


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("relu", [False, True], ids=["bn", "bn+relu"])
def test_training_step_from_packed_sums_matches_torch_with_running_statistics(compiled, dtype, rtol, relu,
                                                                            monkeypatch):
    """The layer's training step: packed local sums (summed over pieces as the allreduce would), the
    statistics, the moved running statistics and the output in one call, the backward from packed sums."""
    from lbannpy.layers.kernels import batchnorm as kbn

    if compiled and kbn._cbn is None:
        pytest.skip("the compiled extension is not built")
    monkeypatch.setattr(kbn, "USE_COMPILED", compiled)
    rng = np.random.default_rng(5)
    shape, c, eps, mom = (3, 5, 6, 7), 5, 1e-5, 0.1
    x = rng.standard_normal(shape) * 2.0 + 3.0
    dy = rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(c), rng.standard_normal(c)
    rm0, rv0 = rng.standard_normal(c), rng.random(c) + 0.5
    xt = torch.tensor(x, requires_grad=True)
    gt, bt = torch.tensor(gamma, requires_grad=True), torch.tensor(beta, requires_grad=True)
    rmt, rvt = torch.tensor(rm0), torch.tensor(rv0)
    yt = F.batch_norm(xt, rmt, rvt, gt, bt, training=True, momentum=mom, eps=eps)
    if relu:
        yt = torch.relu(yt)
    yt.backward(torch.tensor(dy))

    xs, dys = np.array_split(x.astype(dtype), 2, 2), np.array_split(dy.astype(dtype), 2, 2)
    g, b = gamma.astype(dtype), beta.astype(dtype)
    parts = [kbn.bn_local_sums(p) for p in xs]
    assert all(p.shape == (2 * c,) and p.dtype == np.float64 for p in parts)
    tot, count = parts[0] + parts[1], x.size // c
    rm_in, rv_in = rm0.copy(), rv0.copy()
    outs = [kbn.bn_train_forward(p, tot, count, g, b, eps, mom, rm_in, rv_in, relu=relu) for p in xs]
    np.testing.assert_array_equal(rm_in, rm0)  # the given running statistics are not written
    y = np.concatenate([o[0] for o in outs], 2)
    _, mean, var, rm, rv = outs[0]
    assert y.dtype == dtype
    assert_close(y, yt.detach().numpy(), rtol)
    assert_close(rm, rmt.numpy(), rtol)
    assert_close(rv, rvt.numpy(), rtol)
    # in place (the layer's call): the given buffers hold the same bits and are returned
    rm_ip, rv_ip = rm0.copy(), rv0.copy()
    ip = kbn.bn_train_forward(xs[0], tot, count, g, b, eps, mom, rm_ip, rv_ip, relu=relu, in_place=True)
    assert ip[3] is rm_ip and ip[4] is rv_ip
    np.testing.assert_array_equal(rm_ip, rm)
    np.testing.assert_array_equal(rv_ip, rv)
    ys = [o[0] if relu else None for o in outs]
    sums = [kbn.bn_backward_sums(d, p, mean, var, eps, y=yy) for d, p, yy in zip(dys, xs, ys)]
    stot = sums[0] + sums[1]
    dx = np.concatenate([kbn.bn_backward_data_summed(d, p, mean, var, g, eps, stot, count, y=yy)
                         for d, p, yy in zip(dys, xs, ys)], 2)
    assert_close(dx, xt.grad.numpy(), rtol)
    assert_close(stot[c:], gt.grad.numpy(), rtol)
    assert_close(stot[:c], bt.grad.numpy(), rtol)
    # the split forms are the same numbers
    split = kbn.bn_backward_data(dys[0], xs[0], mean, var, g, eps, stot[:c], stot[c:], count, y=ys[0])
    np.testing.assert_array_equal(dx[:, :, :3], split)


def test_compiled_training_forward_checks_every_buffer():
    from lbannpy.layers.kernels import batchnorm as kbn

    if kbn._cbn is None:
        pytest.skip("the compiled extension is not built")
    x, y = np.ones((2, 3, 4), np.float32), np.empty((2, 3, 4), np.float32)
    g, tot, r, st = np.ones(3, np.float32), np.ones(6), np.ones(3), np.empty(12)
    kbn._cbn.train_fwd(4, x, 2, 3, 4, tot, 8.0, g, None, 1e-5, 0, 0.1, r, r, st, y)
    bad = {"input": (x[:1], 0), "sums": (tot[:5], 5), "scale": (g.astype(np.float64), 7),
           "shift": (np.ones(4, np.float32), 8), "running mean": (r[:2], 12), "statistics": (st[:8], 14),
           "output": (y[:, :2], 15)}
    for what, (arr, at) in bad.items():
        args = [4, x, 2, 3, 4, tot, 8.0, g, None, 1e-5, 0, 0.1, r, r, st, y]
        args[1 if at == 0 else at] = arr
        with pytest.raises((ValueError, BufferError), match=what if what != "output" else None):
            kbn._cbn.train_fwd(*args)
