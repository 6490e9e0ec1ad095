"""Explicit padding of a window's spatial dimensions, and its adjoint (the crop of a window gradient): for
single-rank use, kernels and tests; the distributed layers pad through their halo plans."""
from __future__ import annotations

import functools

import numpy as np

from lbannpy.backend import array_module

from ._buffers import scratch as _scratch
from ._geometry import KernelShapeError


def _pads(pads, nsp: int) -> tuple[tuple[int, int], ...]:
    if isinstance(pads, int):
        out = ((pads, pads),) * nsp
    else:
        pads = list(pads)
        if len(pads) != nsp:
            raise KernelShapeError(f"padding {pads}: need one (lo, hi) pair per spatial dimension ({nsp})")
        out = tuple((p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in pads)
    if any(lo < 0 or hi < 0 for lo, hi in out):
        raise KernelShapeError(f"padding must be >= 0, got {out}")
    return out


@functools.lru_cache(maxsize=1024)
def _pad_plan(shape: tuple, pads) -> tuple:
    """``(padded shape, border slices, interior slices)`` of padding an array of ``shape`` by ``pads``:
    worked out once per shape (a layer pads the same shapes every step)."""
    pp = _pads(pads, len(shape) - 2)
    padded = tuple(shape[:2]) + tuple(n + lo + hi for n, (lo, hi) in zip(shape[2:], pp))
    borders = []
    for d, (n, (lo, hi)) in enumerate(zip(shape[2:], pp)):
        before = (slice(None),) * (2 + d)
        borders += [before + (slice(0, lo),)] * (lo > 0) + [before + (slice(lo + n, None),)] * (hi > 0)
    inner = (slice(None), slice(None)) + tuple(slice(lo, lo + n) for n, (lo, _) in zip(shape[2:], pp))
    return padded, tuple(borders), inner


def _hashable(pads):
    """``pads`` as a key of :func:`_pad_plan` (lists become tuples)."""
    try:
        hash(pads)
        return pads
    except TypeError:
        return tuple(p if isinstance(p, int) else tuple(p) for p in pads)


def padded_shape(shape, pads) -> tuple[int, ...]:
    """The shape of an array of ``shape`` padded by ``pads`` (as :func:`pad_spatial`)."""
    return _pad_plan(tuple(shape), _hashable(pads))[0]


def pad_spatial(x, pads, value=0.0, out=None):
    """``x`` (``(N, C, *spatial)``) padded by ``pads`` — an int, or one int or ``(lo, hi)`` per spatial
    dimension — filled with ``value`` (0 for convolution, ``-inf`` for max pooling); written into ``out``
    (of the padded shape) when given."""
    shape, borders, inner = _pad_plan(tuple(x.shape), _hashable(pads))
    if out is None:
        out = array_module(x).empty(shape, dtype=x.dtype)
    elif tuple(out.shape) != shape:
        raise KernelShapeError(f"pad_spatial: out has shape {tuple(out.shape)}, the padded shape is {shape}")
    # fill only the borders, so that every element is written once
    for sl in borders:
        out[sl] = value
    out[inner] = x
    return out


def crop_spatial(x_window, pads):
    """The interior of a padded window (a view): the adjoint of :func:`pad_spatial` for gradients."""
    pp = _pads(pads, x_window.ndim - 2)
    return x_window[(slice(None), slice(None))
                    + tuple(slice(lo, n - hi) for n, (lo, hi) in zip(x_window.shape[2:], pp))]


def symmetric_pads(padding, nsp: int) -> tuple[int, ...] | None:
    """``padding`` (an int or one per spatial dimension) as a tuple; ``None`` where it is all zero."""
    return _symmetric(tuple(padding) if isinstance(padding, list) else padding, nsp)


@functools.lru_cache(maxsize=256)
def _symmetric(padding, nsp: int) -> tuple[int, ...] | None:
    p = (int(padding),) * nsp if isinstance(padding, int) else tuple(int(v) for v in padding)
    if len(p) != nsp or min(p) < 0:
        raise KernelShapeError(f"padding {padding!r}: one value >= 0 per spatial dimension ({nsp})")
    return p if any(p) else None


def pad_into_scratch(x, pads, slot: str):
    """``x`` zero-padded by ``pads`` on both sides: in a reused scratch buffer for NumPy arrays."""
    if not isinstance(x, np.ndarray):
        return pad_spatial(x, pads)
    return pad_spatial(x, pads, out=_scratch(slot, padded_shape(x.shape, pads), x.dtype))
