"""Local pieces of instance, group and layer normalisation: statistics per sample over a group of channels
and the whole (split) spatial domain.

The layer (:mod:`lbannpy.layers.norm`) takes per (sample, group) partial sums of its block
(:func:`group_totals`), allreduces them over the ranks holding the rest of each sample, turns them into mean
and biased variance (:func:`moments`) and normalises (:func:`group_forward`); in backprop it takes partial
sums of the gradient (:func:`group_backward_sums` then :func:`group_backward_totals`), allreduces them and
finishes with :func:`group_backward_data`. Instance norm is group norm with one channel per group; layer norm
is one group of all channels with an element-wise affine map (:func:`layer_forward`, :func:`layer_backward`,
:func:`layer_backward_data`). The arithmetic matches ``torch.nn.functional.instance_norm``/``group_norm``/
``layer_norm``.

A block ``(N, C, *spatial)`` is seen as ``N*C`` rows of ``P`` spatial values. Each row's sum of squares is
formed about a value of the row itself (the compiled path: its first element; the array path: its own mean),
so ``var = E[x^2] - E[x]^2`` of the combined rows loses only ``log10(mean^2 / var)`` of float64's digits;
backward sums are taken about the statistic's mean. Rows are combined in float64.

Compiled path (NumPy float32/float64 C-contiguous blocks, where the ``_cnorm`` extension is built): every pass
over the block is one call, the small per-row coefficients are formed here in float64; layer norm recomputes
``xhat`` from the input inside its backward passes rather than keeping it. Every other array (CuPy included)
takes array expressions in the array module of the arguments, which keep the statistics on the device: nothing
here reads a value back to the host.
"""
from __future__ import annotations


import numpy

from lbannpy.backend import array_module

try:  # the compiled kernels are optional: no compiler, no extension
    from . import _cnorm
except ImportError:  # pragma: no cover - depends on the build
    _cnorm = None

USE_COMPILED = _cnorm is not None  # tests switch it to check both paths
_FLOATS = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))
F64 = numpy.float64


def _compiled(*arrays) -> bool:
    """The compiled kernels take these arrays: NumPy, one float dtype, C-contiguous, not empty."""
    if not USE_COMPILED:
        return False
    dt = arrays[0].dtype
    for a in arrays:
        if a is not None and (type(a) is not numpy.ndarray or a.dtype != dt or not a.flags.c_contiguous):
            return False
    return dt in _FLOATS and arrays[0].size > 0


def _f64(v):
    return numpy.ascontiguousarray(v, dtype=F64)


def _rows(x):
    """``(N, C, ...)`` -> ``(N*C, P)`` (a view when ``x`` is contiguous)."""
    return x.reshape(x.shape[0] * x.shape[1], -1)


def _per_row(v, x):
    """A ``(N, C)`` coefficient shaped to broadcast over the block ``x``."""
    return v.reshape(v.shape[:2] + (1,) * (x.ndim - 2))


