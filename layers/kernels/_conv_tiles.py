"""The interleaving of a host transposed convolution whose stride is its kernel and whose last kernel extent
is 2 (a U-Net's 2x2 or 2x2x2 up-convolution), in compiled calls (``_cconv.c``):

- **forward**: every output row of one leading phase ``a`` holds both column phases of the row's blocks,
  ``y[.., k*i + a, 2j + b] = bias + sum_c W[c, f, a, b] x[c, i, j]``; ``conv_pair`` computes the two phases
  of a row in vector registers and stores them interleaved, so no block array is written and copied;
- **input gradient**: a convolution of ``dy`` with stride ``k`` whose taps are (filter, kernel offset),
  ``dx[c, i, j] = sum W[c, f, a, b] dy[f, k*i + a, 2j + b]``: ``conv_fwd`` reads ``dy``'s columns two
  apart, so ``dy`` is not copied for it;
- **filter gradient**: the direct filter-gradient kernel (``conv_wgrad``) with ``x`` as its output
  gradient, reading ``dy``'s columns two apart; where that does not apply, the output gradient's blocks,
  ``g[f, a, b, i, j] = dy[f, k*i + a, 2j + b]``, as the operand of a matrix product, split out of ``dy`` by
  ``phase_rows`` (one pass, rows of even and odd columns).

All apply to C-contiguous NumPy float32/float64 arrays where the compiled kernels are built; the forward
and the direct gradients also need the conv kernels' vector width
(:data:`lbannpy.layers.kernels.conv.DIRECT_FAST`: their register blocks spill without AVX-512), rows of
at least :data:`MIN_ROW` outputs (narrower rows run mostly as scalar remainders), and, for the direct
gradients, at most ``conv.COMPILED_MAX_CHANNELS`` filters (with more, the matrix product is the faster one,
as for a convolution's input channels). The callers
(:func:`lbannpy.layers.kernels.aten.conv_transpose_forward` and its backward) take their general path where
these return False.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from . import conv as _conv
from ._buffers import addr as _addr

try:  # the compiled kernels (built by setup.py where a C compiler is present), as conv.py takes them
    from . import _cconv
except ImportError:  # pragma: no cover - depends on the install
    _cconv = None

MIN_ROW = 48  # outputs per row from which the compiled forward is taken (as the direct convolution's rows)
ROW_BLOCK_BYTES = 256 * 1024  # the forward's input rows per block, all channels: read once for every phase


def _host_ready(*arrays) -> bool:
    given = [a for a in arrays if a is not None]
    dt = given[0].dtype
    return (_cconv is not None and _conv.USE_COMPILED and dt.char in "fd"
            and all(type(a) is np.ndarray and a.flags.c_contiguous and a.dtype == dt for a in given))


def _interleaved(a, s: tuple, k: tuple):
    """``a`` (``(N, F, k0*S0, ..., k_last*S_last)``) as ``(N, F, S0, k0, ..., S_last, k_last)``."""
    return a.reshape(a.shape[:2] + tuple(v for pair in zip(s, k) for v in pair))


def _phase(v, a: tuple):
    """The view of :func:`_interleaved`'s array at leading phases ``a``: ``(N, F, S0, ..., S_last, 2)``."""
    return v[(slice(None),) * 2 + tuple(p for ad in a for p in (slice(None), ad)) + (slice(None),) * 2]


