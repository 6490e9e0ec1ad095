"""Small convolutions: each pass (forward, data gradient, filter gradient) one compiled call over the arrays
as they are, with the zero padding applied inside the kernel (see ``_csmall.c``).

At a few thousand multiply-adds (a 4x4 layer of 4 channels, the deep layers of a small network at batch 1)
the arithmetic is cheap and the GEMM path's fixed cost (gathering columns, a GEMM, moving the result, a
dozen NumPy calls per pass) is the whole time. Here a pass is one call and, since
the kernel pads, a layer with nothing to exchange hands over its input block and gets its input gradient
back: no padded window is built, kept or cropped (:attr:`lbannpy.layers.conv.Conv.kernel_pads`).

``geo`` is the :class:`~.conv.ConvGeometry` of the padded window; ``pads`` the padding of each spatial
dimension on both sides (``None``: none). Arrays are NumPy float32/float64; inputs are made C-contiguous
(a copy only where they are not), outputs are written C-contiguous.
"""
from __future__ import annotations

import functools
import math

import numpy as np

try:  # built by setup.py where a C compiler is present
    from . import _csmall
except ImportError:  # pragma: no cover - depends on the install
    _csmall = None

# A pass of at most this many multiply-adds runs here (else on the GEMM / direct path): below it the
# window path's fixed cost dominates; above it this kernel's short rows do not vectorise and lose
MAX_MACS = 1 << 15


@functools.lru_cache(maxsize=1024)
def macs(geo) -> int:
    """Multiply-adds of one pass of the convolution ``geo``."""
    return geo.batch * geo.filters * geo.cg * geo.ntaps * math.prod(geo.out)


def fits(geo) -> bool:
    """Whether ``geo`` is small enough for this path (and the extension is built)."""
    return _csmall is not None and macs(geo) <= MAX_MACS


@functools.lru_cache(maxsize=1024)
def _args(geo, pads) -> tuple[int, ...]:
    """The kernels' geometry arguments ``(n, c, f, groups, s[3], k[3], o[3], t[3], d[3], p[3])``: spatial
    dimensions padded to three with leading ones; ``s`` the input's (the window's less its padding)."""
    lead = 3 - len(geo.kernel)
    pads = pads or (0,) * len(geo.kernel)
    s = tuple(n - 2 * p for n, p in zip(geo.window, pads))

    def three(v, fill=1):
        return (fill,) * lead + tuple(v)
    return ((geo.batch, geo.channels, geo.filters, geo.groups) + three(s) + three(geo.kernel) + three(geo.out)
            + three(geo.stride) + three(geo.dilation) + three(pads, 0))


def _c(a):
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _into(out, shape, dtype):
    """Where a kernel writes: ``out`` when it is C-contiguous, else a fresh array copied into ``out``."""
    if out is not None and out.flags.c_contiguous:
        return out
    return np.empty(shape, dtype=dtype)


def _done(res, out):
    if out is None or res is out:
        return res
    out[...] = res
    return out


def forward(x, w, b, geo, pads, out=None):
    """``(N, F, *O)`` convolution of the input block ``x`` (``geo.window`` less ``pads``) with ``w`` plus
    ``b``."""
    y = _into(out, geo.out_shape, x.dtype)
    _csmall.fwd(x.itemsize, _c(x), _c(w), None if b is None else _c(b), y, *_args(geo, pads))
    return _done(y, out)


def backward_data(dy, w, geo, pads, out=None):
    """Gradient w.r.t. the input block (the window less ``pads``), zero-filled and accumulated here."""
    shape = tuple(_args(geo, pads)[:2]) + tuple(n - 2 * p for n, p in zip(geo.window, pads or (0,) * 3))
    dx = _into(out, shape, dy.dtype)
    _csmall.dgrad(dy.itemsize, _c(dy), _c(w), None, dx, *_args(geo, pads))
    return _done(dx, out)


def backward_filter(x, dy, geo, pads, w_shape):
    """Gradient w.r.t. the filter, of shape ``w_shape``."""
    dw = np.empty(tuple(w_shape), dtype=x.dtype)
    _csmall.wgrad(x.itemsize, _c(x), _c(dy), None, dw, *_args(geo, pads))
    return dw


class Plan:
    """The three passes of one small convolution with every argument worked out once: what a layer with
    nothing to exchange calls each step (:meth:`lbannpy.layers.conv.Conv.fp_compute`). The same compiled
    calls as :func:`forward`, :func:`backward_data` and :func:`backward_filter`, without their per-call
    geometry lookups and checks (the extension still checks every buffer's size, item size and
    contiguity); the filter gradient pass also sums the bias gradient. Arrays that are not what the plan
    was made for (:meth:`takes`) go through the general kernels."""

    __slots__ = ("x_shape", "w_shape", "y_shape", "dtype", "_isz", "_args")

    def __init__(self, geo, pads, x_shape: tuple, dtype):
        self.x_shape, self.dtype = tuple(x_shape), np.dtype(dtype)
        self.w_shape = (geo.filters, geo.cg) + tuple(geo.kernel)
        self.y_shape = geo.out_shape
        self._isz = self.dtype.itemsize
        self._args = _args(geo, pads)

    def takes(self, x) -> bool:
        """Whether ``x`` is the NumPy input block this plan is for."""
        return type(x) is np.ndarray and x.shape == self.x_shape and x.dtype == self.dtype

    def forward(self, x, w, b):
        y = np.empty(self.y_shape, dtype=self.dtype)
        _csmall.fwd(self._isz, _c(x), _c(w), None if b is None else _c(b), y, *self._args)
        return y

    def backward_data(self, dy, w):
        dx = np.empty(self.x_shape, dtype=self.dtype)
        _csmall.dgrad(self._isz, _c(dy), _c(w), None, dx, *self._args)
        return dx

    def backward_params(self, x, dy, bias: bool, dw=None, db=None):
        """``(dw, db or None)``, written into ``dw`` / ``db`` where given (C-contiguous, of their shapes)."""
        dw = np.empty(self.w_shape, dtype=self.dtype) if dw is None else dw
        db = (np.empty(self.y_shape[1], dtype=self.dtype) if db is None else db) if bias else None
        _csmall.wgrad(self._isz, _c(x), _c(dy), db, dw, *self._args)
        return dw, db
