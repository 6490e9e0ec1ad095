"""Local N-d convolution (2-D ``(N, C, H, W)`` and 3-D ``(N, C, D, H, W)``) on an already padded window.

The distributed layer hands these kernels the halo-exchanged window of its block, zero padding included, so
every kernel here is a *valid* cross-correlation (PyTorch's ``conv2d``/``conv3d`` semantics, Dryden et al.
Eqs. 1-3)::

    y[n, f, o]  = b[f] + sum_{c, j} w[f, c, j] * x[n, g(f)*Cg + c, o*stride + j*dilation]
    dw[f, c, j] = sum_{n, o} dy[n, f, o] * x[n, g(f)*Cg + c, o*stride + j*dilation]
    dx[n, c, i] = sum_{f, j, o : o*stride + j*dilation = i} dy[n, f, o] * w[f, c - g*Cg, j]

with ``o``, ``j``, ``i`` multi-indices over the spatial dimensions and ``w`` in PyTorch's layout
``(F, C/groups, *kernel)``; ``groups = C // w.shape[1]``.

Implementation: per sample and group, the outputs are taken in blocks of rows of the first spatial
dimension; each block's columns (``Cg*prod(kernel)`` x ``rows*rest``) are gathered from a strided view of
the window into a reused buffer, and a single GEMM (``F x Cg*K`` times ``Cg*K x P``) produces the block's
outputs directly in NCHW order. The filter gradient is the same gather followed by ``dy_block @ cols.T``.
The data gradient is itself a stride-1 convolution (per phase of the stride) with the flipped filter, so it
runs on the same path. Nothing is transposed to another layout; the caller's arrays stay NCHW. The array
module (NumPy or CuPy) is taken from the arguments.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lbannpy.backend import array_module, is_gpu_array

from ._geometry import KernelShapeError, per_dim, tap_view, valid_output_shape

# bytes of gathered columns per GEMM on the CPU: skinny GEMMs (F = 16) need >= ~4096 columns to reach
# OpenBLAS's speed, and the buffer (reused for every block) stays in the L3
CPU_COLUMN_BYTES = 8 * 1024 * 1024
# the data gradient is a flipped convolution (gathering F*K rows per column) while F <= this x C, and a GEMM
# plus col2im scatter (C*K rows) beyond: measured at C = 18, F = 16 / 32 / 64 on one core
GATHER_DATA_GRAD_MAX_RATIO = 1.25
# on a GPU, larger blocks amortise kernel launches; memory, not cache, bounds them
GPU_COLUMN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one local convolution (all derived from the window and filter shapes)."""

    batch: int
    channels: int
    filters: int
    groups: int
    window: tuple[int, ...]
    kernel: tuple[int, ...]
    out: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]

    @classmethod
    def make(cls, x_shape, w_shape, stride, dilation) -> "ConvGeometry":
        x_shape, w_shape = tuple(x_shape), tuple(w_shape)
        if len(x_shape) not in (3, 4, 5) or len(w_shape) != len(x_shape):
            raise KernelShapeError(
                f"conv: window {x_shape} and filter {w_shape} must both be (N, C, *spatial) / "
                f"(F, C/groups, *kernel) with 1 to 3 spatial dimensions")
        nsp = len(x_shape) - 2
        n, c = x_shape[:2]
        f, cg = w_shape[:2]
        if cg < 1 or c % cg:
            raise KernelShapeError(
                f"conv: window has {c} channels but the filter {w_shape} expects a multiple of {cg} "
                f"(C/groups); pass a filter shaped (F, C/groups, *kernel)")
        groups = c // cg
        if f % groups:
            raise KernelShapeError(f"conv: {f} filters cannot be split into {groups} groups")
        kernel = tuple(w_shape[2:])
        s = per_dim(stride, nsp, "stride")
        d = per_dim(dilation, nsp, "dilation")
        out = valid_output_shape(x_shape[2:], kernel, s, d, "conv window")
        return cls(n, c, f, groups, tuple(x_shape[2:]), kernel, out, s, d)

    @property
    def cg(self) -> int:
        return self.channels // self.groups

    @property
    def fg(self) -> int:
        return self.filters // self.groups

    @property
    def ntaps(self) -> int:
        return math.prod(self.kernel)

    @property
    def rest(self) -> int:
        """Outputs per row of the first spatial dimension."""
        return math.prod(self.out[1:])

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.filters) + self.out

    def rows_per_block(self, itemsize: int, budget: int) -> int:
        per_row = self.cg * self.ntaps * self.rest * itemsize
        return max(1, min(self.out[0], budget // max(per_row, 1)))

    def blocks(self, itemsize: int, budget: int):
        rb = self.rows_per_block(itemsize, budget)
        for o0 in range(0, self.out[0], rb):
            yield o0, min(o0 + rb, self.out[0])


def _budget(arr) -> int:
    return GPU_COLUMN_BYTES if is_gpu_array(arr) else CPU_COLUMN_BYTES


def _check_dtypes(*arrays):
    dt = arrays[0].dtype
    for a in arrays[1:]:
        if a is not None and a.dtype != dt:
            got = [str(a.dtype) for a in arrays if a is not None]
            raise KernelShapeError(f"conv: all arrays must share one dtype, got {got}")
    return dt


def _block_index(nsp: int, o0: int, o1: int) -> tuple:
    """Index of output rows ``[o0, o1)`` in a tap view ``(Cg, *kernel, *out)``."""
    return (slice(None),) * (1 + nsp) + (slice(o0, o1),)


def _view(xp, arr, geo: ConvGeometry):
    return tap_view(xp, arr, geo.kernel, geo.out, geo.stride, geo.dilation)


def _gather(xp, view, geo: ConvGeometry, o0: int, o1: int, buf):
    """Columns of output rows ``[o0, o1)``: a ``(Cg*K, rows*rest)`` matrix in ``buf``."""
    nsp = len(geo.kernel)
    p = (o1 - o0) * geo.rest
    col = buf[:geo.cg * geo.ntaps * p].reshape((geo.cg,) + geo.kernel + (o1 - o0,) + geo.out[1:])
    xp.copyto(col, view[_block_index(nsp, o0, o1)])
    return col.reshape(geo.cg * geo.ntaps, p)


def conv_forward(x_window, w, b=None, stride=1, dilation=1):
    """Valid convolution of a padded window: ``(N, C, *S)`` with ``(F, C/groups, *K)`` -> ``(N, F, *O)``,
    ``O = (S - dilation*(K-1) - 1) // stride + 1``; ``b`` is ``(F,)`` or ``None``."""
    xp = array_module(x_window)
    dt = _check_dtypes(x_window, w, b)
    geo = ConvGeometry.make(x_window.shape, w.shape, stride, dilation)
    cg, fg, budget = geo.cg, geo.fg, _budget(x_window)
    y = xp.empty(geo.out_shape, dtype=dt)
    w2 = xp.ascontiguousarray(w).reshape(geo.groups, fg, cg * geo.ntaps)
    bias = None if b is None else b.reshape(geo.groups, fg, 1)
    buf = xp.empty(cg * geo.ntaps * geo.rows_per_block(dt.itemsize, budget) * geo.rest, dtype=dt)
    for n in range(geo.batch):
        for g in range(geo.groups):
            view = _view(xp, x_window[n, g * cg:(g + 1) * cg], geo)
            yg = y[n, g * fg:(g + 1) * fg].reshape(fg, -1)
            for o0, o1 in geo.blocks(dt.itemsize, budget):
                col = _gather(xp, view, geo, o0, o1, buf)
                out = yg[:, o0 * geo.rest:o1 * geo.rest]
                xp.matmul(w2[g], col, out=out)
                if bias is not None:
                    out += bias[g]
    return y


def conv_backward_filter(x_window, dy, w_shape, stride=1, dilation=1):
    """Gradient w.r.t. the filter, shape ``w_shape`` (``(F, C/groups, *K)``), from the window and ``dy``."""
    xp = array_module(x_window)
    dt = _check_dtypes(x_window, dy)
    geo = ConvGeometry.make(x_window.shape, w_shape, stride, dilation)
    _check_dy(dy, geo)
    cg, fg, budget = geo.cg, geo.fg, _budget(x_window)
    dw2 = xp.zeros((geo.groups, fg, cg * geo.ntaps), dtype=dt)
    buf = xp.empty(cg * geo.ntaps * geo.rows_per_block(dt.itemsize, budget) * geo.rest, dtype=dt)
    for n in range(geo.batch):
        for g in range(geo.groups):
            view = _view(xp, x_window[n, g * cg:(g + 1) * cg], geo)
            dyg = dy[n, g * fg:(g + 1) * fg].reshape(fg, -1)
            for o0, o1 in geo.blocks(dt.itemsize, budget):
                col = _gather(xp, view, geo, o0, o1, buf)
                dw2[g] += dyg[:, o0 * geo.rest:o1 * geo.rest] @ col.T
    return dw2.reshape(tuple(w_shape))


def conv_backward_data(dy, w, x_window_shape, stride=1, dilation=1):
    """Gradient w.r.t. the window (shape ``x_window_shape``, padding and halo included): the caller
    halo-accumulates it, or crops the padding (:func:`crop_spatial`) on a single rank.

    With stride 1 this is a valid convolution of ``dy`` zero-padded by ``dilation*(kernel-1)`` with the
    flipped, transposed filter; with stride ``s`` and dilation 1 each of the ``s**nsp`` phases of the window
    (``dx[..., a::s]``) is such a stride-1 convolution with the sub-filter ``w[..., a::s]``. Both run on the
    forward kernel's GEMM path. Other combinations (stride and dilation both > 1) use a GEMM followed by
    a scatter-add (col2im), as do filters with many more outputs than inputs (F > 1.25 C), where gathering
    ``dy``'s columns would cost more than scattering the window's.
    """
    dt = _check_dtypes(dy, w)
    geo = ConvGeometry.make(x_window_shape, w.shape, stride, dilation)
    _check_dy(dy, geo)
    if geo.fg > GATHER_DATA_GRAD_MAX_RATIO * geo.cg:
        # the flipped convolution would gather F*K rows per column, col2im scatters only C*K
        return _backward_data_col2im(dy, w, geo)
    if all(s == 1 for s in geo.stride):
        return _backward_data_phase(dy, w, geo, (0,) * len(geo.kernel), tuple(geo.window))
    if all(d == 1 for d in geo.dilation):
        xp = array_module(dy)
        dx = xp.zeros(tuple(x_window_shape), dtype=dt)
        for phase in itertools.product(*(range(s) for s in geo.stride)):
            # window positions a, a+s, a+2s, ... of each dimension
            extent = tuple(-(-(n - a) // s) for n, a, s in zip(geo.window, phase, geo.stride))
            if any(a >= k for a, k in zip(phase, geo.kernel)) or 0 in extent:
                continue  # no tap reaches these positions: their gradient is zero
            sl = (slice(None), slice(None)) + tuple(slice(a, None, s) for a, s in zip(phase, geo.stride))
            dx[sl] = _backward_data_phase(dy, w, geo, phase, extent)
        return dx
    return _backward_data_col2im(dy, w, geo)


def _backward_data_phase(dy, w, geo: ConvGeometry, phase, extent):
    """``dx[..., phase::stride]`` (spatial ``extent``) as a stride-1 valid convolution of padded ``dy``."""
    nsp = len(geo.kernel)
    sub = w[(slice(None), slice(None)) + tuple(slice(a, None, s) for a, s in zip(phase, geo.stride))]
    taps = sub.shape[2:]
    # (F, Cg, *k) per group -> (C, Fg, *k) flipped: output channels of the adjoint are the input channels
    wt = sub.reshape((geo.groups, geo.fg, geo.cg) + taps).swapaxes(1, 2)
    wt = wt[(slice(None),) * 3 + (slice(None, None, -1),) * nsp].reshape((geo.channels, geo.fg) + taps)
    pads = []
    for t, d, m, o in zip(taps, geo.dilation, extent, geo.out):
        lo = d * (t - 1)
        pads.append((lo, m + d * (t - 1) - o - lo))
    return conv_forward(pad_spatial(dy, pads), array_module(dy).ascontiguousarray(wt), None, 1, geo.dilation)


def _backward_data_col2im(dy, w, geo: ConvGeometry):
    xp = array_module(dy)
    dt = dy.dtype
    cg, fg, budget = geo.cg, geo.fg, _budget(dy)
    dx = xp.zeros((geo.batch, geo.channels) + geo.window, dtype=dt)
    w2t = xp.ascontiguousarray(w).reshape(geo.groups, fg, cg * geo.ntaps).transpose(0, 2, 1)
    rb = geo.rows_per_block(dt.itemsize, budget)
    buf = xp.empty(cg * geo.ntaps * rb * geo.rest, dtype=dt)
    taps = list(itertools.product(*(range(k) for k in geo.kernel)))
    for n in range(geo.batch):
        for g in range(geo.groups):
            view = _view(xp, dx[n, g * cg:(g + 1) * cg], geo)
            dyg = dy[n, g * fg:(g + 1) * fg].reshape(fg, -1)
            for o0, o1 in geo.blocks(dt.itemsize, budget):
                p = (o1 - o0) * geo.rest
                dcol = buf[:cg * geo.ntaps * p].reshape(cg * geo.ntaps, p)
                xp.matmul(w2t[g], dyg[:, o0 * geo.rest:o1 * geo.rest], out=dcol)
                dcol = dcol.reshape((cg,) + geo.kernel + (o1 - o0,) + geo.out[1:])
                for tap in taps:
                    idx = (slice(None),) + tap + (slice(o0, o1),)
                    view[idx] += dcol[(slice(None),) + tap]
    return dx


def conv_backward_bias(dy):
    """Gradient w.r.t. the bias: ``dy`` summed over every dimension but the filter dimension (1)."""
    axes = (0,) + tuple(range(2, dy.ndim))
    return dy.sum(axis=axes)


def _check_dy(dy, geo: ConvGeometry):
    if tuple(dy.shape) != geo.out_shape:
        raise KernelShapeError(
            f"conv: dy has shape {tuple(dy.shape)} but a window {(geo.batch, geo.channels) + geo.window} "
            f"with kernel {geo.kernel}, stride {geo.stride}, dilation {geo.dilation} gives {geo.out_shape}")


# --------------------------------------------------------------------------------------------------------
# explicit padding, for single-rank use and tests


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


def pad_spatial(x, pads, value=0.0):
    """``x`` (``(N, C, *spatial)``) padded by ``pads`` — an int, or one int or ``(lo, hi)`` per spatial
    dimension — filled with ``value`` (0 for convolution, ``-inf`` for max pooling)."""
    xp = array_module(x)
    pp = _pads(pads, x.ndim - 2)
    shape = tuple(x.shape[:2]) + tuple(n + lo + hi for n, (lo, hi) in zip(x.shape[2:], pp))
    out = xp.full(shape, value, dtype=x.dtype)
    out[(slice(None), slice(None)) + tuple(slice(lo, lo + n) for n, (lo, _) in zip(x.shape[2:], pp))] = x
    return out


def crop_spatial(x_window, pads):
    """The interior of a padded window (a view): the adjoint of :func:`pad_spatial` for gradients."""
    pp = _pads(pads, x_window.ndim - 2)
    return x_window[(slice(None), slice(None))
                    + tuple(slice(lo, n - hi) for n, (lo, hi) in zip(x_window.shape[2:], pp))]
