"""Stencil geometry: the window of one spatial dimension (kernel, stride, padding, dilation), the input
window an output block reads, and the padding rules of the spec. Pure index math, like
:mod:`lbannpy.dist`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .dist import Box, DistributionError


@dataclass(frozen=True)
class Window1D:
    """Stencil geometry of one dimension: output ``o`` reads inputs ``o*stride - pad_lo + dilation*j``.

    The identity (kernel 1, stride 1, no padding) describes dimensions a layer does not convolve.
    """

    kernel: int = 1
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    dilation: int = 1

    def __post_init__(self):
        for name in ("kernel", "stride", "dilation"):
            if getattr(self, name) < 1:
                raise DistributionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pad_lo < 0 or self.pad_hi < 0:
            raise DistributionError(f"padding must be >= 0, got ({self.pad_lo}, {self.pad_hi})")

    @property
    def reach(self) -> int:
        """Span of one output's receptive field, in input elements."""
        return self.dilation * (self.kernel - 1) + 1

    def output_size(self, n: int) -> int:
        return (n + self.pad_lo + self.pad_hi - self.reach) // self.stride + 1

    def input_window(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input range (global coordinates, may extend past [0, n) into padding) that outputs
        ``[out_start, out_stop)`` read. An empty output range reads nothing: ``(s, s)``."""
        if out_stop <= out_start:
            s = out_start * self.stride - self.pad_lo
            return s, s
        lo = out_start * self.stride - self.pad_lo
        hi = (out_stop - 1) * self.stride - self.pad_lo + self.reach
        return lo, hi


def parse_padding(padding, kernel: int, dilation: int = 1) -> tuple[int, int]:
    """``0``/int, ``"same"``/``"valid"``, or an explicit ``(lo, hi)`` pair -> ``(lo, hi)``.

    ``"same"`` pads ``dilation*(kernel-1)`` in all, the smaller half first: with stride 1 the output has the
    input's size; with stride s it has ``ceil(n / s)`` elements (for odd kernels this is PyTorch's
    ``padding=kernel//2``).
    """
    if isinstance(padding, str):
        if padding == "same":
            total = dilation * (kernel - 1)
            return total // 2, total - total // 2
        if padding == "valid":
            return 0, 0
        raise DistributionError(f"padding must be an int, a (lo, hi) pair, 'same' or 'valid'; got "
                                f"{padding!r}")
    if isinstance(padding, int):
        return padding, padding
    lo, hi = padding
    return int(lo), int(hi)


@dataclass(frozen=True)
class Stencil:
    """Per-dimension windows of a layer over a whole tensor (identity on sample and channel dims)."""

    dims: tuple[Window1D, ...]

    @classmethod
    def conv(cls, ndim: int, kernel, stride=1, padding=0, dilation=1) -> "Stencil":
        """Stencil of an N-d convolution or pooling on an ``ndim``-dimensional (n, c, spatial...) tensor."""
        nsp = ndim - 2
        k = _per_dim(kernel, nsp, "kernel")
        s = _per_dim(stride, nsp, "stride")
        d = _per_dim(dilation, nsp, "dilation")
        if isinstance(padding, (str, int)):
            pads = [parse_padding(padding, k[i], d[i]) for i in range(nsp)]
        elif nsp == 1 and len(padding) == 2 and all(isinstance(p, int) for p in padding):
            pads = [parse_padding(tuple(padding), k[0], d[0])]  # one spatial dim: (lo, hi)
        else:
            if len(padding) != nsp:
                raise DistributionError(f"padding {padding!r}: need one entry per spatial dimension ({nsp})")
            pads = [parse_padding(p, k[i], d[i]) for i, p in enumerate(padding)]
        windows = [Window1D(), Window1D()] + [
            Window1D(k[i], s[i], pads[i][0], pads[i][1], d[i]) for i in range(nsp)
        ]
        return cls(tuple(windows))

    @classmethod
    def identity(cls, ndim: int) -> "Stencil":
        return cls(tuple(Window1D() for _ in range(ndim)))

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(w.output_size(n) for w, n in zip(self.dims, input_shape))

    def input_window(self, out_box: Box) -> Box:
        return tuple(w.input_window(lo, hi) for w, (lo, hi) in zip(self.dims, out_box))


def _per_dim(value, n: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise DistributionError(f"{name} {value}: need one entry per spatial dimension ({n})")
    return [int(v) for v in value]


# --------------------------------------------------------------------------------------------------------
# process grid and distribution
