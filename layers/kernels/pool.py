"""Local max and average pooling (2-D and 3-D) on an already windowed input (a *valid* pooling).

The caller pads: with ``-inf`` for max pooling (``pad_spatial(x, pads, -inf)``), so padding never wins,
and with zeros for average pooling. Average pooling divides by ``prod(kernel)`` (PyTorch's
``count_include_pad=True``) unless a ``valid`` mask of the window (1 = real element, 0 = padding) is given,
in which case each output is divided by the number of real elements under it (``count_include_pad=False``).

Max pooling returns the winning tap of every output; ties go to the first maximum in tap order (row-major
over the kernel), and a NaN wins (propagates), as in PyTorch's CPU kernels.
"""
from __future__ import annotations

import itertools
import math

import numpy

from lbannpy.backend import array_module

from ._geometry import KernelShapeError, per_dim, tap_slices, valid_output_shape


def _geometry(window_shape, kernel, stride, dilation):
    nsp = len(window_shape) - 2
    if nsp not in (1, 2, 3):
        raise KernelShapeError(
            f"pool: input {tuple(window_shape)} must be (N, C, *spatial) with 1-3 spatial dims")
    k = per_dim(kernel, nsp, "kernel")
    s = per_dim(k if stride is None else stride, nsp, "stride")
    d = per_dim(dilation, nsp, "dilation")
    out = valid_output_shape(tuple(window_shape[2:]), k, s, d, "pool window")
    return k, s, d, out


def _taps(kernel):
    return list(itertools.product(*(range(j) for j in kernel)))


def _at(tap, out, s, d):
    return (slice(None), slice(None)) + tap_slices(tap, out, s, d)


def max_pool_forward(x_window, kernel, stride=None, dilation=1):
    """``(N, C, *S)`` -> ``(y, argmax)``: the maxima ``(N, C, *O)`` and the winning tap of each (an integer
    index into the row-major flattened kernel; pass it to :func:`max_pool_backward`). ``stride`` defaults to
    ``kernel``."""
    xp = array_module(x_window)
    k, s, d, out = _geometry(x_window.shape, kernel, stride, dilation)
    taps = _taps(k)
    idx_dtype = numpy.int8 if len(taps) <= 127 else numpy.int16
    y = x_window[_at(taps[0], out, s, d)].copy()
    for tap in taps[1:]:
        xp.maximum(y, x_window[_at(tap, out, s, d)], out=y)  # NaN propagates
    has_nan = bool(xp.isnan(y).any())
    arg = xp.empty(y.shape, dtype=idx_dtype)
    # the first tap equal to the maximum (or the first NaN) wins: walk the taps backwards, last write wins
    for t in range(len(taps) - 1, -1, -1):
        v = x_window[_at(taps[t], out, s, d)]
        hit = v == y
        if has_nan:
            hit |= xp.isnan(v)
        xp.copyto(arg, idx_dtype(t), where=hit)
    return y, arg


def max_pool_backward(dy, argmax, x_window_shape, kernel, stride=None, dilation=1):
    """Gradient w.r.t. the window: each ``dy`` goes to the input its output took the maximum from."""
    xp = array_module(dy)
    k, s, d, out = _geometry(x_window_shape, kernel, stride, dilation)
    _check(dy, x_window_shape, out)
    dx = xp.zeros(tuple(x_window_shape), dtype=dy.dtype)
    for t, tap in enumerate(_taps(k)):
        dx[_at(tap, out, s, d)] += dy * (argmax == t)
    return dx


def _divisor(xp, valid, x_window_shape, k, s, d, out, dtype):
    if valid is None:
        return dtype.type(math.prod(k))
    valid = xp.asarray(valid, dtype=dtype)
    nsp = len(k)
    valid = valid.reshape((1,) * (len(x_window_shape) - valid.ndim) + tuple(valid.shape))
    if tuple(valid.shape[-nsp:]) != tuple(x_window_shape[-nsp:]):
        raise KernelShapeError(f"avg pool: valid mask {tuple(valid.shape)} does not match the window "
                               f"{tuple(x_window_shape)}")
    count = sum(valid[_at(tap, out, s, d)] for tap in _taps(k))
    if bool((count == 0).any()):
        raise KernelShapeError("avg pool: a window holds only padding; reduce the padding")
    return count


def avg_pool_forward(x_window, kernel, stride=None, valid=None):
    """Mean over each window: ``(N, C, *S)`` -> ``(N, C, *O)``; see the module doc for ``valid``."""
    xp = array_module(x_window)
    k, s, d, out = _geometry(x_window.shape, kernel, stride, 1)
    taps = _taps(k)
    y = x_window[_at(taps[0], out, s, d)].copy()
    for tap in taps[1:]:
        y += x_window[_at(tap, out, s, d)]
    y /= _divisor(xp, valid, x_window.shape, k, s, d, out, y.dtype)
    return y


def avg_pool_backward(dy, x_window_shape, kernel, stride=None, valid=None):
    """Gradient w.r.t. the window of :func:`avg_pool_forward`."""
    xp = array_module(dy)
    k, s, d, out = _geometry(x_window_shape, kernel, stride, 1)
    _check(dy, x_window_shape, out)
    g = dy / _divisor(xp, valid, x_window_shape, k, s, d, out, dy.dtype)
    dx = xp.zeros(tuple(x_window_shape), dtype=dy.dtype)
    for tap in _taps(k):
        dx[_at(tap, out, s, d)] += g
    return dx


def _check(dy, x_window_shape, out):
    want = tuple(x_window_shape[:2]) + tuple(out)
    if tuple(dy.shape) != want:
        raise KernelShapeError(f"pool: dy has shape {tuple(dy.shape)}, expected {want} for window "
                               f"{tuple(x_window_shape)}")
