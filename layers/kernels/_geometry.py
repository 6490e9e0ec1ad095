"""Shared geometry of the windowed kernels (conv, pooling): output sizes, per-dimension parameters and
strided views of a window that expose one kernel tap at a time without copying."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np


class KernelShapeError(ValueError):
    """Shapes or parameters a kernel cannot work with. The message names the shapes and the fix."""


def per_dim(value, nsp: int, name: str) -> tuple[int, ...]:
    """An int or a sequence of ``nsp`` ints -> a tuple of ``nsp`` ints (each >= 1)."""
    if isinstance(value, (int,)) or hasattr(value, "__index__"):
        out = (int(value),) * nsp
    else:
        out = tuple(int(v) for v in value)
        if len(out) != nsp:
            raise KernelShapeError(f"{name} {tuple(value)}: need one entry per spatial dimension ({nsp})")
    if any(v < 1 for v in out):
        raise KernelShapeError(f"{name} must be >= 1 in every dimension, got {out}")
    return out


def valid_output_shape(window: Sequence[int], kernel: Sequence[int], stride: Sequence[int],
                       dilation: Sequence[int], what: str = "window") -> tuple[int, ...]:
    """Output extents of a 'valid' stencil over ``window`` (all spatial)."""
    out = []
    for n, k, s, d in zip(window, kernel, stride, dilation):
        reach = d * (k - 1) + 1
        if n < reach:
            raise KernelShapeError(
                f"{what} spatial shape {tuple(window)} is smaller than the kernel's reach "
                f"(kernel {tuple(kernel)}, dilation {tuple(dilation)}); pad it or use a smaller kernel")
        out.append((n - reach) // s + 1)
    return tuple(out)


def tap_view(xp, arr, kernel, out_shape, stride, dilation):
    """A read/write view of ``arr`` (``(..., *spatial)``) shaped ``(..., *kernel, *out_shape)``.

    Element ``[..., j..., o...]`` is ``arr[..., o*stride + j*dilation]``: the input each output reads
    through tap ``j``. No copy; the view aliases ``arr`` (distinct taps overlap in memory, so write through
    one tap at a time).
    """
    nsp = len(kernel)
    lead = arr.shape[:arr.ndim - nsp]
    sp_strides = arr.strides[arr.ndim - nsp:]
    shape = tuple(lead) + tuple(kernel) + tuple(out_shape)
    strides = (tuple(arr.strides[:arr.ndim - nsp]) + tuple(d * st for d, st in zip(dilation, sp_strides))
               + tuple(s * st for s, st in zip(stride, sp_strides)))
    return strided(xp, arr, shape, strides)


@functools.lru_cache(maxsize=1024)
def column_strides(x_strides, stride, dilation) -> tuple[int, ...]:
    """Byte strides of the columns view of an ``(N, C, *S)`` window with strides ``x_strides``: shaped
    ``(C, *kernel, N, *out)``, element ``[c, j..., n, o...]`` is ``x[n, c, o*stride + j*dilation]`` (the
    layout the GEMM path gathers its columns in)."""
    sp = x_strides[2:]
    return ((x_strides[1],) + tuple(d * st for d, st in zip(dilation, sp)) + (x_strides[0],)
            + tuple(s * st for s, st in zip(stride, sp)))


def strided(xp, arr, shape, strides):
    """``as_strided(arr, shape, strides)``: a view of ``arr``'s memory. A C-contiguous NumPy array takes
    ``numpy.ndarray`` on its buffer, about 7x cheaper per call than NumPy's ``as_strided`` (which
    matters for the small arrays of a layer's every step); the buffer bounds are checked either way."""
    if xp is np and arr.flags.c_contiguous:
        return np.ndarray(shape, arr.dtype, arr, 0, strides)
    return xp.lib.stride_tricks.as_strided(arr, shape=shape, strides=strides)


def tap_slices(tap: Sequence[int], out_shape: Sequence[int], stride: Sequence[int],
               dilation: Sequence[int]) -> tuple[slice, ...]:
    """Spatial slices of a window that tap ``tap`` reads for every output (basic strided slices)."""
    return tuple(slice(j * d, j * d + s * (o - 1) + 1, s)
                 for j, o, s, d in zip(tap, out_shape, stride, dilation))


def ntaps(kernel: Sequence[int]) -> int:
    return math.prod(kernel)
