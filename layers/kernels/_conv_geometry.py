"""The sizes of one local convolution (:class:`ConvGeometry`), worked out once per shape and cached: a layer
calls its kernels with the same shapes every step, and working them out again costs more than a small
convolution's arithmetic."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ._geometry import KernelShapeError, per_dim, valid_output_shape
from .padding import padded_shape, symmetric_pads


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

    # derived sizes, computed on first use and kept (a geometry is made once per shape: see geometry())
    @functools.cached_property
    def cg(self) -> int:
        return self.channels // self.groups

    @functools.cached_property
    def fg(self) -> int:
        return self.filters // self.groups

    @functools.cached_property
    def ntaps(self) -> int:
        return math.prod(self.kernel)

    @functools.cached_property
    def rest(self) -> int:
        """Outputs per row of the first spatial dimension."""
        return math.prod(self.out[1:])

    @functools.cached_property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.filters) + self.out

    @functools.cached_property
    def x_shape(self) -> tuple[int, ...]:
        """The window's shape."""
        return (self.batch, self.channels) + self.window

    def __hash__(self) -> int:
        # geometries key the kernels' caches on every call: the fields are hashed once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.batch, self.channels, self.filters, self.groups, self.window, self.kernel,
                      self.out, self.stride, self.dilation))
            self.__dict__["_hash"] = h
        return h

    def rows_per_block(self, itemsize: int, budget: int) -> int:
        per_row = self.cg * self.ntaps * self.rest * itemsize
        return max(1, min(self.out[0], budget // max(per_row, 1)))


@functools.lru_cache(maxsize=1024)
def _geometry(x_shape: tuple, w_shape: tuple, stride, dilation) -> ConvGeometry:
    return ConvGeometry.make(x_shape, w_shape, stride, dilation)


def geometry(x_shape, w_shape, stride, dilation) -> ConvGeometry:
    """:meth:`ConvGeometry.make`, cached: a layer calls its kernels with the same shapes every step, and
    working the sizes out again costs more than a small convolution's arithmetic."""
    if isinstance(stride, list) or isinstance(dilation, list):  # hashable for the cache
        stride = stride if isinstance(stride, int) else tuple(stride)
        dilation = dilation if isinstance(dilation, int) else tuple(dilation)
    return _geometry(tuple(x_shape), tuple(w_shape), stride, dilation)


def padded_geometry(x_shape, w_shape, stride, dilation, padding=0):
    """``(geometry of the padded window, padding per dimension or None)`` of a call with ``padding`` (an int
    or one per spatial dimension, both sides); cached like :func:`geometry`."""
    try:
        return _padded_geometry(x_shape, w_shape, stride, dilation, padding)
    except TypeError:  # a list among the arguments: hashable for the cache
        return _padded_geometry(*(tuple(v) if isinstance(v, list) else v
                                  for v in (x_shape, w_shape, stride, dilation, padding)))


@functools.lru_cache(maxsize=1024)
def _padded_geometry(x_shape, w_shape, stride, dilation, padding):
    pads = symmetric_pads(padding, len(x_shape) - 2)
    shape = tuple(x_shape) if pads is None else padded_shape(tuple(x_shape), pads)
    return geometry(shape, w_shape, stride, dilation), pads
