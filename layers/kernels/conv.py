"""Local N-d convolution (2-D ``(N, C, H, W)`` and 3-D ``(N, C, D, H, W)``) on an already padded window.

The distributed layer hands these kernels the halo-exchanged window of its block, zero padding included, so
every kernel here is a *valid* cross-correlation (PyTorch's ``conv2d``/``conv3d`` semantics, Dryden et al.
Eqs. 1-3)::

    y[n, f, o]  = b[f] + sum_{c, j} w[f, c, j] * x[n, g(f)*Cg + c, o*stride + j*dilation]
    dw[f, c, j] = sum_{n, o} dy[n, f, o] * x[n, g(f)*Cg + c, o*stride + j*dilation]
    dx[n, c, i] = sum_{f, j, o : o*stride + j*dilation = i} dy[n, f, o] * w[f, c - g*Cg, j]

with ``o``, ``j``, ``i`` multi-indices over the spatial dimensions and ``w`` in PyTorch's layout
``(F, C/groups, *kernel)``; ``groups = C // w.shape[1]``.

Two implementations, same semantics; nothing is transposed to another layout, the arrays stay NCHW.

Compiled path (NumPy float32/float64 arrays, when the ``_cconv`` extension is built; ``set_compiled(False)``
turns it off for a benchmark of the NumPy path): a direct convolution in which every (channel, tap) pair is a
plain shifted read of the window, ``x[off[t] + h*row_pitch + w*col_stride]`` -- dilation and row strides
live in the offsets and the row pitch, a column stride of 2 is two vector loads and a permutation, larger
column strides read a copy split into stride phases. Per output row, 2 vectors of outputs (32 float32)
times up to 12 filters accumulate in registers over all taps (64-byte GCC vectors; AVX-512, AVX2 and
baseline builds picked at load time). The filter gradient accumulates 4 filters x 6 taps of vector partial
sums over tiles of about 512 outputs. The data gradient is a stride-1 convolution of ``dy``, zero-padded
once into a reused buffer, with the flipped, channel-transposed filter; with strides, one such convolution
per stride phase of the window with the matching sub-filter (column stride 2: both column phases in one
call, written interleaved; otherwise into a phase array merged into ``dx`` afterwards). Stride and
dilation both > 1 take the NumPy col2im path below.

Small path (NumPy float32/float64, at most ``_conv_small.MAX_MACS`` multiply-adds per pass): one compiled
call per pass, padding applied inside, so an unsplit layer needs no window (``_conv_small.py``).

NumPy / CuPy path (the array module is taken from the arguments; see _conv_gemm.py): the columns of a
chunk of samples (``Cg*prod(kernel)`` x ``samples*outputs``, as many whole samples as fit a column budget,
row blocks of one sample where a single sample does not) are gathered at once from a strided view of the
window, and one GEMM per chunk and group (``F x Cg*K`` times ``Cg*K x nb*L``) produces the chunk's outputs,
moved into NCHW order with one copy. The filter gradient is the same gather followed by
``dy_chunk @ cols.T``. The data gradient is the flipped convolution above on the same path, or a GEMM
``w.T @ dy_chunk`` plus a col2im scatter (one strided add per tap over the chunk) when F > 1.25 C, from 64
channels per group on, or when stride and dilation are both > 1.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from lbannpy.backend import array_module, is_gpu_array

from . import _conv_gemm as _gemm
from . import _conv_one as _one
from . import _conv_small as _small
from ._buffers import addr as _addr
from ._buffers import scratch as _scratch  # per-thread temporaries of the compiled path
from ._conv_geometry import ConvGeometry, geometry, padded_geometry
from ._geometry import KernelShapeError
from .padding import crop_spatial, pad_into_scratch, padded_shape

# bytes of gathered columns per GEMM on the CPU: skinny GEMMs (F = 16) need >= ~4096 columns to reach
# OpenBLAS's speed, and the buffer (reused for every block) stays in the L3
CPU_COLUMN_BYTES = 8 * 1024 * 1024
# the data gradient is a flipped convolution (gathering F*K rows per column) while F <= this x C, and a GEMM
# plus col2im scatter (C*K rows) beyond, whichever gathers fewer rows
GATHER_DATA_GRAD_MAX_RATIO = 1.25
# ... and from this many input channels per group on, unless F < C / 1.25 (a few filters: the flipped
# convolution gathers only F*K rows): the flipped convolution runs over the whole window (padding included:
# 10x10 for the 8x8 outputs of a deep layer), col2im's GEMM over the outputs only, and its per-tap scatter
# is cheap next to a GEMM of >= 64*K rows
COL2IM_MIN_CHANNELS = 64
# on a GPU, larger blocks amortise kernel launches; memory, not cache, bounds them
GPU_COLUMN_BYTES = 64 * 1024 * 1024

try:  # the compiled kernels (built by setup.py where a C compiler is present)
    from . import _cconv
except ImportError:  # pragma: no cover - depends on the install
    _cconv = None
# NumPy arrays of float32/float64 go through the compiled kernels when they are built; tests switch this
# flag to check both paths against PyTorch, `bench layers --conv-kernel numpy` through set_compiled
USE_COMPILED = _cconv is not None


def set_compiled(on: bool) -> None:
    """Whether NumPy convolutions take the compiled kernels (where built) or im2col + GEMM: a benchmark's
    switch (``bench layers --conv-kernel numpy``), never a run's; both compute the same convolutions."""
    global USE_COMPILED
    USE_COMPILED = bool(on) and _cconv is not None


