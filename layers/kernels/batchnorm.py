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

Compiled path (NumPy float32/float64 C-contiguous blocks, when the ``_cbn`` extension is built): the
statistics are one pass with float64 accumulators (each row about its first element), the forward one pass
(optionally with the ReLU of a fused batch-norm + ReLU), the backward's two sums one pass and its data
gradient one pass. With ``y`` (the fused layer's output) the backward first masks ``dy`` where ``y <= 0``: the
gradient of ``relu(bn(x))``. On a GPU every pass is one CuPy kernel (:mod:`._bn_gpu`: reductions, per-channel
and element-wise kernels) where the array module has ``ElementwiseKernel`` and ``ReductionKernel``, else array
expressions.
"""
from __future__ import annotations


import numpy

from lbannpy.backend import array_module, module_kernels

from . import _bn_gpu

try:  # the compiled kernels are optional: no compiler, no extension
    from . import _cbn
except ImportError:  # pragma: no cover - depends on the build
    _cbn = None

USE_COMPILED = _cbn is not None  # tests switch it to check both paths
_FLOATS = (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))


def _compiled(*arrays) -> bool:
    """The compiled kernels take these arrays: NumPy, one float dtype, C-contiguous."""
    if not USE_COMPILED:
        return False
    dt = arrays[0].dtype
    for a in arrays:
        if a is not None and (type(a) is not numpy.ndarray or a.dtype != dt or not a.flags.c_contiguous):
            return False
    return dt in _FLOATS


def _ncp(x):
    """``(N, C, P)`` of a channels-first block."""
    n, c = x.shape[0], x.shape[1]
    return n, c, (x.size // (n * c) if n * c else 0)


def _f64(v):
    return numpy.ascontiguousarray(v, dtype=numpy.float64)


def _flat(x):
    """``(N, C, ...)`` -> ``(N, C, P)`` (a view when ``x`` is contiguous)."""
    return x.reshape(x.shape[0], x.shape[1], -1)


def _per_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def bn_local_stats(x):
    """Per-channel ``(sum, sum of squares, count)`` of the local block; sums are float64 ``(C,)``."""
    tot = bn_local_sums(x)
    c = tot.shape[0] // 2
    return tot[:c], tot[c:], x.size // x.shape[1]


def bn_local_sums(x):
    """The local block's per-channel sums then sums of squares, one float64 ``(2C,)`` vector: what the
    statistics allreduce carries and :func:`bn_train_forward` reads."""
    if _compiled(x):
        n, c, p = _ncp(x)
        out = numpy.empty(2 * c)
        _cbn.stats(x.dtype.itemsize, x, n, c, p, out)
        return out
    gpu = _gpu_kernels(x)
    if gpu is not None and x.size:
        return _bn_gpu.local_sums(gpu, x)
    return array_module(x).concatenate(_numpy_stats(x))


def _numpy_stats(x):
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
    return row_sum.sum(axis=0), sq.sum(axis=0)


def bn_mean_var(total, total_sq, count):
    """Mean and biased variance (float64) from globally reduced sums."""
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, var.clip(min=0.0)


def bn_train_forward(x, tot, count, gamma, beta, eps, momentum, running_mean, running_var, relu=False,
                     in_place=False):
    """A training step's forward from the reduced sums ``tot`` (:func:`bn_local_sums` summed over the
    statistics group, ``count`` values per channel): ``(y, mean, var, running_mean, running_var)``, the
    running statistics moved by ``momentum`` towards this batch's mean and unbiased variance (new arrays,
    the given ones not written; with ``in_place`` the given ones, updated: a captured GPU step keeps
    writing the same buffers). Compiled: one call (:func:`bn_mean_var`'s arithmetic, the running update's
    and :func:`bn_forward`'s, in their order)."""
    c = tot.shape[0] // 2
    if _compiled(x, gamma, beta) and _compiled(tot, running_mean, running_var):
        n, _, p = _ncp(x)
        st, y = numpy.empty(4 * c), numpy.empty_like(x)
        _cbn.train_fwd(x.dtype.itemsize, x, n, c, p, tot, float(count), gamma, beta, float(eps), int(relu),
                       float(momentum), running_mean, running_var, st, y)
        rm, rv = st[2 * c:3 * c], st[3 * c:]
        if in_place:
            running_mean[...], running_var[...] = rm, rv
            rm, rv = running_mean, running_var
        return y, st[:c], st[c:2 * c], rm, rv
    gpu = _gpu_kernels(x)
    if gpu is not None and x.size:
        if not in_place:
            running_mean, running_var = running_mean.copy(), running_var.copy()
        return _bn_gpu.train_forward(gpu, x, tot, count, gamma, beta, eps, momentum, running_mean,
                                     running_var, relu)
    mean, var = bn_mean_var(tot[:c], tot[c:], count)
    unbiased = var * (count / max(count - 1.0, 1.0))
    m = momentum
    rm = (1 - m) * running_mean + m * mean
    rv = (1 - m) * running_var + m * unbiased
    if in_place:
        running_mean[...], running_var[...] = rm, rv
        rm, rv = running_mean, running_var
    return bn_forward(x, mean, var, gamma, beta, eps, relu=relu), mean, var, rm, rv


def _scale_shift(mean, var, gamma, beta, eps, dtype):
    xp = array_module(mean)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    scale = gamma.astype(numpy.float64) * inv_std
    shift = (0.0 if beta is None else beta.astype(numpy.float64)) - mean * scale
    return scale.astype(dtype), xp.asarray(shift).astype(dtype), inv_std


def bn_forward(x, mean, var, gamma, beta, eps=1e-5, relu=False):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` with per-channel ``(C,)`` parameters; with ``relu``
    its ``max(., 0)`` (fused batch-norm + ReLU)."""
    if _compiled(x):
        y = numpy.empty_like(x)
        n, c, p = _ncp(x)
        _cbn.forward(x.dtype.itemsize, x, n, c, p, _f64(mean), _f64(var), _f64(gamma),
                     None if beta is None else _f64(beta), float(eps), int(relu), y)
        return y
    gpu = _gpu_kernels(x)
    if gpu is not None and x.size:
        return _bn_gpu.forward(gpu, x, mean, var, gamma, beta, eps, relu)
    scale, shift, _ = _scale_shift(mean, var, gamma, beta, eps, x.dtype)
    y = x * _per_channel(scale, x.ndim)
    y += _per_channel(shift, x.ndim)
    if relu:
        array_module(x).maximum(y, x.dtype.type(0), out=y)
    return y


def bn_backward(dy, x, mean, var, gamma, eps=1e-5, y=None):
    """Local partial sums ``(sum dy, sum dy * xhat)`` per channel (float64 ``(C,)``), to be allreduced
    over the same ranks as the statistics. ``gamma`` is unused (kept for a uniform signature). With ``y``
    (the output of a fused batch-norm + ReLU) ``dy`` counts only where ``y > 0``."""
    tot = bn_backward_sums(dy, x, mean, var, eps, y)
    c = tot.shape[0] // 2
    return tot[:c], tot[c:]


def bn_backward_sums(dy, x, mean, var, eps=1e-5, y=None):
    """:func:`bn_backward`'s two sums as one float64 ``(2C,)`` vector (what the backward's allreduce
    carries and :func:`bn_backward_data_summed` reads)."""
    if _compiled(dy, x, y):
        n, c, p = _ncp(x)
        out = numpy.empty(2 * c)
        _cbn.bwd_sums(x.dtype.itemsize, dy, x, y, n, c, p, _f64(mean), _f64(var), float(eps), out)
        return out
    gpu = _gpu_kernels(x)
    if gpu is not None and x.size:
        return _bn_gpu.backward_sums(gpu, dy, x, mean, var, eps, y)
    return array_module(x).concatenate(_numpy_backward_sums(dy, x, mean, var, eps, y))


def _numpy_backward_sums(dy, x, mean, var, eps, y):
    xp = array_module(x)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    if y is not None:
        dy = relu_mask(dy, y)
    dyf, xf = _flat(dy), _flat(x)
    sum_dy = dyf.sum(axis=2).sum(axis=0, dtype=numpy.float64)
    # sum dy * (x - mean) in x's dtype (centred, so no cancellation), pairwise along rows
    centred = xf - mean.astype(x.dtype).reshape(1, -1, 1)
    centred *= dyf
    sum_dy_xc = centred.sum(axis=2).sum(axis=0, dtype=numpy.float64)
    return sum_dy, inv_std * sum_dy_xc


def bn_backward_data(dy, x, mean, var, gamma, eps, sum_dy, sum_dy_xhat, count, y=None):
    """``dx = gamma/sigma * (dy - sum_dy/count - xhat * sum_dy_xhat/count)`` given the global sums; with
    ``y`` (fused batch-norm + ReLU) ``dy`` is first masked where ``y <= 0``."""
    tot = array_module(x).concatenate((sum_dy, sum_dy_xhat)).astype(numpy.float64, copy=False)
    return bn_backward_data_summed(dy, x, mean, var, gamma, eps, tot, count, y)


def bn_backward_data_summed(dy, x, mean, var, gamma, eps, tot, count, y=None):
    """:func:`bn_backward_data` given the reduced sums as one ``(2C,)`` vector (:func:`bn_backward_sums`)."""
    if _compiled(dy, x, y) and _compiled(tot) and tot.shape == (2 * x.shape[1],):
        dx = numpy.empty_like(x)
        n, ch, p = _ncp(x)
        _cbn.bwd_data(x.dtype.itemsize, dy, x, y, n, ch, p, _f64(mean), _f64(var), _f64(gamma), float(eps),
                      tot, float(count), dx)
        return dx
    gpu = _gpu_kernels(x)
    if gpu is not None and x.size:
        return _bn_gpu.backward_data(gpu, dy, x, mean, var, gamma, eps, tot, count, y)
    c = tot.shape[0] // 2
    return _numpy_backward_data(dy, x, mean, var, gamma, eps, tot[:c], tot[c:], count, y)


def _numpy_backward_data(dy, x, mean, var, gamma, eps, sum_dy, sum_dy_xhat, count, y):
    xp = array_module(x)
    inv_std = 1.0 / xp.sqrt(var.astype(numpy.float64) + eps)
    k = gamma.astype(numpy.float64) * inv_std
    # dx = a*dy + b*x + c per channel
    a = k
    b = -k * inv_std * sum_dy_xhat / count
    c = -k * sum_dy / count - b * mean
    nd = x.ndim
    if y is not None:
        dy = relu_mask(dy, y)
    dx = dy * _per_channel(a.astype(x.dtype), nd)
    dx += x * _per_channel(b.astype(x.dtype), nd)
    dx += _per_channel(c.astype(x.dtype), nd)
    return dx


def bn_backward_params(sum_dy, sum_dy_xhat):
    """``(dgamma, dbeta)`` from the globally reduced sums of :func:`bn_backward`."""
    return sum_dy_xhat, sum_dy


def bn_add_param_grads(tot, gamma_grad, beta_grad):
    """``gamma_grad += sum dy xhat`` and ``beta_grad += sum dy`` (in their dtype) from the ``(2C,)`` vector
    of :func:`bn_backward_sums`: one kernel on a GPU."""
    gpu = _gpu_kernels(gamma_grad)
    if gpu is not None:
        _bn_gpu.add_param_grads(gpu, tot, gamma_grad, beta_grad)
        return
    c = tot.shape[0] // 2
    xp = array_module(gamma_grad)
    gamma_grad += xp.asarray(tot[c:], dtype=gamma_grad.dtype)
    beta_grad += xp.asarray(tot[:c], dtype=beta_grad.dtype)


def relu_mask(dy, y):
    """``dy`` where ``y > 0``, else 0: the gradient through a ReLU whose output is ``y``."""
    if _compiled(dy, y):
        dx = numpy.empty_like(dy)
        _cbn.relu_bwd(dy.dtype.itemsize, dy, y, dy.size, dx)
        return dx
    gpu = _gpu_kernels(y)
    if gpu is not None:  # one kernel (where(y > 0, ...) is two)
        return gpu.relu_mask(dy, y)
    return array_module(y).where(y > 0, dy, dy.dtype.type(0))


# the GPU's element-wise passes: one CuPy ElementwiseKernel each, with the reductions and per-channel kernels
# of _bn_gpu (built on first use; None where the array module has no ElementwiseKernel/ReductionKernel)
_GPU_FWD = (
    "T x, T s, T h, int32 relu", "T y",
    "T v = x * s + h; y = (relu && v < (T)0) ? (T)0 : v;", "lbannpy_bn_relu_fwd")
_GPU_BWD = (
    "T dy, T x, T y, int32 relu, T a, T b, T c", "T dx",
    "T g = (relu && !(y > (T)0)) ? (T)0 : dy; dx = g * a + x * b + c;", "lbannpy_bn_relu_bwd")


def _gpu_kernels(x):
    """The GPU kernels (:class:`._bn_gpu.Kernels`) of ``x``'s array module, or None."""
    return module_kernels(array_module(x), "bn", lambda xp: _bn_gpu.Kernels(
        xp, *(xp.ElementwiseKernel(*k) for k in (_GPU_FWD, _GPU_BWD))))