def _expand(v, n, c):
    """``(N, G)`` per-group values -> ``(N, C)``, each group's value on its ``C // G`` channels."""
    xp = array_module(v)
    g = v.shape[1]
    return xp.broadcast_to(v.reshape(n, g, 1), (n, g, c // g)).reshape(n, c)


def _channels(v, n, c, xp, default=1.0):
    """A per-channel ``(C,)`` vector (or None: ``default``) as float64 ``(N, C)``."""
    if v is None:
        return xp.full((n, c), default, dtype=F64)
    return xp.broadcast_to(v.astype(F64).reshape(1, c), (n, c))


# ------------------------------------------------------------------------------------------------ forward
def row_sums(x):
    """Per (sample, channel) row: ``(2, N*C)`` float64, the sums of ``x`` then of ``x**2``."""
    r = x.shape[0] * x.shape[1]
    if _compiled(x):
        out = numpy.empty(2 * r)
        _cnorm.row_stats(x.dtype.itemsize, x, r, x.size // r, out)
        return out.reshape(2, r)
    xp = array_module(x)
    xf = _rows(x)
    p = xf.shape[1]
    s = xf.sum(axis=1, keepdims=True)
    m = s / float(max(p, 1))
    dev = xf - m
    dev *= dev
    m2 = dev.sum(axis=1, dtype=F64)
    s, m = s[:, 0].astype(F64), m[:, 0].astype(F64)
    # sum x^2 = sum (x - m)^2 + 2 m sum x - p m^2 holds for the rounded m as well
    return xp.stack((s, m2 + m * (2.0 * s - p * m)))


def group_totals(x, groups: int):
    """The block's partial sums per (sample, group): ``(2, N, groups)`` float64 (sum of ``x``, of ``x**2``),
    the vector the statistics allreduce carries; ``groups`` divides the block's channels."""
    n, c = x.shape[0], x.shape[1]
    return row_sums(x).reshape(2, n, groups, c // groups).sum(axis=3)


def moments(tot, count: float):
    """Mean and biased variance (float64, each ``tot.shape[1:]``) from reduced sums over ``count`` values."""
    xp = array_module(tot)
    mean = tot[0] / count
    var = xp.maximum(tot[1] / count - mean * mean, 0.0)
    return mean, var


def running_update(mean, var, count: float, momentum: float, running_mean, running_var) -> None:
    """PyTorch's instance norm with ``track_running_stats``: the running statistics (``(C,)``, float64,
    written in place: a captured step keeps writing the same buffers) move by ``momentum`` towards the
    average over the samples of each sample's mean and unbiased variance (``mean``, ``var``: ``(N, C)`` of
    all samples)."""
    unbiased = var * (count / max(count - 1.0, 1.0))
    m = momentum
    running_mean[...] = (1.0 - m) * running_mean + m * mean.mean(axis=0)
    running_var[...] = (1.0 - m) * running_var + m * unbiased.mean(axis=0)


def _scale_shift(mean, var, gamma, beta, eps: float, n: int, c: int):
    """The forward's per-row ``(N, C)`` float64 coefficients: ``y = x * scale + shift``."""
    xp = array_module(mean)
    inv = 1.0 / xp.sqrt(var + eps)
    scale = _expand(inv, n, c) * _channels(gamma, n, c, xp)
    shift = -_expand(mean, n, c) * scale
    if beta is not None:
        shift = shift + _channels(beta, n, c, xp)
    return scale, shift


def group_forward(x, mean, var, gamma, beta, eps: float):
    """``gamma_c * (x - mean) / sqrt(var + eps) + beta_c``: ``mean``, ``var`` per (sample, group) ``(N, G)``,
    ``gamma``, ``beta`` per channel ``(C,)`` or None (no scale, no shift)."""
    n, c = x.shape[0], x.shape[1]
    scale, shift = _scale_shift(mean, var, gamma, beta, eps, n, c)
    if _compiled(x):
        y = numpy.empty_like(x)
        _cnorm.row_affine(x.dtype.itemsize, x, n * c, x.size // (n * c), _f64(scale), _f64(shift), y)
        return y
    y = x * _per_row(scale.astype(x.dtype), x)
    y += _per_row(shift.astype(x.dtype), x)
    return y


# ----------------------------------------------------------------------------------------------- backward
def group_backward_sums(dy, x, mean, var, eps: float):
    """Per (sample, channel) row: ``(2, N, C)`` float64, ``sum dy`` and ``sum dy * xhat`` of the block (to be
    turned into the allreduced vector by :func:`group_backward_totals`; summed over the samples they are the
    gradients of the shift and the scale)."""
    n, c = x.shape[0], x.shape[1]
    r = n * c
    xp = array_module(x)
    inv = 1.0 / xp.sqrt(_expand(var, n, c).reshape(r) + eps)
    if _compiled(dy, x):
        out = numpy.empty(2 * r)
        _cnorm.row_bwd_sums(x.dtype.itemsize, dy, x, r, x.size // r, _f64(_expand(mean, n, c)), out)
        out[r:] *= inv
        return out.reshape(2, n, c)
    dyf, xf = _rows(dy), _rows(x)
    sum_dy = dyf.sum(axis=1).astype(F64)
    # sum dy * (x - mean) in x's dtype (centred, so no cancellation), pairwise along rows
    centred = xf - _expand(mean, n, c).reshape(r, 1).astype(x.dtype)
    centred *= dyf
    return xp.stack((sum_dy, centred.sum(axis=1).astype(F64) * inv)).reshape(2, n, c)


def group_backward_totals(sums, gamma, groups: int):
    """The vector the backward's allreduce carries, from :func:`group_backward_sums`: one channel per group
    (instance norm), the sums themselves ``(2, N, C)``; else ``(2, N, groups)``, the sums of ``gamma_c * sum
    dy`` and ``gamma_c * sum dy * xhat`` over each group's channels."""
    _, n, c = sums.shape
    if groups == c:
        return sums
    if gamma is not None:
        sums = sums * gamma.astype(F64).reshape(1, 1, c)
    return sums.reshape(2, n, groups, c // groups).sum(axis=3)


def group_backward_data(dy, x, mean, var, gamma, eps: float, tot, count: float):
    """``dx = gamma_c / sigma * (dy - S1 / (gamma_c count) - xhat S2 / (gamma_c count))`` with the reduced
    totals ``tot`` of :func:`group_backward_totals` (``S1``, ``S2``: the sums of ``gamma * dy`` and ``gamma
    * dy * xhat`` over each statistic's values), as ``a * dy + b * x + c`` per row."""
    n, c = x.shape[0], x.shape[1]
    groups = mean.shape[1]
    xp = array_module(x)
    inv = 1.0 / xp.sqrt(var + eps)
    gam = _channels(gamma, n, c, xp)
    if groups == c:  # one channel per group: the per-channel totals, weighted by the scale
        s1, s2 = tot[0] * gam, tot[1] * gam
    else:
        s1, s2 = tot[0], tot[1]
    b = -inv * inv * s2 / count
    cc = -inv * s1 / count - b * mean
    a = _expand(inv, n, c) * gam
    b, cc = _expand(b, n, c), _expand(cc, n, c)
    if _compiled(dy, x):
        dx = numpy.empty_like(x)
        _cnorm.row_axpbyc(x.dtype.itemsize, dy, x, n * c, x.size // (n * c), _f64(a), _f64(b), _f64(cc), dx)
        return dx
    dx = dy * _per_row(a.astype(x.dtype), x)
    dx += x * _per_row(b.astype(x.dtype), x)
    dx += _per_row(cc.astype(x.dtype), x)
    return dx


def add_param_grads(sums, gamma_grad, beta_grad) -> None:
    """``gamma_grad += sum_n sum dy xhat`` and ``beta_grad += sum_n sum dy`` (in their dtype) from the
    ``(2, N, C)`` row sums of :func:`group_backward_sums`."""
    xp = array_module(gamma_grad)
    tot = sums.sum(axis=1)
    gamma_grad += xp.asarray(tot[1], dtype=gamma_grad.dtype)
    beta_grad += xp.asarray(tot[0], dtype=beta_grad.dtype)


# ---------------------------------------------------------------------------------------------- layer norm
def layer_forward(x, mean, var, gamma, beta, eps: float):
    """Layer norm of the block: ``(x - mean) / sqrt(var + eps) * gamma + beta`` with per-sample ``mean``,
    ``var`` (``(N, 1)``) and the element-wise ``gamma``, ``beta`` of the block's ``(C, *spatial)`` piece (or
    None: no scale, no shift)."""
    n = x.shape[0]
    xp = array_module(x)
    inv = 1.0 / xp.sqrt(var + eps)
    if _compiled(x, gamma, beta):
        y = numpy.empty_like(x)
        _cnorm.ln_fwd(x.dtype.itemsize, x, n, x.size // max(n, 1), _f64(inv), _f64(-mean * inv), gamma, beta,
                      y)
        return y
    y = group_forward(x, mean, var, None, None, eps)
    if gamma is not None:
        y *= gamma
        y += beta
    return y


def layer_backward(dy, x, mean, var, eps: float, gamma, gamma_grad, beta_grad):
    """The parameter gradients (added to ``gamma_grad``, ``beta_grad``: the sums over this block's samples of
    ``dy * xhat`` and ``dy``) and the per-sample partial sums ``(2, N, 1)`` float64 of ``g = dy * gamma`` and
    ``g * xhat`` that the backward's allreduce carries: ``(totals, work)``, ``work`` what
    :func:`layer_backward_data` reuses (None on the compiled path, which recomputes ``xhat`` as it goes)."""
    n = x.shape[0]
    xp = array_module(x)
    inv = 1.0 / xp.sqrt(var + eps)
    if _compiled(dy, x, gamma, gamma_grad, beta_grad):
        out = numpy.empty(2 * n)
        _cnorm.ln_bwd_sums(x.dtype.itemsize, dy, x, n, x.size // max(n, 1), _f64(inv), _f64(-mean * inv),
                           gamma, gamma_grad, beta_grad, out)
        return out.reshape(2, n, 1), None
    xhat = group_forward(x, mean, var, None, None, eps)
    if gamma is not None:
        beta_grad += dy.sum(axis=0)
        g = dy * xhat
        gamma_grad += g.sum(axis=0)
        xp.multiply(dy, gamma, out=g)
    else:
        g = dy
    rows = group_backward_sums(g, xhat, xp.zeros((n, 1), dtype=F64), xp.ones((n, 1), dtype=F64), 0.0)
    return rows.sum(axis=2, keepdims=True), (g, xhat)


def layer_backward_data(dy, x, mean, var, eps: float, gamma, tot, count: float, work):
    """``dx = (g - S1 / count - xhat * S2 / count) / sqrt(var + eps)`` per sample (``g = dy * gamma``) from
    the reduced totals of :func:`layer_backward`, as ``a * gamma * dy + b * x + c``."""
    n = x.shape[0]
    xp = array_module(x)
    inv = 1.0 / xp.sqrt(var + eps)
    s1, s2 = tot[0], tot[1]
    if work is None and _compiled(dy, x, gamma):
        b = -inv * inv * s2 / count
        c = -inv * s1 / count - b * mean
        dx = numpy.empty_like(x)
        _cnorm.ln_bwd_data(x.dtype.itemsize, dy, x, n, x.size // max(n, 1), _f64(inv), _f64(b), _f64(c),
                           gamma, dx)
        return dx
    g, xhat = work
    dx = g * _per_row(inv.astype(x.dtype), x)
    dx += xhat * _per_row((-inv * s2 / count).astype(x.dtype), x)
    dx += _per_row((-inv * s1 / count).astype(x.dtype), x)
    return dx