def _budget(arr) -> int:
    return GPU_COLUMN_BYTES if is_gpu_array(arr) else CPU_COLUMN_BYTES


def _check_dtypes(*arrays):
    dt = arrays[0].dtype
    for a in arrays[1:]:
        if a is not None and a.dtype != dt:
            got = [str(a.dtype) for a in arrays if a is not None]
            raise KernelShapeError(f"conv: all arrays must share one dtype, got {got}")
    return dt


# --------------------------------------------------------------------------------------------------------
# compiled path (NumPy arrays): direct convolution over shifted taps, see _cconv.c


# Where the direct kernel beats the NumPy GEMM path (forward + both gradients; `bench layers` times both):
# up to 64 input channels per group on rows of at least 48 outputs. On narrower rows its 32-output vector
# blocks run mostly as remainders, and with many channels OpenBLAS's GEMM is the faster one.
COMPILED_MAX_CHANNELS = 64
COMPILED_MIN_ROW = 48
# ... and only with AVX-512: the direct kernel's register blocks are sized for 32 vector registers of 64
# bytes. Without it (AVX2, the x86-64 baseline, other CPUs) they spill and the GEMM path is the faster one
DIRECT_FAST = _cconv is not None and bool(_cconv.wide_vectors())


def _compiled(*arrays, channels: int = 0, row: int = COMPILED_MIN_ROW) -> bool:
    """Whether these arrays take the compiled kernels: built, enabled, running with AVX-512, NumPy, float32
    or float64, and a convolution of ``channels`` input channels per group producing rows of ``row``
    outputs, where the direct kernel is the faster one."""
    return (DIRECT_FAST and channels <= COMPILED_MAX_CHANNELS and row >= COMPILED_MIN_ROW
            and _cconv is not None and USE_COMPILED and arrays[0].dtype in (np.float32, np.float64)
            and all(isinstance(a, np.ndarray) for a in arrays if a is not None))


def cpu_path() -> str:
    """Which kernels NumPy convolutions take here, in words (for benchmark headers)."""
    if _cconv is None:
        return "NumPy im2col + GEMM (_cconv not built)"
    if not USE_COMPILED:
        return "NumPy im2col + GEMM (compiled kernels switched off)"
    if not DIRECT_FAST:
        return "NumPy im2col + GEMM (the compiled direct kernel needs AVX-512, which this CPU lacks)"
    return (f"compiled direct convolution (_cconv, AVX-512) up to {COMPILED_MAX_CHANNELS} channels on rows "
            f"of {COMPILED_MIN_ROW}+ outputs, else NumPy im2col + GEMM")


