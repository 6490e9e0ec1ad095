"""PyTorch's own transposed convolution (ATen ``convolution`` with ``transposed=True`` and its backward) on
lbannpy's arrays, for a layer whose spatial dimensions are not split and whose run takes ATen kernels
(``runtime.kernels``): the same operator PyTorch's ``conv_transpose1d/2d/3d`` runs (oneDNN on the CPU,
cuDNN on a GPU), with the output padding, groups and bias inside it, so no window is filled or cropped
around it. The arrays go in and out without a copy, on CuPy's current stream, as in :mod:`.aten`."""
from __future__ import annotations

from . import aten


def _lists(*vals):
    return [list(int(x) for x in v) for v in vals]


@aten._on_device
def forward(x, w, b, stride, padding, output_padding, dilation, groups: int):
    """``conv_transpose`` of ``x`` (``(N, C_in, *S)``) with ``w`` (``(C_in, F/groups, *k)``) and ``b``."""
    conv, _ = aten._ops()
    s, p, op, d = _lists(stride, padding, output_padding, dilation)
    y = conv(aten._t(x), aten._t(w), None if b is None else aten._t(b), s, p, d, True, op, int(groups))
    return aten._back(y, x)


@aten._on_device
def backward(dy, x, w, bias: bool, want_dx: bool, stride, padding, output_padding, dilation, groups: int):
    """``(dL/dx or None, dL/dw, dL/db or None)`` in one operator call."""
    _, bwd = aten._ops()
    s, p, op, d = _lists(stride, padding, output_padding, dilation)
    sizes = [int(w.shape[1]) * int(groups)] if bias else None
    gx, gw, gb = bwd(aten._t(dy), aten._t(x), aten._t(w), sizes, s, p, d, True, op, int(groups),
                     [bool(want_dx), True, bool(bias)])
    return (aten._back(gx, dy) if want_dx else None, aten._back(gw, dy),
            aten._back(gb, dy) if bias else None)
