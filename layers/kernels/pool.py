"""Local max and average pooling (2-D and 3-D) on an already windowed input (a *valid* pooling).

The caller pads: with ``-inf`` for max pooling (``pad_spatial(x, pads, -inf)``), so padding never wins,
and with zeros for average pooling. Average pooling divides by ``prod(kernel)`` (PyTorch's
``count_include_pad=True``) unless a ``valid`` mask of the window (1 = real element, 0 = padding) is given,
in which case each output is divided by the number of real elements under it (``count_include_pad=False``).

Max pooling returns the winning tap of every output; ties go to the first maximum in tap order (row-major
over the kernel), and a NaN wins (propagates), as in PyTorch's CPU kernels.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy

from lbannpy.backend import array_module

from . import _pool_gpu
from ._geometry import KernelShapeError, per_dim, tap_slices, valid_output_shape

try:  # the compiled kernels (built by pip install where a C compiler is present; see _cconv.c)
    from . import _cconv
except ImportError:  # pragma: no cover - exercised on installs without a compiler
    _cconv = None
try:  # average pooling (see _csmall.c)
    from . import _csmall
except ImportError:  # pragma: no cover - exercised on installs without a compiler
    _csmall = None

# max pooling of NumPy float32/float64 arrays runs in one compiled pass (maximum and winning tap together)
# where the extension is built (set_compiled(False): the NumPy path, for a benchmark)
USE_COMPILED = _cconv is not None


def set_compiled(on: bool) -> None:
    """Whether NumPy pooling takes the compiled pass (where built): ``bench layers --conv-kernel numpy``."""
    global USE_COMPILED
    USE_COMPILED = bool(on) and _cconv is not None


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


@functools.lru_cache(maxsize=1024)
def _cached_plan(window_shape: tuple, kernel, stride, dilation):
    k, s, d, out = _geometry(window_shape, kernel, stride, dilation)
    return k, s, d, out, tuple(_at(tap, out, s, d) for tap in _taps(k))


def _hashable(v):
    return v if v is None or isinstance(v, (int, tuple)) else tuple(v)


def _plan(window_shape, kernel, stride, dilation):
    """``(kernel, stride, dilation, output extents, the window slices of each tap)``, worked out once per
    shape (a layer pools the same shapes every step)."""
    return _cached_plan(tuple(window_shape), _hashable(kernel), _hashable(stride), _hashable(dilation))


def _at(tap, out, s, d):
    return (slice(None), slice(None)) + tap_slices(tap, out, s, d)


def _compiled(a) -> bool:
    """A NumPy float32/float64 array, with the compiled kernels in use (``dtype.char``: comparing dtypes
    costs a microsecond, as much as pooling a small layer)."""
    return USE_COMPILED and isinstance(a, numpy.ndarray) and a.dtype.char in "fd"


def _three(vals, fill):
    """Spatial parameters padded in front to three dimensions (2-D pooling has a leading extent of 1)."""
    return (fill,) * (3 - len(vals)) + tuple(vals)


@functools.lru_cache(maxsize=1024)
def _fwd_args(shape, strides, isz, kernel, stride, dilation):
    """The compiled forward's geometry arguments after the input, for one input layout: the samples and
    channels, each with its own stride (a strided view needs no merging), then the spatial strides,
    outputs, kernel, stride and dilation padded to three dimensions; with the output shape and index type.
    None where the kernel cannot walk the strides (negative, or not whole elements)."""
    k, s, d, out, at = _plan(shape, kernel, stride, dilation)
    if any(st < 0 or st % isz for st in strides):
        return None
    el = [st // isz for st in strides]
    geo = (shape[0], el[0], shape[1], el[1], *_three(el[2:], 0), *_three(out, 1), *_three(k, 1),
           *_three(s, 1), *_three(d, 1))
    return geo, tuple(shape[:2]) + tuple(out), numpy.int8 if len(at) <= 127 else numpy.int16


def max_pool_forward(x_window, kernel, stride=None, dilation=1):
    """``(N, C, *S)`` -> ``(y, argmax)``: the maxima ``(N, C, *O)`` and the winning tap of each (an integer
    index into the row-major flattened kernel; pass it to :func:`max_pool_backward`). ``stride`` defaults to
    ``kernel``."""
    fa = _compiled(x_window) and _fwd_args(x_window.shape, x_window.strides, x_window.itemsize,
                                           _hashable(kernel), _hashable(stride), _hashable(dilation))
    if fa:  # one call for the whole batch
        geo, yshape, idx_dtype = fa
        y = numpy.empty(yshape, dtype=x_window.dtype)
        arg = numpy.empty(yshape, dtype=idx_dtype)
        _cconv.maxpool_fwd(x_window.itemsize, x_window, *geo, y, arg, arg.itemsize)
        return y, arg
    xp = array_module(x_window)
    k, s, d, out, at = _plan(x_window.shape, kernel, stride, dilation)
    idx_dtype = numpy.int8 if len(at) <= 127 else numpy.int16
    gpu = _pool_gpu.kernels(xp)
    if gpu is not None and x_window.size:  # one kernel (the array expressions below launch ~5 a tap)
        return _pool_gpu.max_forward(xp, gpu, x_window, k, s, d, out, idx_dtype)
    y = x_window[at[0]].copy()
    for sl in at[1:]:
        xp.maximum(y, x_window[sl], out=y)  # NaN propagates
    # on the host, skip the NaN pass when there is none; on a GPU asking would stall the stream every step,
    # so the NaN test always runs there (same result)
    has_nan = bool(xp.isnan(y).any()) if xp is numpy else True
    arg = xp.empty(y.shape, dtype=idx_dtype)
    # the first tap equal to the maximum (or the first NaN) wins: walk the taps backwards, last write wins
    for t in range(len(at) - 1, -1, -1):
        v = x_window[at[t]]
        hit = v == y
        if has_nan:
            hit |= xp.isnan(v)
        xp.copyto(arg, idx_dtype(t), where=hit)
    return y, arg


@functools.lru_cache(maxsize=1024)
def _bwd_args(x_window_shape, kernel, stride, dilation):
    """The compiled backward's geometry arguments (samples, channels, outputs, kernel, stride, dilation,
    then after dx its spatial extents and whether the windows tile it exactly, so that every element is
    written directly instead of accumulated into zeros)."""
    k, s, d, out, _ = _plan(x_window_shape, kernel, stride, dilation)
    k3, s3, d3, w3 = _three(k, 1), _three(s, 1), _three(d, 1), _three(x_window_shape[2:], 1)
    tiles = all(kk == ss and (kk == 1 or dd == 1) and ww == oo * ss
                for kk, ss, dd, ww, oo in zip(k3, s3, d3, w3, _three(out, 1)))
    return (*x_window_shape[:2], *_three(out, 1), *k3, *s3, *d3), (*w3, int(tiles)), tuple(out)


def max_pool_backward(dy, argmax, x_window_shape, kernel, stride=None, dilation=1):
    """Gradient w.r.t. the window: each ``dy`` goes to the input its output took the maximum from."""
    if _compiled(dy) and isinstance(argmax, numpy.ndarray) and argmax.dtype.char in "bh":
        geo, tail, out = _bwd_args(tuple(x_window_shape), _hashable(kernel), _hashable(stride),
                                   _hashable(dilation))
        _check(dy, x_window_shape, out)
        dx = numpy.empty(tuple(x_window_shape), dtype=dy.dtype)  # written whole (zeroed as it goes)
        dy_c, arg_c = numpy.ascontiguousarray(dy), numpy.ascontiguousarray(argmax)
        _cconv.maxpool_bwd(dy.itemsize, dy_c, arg_c, arg_c.itemsize, *geo, dx, *tail)
        return dx
    xp = array_module(dy)
    k, s, d, out, at = _plan(x_window_shape, kernel, stride, dilation)
    _check(dy, x_window_shape, out)
    gpu = _pool_gpu.kernels(xp)
    if gpu is not None and dy.size:
        return _pool_gpu.max_backward(xp, gpu, dy, argmax, x_window_shape, k, s, d, out)
    dx = xp.zeros(tuple(x_window_shape), dtype=dy.dtype)
    for t, sl in enumerate(at):
        dx[sl] += dy * (argmax == t)
    return dx


def _divisor(xp, valid, x_window_shape, k, s, d, out, dtype):
    if valid is None:
        return dtype.type(math.prod(k))
    # the mask is geometry (known on the host): count the window sizes and check them there, then upload
    # once, so a GPU never reads a device array back for the check
    on_host = array_module(valid) is numpy
    m = numpy if on_host else xp
    valid = m.asarray(valid, dtype=dtype)
    nsp = len(k)
    valid = valid.reshape((1,) * (len(x_window_shape) - valid.ndim) + tuple(valid.shape))
    if tuple(valid.shape[-nsp:]) != tuple(x_window_shape[-nsp:]):
        raise KernelShapeError(f"avg pool: valid mask {tuple(valid.shape)} does not match the window "
                               f"{tuple(x_window_shape)}")
    count = sum(valid[_at(tap, out, s, d)] for tap in _taps(k))
    if on_host:
        if bool((count == 0).any()):
            raise KernelShapeError("avg pool: a window holds only padding; reduce the padding")
        count = xp.asarray(count)
    return count


@functools.lru_cache(maxsize=1024)
def _avg_args(window_shape: tuple, kernel, stride):
    """The compiled average pooling's arguments after the arrays: the divisor, the planes (samples x
    channels), the window's and the outputs' extents, kernel, stride, dilation 1 (three dimensions each);
    with the output shape."""
    k, s, _, out, _ = _plan(window_shape, kernel, stride, 1)
    return ((float(math.prod(k)), window_shape[0] * window_shape[1], *_three(window_shape[2:], 1),
             *_three(out, 1), *_three(k, 1), *_three(s, 1), 1, 1, 1), tuple(window_shape[:2]) + tuple(out))


def _avg_compiled(a, valid) -> bool:
    return valid is None and _csmall is not None and _compiled(a)


def avg_pool_forward(x_window, kernel, stride=None, valid=None):
    """Mean over each window: ``(N, C, *S)`` -> ``(N, C, *O)``; see the module doc for ``valid``."""
    if _avg_compiled(x_window, valid):  # one call, the NumPy path's arithmetic in its order
        args, yshape = _avg_args(tuple(x_window.shape), _hashable(kernel), _hashable(stride))
        y = numpy.empty(yshape, dtype=x_window.dtype)
        _csmall.avg_fwd(x_window.itemsize, numpy.ascontiguousarray(x_window), y, *args)
        return y
    xp = array_module(x_window)
    k, s, d, out, at = _plan(x_window.shape, kernel, stride, 1)
    y = x_window[at[0]].copy()
    for sl in at[1:]:
        y += x_window[sl]
    y /= _divisor(xp, valid, x_window.shape, k, s, d, out, y.dtype)
    return y


def avg_pool_backward(dy, x_window_shape, kernel, stride=None, valid=None):
    """Gradient w.r.t. the window of :func:`avg_pool_forward`."""
    if _avg_compiled(dy, valid):
        args, yshape = _avg_args(tuple(x_window_shape), _hashable(kernel), _hashable(stride))
        _check(dy, x_window_shape, yshape[2:])
        dx = numpy.empty(tuple(x_window_shape), dtype=dy.dtype)  # zeroed by the kernel
        _csmall.avg_bwd(dy.itemsize, numpy.ascontiguousarray(dy), dx, *args)
        return dx
    xp = array_module(dy)
    k, s, d, out, at = _plan(x_window_shape, kernel, stride, 1)
    _check(dy, x_window_shape, out)
    g = dy / _divisor(xp, valid, x_window_shape, k, s, d, out, dy.dtype)
    dx = xp.zeros(tuple(x_window_shape), dtype=dy.dtype)
    for sl in at:
        dx[sl] += g
    return dx


def _check(dy, x_window_shape, out):
    want = tuple(x_window_shape[:2]) + tuple(out)
    if tuple(dy.shape) != want:
        raise KernelShapeError(f"pool: dy has shape {tuple(dy.shape)}, expected {want} for window "
                               f"{tuple(x_window_shape)}")
