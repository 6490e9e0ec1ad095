"""Local pieces of training-mode batch normalisation over the channel dimension (axis 1).

A distributed layer computes per-channel partial sums on its block (:func:`bn_local_stats`), allreduces
them over the ranks that share its channels, turns them into mean and biased variance
(:func:`bn_mean_var`), normalises (:func:`bn_forward`); in backprop it computes partial sums
(:func:`bn_backward`), allreduces them, and finishes with :func:`bn_backward_data`. The reduced sums are
also the parameter gradients: ``dgamma = sum_dy_xhat``, ``dbeta = sum_dy``. This matches
``torch.nn.functional.batch_norm(..., training=True)``.

``var = E[x^2] - E[x]^2`` loses ``log10(mean^2 / var)`` digits, so each (sample, channel) row's sum of
squares is formed about the row's own mean (two passes, pairwise sums) and rows are combined in float64;
the backward sums are taken about the global mean.
"""
from __future__ import annotations

import numpy

from lbannpy.backend import array_module


def _flat(x):
    """``(N, C, ...)`` -> ``(N, C, P)`` (a view when ``x`` is contiguous)."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def bn_local_stats(x):
    """Per-channel ``(sum, sum of squares, count)`` of the local block; sums are float64 ``(C,)``."""
    xf = _flat(x)
    p = xf.shape[2]
    # per (sample, channel) row: pairwise sums in x's dtype, then the squares about the row's own mean, so
    # float32 rows keep full relative precision in the spread; rows are combined in float64
    row_sum = xf.sum(axis=2, keepdims=True)
    row_mean = row_sum / xf.dtype.type(max(p, 1))
    dev = xf - row_mean
    dev *= dev
    row_m2 = dev.sum(axis=2, dtype=numpy.float64)
    row_sum = row_sum[..., 0].astype(numpy.float64)
    m = row_mean[..., 0].astype(numpy.float64)
    # sum x^2 = sum (x - m)^2 + 2 m sum x - p m^2 holds for the rounded m as well
    sq = row_m2 + m * (2.0 * row_sum - p * m)
    return row_sum.sum(axis=0), sq.sum(axis=0), x.size // x.shape[1]


def bn_mean_var(total, total_sq, count):
    """Mean and biased variance (float64) from globally reduced sums."""
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, var.clip(min=0.0)


def _scale_shift(mean, var, gamma, beta, eps, dtype):
    xp = array_module(mean)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    scale = gamma.astype(numpy.float64) * inv_std
    shift = (0.0 if beta is None else beta.astype(numpy.float64)) - mean * scale
    return scale.astype(dtype), xp.asarray(shift).astype(dtype), inv_std


def bn_forward(x, mean, var, gamma, beta, eps=1e-5):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` with per-channel ``(C,)`` parameters."""
    scale, shift, _ = _scale_shift(mean, var, gamma, beta, eps, x.dtype)
    y = x * _per_channel(scale, x.ndim)
    y += _per_channel(shift, x.ndim)
    return y


def bn_backward(dy, x, mean, var, gamma, eps=1e-5):
    """Local partial sums ``(sum dy, sum dy * xhat)`` per channel (float64 ``(C,)``), to be allreduced
    over the same ranks as the statistics. ``gamma`` is unused (kept for a uniform signature)."""
    xp = array_module(x)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    dyf, xf = _flat(dy), _flat(x)
    sum_dy = dyf.sum(axis=2).sum(axis=0, dtype=numpy.float64)
    # sum dy * (x - mean) in x's dtype (centred, so no cancellation), pairwise along rows
    centred = xf - mean.astype(x.dtype).reshape(1, -1, 1)
    centred *= dyf
    sum_dy_xc = centred.sum(axis=2).sum(axis=0, dtype=numpy.float64)
    return sum_dy, inv_std * sum_dy_xc


def bn_backward_data(dy, x, mean, var, gamma, eps, sum_dy, sum_dy_xhat, count):
    """``dx = gamma/sigma * (dy - sum_dy/count - xhat * sum_dy_xhat/count)`` given the global sums."""
    xp = array_module(x)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    k = gamma.astype(numpy.float64) * inv_std
    # dx = a*dy + b*x + c per channel
    a = k
    b = -k * inv_std * sum_dy_xhat / count
    c = -k * sum_dy / count - b * mean
    nd = x.ndim
    dx = dy * _per_channel(a.astype(x.dtype), nd)
    dx += x * _per_channel(b.astype(x.dtype), nd)
    dx += _per_channel(c.astype(x.dtype), nd)
    return dx


def bn_backward_params(sum_dy, sum_dy_xhat):
    """``(dgamma, dbeta)`` from the globally reduced sums of :func:`bn_backward`."""
    return sum_dy_xhat, sum_dy
