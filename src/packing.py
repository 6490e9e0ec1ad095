"""Packing boxes into flat, contiguous buffers: :class:`Segment` lists planned once from pure box math;
:func:`pack` and :func:`unpack` are the only places that copy between boxes and flat buffers, so every
communication path in the package (tensors, halo and shuffle plans) packs the same way. Also the checks
those paths share on communicators and local arrays."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lbannpy.backend import array_module
from lbannpy.comm.base import Communicator
from lbannpy.dist import Box, Distribution, DistributionError, box_shape, relative_slices

try:  # optional compiled kernel (setup.py); without it relayout is NumPy's assignment
    from . import _crelayout
except ImportError:  # pragma: no cover - a build without a C compiler
    _crelayout = None


@dataclass(frozen=True)
class Segment:
    """One box moved to or from ``peer``: where it sits in a local array and in a flat buffer.

    ``box`` is in global coordinates; ``slices`` select it from the local array it is packed from or
    unpacked into; elements ``[offset, offset + size)`` of the flat buffer hold it in C order.
    """

    peer: int
    box: Box
    slices: tuple
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.size


def segments(pieces: Sequence[tuple[int, Box]], origin: Sequence[int]) -> tuple[Segment, ...]:
    """Segments for ``(peer, box)`` pieces laid one after another in a flat buffer, in the order given;
    ``origin`` is the global index of element 0 of the local array the boxes are cut from."""
    out, offset = [], 0
    for peer, box in pieces:
        seg = Segment(peer, tuple(box), relative_slices(box, origin), offset)
        out.append(seg)
        offset = seg.stop
    return tuple(out)


def packed_size(segs: Sequence[Segment]) -> int:
    return segs[-1].stop if segs else 0


def pack(arr, segs: Sequence[Segment], flat=None):
    """Copy each segment's box of ``arr`` into its place in the flat buffer ``flat`` (allocated when
    ``None``); returns ``flat``."""
    xp = array_module(arr)
    if flat is None:
        flat = xp.empty(packed_size(segs), dtype=arr.dtype)
    for s in segs:
        flat[s.offset:s.stop].reshape(s.shape)[...] = arr[s.slices]
    return flat


def unpack(flat, segs: Sequence[Segment], arr, add: bool = False):
    """Copy (or, with ``add``, accumulate) each segment of the flat buffer into its box of ``arr``.
    Segments that overlap in ``arr`` must use ``add``; returns ``arr``."""
    for s in segs:
        part = flat[s.offset:s.stop].reshape(s.shape)
        if add:
            arr[s.slices] += part
        else:
            arr[s.slices] = part
    return arr


def relayout(dst, src):
    """``dst[...] = src`` for arrays of the same shape and type, returning ``dst``. Host arrays whose fastest
    axes differ (one NCHW, the other channels-last: a convolution run in that layout) go through the
    compiled tiled copy, which NumPy's strided assignment is several times slower than; the bits are the
    same either way."""
    if (_crelayout is not None and type(dst) is np.ndarray and isinstance(src, np.ndarray)
            and dst.dtype == src.dtype and dst.shape == src.shape and 2 <= dst.ndim <= 8
            and not np.may_share_memory(dst, src) and _crelayout.copy(dst, src)):
        return dst
    dst[...] = src
    return dst


def check_comm(comm: Communicator, dist: Distribution, rank: int | None, what: str) -> None:
    """Refuse a communicator that does not match the distribution (or the rank a plan was built for)."""
    if comm.size != dist.ranks:
        raise DistributionError(
            f"{what}: distribution {dist} is laid on {dist.ranks} ranks but the communicator has "
            f"{comm.size}; "
            f"build the distribution with ranks={comm.size} (Distribution.with_ranks)")
    if rank is not None and comm.rank != rank:
        raise DistributionError(
            f"{what}: plan was built for rank {rank} but is executed on rank {comm.rank}; build it with "
            f"rank=comm.rank")


def check_array(arr, shape: Sequence[int], what: str, rank: int, dtype=None) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise DistributionError(f"rank {rank}: {what} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if dtype is not None and arr.dtype != dtype:
        raise DistributionError(f"rank {rank}: {what} has dtype {arr.dtype}, expected {dtype}")