def forward(x, w, b, y) -> bool:
    """``y = conv_transpose(x, w, b, stride=kernel)`` for ``x`` ``(N, C, *S)``, ``w`` ``(C, F, *k)`` with
    ``k[-1] == 2``, into ``y`` ``(N, F, *(k*S))``; False (nothing written) where this path does not apply."""
    k, s = tuple(w.shape[2:]), tuple(x.shape[2:])
    if (k[-1] != 2 or not _conv.DIRECT_FAST or 2 * s[-1] < MIN_ROW or not _host_ready(x, w, b, y)):
        return False
    n, c, f, isz = x.shape[0], x.shape[1], w.shape[1], x.itemsize
    pix = math.prod(s)
    off = np.arange(c, dtype=np.int64) * pix  # tap t = input channel t
    bias = 0 if b is None else _addr(b)
    yv = _interleaved(y, s, k)
    xrow = s[-1] if len(s) > 1 else 0
    phases = []
    for a in itertools.product(*(range(kk) for kk in k[:-1])):
        wp = [np.ascontiguousarray(w[(slice(None), slice(None)) + a + (bb,)]) for bb in (0, 1)]  # (C, F)
        ya = _phase(yv, a)  # (N, F, S0, ..., S_last, 2)
        ys = tuple(st // isz for st in ya.strides)
        phases.append((_addr(wp[0]), _addr(wp[1]), ys, _offset(ya, y), wp))
    rows = s[-2] if len(s) > 1 else 1
    # rows of every phase in blocks whose input rows stay in cache between the phases
    block = max(1, min(rows, ROW_BLOCK_BYTES // max(1, c * s[-1] * isz)))
    xa, ya0, oa, pair = _addr(x), _addr(y), _addr(off), _cconv.conv_pair
    for lead in itertools.product(range(n), *(range(m) for m in s[:-2])):
        xo = lead[0] * c * pix + sum(i * math.prod(s[d + 1:]) for d, i in enumerate(lead[1:]))
        for r0 in range(0, rows, block):
            nr = min(block, rows - r0)
            for w0, w1, ys, base, _ in phases:
                rsy = ys[-3] if len(s) > 1 else 0
                yo = base + lead[0] * ys[0] + sum(i * st for i, st in zip(lead[1:], ys[2:])) + r0 * rsy
                pair(isz, xa + (xo + r0 * xrow) * isz, oa, c, oa, c, xrow, w0, w1, f, ya0 + yo * isz, ys[1],
                     rsy, nr, 2 * s[-1], bias)
    return True


def _offset(view, base) -> int:
    """Element offset of ``view``'s first element in ``base``'s buffer."""
    return (_addr(view) - _addr(base)) // base.itemsize


def _direct_taps(dy, w, s: tuple):
    """``(offsets, row step)`` of the taps (filter, a..., b) of :func:`backward_data` and
    :func:`backward_filter` in one sample of ``dy``, in ``w``'s ``(F, *k)`` order, or None where those do not
    apply (see the module)."""
    k, f = tuple(w.shape[2:]), w.shape[1]
    if k[-1] != 2 or not _conv.DIRECT_FAST or s[-1] < MIN_ROW or f > _conv.COMPILED_MAX_CHANNELS:
        return None
    ost = [math.prod(dy.shape[3 + d:]) for d in range(len(s))]
    off = np.arange(f, dtype=np.int64).reshape((f,) + (1,) * len(k)) * math.prod(dy.shape[2:])
    for d, kd in enumerate(k):
        at = np.arange(kd, dtype=np.int64) * ost[d]
        off = off + at.reshape((1,) * (1 + d) + (kd,) + (1,) * (len(k) - 1 - d))
    return off.ravel(), (k[-2] * ost[-2] if len(s) > 1 else 0)


def _over_planes(dy, w, xs, call) -> bool:
    """Runs ``call(dy row 0, dy end, tap offsets, taps, dy row step, xs row 0, channels, channel stride,
    rows)`` (addresses, counts and strides in elements as ``_cconv`` takes them) once for every 2-D plane of
    rows of ``xs`` (``(N, C, *S)``: the input gradient, or the input whose products with ``dy`` make the
    filter gradient); False (nothing called) where the direct kernels do not apply."""
    s = tuple(xs.shape[2:])
    taps = _direct_taps(dy, w, s) if _host_ready(dy, w, xs) else None
    if taps is None:
        return False
    off, rsx = taps
    k, n, c, f, isz = tuple(w.shape[2:]), xs.shape[0], xs.shape[1], dy.shape[1], xs.itemsize
    pix, opix = math.prod(s), math.prod(dy.shape[2:])
    ost = [math.prod(dy.shape[3 + d:]) for d in range(len(s))]
    da, xa = _addr(dy), _addr(xs)
    for lead in itertools.product(range(n), *(range(m) for m in s[:-2])):
        do = lead[0] * f * opix + sum(i * kd * st for i, kd, st in zip(lead[1:], k, ost))
        xo = lead[0] * c * pix + sum(i * math.prod(s[d + 1:]) for d, i in enumerate(lead[1:]))
        call(da + do * isz, da + dy.nbytes, _addr(off), off.size, rsx, xa + xo * isz, c, pix,
             s[-2] if len(s) > 1 else 1)
    return True


def backward_data(dy, w, dx) -> bool:
    """``dx`` (``(N, C, *S)``) = the input gradient of :func:`forward` for ``dy`` (``(N, F, *(k*S))``);
    False (nothing written) where this path does not apply."""
    wp = np.ascontiguousarray(w.reshape(w.shape[0], -1).T)  # (taps, C)
    isz, cols, wa = dx.itemsize, dx.shape[-1], _addr(wp)

    def call(d, end, off, ntap, rsx, x, c, pix, rows):
        _cconv.conv_fwd(isz, d, end, off, ntap, rsx, 2, wa, c, x, pix, cols, rows, cols, 0)
    return _over_planes(dy, w, dx, call)


def backward_filter(dy, x, w):
    """The filter gradient of :func:`forward` (``w``'s shape) for ``dy``, or None where this path does not
    apply: the direct filter-gradient kernel with ``x`` as its output gradient and ``dy``'s columns read
    two apart, so ``dy`` is not split into blocks for it."""
    dw = np.zeros(w.shape, dtype=x.dtype)  # (C, taps): accumulated over samples and planes
    isz, cols, wa = x.itemsize, x.shape[-1], _addr(dw)

    def call(d, end, off, ntap, rsx, xp, c, pix, rows):
        _cconv.conv_wgrad(isz, d, end, off, ntap, rsx, 2, xp, c, pix, cols, rows, cols, wa)
    return dw if _over_planes(dy, w, x, call) else None


def split(dy, g, k: tuple) -> bool:
    """``g`` (``(N*F, *k, *S)``) = the blocks of ``dy`` (``(N, F, *(k*S))``), ``g[q, a, b, i, j] = dy[q,
    k*i + a, 2j + b]``, for ``k[-1] == 2``; False (nothing written) where this path does not apply."""
    if k[-1] != 2 or not _host_ready(dy, g):
        return False
    s = tuple(g.shape[1 + len(k):])
    isz, nf, pix = dy.itemsize, g.shape[0], math.prod(s)
    dv = _interleaved(dy.reshape((1, nf) + dy.shape[2:]), s, k)
    gv = g.reshape((nf, math.prod(k), pix))
    dya, gva = _addr(dy), _addr(g)
    for ai, a in enumerate(itertools.product(*(range(kk) for kk in k[:-1]))):
        da = _phase(dv, a)[0]  # (N*F, S0, ..., S_last, 2)
        ds = tuple(st // isz for st in da.strides)
        d0, g0 = _offset(da, dy), 2 * ai * pix  # phase (a, 0) of g; (a, 1) is pix further
        rows, rs, prs = (s[-2], ds[-3], s[-1]) if len(s) > 1 else (1, 0, 0)
        for lead in itertools.product(*(range(m) for m in s[:-2])):
            do = d0 + sum(i * st for i, st in zip(lead, ds[1:]))
            go = g0 + sum(i * math.prod(s[d + 1:]) for d, i in enumerate(lead))
            _cconv.phase_rows(isz, dya + do * isz, nf, rows, ds[0], rs, 2 * s[-1], 2, gva + go * isz,
                                    gv.shape[1] * pix, prs, pix, 0)
    return True