def _elem_strides(a) -> tuple[int, ...] | None:
    st = tuple(s // a.itemsize for s in a.strides)
    return st if all(s * a.itemsize == b for s, b in zip(st, a.strides)) else None


def _split_columns(geo: ConvGeometry) -> bool:
    """Whether the compiled kernels read a phase-split copy: they stride rows freely and columns by 1 or 2."""
    return geo.stride[-1] > 2


def _tap_input(xg, geo: ConvGeometry):
    """``xg`` (``(Cg, *S)``) in a layout where every tap is a shifted read: ``xg`` itself (contiguous
    rows) for column strides 1 and 2; for larger ones its stride phases ``(Cg, *s, *Q)``,
    ``[c, a, q] = xg[c, a + s*q]``, ``Q = ceil(S/s)`` (entries past the window are left unset: no output
    reads them)."""
    if not _split_columns(geo):
        if xg.strides[-1] != xg.itemsize or _elem_strides(xg) is None:
            xg = np.ascontiguousarray(xg)
        return xg
    q = tuple(-(-n // s) for n, s in zip(geo.window, geo.stride))
    xs = _scratch("input phases", (xg.shape[0],) + geo.stride + q, xg.dtype)
    _phases(xg, xs, geo.stride, merge=False)
    return xs


def _end(a) -> int:
    """Address one past the last element of ``a``."""
    last = sum((n - 1) * st for n, st in zip(a.shape, _elem_strides(a)) if st > 0)
    return _addr(a) + a.itemsize * (1 + last)


def _phases(win, ph, stride, merge: bool):
    """Split ``win`` (``(..., *S)``, ``len(stride)`` spatial dimensions) into its stride phases ``ph``
    (``(..., *stride, *Q)``), or merge them back into ``win`` (``merge``); one pass over the window."""
    nsp = len(stride)
    lead = win.ndim - nsp
    for a in itertools.product(*(range(s) for s in stride[:-1])):
        rows = tuple(slice(ad, None, s) for ad, s in zip(a, stride[:-1]))
        w_rows = win[(slice(None),) * lead + rows]
        p_rows = ph[(slice(None),) * lead + a + (slice(None),)
                    + tuple(slice(0, n) for n in w_rows.shape[lead:-1])]
        _phase_rows(w_rows, np.moveaxis(p_rows, lead, -2), stride[-1], merge)


def _phase_rows(win, ph, s: int, merge: bool):
    """Rows ``win`` (``(..., W)``) against their column phases ``ph`` (``(..., s, Q)``)."""
    ws, ps = _elem_strides(win), _elem_strides(ph)
    if ws is None or ps is None or ws[-1] != 1 or ps[-1] != 1:
        for b in range(s):
            n = len(range(b, win.shape[-1], s))
            if merge:
                win[..., b::s] = ph[..., b, :n]
            else:
                ph[..., b, :n] = win[..., b::s]
        return
    extra = max(0, 3 - win.ndim)  # two row dimensions for the kernel: pad with unit ones
    shape = (1,) * extra + win.shape[:-1]
    ws, ps = (0,) * extra + ws, (0,) * extra + ps
    r = len(shape)
    isz = win.itemsize
    for idx in itertools.product(*(range(n) for n in shape[:-2])):
        wo = sum(i * st for i, st in zip(idx, ws)) * isz
        po = sum(i * st for i, st in zip(idx, ps)) * isz
        _cconv.phase_rows(isz, _addr(win) + wo, shape[-2], shape[-1], ws[r - 2], ws[r - 1], win.shape[-1], s,
                          _addr(ph) + po, ps[r - 2], ps[r - 1], ps[r], int(merge))


@functools.lru_cache(maxsize=256)
def _tap_offsets(cg: int, est: tuple, kernel: tuple, stride: tuple, dilation: tuple):
    """Element offsets into :func:`_tap_input`'s array of every (channel, tap), in the filter's
    ``(Cg, *kernel)`` order, and the offsets of one output step along each spatial dimension."""
    nsp = len(kernel)
    split = stride[-1] > 2  # as _split_columns
    off = (np.arange(cg, dtype=np.int64) * est[0]).reshape((cg,) + (1,) * nsp)
    for d in range(nsp):
        r = np.arange(kernel[d], dtype=np.int64) * dilation[d]
        o = (r % stride[d]) * est[1 + d] + (r // stride[d]) * est[1 + nsp + d] if split else r * est[1 + d]
        off = off + o.reshape((1,) * (1 + d) + (-1,) + (1,) * (nsp - 1 - d))
    off = off.ravel()
    off.flags.writeable = False
    step = est[1 + nsp:] if split else tuple(s * e for s, e in zip(stride, est[1:]))
    return off, tuple(step)


def _planes(out: tuple, xstep: tuple, ystep: tuple):
    """Calls of a compiled kernel over the output: ``(x offset, y offset)`` of each 2-D plane (leading
    dimensions of a 3-D output looped here), and ``(rows, cols, x row stride, x column stride, y row
    stride)``."""
    if len(out) == 1:
        return [(0, 0)], (1, out[0], 0, xstep[-1], 0)
    lead = [(sum(o * s for o, s in zip(idx, xstep)), sum(o * s for o, s in zip(idx, ystep)))
            for idx in itertools.product(*(range(n) for n in out[:-2]))]
    return lead, (out[-2], out[-1], xstep[-2], xstep[-1], ystep[-2])


def _forward_compiled(x_window, w, b, geo: ConvGeometry, out=None):
    """Compiled forward; ``out`` (optional) is any array of the output's shape with contiguous rows."""
    dt = x_window.dtype
    isz, cg, fg = dt.itemsize, geo.cg, geo.fg
    y = np.empty(geo.out_shape, dtype=dt) if out is None else out
    wp = np.ascontiguousarray(w.reshape(geo.groups, fg, cg * geo.ntaps).transpose(0, 2, 1))  # (G, T, Fg)
    bias = None if b is None else np.ascontiguousarray(b)
    ystep = y.strides[2:]
    for n in range(geo.batch):
        for g in range(geo.groups):
            xs = _tap_input(x_window[n, g * cg:(g + 1) * cg], geo)
            off, xstep = _tap_offsets(cg, _elem_strides(xs), geo.kernel, geo.stride, geo.dilation)
            planes, (rows, cols, rsx, cs, rsy) = _planes(geo.out, xstep, tuple(s // isz for s in ystep))
            yg = y[n, g * fg:(g + 1) * fg]
            bg = 0 if bias is None else _addr(bias) + g * fg * isz
            for xo, yo in planes:
                _cconv.conv_fwd(isz, _addr(xs) + xo * isz, _end(xs), _addr(off), off.size, rsx, cs,
                                _addr(wp[g]), fg, _addr(yg) + yo * isz, yg.strides[0] // isz, rsy, rows, cols,
                                bg)
    return y


def _backward_filter_compiled(x_window, dy, w_shape, geo: ConvGeometry):
    dt = x_window.dtype
    isz, cg, fg = dt.itemsize, geo.cg, geo.fg
    dw2 = np.zeros((geo.groups, fg, cg * geo.ntaps), dtype=dt)
    for n in range(geo.batch):
        for g in range(geo.groups):
            xs = _tap_input(x_window[n, g * cg:(g + 1) * cg], geo)
            off, xstep = _tap_offsets(cg, _elem_strides(xs), geo.kernel, geo.stride, geo.dilation)
            dyg = dy[n, g * fg:(g + 1) * fg]
            dst = _elem_strides(dyg)
            if dst is None or dst[-1] != 1:
                dyg = np.ascontiguousarray(dyg)
                dst = _elem_strides(dyg)
            planes, (rows, cols, rsx, cs, rsdy) = _planes(geo.out, xstep, dst[1:])
            for xo, yo in planes:
                _cconv.conv_wgrad(isz, _addr(xs) + xo * isz, _end(xs), _addr(off), off.size, rsx, cs,
                                  _addr(dyg) + yo * isz, fg, dst[0], rsdy, rows, cols, _addr(dw2[g]))
    return dw2.reshape(tuple(w_shape))


def conv_forward(x_window, w, b=None, stride=1, dilation=1, out=None, padding=0):
    """Valid convolution of a padded window: ``(N, C, *S)`` with ``(F, C/groups, *K)`` -> ``(N, F, *O)``,
    ``O = (S - dilation*(K-1) - 1) // stride + 1``; ``b`` is ``(F,)`` or ``None``. ``out`` (optional): an
    array of the output's shape and dtype to write into (every element is written), such as a block of a
    larger output; written in place where its rows are contiguous, else through a temporary. ``padding``
    (an int or one per spatial dimension, both sides): ``x_window`` is the input block, padded here."""
    dt = _check_dtypes(x_window, w, b)
    geo, pads = padded_geometry(x_window.shape, w.shape, stride, dilation, padding)
    _check_out(out, geo.out_shape, dt, "output")
    if pads is not None:
        if _small_ok(geo, x_window, w, b, out):
            return _small.forward(x_window, w, b, geo, pads, out)
        x_window = pad_into_scratch(x_window, pads, "padded input")
    return _forward(x_window, w, b, geo, out)


def _small_ok(geo: ConvGeometry, *arrays) -> bool:
    """Whether these arrays take the small compiled path (:mod:`._conv_small`)."""
    if not (USE_COMPILED and _small.fits(geo)) or arrays[0].dtype.char not in "fd":
        return False
    for a in arrays:
        if a is not None and not isinstance(a, np.ndarray):
            return False
    return True


def _forward(x_window, w, b, geo: ConvGeometry, out):
    """:func:`conv_forward` of checked arguments."""
    dt = x_window.dtype
    if _small_ok(geo, x_window, w, b, out):
        return _small.forward(x_window, w, b, geo, None, out)
    if geo.channels == 1:
        y = _one.forward(x_window, w, b, geo.stride, geo.dilation, out, USE_COMPILED)
        if y is not None:
            return y
    if _compiled(x_window, w, b, out, channels=geo.cg, row=geo.out[-1]):
        if out is None or out.strides[-1] == dt.itemsize:
            return _forward_compiled(x_window, w, b, geo, out=out)
    if out is not None and not out.flags.c_contiguous:
        out[...] = _forward(x_window, w, b, geo, None)
        return out
    xp = array_module(x_window)
    y = xp.empty(geo.out_shape, dtype=dt) if out is None else out
    return _gemm.forward(xp, x_window, w, b, geo, y, _budget(x_window))


def conv_backward_filter(x_window, dy, w_shape, stride=1, dilation=1, padding=0):
    """Gradient w.r.t. the filter, shape ``w_shape`` (``(F, C/groups, *K)``), from the window and ``dy``
    (``padding``: as for :func:`conv_forward`)."""
    xp = array_module(x_window)
    _check_dtypes(x_window, dy)
    geo, pads = padded_geometry(x_window.shape, w_shape, stride, dilation, padding)
    _check_dy(dy, geo)
    if _small_ok(geo, x_window, dy):
        return _small.backward_filter(x_window, dy, geo, pads, w_shape)
    if pads is not None:
        x_window = pad_into_scratch(x_window, pads, "padded input")
    if _compiled(x_window, dy, channels=geo.cg, row=geo.out[-1]):
        return _backward_filter_compiled(x_window, dy, w_shape, geo)
    return _gemm.backward_filter(xp, x_window, dy, geo, _budget(x_window)).reshape(tuple(w_shape))


def conv_backward_data(dy, w, x_window_shape, stride=1, dilation=1, out=None, padding=0):
    """Gradient w.r.t. the window (shape ``x_window_shape``, padding and halo included): the caller
    halo-accumulates it, or crops the padding (:func:`crop_spatial`) on a single rank. ``out``
    (optional): a C-contiguous array of the window's shape and dtype to write into (a reused workspace
    spares the page faults of a fresh window-sized array on every call). With ``padding`` (as for
    :func:`conv_forward`) ``x_window_shape`` is the input block's and so is the gradient returned.

    With stride 1 this is a valid convolution of ``dy`` zero-padded by ``dilation*(kernel-1)`` with the
    flipped, transposed filter; with stride ``s`` and dilation 1 each of the ``s**nsp`` phases of the window
    (``dx[..., a::s]``) is such a stride-1 convolution with the sub-filter ``w[..., a::s]``. Both run on the
    forward kernel's GEMM path. Other combinations (stride and dilation both > 1) use a GEMM followed by
    a scatter-add (col2im), as do filters with many more outputs than inputs (F > 1.25 C), where gathering
    ``dy``'s columns would cost more than scattering the window's, and convolutions of 64 or more channels
    per group (col2im's GEMM covers the outputs, the flipped convolution the larger padded window).
    """
    dt = _check_dtypes(dy, w)
    geo, pads = padded_geometry(x_window_shape, w.shape, stride, dilation, padding)
    if pads is not None:
        return _backward_data_padded(dy, w, tuple(x_window_shape), geo, out, pads)
    _check_dy(dy, geo)
    _check_out(out, (geo.batch, geo.channels) + tuple(geo.window), dt, "window gradient", contiguous=True)
    if _small_ok(geo, dy, w, out):
        return _small.backward_data(dy, w, geo, None, out)
    # the adjoint is a convolution of Fg input channels producing rows as wide as the window
    compiled = _compiled(dy, w, out, channels=geo.fg, row=geo.window[-1])
    ratio, cg, fg = GATHER_DATA_GRAD_MAX_RATIO, geo.cg, geo.fg
    if not compiled and (fg > ratio * cg or (cg >= COL2IM_MIN_CHANNELS and fg * ratio >= cg)):
        # the flipped convolution would gather F*K rows per column, col2im scatters only C*K
        return _backward_data_col2im(dy, w, geo, out)
    if all(s == 1 for s in geo.stride):
        return _backward_data_phase(dy, w, geo, (0,) * len(geo.kernel), tuple(geo.window), out)
    if all(d == 1 for d in geo.dilation):
        if compiled:
            if geo.stride[-1] == 2:
                return _backward_data_pairs_compiled(dy, w, geo, out)
            return _backward_data_phases_compiled(dy, w, geo, out)
        xp = array_module(dy)
        dx = xp.zeros(tuple(x_window_shape), dtype=dt) if out is None else out
        if out is not None:
            dx[...] = 0
        for phase in itertools.product(*(range(s) for s in geo.stride)):
            # window positions a, a+s, a+2s, ... of each dimension
            extent = tuple(-(-(n - a) // s) for n, a, s in zip(geo.window, phase, geo.stride))
            if any(a >= k for a, k in zip(phase, geo.kernel)) or 0 in extent:
                continue  # no tap reaches these positions: their gradient is zero
            sl = (slice(None), slice(None)) + tuple(slice(a, None, s) for a, s in zip(phase, geo.stride))
            dx[sl] = _backward_data_phase(dy, w, geo, phase, extent)
        return dx
    return _backward_data_col2im(dy, w, geo, out)


def _backward_data_padded(dy, w, x_shape, geo, out, pads):
    """:func:`conv_backward_data` of an input block padded by ``pads`` inside: the small path writes the
    block's gradient directly, else the window's gradient (a scratch buffer on the host) is cropped."""
    _check_dy(dy, geo)
    _check_out(out, x_shape, dy.dtype, "input gradient", contiguous=True)
    if _small_ok(geo, dy, w, out):
        return _small.backward_data(dy, w, geo, pads, out)
    space = _scratch("padded input gradient", geo.x_shape, dy.dtype) if isinstance(dy, np.ndarray) else None
    inner = crop_spatial(conv_backward_data(dy, w, geo.x_shape, geo.stride, geo.dilation, out=space), pads)
    if out is None:
        return inner.copy()
    out[...] = inner
    return out


@functools.lru_cache(maxsize=1024)
def _subfilter_plan(geo: ConvGeometry, phase: tuple):
    """Index and shapes of :func:`_flipped_subfilter` for one phase (worked out once per geometry)."""
    nsp = len(geo.kernel)
    taps_of = (slice(None), slice(None)) + tuple(slice(a, None, s) for a, s in zip(phase, geo.stride))
    taps = tuple(len(range(a, k, s)) for a, k, s in zip(phase, geo.kernel, geo.stride))
    flip = (slice(None),) * 3 + (slice(None, None, -1),) * nsp
    return taps_of, (geo.groups, geo.fg, geo.cg) + taps, flip, (geo.channels, geo.fg) + taps


def _flipped_subfilter(w, geo: ConvGeometry, phase):
    """The adjoint's filter for phase ``phase`` of the window: taps ``w[..., phase::stride]``, flipped, with
    input and output channels exchanged per group: ``(C, F/groups, *taps)``."""
    taps_of, grouped, flip, flipped = _subfilter_plan(geo, tuple(phase))
    wt = w[taps_of].reshape(grouped).swapaxes(1, 2)[flip].reshape(flipped)
    return array_module(w).ascontiguousarray(wt)


@functools.lru_cache(maxsize=1024)
def _phase_plan(geo: ConvGeometry, phase: tuple, extent: tuple):
    """``(pads, geometry)`` of :func:`_backward_data_phase`: the padding of ``dy`` and the stride-1
    convolution of the padded ``dy`` with the phase's flipped sub-filter."""
    flipped = _subfilter_plan(geo, phase)[3]
    pads = tuple((d * (t - 1), m - o) for t, d, m, o in zip(flipped[2:], geo.dilation, extent, geo.out))
    return pads, geometry(padded_shape(geo.out_shape, pads), flipped, 1, geo.dilation)


def _backward_data_phase(dy, w, geo: ConvGeometry, phase, extent, out=None):
    """``dx[..., phase::stride]`` (spatial ``extent``) as a stride-1 valid convolution of padded ``dy``."""
    pads, inner = _phase_plan(geo, tuple(phase), tuple(extent))
    wt = _flipped_subfilter(w, geo, phase)
    # NumPy: a scratch buffer (the forward below reads it and keeps nothing); CuPy: a fresh array
    dyp = pad_into_scratch(dy, pads, "padded dy")
    return _forward(dyp, wt, None, inner, out)


def _backward_data_phases_compiled(dy, w, geo: ConvGeometry, out=None):
    """Stride > 1, dilation 1, compiled path: ``dy`` padded once for every phase, each phase's stride-1
    convolution written into the phase layout ``(N, C, *stride, *Q)``, merged into ``dx`` in one pass."""
    q = tuple(-(-n // s) for n, s in zip(geo.window, geo.stride))
    lo = tuple(-(-k // s) - 1 for k, s in zip(geo.kernel, geo.stride))  # phase 0 has the most taps
    dyp = pad_into_scratch(dy, tuple((a, qd - o) for a, qd, o in zip(lo, q, geo.out)), "padded dy")
    dxs = _scratch("gradient phases", (geo.batch, geo.channels) + geo.stride + q, dy.dtype)
    for phase in itertools.product(*(range(s) for s in geo.stride)):
        taps = tuple(max(0, -(-(k - a) // s)) for k, a, s in zip(geo.kernel, phase, geo.stride))
        extent = tuple(-(-(n - a) // s) for n, a, s in zip(geo.window, phase, geo.stride))
        target = dxs[(slice(None), slice(None)) + phase + tuple(slice(0, m) for m in extent)]
        if 0 in taps or 0 in extent:
            target[...] = 0  # no tap reaches these positions: their gradient is zero
            continue
        view = dyp[(slice(None), slice(None))
                   + tuple(slice(lm - t + 1, lm + m) for lm, t, m in zip(lo, taps, extent))]
        wt = _flipped_subfilter(w, geo, phase)
        _forward_compiled(view, wt, None, geometry(view.shape, wt.shape, 1, 1), out=target)
    dx = np.empty((geo.batch, geo.channels) + geo.window, dtype=dy.dtype) if out is None else out
    _phases(dx, dxs, geo.stride, merge=True)
    return dx


def _backward_data_pairs_compiled(dy, w, geo: ConvGeometry, out=None):
    """Column stride 2, dilation 1, compiled path: for each phase of the leading dimensions, both column
    phases of the window gradient come from one kernel call that writes them interleaved into ``dx``,
    each a stride-1 convolution of ``dy`` (padded once for all phases) with its flipped sub-filter."""
    nsp, dt = len(geo.kernel), dy.dtype
    isz, cg, fg = dt.itemsize, geo.cg, geo.fg
    q = tuple(-(-n // s) for n, s in zip(geo.window, geo.stride))
    lo = tuple(-(-k // s) - 1 for k, s in zip(geo.kernel, geo.stride))  # phase 0 has the most taps
    dyp = pad_into_scratch(dy, tuple((a, qd - o) for a, qd, o in zip(lo, q, geo.out)), "padded dy")
    dx = np.empty((geo.batch, geo.channels) + geo.window, dtype=dt) if out is None else out
    est = _elem_strides(dyp)
    for a in itertools.product(*(range(s) for s in geo.stride[:-1])):
        rows = tuple(-(-(n - ad) // s) for n, ad, s in zip(geo.window[:-1], a, geo.stride[:-1]))
        pair = []
        for b in (0, 1):
            phase = a + (b,)
            taps = tuple(max(0, -(-(k - p) // s)) for k, p, s in zip(geo.kernel, phase, geo.stride))
            if 0 in taps:
                pair.append((np.zeros(0, dtype=np.int64), np.zeros((geo.groups, 1, cg), dtype=dt)))
                continue
            wt = _flipped_subfilter(w, geo, phase)  # (C, Fg, *taps)
            off, _ = _tap_offsets(fg, est[1:], taps, (1,) * nsp, (1,) * nsp)
            origin = sum((lm - t + 1) * e for lm, t, e in zip(lo, taps, est[2:]))
            wp = np.ascontiguousarray(wt.reshape(geo.groups, cg, -1).transpose(0, 2, 1))  # (G, Fg*T, Cg)
            pair.append((off + origin, wp))
        (off0, wp0), (off1, wp1) = pair
        dxa = dx[(slice(None), slice(None)) + tuple(slice(ad, None, s) for ad, s in zip(a, geo.stride[:-1]))]
        ystep = tuple(s // isz for s in dxa.strides[2:])
        planes, (nrows, _, rsx, _, rsy) = _planes(rows + (geo.window[-1],), est[2:], ystep)
        for n in range(geo.batch):
            for g in range(geo.groups):
                xg, yg = dyp[n, g * fg:(g + 1) * fg], dxa[n, g * cg:(g + 1) * cg]
                for xo, yo in planes:
                    _cconv.conv_pair(isz, _addr(xg) + xo * isz, _addr(off0), off0.size, _addr(off1),
                                     off1.size, rsx, _addr(wp0[g]), _addr(wp1[g]), cg, _addr(yg) + yo * isz,
                                     yg.strides[0] // isz, rsy, nrows, geo.window[-1], 0)
    return dx


def _backward_data_col2im(dy, w, geo: ConvGeometry, out=None):
    xp = array_module(dy)
    dx = xp.empty((geo.batch, geo.channels) + geo.window, dtype=dy.dtype) if out is None else out
    return _gemm.backward_data_col2im(xp, dy, w, geo, dx, _budget(dy))


def conv_backward_bias(dy):
    """Gradient w.r.t. the bias: ``dy`` summed over every dimension but the filter dimension (1)."""
    axes = (0,) + tuple(range(2, dy.ndim))
    return dy.sum(axis=axes)


def _check_out(out, shape, dtype, what: str, contiguous: bool = False):
    if out is None:
        return
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or (contiguous and not out.flags.c_contiguous):
        raise KernelShapeError(
            f"conv: the {what} buffer must be a {'C-contiguous ' if contiguous else ''}"
            f"{np.dtype(dtype).name} array of shape {tuple(shape)}, got {out.dtype} {tuple(out.shape)}"
            f"{'' if out.flags.c_contiguous else ' (not C-contiguous)'}")


def _check_dy(dy, geo: ConvGeometry):
    if tuple(dy.shape) != geo.out_shape:
        raise KernelShapeError(
            f"conv: dy has shape {tuple(dy.shape)} but a window {(geo.batch, geo.channels) + geo.window} "
            f"with kernel {geo.kernel}, stride {geo.stride}, dilation {geo.dilation} gives {geo.out_shape}")
