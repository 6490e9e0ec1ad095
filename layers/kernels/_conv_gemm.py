"""The GEMM path of the local convolution (NumPy / CuPy): batched im2col and one GEMM per chunk of samples.

The columns of a whole chunk of samples are gathered at once from a strided view of the window into one
``(Cg*K, nb*L)`` matrix (``L`` outputs per sample, samples side by side), so that the forward, the filter
gradient and the col2im data gradient are each a single GEMM over the chunk: ``F x Cg*K`` times
``Cg*K x nb*L`` has ``nb`` times the columns of a per-sample GEMM, which is what BLAS needs on the small
images of the classification models (7x7 to 32x32 outputs). A chunk holds as many whole samples as fit the
column budget; a sample too large for it alone is cut into blocks of output rows, one sample at a time.
The GEMM result is ``(F, nb, L)``; it is moved into NCHW order with one copy (none when ``nb == 1``).

Temporaries (columns, GEMM results) of NumPy calls come from the per-thread scratch buffers, reused from
call to call; CuPy calls allocate them from CuPy's pool.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from ._buffers import scratch as _scratch
from ._geometry import column_strides, strided, tap_view


@functools.lru_cache(maxsize=1024)
def chunks(geo, itemsize: int, budget: int) -> tuple[tuple[int, int, int, int], ...]:
    """``(n0, n1, o0, o1)``: samples ``[n0, n1)`` and output rows ``[o0, o1)`` of each GEMM. Whole samples
    while one sample's columns fit ``budget`` bytes (as many per chunk as fit), else row blocks of one
    sample. Cached: a layer asks for the same geometry every step."""
    per_sample = geo.cg * geo.ntaps * geo.out[0] * geo.rest * itemsize
    if per_sample <= budget:
        nb = max(1, min(geo.batch, budget // max(per_sample, 1)))
        return tuple((n0, min(n0 + nb, geo.batch), 0, geo.out[0]) for n0 in range(0, geo.batch, nb))
    rb = geo.rows_per_block(itemsize, budget)
    return tuple((n, n + 1, o0, min(o0 + rb, geo.out[0]))
                 for n in range(geo.batch) for o0 in range(0, geo.out[0], rb))


def _temp(xp, slot: str, shape, dtype):
    """A temporary of one call: a reused scratch buffer for NumPy, a fresh array for CuPy."""
    if xp is np:
        return _scratch(slot, shape, dtype)
    return xp.empty(shape, dtype=dtype)


def gather(xp, x_window, g: int, geo, blk):
    """Columns of block ``blk`` (:func:`chunks`) for group ``g``: a ``(Cg*K, nb*rows*rest)`` matrix whose
    column ``(n, o)`` holds every (channel, tap) input of output ``o`` of sample ``n0 + n``."""
    n0, n1, o0, o1 = blk
    cg = geo.cg
    xg = x_window[n0:n1, g * cg:(g + 1) * cg]
    if o0:  # the block's first output row reads from window row o0 * stride on
        xg = xg[:, :, o0 * geo.stride[0]:]
    shape = (cg,) + geo.kernel + (n1 - n0, o1 - o0) + geo.out[1:]
    col = _temp(xp, "gemm columns", shape, x_window.dtype)
    xp.copyto(col, strided(xp, xg, shape, column_strides(xg.strides, geo.stride, geo.dilation)))
    return col.reshape(cg * geo.ntaps, -1)


def _dy_columns(xp, dy, g: int, geo, blk):
    """``dy`` of block ``blk`` and group ``g``: the ``(Fg, nb*rows*rest)`` matrix matching :func:`gather`."""
    n0, n1, o0, o1 = blk
    fg = geo.fg
    dyg = dy[n0:n1, g * fg:(g + 1) * fg].reshape(n1 - n0, fg, -1)[:, :, o0 * geo.rest:o1 * geo.rest]
    if n1 - n0 == 1:
        return dyg[0]
    out = _temp(xp, "gemm dy", (fg, n1 - n0, dyg.shape[-1]), dy.dtype)
    xp.copyto(out, dyg.transpose(1, 0, 2))
    return out.reshape(fg, -1)


def forward(xp, x_window, w, b, geo, y, budget: int):
    """``y`` (C-contiguous, ``geo.out_shape``) = valid convolution of ``x_window`` with ``w``, plus ``b``."""
    cg, fg, dt = geo.cg, geo.fg, x_window.dtype
    w2 = xp.ascontiguousarray(w).reshape(geo.groups, fg, cg * geo.ntaps)
    bias = None if b is None else b.reshape(geo.groups, 1, fg, 1)
    yf = y.reshape(geo.batch, geo.filters, -1)
    for blk in chunks(geo, dt.itemsize, budget):
        n0, n1, o0, o1 = blk
        for g in range(geo.groups):
            col = gather(xp, x_window, g, geo, blk)
            dst = yf[n0:n1, g * fg:(g + 1) * fg, o0 * geo.rest:o1 * geo.rest]
            if n1 - n0 == 1:
                xp.matmul(w2[g], col, out=dst[0])
            else:
                res = _temp(xp, "gemm result", (fg, col.shape[1]), dt)
                xp.matmul(w2[g], col, out=res)
                xp.copyto(dst, res.reshape(fg, n1 - n0, -1).transpose(1, 0, 2))
            if bias is not None:
                dst += bias[g]
    return y


def backward_filter(xp, x_window, dy, geo, budget: int):
    """``(G, Fg, Cg*K)`` filter gradient: one ``dy_block @ cols.T`` per chunk and group."""
    dt = x_window.dtype
    dw2 = xp.empty((geo.groups, geo.fg, geo.cg * geo.ntaps), dtype=dt)
    for i, blk in enumerate(chunks(geo, dt.itemsize, budget)):
        for g in range(geo.groups):
            col = gather(xp, x_window, g, geo, blk)
            dyc = _dy_columns(xp, dy, g, geo, blk)
            if i == 0:  # the first block writes the gradient, the others add to it
                xp.matmul(dyc, col.T, out=dw2[g])
            else:
                dw2[g] += dyc @ col.T
    return dw2


def backward_data_col2im(xp, dy, w, geo, dx, budget: int):
    """Window gradient ``dx`` (zeroed here) by a GEMM ``w.T @ dy_block`` per chunk and group, scattered
    back tap by tap over the whole chunk (one strided add per kernel tap)."""
    dt = dy.dtype
    cg, fg = geo.cg, geo.fg
    dx[...] = 0
    w2t = xp.ascontiguousarray(w).reshape(geo.groups, fg, cg * geo.ntaps).transpose(0, 2, 1)
    taps = list(itertools.product(*(range(k) for k in geo.kernel)))
    for blk in chunks(geo, dt.itemsize, budget):
        n0, n1, o0, o1 = blk
        for g in range(geo.groups):
            dyc = _dy_columns(xp, dy, g, geo, blk)
            dcol = _temp(xp, "gemm columns", (cg * geo.ntaps, dyc.shape[1]), dt)
            xp.matmul(w2t[g], dyc, out=dcol)
            # (nb, Cg, *K, rows, *O[1:]) like the view below (one axis move for all taps)
            dcol = xp.moveaxis(dcol.reshape((cg,) + geo.kernel + (n1 - n0, o1 - o0) + geo.out[1:]),
                               1 + len(geo.kernel), 0)
            view = tap_view(xp, dx[n0:n1, g * cg:(g + 1) * cg], geo.kernel, geo.out, geo.stride,
                            geo.dilation)  # (nb, Cg, *K, *O), aliasing dx
            for tap in taps:
                idx = (slice(None), slice(None)) + tap
                view[idx + (slice(o0, o1),)] += dcol[idx]
    return dx
