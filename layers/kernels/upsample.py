"""Local upsampling by integer scales (nearest, and linear: bi-/trilinear) on any block of the output.

PyTorch's ``F.interpolate(x, scale_factor=s, mode=...)`` semantics, one spatial dimension at a time (both
modes are separable). Along a dimension of ``n`` inputs and ``Y = s*n`` outputs, output ``o`` reads:

* nearest: ``x[o // s]``;
* linear, ``align_corners=False``: the source ``(o + 0.5)/s - 0.5`` (clamped at 0) between ``x[i0]`` and
  ``x[i1]``, ``i1 = min(i0 + 1, n - 1)``. With ``o = s*q + a`` the source is ``q + f_a``,
  ``f_a = (2a + 1 - s) / (2s)``: every output of phase ``a`` is ``x[q] + f_a * (x[q+1] - x[q])`` (or
  ``x[q-1]`` for ``f_a < 0``), one strided pass per phase over differences of ``x`` computed once;
* linear, ``align_corners=True``: the source ``o*(n-1)/(Y-1)``, not periodic in ``o``: a gather of the two
  taps per output from index tables made once per block (the backward gathers the few outputs that feed
  each input the same way), no scatter and no dense interpolation matrix.

A :class:`Plan` computes the outputs of one box of the global output from an input array that covers (at
least) the inputs that box reads (:meth:`Plan.source`), whatever its place in the global input: the
distributed layer hands it its halo window. The last spatial dimension is upsampled first (on the smallest
array: its strided writes are the slowest), then the others. Arrays are NumPy or CuPy (the module is taken
from the arguments), every temporary is made by that module, and index tables live on the arrays' device.
Host float arrays go through the compiled kernels of ``_cupsample`` where they are built (:class:`_Compiled`:
each way one call, every (sample, channel) plane done in cache with one pass over the output). Without them,
NumPy (a pass is inner loops over the runs it cannot merge, each costing as much to start as a row of floats
to add): nearest is one broadcast copy (:func:`_nearest_forward`), linear x2 along an unsplit dimension
shifted passes over flattened arrays (:meth:`_Step._linear2_forward`), and a plan runs blocks of channels
one at a time so its temporaries stay in cache (:data:`BLOCK_BYTES`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lbannpy.backend import array_module

from ._buffers import scratch as _scratch
from ._geometry import KernelShapeError

try:  # the compiled kernels (built by setup.py where a C compiler is present)
    from . import _cupsample
except ImportError:  # pragma: no cover - depends on the install
    _cupsample = None
USE_COMPILED = _cupsample is not None  # host float plans made while it holds use them (tests switch it)

MODES = ("nearest", "linear")


@dataclass(frozen=True)
class Axis:
    """One spatial dimension: ``n`` inputs upsampled ``scale`` times."""

    n: int
    scale: int
    mode: str = "nearest"
    align_corners: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise KernelShapeError(f"upsample: mode must be one of {MODES}, got {self.mode!r}")
        if self.n < 1 or self.scale < 1:
            raise KernelShapeError(f"upsample: need n >= 1 and scale >= 1, got n={self.n}, "
                                   f"scale={self.scale}")

    @property
    def out(self) -> int:
        return self.n * self.scale

    @property
    def identity(self) -> bool:
        return self.scale == 1

    def taps(self, o: int) -> tuple[int, int, float]:
        """``(i0, i1, lam)``: output ``o`` is ``(1 - lam) x[i0] + lam x[i1]`` (nearest: ``lam`` 0)."""
        n, s = self.n, self.scale
        if self.mode == "nearest" or s == 1:
            return o // s, o // s, 0.0
        if self.align_corners:
            den = self.out - 1
            if den == 0:
                return 0, 0, 0.0
            i0 = min(o * (n - 1) // den, n - 1)
            return i0, min(i0 + 1, n - 1), (o * (n - 1) - i0 * den) / den
        num = 2 * o + 1 - s  # source (o + 0.5)/s - 0.5 = num / (2s), clamped at 0
        if num <= 0:
            return 0, min(1, n - 1), 0.0
        i0 = num // (2 * s)
        return i0, min(i0 + 1, n - 1), (num - 2 * s * i0) / (2 * s)

    def source(self, o0: int, o1: int) -> tuple[int, int]:
        """The input range ``[lo, hi)`` that outputs ``[o0, o1)`` read (``i0`` and ``i1`` are monotone)."""
        if o1 <= o0:
            return 0, 0
        return self.taps(o0)[0], self.taps(o1 - 1)[1] + 1


def _sl(axis: int, sl) -> tuple:
    return (slice(None),) * axis + (sl,)


def _phases(axis: Axis, o0: int, o1: int):
    """Per phase ``a``: ``(a, f, q0, q1)``, outputs ``s*q + a`` for ``q`` in ``[q0, q1)`` within
    ``[o0, o1)`` and the phase's offset ``f`` of the source from ``q`` (0 for nearest)."""
    s = axis.scale
    for a in range(s):
        q0, q1 = -(-(o0 - a) // s), -(-(o1 - a) // s)
        if q1 > q0:
            f = 0.0 if axis.mode == "nearest" else (2 * a + 1 - s) / (2 * s)
            yield a, f, q0, q1


def _pieces(axis: Axis, f: float, q0: int, q1: int):
    """``(qa, qb, shift)`` runs of a phase: ``shift`` None copies ``x[q]``, else the output is
    ``x[q] + f * d[q + shift]`` with ``d[j] = x[j+1] - x[j]`` (the clamped edges are copies)."""
    n = axis.n
    if f == 0.0:
        return [(q0, q1, None)]
    out = []
    if f < 0:
        if q0 == 0:  # source clamped at 0
            out.append((0, 1, None))
        if max(q0, 1) < q1:
            out.append((max(q0, 1), q1, -1))
    else:
        if q0 < min(q1, n - 1):
            out.append((q0, min(q1, n - 1), 0))
        if q1 > n - 1:  # i1 clamped at n - 1
            out.append((n - 1, n, None))
    return out


def _strided(o0: int, s: int, a: int, qa: int, qb: int) -> slice:
    start = s * qa + a - o0
    return slice(start, start + s * (qb - qa - 1) + 1, s)


@functools.lru_cache(maxsize=4096)
def _compiled_tables(axis: Axis, o0: int, o1: int, lo: int, hi: int, char: str):
    """The tables of ``_cupsample`` for outputs ``[o0, o1)`` from inputs ``[lo, hi)`` (see its header):
    ``(itab, ftab, (nin, nout, taps, nearest))``, ``ftab`` in the arrays' type ``char``."""
    taps_of = [axis.taps(o) for o in range(o0, o1)]
    i0, i1, lam = ([a - lo for a, _, _ in taps_of], [b - lo for _, b, _ in taps_of], [t for *_, t in taps_of])
    feeds: dict[int, dict[int, float]] = {}
    for k, (a, b, t) in enumerate(taps_of):
        for j, wt in ((a, 1.0 - t), (b, t)):
            if wt != 0.0 or j == a:
                d = feeds.setdefault(j - lo, {})
                d[k] = d.get(k, 0.0) + wt
    m, n = hi - lo, o1 - o0
    runs = [sorted(feeds.get(j, {}).items()) for j in range(m)]
    taps = max([1] + [r[-1][0] - r[0][0] + 1 for r in runs if r])  # each input gathers `taps` outputs,
    start = [min(r[0][0] if r else 0, n - taps) for r in runs]  # weights 0 past its run; late ones earlier
    w = np.zeros((taps, m))
    for j, r in enumerate(runs):
        for k, wt in r:
            w[k - start[j], j] = wt
    itab = np.array(i0 + i1 + start, dtype=np.int64)
    ftab = np.concatenate([np.array(lam), w.reshape(-1)]).astype(char)
    return itab, ftab, (m, n, taps, int(not any(lam)))


def _gather_tables(axis: Axis, o0: int, o1: int, lo: int, hi: int):
    """Host tables of the NumPy general (align_corners) path, from :func:`_compiled_tables`: forward ``i0,
    i1`` (relative to ``lo``) and ``lam`` per output; backward, per input ``j``, the outputs
    ``idx[k, j]`` whose gradients it gathers with the weights ``w[k, j]``."""
    itab, ftab, (m, n, taps, _) = _compiled_tables(axis, o0, o1, lo, hi, "d")
    idx = itab[2 * n:][None, :] + np.arange(taps)[:, None]
    return itab[:n], itab[n:2 * n], ftab[:n], idx, ftab[n:].reshape(taps, m)


class _Compiled:
    """A host plan's passes as one call of ``_cupsample`` each way over ``(N, C, D, H, W)`` views (missing
    leading spatial dimensions as extents of 1)."""

    def __init__(self, axes, out_box, source, char: str):
        pad = 3 - len(axes)
        self.index = (slice(None), slice(None)) + (None,) * pad
        tabs = [_compiled_tables(Axis(1, 1), 0, 1, 0, 1, char)] * pad + [
            _compiled_tables(ax, o0, o1, lo, hi, char)
            for ax, (o0, o1), (lo, hi) in zip(axes, out_box, source)]
        self.args = [a for t in tabs for a in t[:2]] + [tuple(v for t in tabs for v in t[2])]

    def takes(self, a) -> bool:
        return a.dtype == self.args[1].dtype

    def __call__(self, fn, src, dst):
        fn(src.dtype.itemsize, src[self.index], dst[self.index], *self.args)
        return dst


class _Step:
    """Upsampling along one array axis: outputs ``[o0, o1)`` from inputs ``[lo, hi)``."""

    def __init__(self, dim: int, axis: Axis, o0: int, o1: int, lo: int, hi: int, nd: int, xp, dtype):
        self.dim, self.axis, self.o0, self.o1, self.lo, self.hi, self.nd = dim, axis, o0, o1, lo, hi, nd
        self.gather = axis.mode == "linear" and axis.align_corners
        s = axis.scale
        if self.gather:
            i0, i1, lam, idx, w = _gather_tables(axis, o0, o1, lo, hi)
            bshape = (-1,) + (1,) * (nd - dim - 1)
            self.i0, self.i1 = xp.asarray(i0), xp.asarray(i1)
            self.lam = xp.asarray(lam.astype(dtype)).reshape(bshape)
            self.idx = [xp.asarray(r) for r in idx]
            self.w = [xp.asarray(r.astype(dtype)).reshape(bshape) for r in w]
            return
        # every output is x[o // s] plus, for linear, f * (a difference of neighbours): the nearest part
        # as whole groups of s outputs (a broadcast copy / a sum of s phases) and the partial groups at the
        # ends of the range
        qa, qb = -(-o0 // s), o1 // s
        self.groups = None if qb <= qa else (_sl(dim, slice(s * qa - o0, s * qb - o0)),
                                             _sl(dim, slice(qa - lo, qb - lo)), qb - qa)
        # (outputs, the one input they copy) of the partial groups
        if qb < qa:  # the range lies inside one group
            part = [((0, o1 - o0), o0 // s)]
        else:
            part = ([((0, s * qa - o0), qa - 1)] * (o0 < s * qa)
                    + [((s * qb - o0, o1 - o0), qb)] * (s * qb < o1))
        self.partial = [(_sl(dim, slice(*r)), _sl(dim, slice(q - lo, q + 1 - lo))) for r, q in part]
        n0, n1 = o0 // s - lo, (o1 - 1) // s + 1 - lo
        self.unread = [_sl(dim, r) for r in (slice(0, n0), slice(n1, hi - lo)) if r.stop > r.start]
        # linear: per phase, runs of copies (clamped edges, f = 0) and of x[q] + f * d[q + shift]; the
        # forward writes each output once from them, the backward sums the x[q] terms as nearest's
        self.copies, self.diffs = [], []
        # host arrays, linear x2 over the whole axis (an unsplit dimension): the phases as shifted contiguous
        # passes over the flattened arrays (:meth:`_linear2_forward`), no pass with short inner loops
        self.linear2 = (xp is np and axis.mode == "linear" and s == 2 and axis.n >= 2
                        and (o0, o1, lo, hi) == (0, axis.out, 0, axis.n))
        if axis.mode == "linear":
            for a, f, q0, q1 in _phases(axis, o0, o1):
                for qa_, qb_, shift in _pieces(axis, f, q0, q1):
                    ysl, xsl = _sl(dim, _strided(o0, s, a, qa_, qb_)), _sl(dim, slice(qa_ - lo, qb_ - lo))
                    if shift is None:
                        self.copies.append((ysl, xsl))
                    else:
                        self.diffs.append((ysl, xsl, _sl(dim, slice(qa_ + shift - lo, qb_ + shift - lo)), f))

    def out_shape(self, shape) -> tuple:
        return tuple(shape[:self.dim]) + (self.o1 - self.o0,) + tuple(shape[self.dim + 1:])

    def in_shape(self, shape) -> tuple:
        return tuple(shape[:self.dim]) + (self.hi - self.lo,) + tuple(shape[self.dim + 1:])

    def _split(self, xp, v, m: int):
        """``v`` with axis ``dim`` (``m * s`` long) seen as ``(m, s)``: a view, never a copy."""
        d, s = self.dim, self.axis.scale
        st = v.strides
        return xp.lib.stride_tricks.as_strided(v, v.shape[:d] + (m, s) + v.shape[d + 1:],
                                               st[:d] + (st[d] * s, st[d]) + st[d + 1:])

    def forward(self, x, out):
        xp, dim = array_module(x), self.dim
        if self.gather:  # x[i0] + lam * d[i0], d[j] = x[j+1] - x[j] (0 past the end, where lam is 0)
            n = x.shape[dim]
            d = _temp(xp, "upsample differences", x.shape, x.dtype)
            xp.subtract(x[_sl(dim, slice(1, n))], x[_sl(dim, slice(0, n - 1))],
                        out=d[_sl(dim, slice(0, n - 1))])
            d[_sl(dim, slice(n - 1, n))] = 0
            _take(xp, x, self.i0, dim, out)
            t = _take(xp, d, self.i0, dim, _temp(xp, "upsample product", out.shape, x.dtype))
            t *= self.lam
            out += t
            return out
        if self.linear2:
            return self._linear2_forward(x, out)
        if self.axis.mode == "nearest":
            if self.groups is not None:
                ysl, xsl, m = self.groups
                self._split(xp, out[ysl], m)[...] = xp.expand_dims(x[xsl], dim + 1)
            for ysl, xsl in self.partial:
                out[ysl] = x[xsl]
            return out
        for ysl, xsl in self.copies:
            out[ysl] = x[xsl]
        if self.diffs:
            n = x.shape[dim]
            d = _temp(xp, "upsample differences", x.shape[:dim] + (n - 1,) + x.shape[dim + 1:], x.dtype)
            xp.subtract(x[_sl(dim, slice(1, n))], x[_sl(dim, slice(0, n - 1))], out=d)
            # x[q] + f d[q + shift] in one pass over the outputs: d scaled once per |f| (a pass over the
            # inputs), then added or subtracted (phases a and s-1-a have opposite f)
            scaled = {}
            for ysl, xsl, dsl, f in self.diffs:
                e = scaled.get(abs(f))
                if e is None:
                    e = _temp(xp, f"upsample scaled {len(scaled)}", d.shape, x.dtype)
                    e = scaled[abs(f)] = xp.multiply(d, abs(f), out=e)
                (xp.add if f > 0 else xp.subtract)(x[xsl], e[dsl], out=out[ysl])
        return out

    def backward(self, g, out=None):
        """The adjoint: the gradient of the inputs ``[lo, hi)`` from that of the outputs ``g``."""
        xp, dim = array_module(g), self.dim
        if self.gather:  # each input from the run of outputs that read it: a few weighted gathers
            shape = self.in_shape(g.shape)
            dx = _take(xp, g, self.idx[0], dim, xp.empty(shape, dtype=g.dtype) if out is None else out)
            dx *= self.w[0]
            for idx, w in zip(self.idx[1:], self.w[1:]):
                t = _take(xp, g, idx, dim, _temp(xp, "upsample product", shape, g.dtype))
                t *= w
                dx += t
            return dx
        shape = self.in_shape(g.shape)
        dx = xp.empty(shape, dtype=g.dtype) if out is None else out
        if self.linear2:
            return self._linear2_backward(g, dx)
        s = self.axis.scale
        for sl in self.unread:  # inputs only the linear taps read (no group of outputs starts there)
            dx[sl] = 0
        if self.groups is not None:
            ysl, xsl, m = self.groups
            gs = self._split(xp, g[ysl], m)
            ph = [gs[_sl(dim + 1, a)] for a in range(s)]
            dv = dx[xsl]
            if s == 1:
                dv[...] = ph[0]
            elif xp is np and dim < g.ndim - 1:  # runs of whole rows: NumPy's reduction beats row-wise adds
                gs.sum(axis=dim + 1, out=dv)
            else:
                xp.add(ph[0], ph[1], out=dv)
                for p in ph[2:]:
                    dv += p
        for ysl, xsl in self.partial:
            dx[xsl] = g[ysl].sum(axis=dim, keepdims=True)
        if self.diffs:  # d[j] = x[j+1] - x[j]: its gradient dd goes to x[j+1] (+) and x[j] (-)
            n = shape[dim]
            dd = _temp(xp, "upsample differences", shape[:dim] + (n - 1,) + shape[dim + 1:], g.dtype)
            dd[...] = 0
            for ysl, _, dsl, f in self.diffs:
                gv = g[ysl]
                t = _temp(xp, "upsample product", gv.shape, g.dtype)
                xp.multiply(gv, f, out=t)
                dd[dsl] += t
            dx[_sl(dim, slice(1, n))] += dd
            dx[_sl(dim, slice(0, n - 1))] -= dd
        return dx

    # -- linear x2 over a whole axis (host arrays): output 2j is 3/4 x[j] + 1/4 x[j-1], 2j+1 is 3/4 x[j] +
    # 1/4 x[j+1] (ends copied). Each pass runs over the flattened arrays (a neighbour along the axis is
    # ``step`` elements away) in a few long inner loops; entries that wrap into the next row are redone.

    def _linear2_forward(self, x, out):
        dim, n, dt = self.dim, x.shape[self.dim], x.dtype
        step = math.prod(x.shape[dim + 1:])
        q = np.multiply(x, dt.type(0.25), out=_scratch("upsample quarter", x.shape, dt))
        t = np.subtract(x, q, out=_scratch("upsample three quarters", x.shape, dt))
        qf, tf = q.reshape(-1), t.reshape(-1)
        split = self._split(np, out, n)
        if dim == x.ndim - 1 and out.flags.c_contiguous:  # straight into the even and odd entries of a row
            yf = out.reshape(-1)
            np.add(tf[1:], qf[:-1], out=yf[2::2])
            np.add(tf[:-1], qf[1:], out=yf[1:-2:2])
            split[..., 0, 0] = x[..., 0]
            split[..., n - 1, 1] = x[..., n - 1]
            return out
        even, odd = _scratch("upsample even", x.shape, dt), _scratch("upsample odd", x.shape, dt)
        ef, of = even.reshape(-1), odd.reshape(-1)
        np.add(tf[step:], qf[:-step], out=ef[step:])
        np.add(tf[:-step], qf[step:], out=of[:-step])
        even[_sl(dim, 0)] = x[_sl(dim, 0)]
        odd[_sl(dim, n - 1)] = x[_sl(dim, n - 1)]
        split[_sl(dim + 1, 0)] = even
        split[_sl(dim + 1, 1)] = odd
        return out

    def _linear2_backward(self, g, dx):
        """The adjoint of :meth:`_linear2_forward`: ``dx[j] = (g[2j-1] + 3 g[2j] + 3 g[2j+1] + g[2j+2]) / 4``
        (``g[0]`` and ``g[2n-1]`` weigh 1 at the ends), as ``S[j]/2 + (T[j] + T[j+1])/4`` with the pair
        sums ``S[j] = g[2j] + g[2j+1]`` and ``T[k] = g[2k-1] + g[2k]`` (``T[0] = 2 g[0]``,
        ``T[n] = 2 g[2n-1]``)."""
        dim, n, dt = self.dim, dx.shape[self.dim], g.dtype
        last = dim == g.ndim - 1
        if last:
            g = np.ascontiguousarray(g)
            if not dx.flags.c_contiguous:  # the passes below run over the flattened array
                target, dx = dx, _scratch("upsample gradient", dx.shape, dt)
                target[...] = self._linear2_backward(g, dx)
                return target
        step = math.prod(dx.shape[dim + 1:])
        half = _scratch("upsample pair sums", dx.shape, dt)
        gs = self._split(np, g, n)
        if last:  # even and odd elements: one strided pass over the flattened rows
            np.add(gs[..., 0], gs[..., 1], out=half)
        else:
            gs.sum(axis=dim + 1, out=half)
        half *= dt.type(0.5)
        if last:
            # T over the flattened array: T[m] = g[2m-1] + g[2m] (m = row * n + k; k = 0 is a cross-row
            # entry), then dx = S/2 + (T[m] + T[m+1])/4, the columns j = 0 and n - 1 redone after
            gf = g.reshape(-1)
            m = gf.size // 2
            tt = _scratch("upsample shifted sums", (m + 1,), dt)
            np.add(gf[1:-1:2], gf[2::2], out=tt[1:m])
            tt[0] = tt[m] = 0  # read only into the end columns, redone below
            dxf = dx.reshape(-1)
            np.add(tt[:m - 1], tt[1:m], out=dxf[:m - 1])
            dxf[m - 1] = 0
            dxf *= dt.type(0.25)
            dxf += half.reshape(-1)
            dx[..., 0] = g[..., 0] + 0.75 * g[..., 1] + 0.25 * g[..., 2]
            dx[..., n - 1] = 0.25 * g[..., 2 * n - 3] + 0.75 * g[..., 2 * n - 2] + g[..., 2 * n - 1]
            return dx
        tshape = dx.shape[:dim] + (n + 1,) + dx.shape[dim + 1:]
        tt = _scratch("upsample shifted sums", tshape, dt)
        inner = g[_sl(dim, slice(1, 2 * n - 1))]
        self._split(np, inner, n - 1).sum(axis=dim + 1, out=tt[_sl(dim, slice(1, n))])
        np.multiply(g[_sl(dim, 0)], dt.type(2), out=tt[_sl(dim, 0)])
        np.multiply(g[_sl(dim, 2 * n - 1)], dt.type(2), out=tt[_sl(dim, n)])
        tf = tt.reshape(-1)
        full = _scratch("upsample shifted pairs", tshape, dt)
        ff = full.reshape(-1)
        np.add(tf[:-step], tf[step:], out=ff[:-step])
        np.multiply(full[_sl(dim, slice(0, n))], dt.type(0.25), out=dx)
        dx += half
        return dx


def _take(xp, a, idx, axis: int, out):
    """``a`` gathered at ``idx`` along ``axis`` into ``out`` (NumPy: unbuffered, the indices are valid)."""
    if xp is np:
        return np.take(a, idx, axis=axis, out=out, mode="clip")
    return xp.take(a, idx, axis=axis, out=out)


def _temp(xp, slot: str, shape, dtype):
    """A temporary of one call: this thread's scratch buffer on the host, a fresh array on a device."""
    if xp is np:
        return _scratch(slot, shape, dtype)
    return xp.empty(shape, dtype=dtype)


class Plan:
    """Upsampling of the output box ``out_box`` (global ``(lo, hi)`` per spatial dimension) from an input
    array whose element 0 sits at the global spatial index ``x_origin`` and which covers :attr:`source`.

    ``forward(x, out=None)`` writes the box (``(N, C, *box)``); ``backward(dy)`` returns the gradient of
    the inputs in :attr:`source` (``(N, C, *source extents)``), which the caller adds into its own array at
    :attr:`source_slices`. Tables on the device of ``xp``, in ``dtype``, made once here."""

    def __init__(self, axes: Sequence[Axis], out_box, x_origin, xp=np, dtype=np.float64):
        self.axes = tuple(axes)
        nsp = len(self.axes)
        self.out_box = tuple((int(a), int(b)) for a, b in out_box)
        if len(self.out_box) != nsp or len(x_origin) != nsp:
            raise KernelShapeError(f"upsample plan: {nsp} axes, box {out_box}, origin {x_origin}")
        for ax, (o0, o1) in zip(self.axes, self.out_box):
            if not 0 <= o0 < o1 <= ax.out:
                raise KernelShapeError(f"upsample plan: output range [{o0}, {o1}) outside [0, {ax.out})")
        self.source = tuple((o0, o1) if ax.identity else ax.source(o0, o1)
                            for ax, (o0, o1) in zip(self.axes, self.out_box))
        self.x_origin = tuple(int(v) for v in x_origin)
        self.source_slices = (slice(None), slice(None)) + tuple(
            slice(lo - org, hi - org) for (lo, hi), org in zip(self.source, self.x_origin))
        # the last dimension first (its strided writes on the smallest array), identities skipped
        self.steps = [_Step(2 + d, ax, o0, o1, lo, hi, 2 + nsp, xp, dtype)
                      for d, (ax, (o0, o1), (lo, hi)) in reversed(list(enumerate(
                          zip(self.axes, self.out_box, self.source)))) if not ax.identity]
        # host arrays, nearest, every box edge on a whole group of s outputs: one broadcast copy forward
        aligned = all(o0 % ax.scale == 0 == o1 % ax.scale for ax, (o0, o1) in zip(self.axes, self.out_box))
        self.nearest = tuple(ax.scale for ax in self.axes) if (
            xp is np and aligned and all(ax.mode == "nearest" or ax.identity for ax in self.axes)) else None
        self.compiled = (_Compiled(self.axes, self.out_box, self.source, np.dtype(dtype).char)
                         if xp is np and USE_COMPILED and np.dtype(dtype).char in "fd" else None)

    def _check(self, x):
        need = tuple(hi - org for (_, hi), org in zip(self.source, self.x_origin))
        if x.ndim != 2 + len(self.axes) or any(sl.start < 0 for sl in self.source_slices[2:]) or any(
                n < h for n, h in zip(x.shape[2:], need)):
            raise KernelShapeError(f"upsample: input of shape {tuple(x.shape)} at spatial origin "
                                   f"{self.x_origin} does not cover the source {self.source} of the box "
                                   f"{self.out_box}")

    def out_shape(self, shape) -> tuple:
        """The output box's array shape for an input of ``shape`` (its first two extents)."""
        return tuple(shape[:2]) + tuple(o1 - o0 for o0, o1 in self.out_box)

    def _blocks(self, xp, shape, dtype):
        """``[(sample, first channel, last channel + 1)]``: the channel blocks a host plan runs one at a
        time (about :data:`BLOCK_BYTES` of output each), or None for one call over the whole array."""
        if xp is not np or not self.steps or self.nearest is not None:  # nearest: one pass already
            return None
        per = math.prod(self.out_shape(shape)[2:]) * np.dtype(dtype).itemsize
        nc = max(1, BLOCK_BYTES // max(per, 1))
        n, c = shape[0], shape[1]
        if n * c <= nc:
            return None
        return [(i, c0, min(c0 + nc, c)) for i in range(n) for c0 in range(0, c, nc)]

    def forward(self, x, out=None):
        self._check(x)
        xp = array_module(x)
        cur = x[self.source_slices]
        if not self.steps:
            if out is None:
                return cur.copy()
            out[...] = cur
            return out
        if out is None:
            out = xp.empty(self.out_shape(cur.shape), dtype=x.dtype)
        if self.compiled is not None and self.compiled.takes(x):
            return self.compiled(_cupsample.forward, cur, out)
        blocks = self._blocks(xp, cur.shape, x.dtype)
        if blocks is None:
            return self._forward(xp, cur, out)
        for i, c0, c1 in blocks:
            self._forward(xp, cur[i:i + 1, c0:c1], out[i:i + 1, c0:c1])
        return out

    def _forward(self, xp, cur, out):
        if self.nearest is not None:
            return _nearest_forward(cur, out, self.nearest)
        shape = tuple(cur.shape)
        last = len(self.steps) - 1
        for i, step in enumerate(self.steps):
            shape = step.out_shape(shape)
            # passes between the first and the last: temporaries of this call
            dst = out if i == last else _temp(xp, f"upsample pass {i % 2}", shape, cur.dtype)
            cur = step.forward(cur, dst)
        return cur

    def backward(self, dy):
        """A fresh array (never ``dy`` itself, never a scratch buffer)."""
        if not self.steps:
            return dy.copy()
        xp = array_module(dy)
        shape = dy.shape
        for step in reversed(self.steps):
            shape = step.in_shape(shape)
        dx = xp.empty(shape, dtype=dy.dtype)
        if self.compiled is not None and self.compiled.takes(dy):
            return self.compiled(_cupsample.backward, dy, dx)
        blocks = self._blocks(xp, dx.shape, dy.dtype)
        if blocks is None:
            return self._backward(xp, dy, dx)
        for i, c0, c1 in blocks:
            self._backward(xp, dy[i:i + 1, c0:c1], dx[i:i + 1, c0:c1])
        return dx

    def _backward(self, xp, g, dx):
        for i, step in enumerate(reversed(self.steps)):
            last = i == len(self.steps) - 1
            shape = step.in_shape(g.shape)
            g = step.backward(g, dx if last else _temp(xp, f"upsample pass {i % 2}", shape, g.dtype))
        return g


#: a NumPy host plan upsamples blocks of channels of about this many output bytes one after the other, so
#: that the temporaries of its passes stay in cache and only the input and the output go through memory
BLOCK_BYTES = 2 << 20


def _nearest_forward(x, out, scales):
    """Nearest upsampling of the whole box by ``scales`` (one per spatial dimension) in one broadcast copy:
    ``out`` seen as ``(N, C, n0, s0, n1, s1, ...)`` takes ``x`` broadcast over the ``s`` axes. Along the last
    dimension the ``s`` copies of an element are one wider integer (``s * itemsize`` of 2, 4 or 8 bytes:
    the element's bits times ``1 + 2^b + 2^2b ...``), so the copy writes whole runs of a row, not ``s``
    interleaved strided streams."""
    nsp = len(scales)
    isz, s_last = x.dtype.itemsize, scales[-1]
    wide = s_last * isz if s_last > 1 and out.strides[-1] == isz else 0
    if wide in (2, 4, 8):
        dst = out.view(f"u{wide}")  # the last axis is contiguous: n_last wide elements
        src = x.view(f"u{isz}")
        k = np.array(sum(1 << (8 * isz * j) for j in range(s_last)), dtype=f"u{wide}")
        scales = scales[:-1] + (1,)
    else:
        dst, src, k = out, x, None
    shape, strides, index = list(dst.shape[:2]), list(dst.strides[:2]), [slice(None)] * 2
    for d in range(nsp):
        n, st, sc = src.shape[2 + d], dst.strides[2 + d], scales[d]
        shape += [n, sc]
        strides += [st * sc, st]
        index += [slice(None), None]
    view = np.lib.stride_tricks.as_strided(dst, tuple(shape), tuple(strides))
    if k is None:
        view[...] = src[tuple(index)]
    else:
        np.multiply(src[tuple(index)], k, out=view)
    return out


def upsample(x, scale, mode: str = "nearest", align_corners: bool = False):
    """The whole tensor ``x`` (``(N, C, *spatial)``) upsampled (``scale``: an int or one per dimension)."""
    axes = _axes(x.shape, scale, mode, align_corners)
    plan = Plan(axes, [(0, a.out) for a in axes], (0,) * len(axes), array_module(x), x.dtype)
    return plan.forward(x)


def upsample_backward(dy, in_shape, scale, mode: str = "nearest", align_corners: bool = False):
    """Adjoint of :func:`upsample`: the input gradient (shape ``in_shape``) from the output's ``dy``."""
    axes = _axes(in_shape, scale, mode, align_corners)
    plan = Plan(axes, [(0, a.out) for a in axes], (0,) * len(axes), array_module(dy), dy.dtype)
    return plan.backward(dy)


def _axes(shape, scale, mode, align_corners) -> tuple[Axis, ...]:
    nsp = len(shape) - 2
    scales = [int(scale)] * nsp if isinstance(scale, (int, np.integer)) else [int(s) for s in scale]
    if len(scales) != nsp:
        raise KernelShapeError(f"upsample: scale {scale}: need one entry per spatial dimension ({nsp})")
    return tuple(Axis(int(n), s, mode, bool(align_corners)) for n, s in zip(shape[2:], scales))
