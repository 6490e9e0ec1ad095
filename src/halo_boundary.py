"""Boundary maps of a halo window: which rows of the tensor fill the window's parts past its edges.

A window past the tensor's edges holds zero padding, or (a ``boundary`` mode other than ``zeros``) rows of
the tensor itself, as ``F.pad`` pads: ``reflect``, ``replicate`` or ``circular`` (periodic). Each padded run
of rows is an index map onto tensor rows (reversed for a reflection), so :class:`lbannpy.halo.HaloPlan`
treats the parts they map to like any other part of the window: rows held by another rank (the rank at the
other end of the process grid for a periodic dimension) or by this rank's own block. Pure index math, for
any rank; :func:`window_of` is the global reference the tests compare windows with.
"""
from __future__ import annotations

import itertools

from lbannpy.backend import array_module
from lbannpy.dist import Box, Distribution, DistributionError, box_shape, clip_box, intersect, relative_slices

#: how a plan fills the parts of a window past the tensor's edges (see the module docstring)
BOUNDARY_MODES = ("zeros", "reflect", "replicate", "circular")


def boundary_modes(boundary, ndim: int) -> tuple[str, ...]:
    """``boundary`` (None: zeros; one mode for every spatial dimension; or one per tensor dimension) as one
    mode per tensor dimension (sample and channel dimensions: zeros, they have no padding)."""
    if boundary is None:
        return ("zeros",) * ndim
    modes = (("zeros", "zeros") + (boundary,) * (ndim - 2) if isinstance(boundary, str)
             else tuple(boundary))
    if len(modes) != ndim or any(m not in BOUNDARY_MODES for m in modes):
        raise DistributionError(f"halo boundary {boundary!r}: one of {', '.join(BOUNDARY_MODES)} (or one per "
                                f"dimension of the rank-{ndim} tensor)")
    return modes


def runs_1d(a: int, b: int, n: int, mode: str) -> list[tuple]:
    """The window range ``[a, b)`` of one dimension as runs ``(wa, wb, sa, flip)``: window rows
    ``[wa, wb)`` are the tensor's rows ``[sa, sa + wb - wa)`` (in reverse order where ``flip``), or zero
    padding (``sa`` None)."""
    out = []
    if a < 0:
        e = min(b, 0)
        if mode == "zeros":
            out.append((a, e, None, False))
        elif mode == "circular":
            out.append((a, e, a + n, False))
        elif mode == "reflect":  # row i < 0 is row -i
            out.append((a, e, 1 - e, True))
        else:  # replicate: every row is row 0
            out += [(i, i + 1, 0, False) for i in range(a, e)]
    lo, hi = max(a, 0), min(b, n)
    if lo < hi:
        out.append((lo, hi, lo, False))
    if b > n:
        s = max(a, n)
        if mode == "zeros":
            out.append((s, b, None, False))
        elif mode == "circular":
            out.append((s, b, s - n, False))
        elif mode == "reflect":  # row i >= n is row 2(n - 1) - i
            out.append((s, b, 2 * n - 1 - b, True))
        else:
            out += [(i, i + 1, n - 1, False) for i in range(s, b)]
    return out


def window_part(run, piece) -> tuple[int, int]:
    """The window rows of ``run`` whose source rows are ``piece`` (a sub-range of the run's source)."""
    wa, wb, sa, flip = run
    ps, pe = piece
    if not flip:
        return wa + ps - sa, wa + pe - sa
    sb = sa + wb - wa
    return wa + sb - pe, wa + sb - ps


def window_sources(dist: Distribution, global_shape: tuple, window_box: Box, modes: tuple,
                   replica: int) -> list:
    """Every part of a window that holds tensor data (not zero padding), as ``(peer, window box, source
    box, flips)``: the rank of replica ``replica`` holding the source rows, where they land in the window
    (global coordinates, possibly past the edges) and the dimensions in which their order is reversed."""
    per_dim = [runs_1d(a, b, n, m) for (a, b), n, m in zip(window_box, global_shape, modes)]
    out = []
    for combo in itertools.product(*per_dim):
        if any(r[2] is None for r in combo):
            continue
        src = tuple((r[2], r[2] + r[1] - r[0]) for r in combo)
        flips = tuple(r[3] for r in combo)
        for coords in dist.blocks_meeting(global_shape, src):
            peer = dist.rank_of(coords, replica)
            piece = intersect(src, dist.box(global_shape, peer))
            out.append((peer, tuple(window_part(r, p) for r, p in zip(combo, piece)), piece, flips))
    return out


def source_slices(box: Box, origin, flips) -> tuple[slice, ...]:
    """Slices selecting ``box`` from an array whose element 0 is at ``origin``, reversed along ``flips``."""
    out = []
    for (lo, hi), o, f in zip(box, origin, flips):
        a, b = lo - o, hi - o
        out.append(slice(b - 1, a - 1 if a > 0 else None, -1) if f else slice(a, b))
    return tuple(out)


_NUMPY_PAD = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def window_of(global_array, box: Box, boundary=None):
    """Reference window: ``box`` (global coordinates) cut from ``global_array`` zero-padded outside it
    (``boundary``: padded as ``np.pad`` does with its modes reflect, edge and wrap, dimension by dimension).
    For tests and checks; it allocates the whole window."""
    xp = array_module(global_array)
    modes = boundary_modes(boundary, global_array.ndim)
    if any(m != "zeros" for m in modes):
        padded = global_array
        for d, ((lo, hi), n, m) in enumerate(zip(box, global_array.shape, modes)):
            if m != "zeros" and (lo < 0 or hi > n):
                widths = [(0, 0)] * global_array.ndim
                widths[d] = (max(0, -lo), max(0, hi - n))
                padded = xp.pad(padded, widths, mode=_NUMPY_PAD[m])
        shift = [max(0, -lo) if m != "zeros" else 0 for (lo, _), m in zip(box, modes)]
        inner = window_of(padded, tuple((lo + s, hi + s) for (lo, hi), s in zip(box, shift)))
        return inner
    out = xp.zeros(box_shape(box), dtype=global_array.dtype)
    inside = clip_box(box, global_array.shape)
    if inside is not None:
        out[relative_slices(inside, [lo for lo, _ in box])] = \
            global_array[tuple(slice(a, b) for a, b in inside)]
    return out


