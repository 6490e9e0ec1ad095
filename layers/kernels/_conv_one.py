"""The forward convolution of a one-input-channel 2-D layer (the first layer of a network on grey images) in
one compiled call (``_conv1c.c``), for the own kernels and the ATen set alike.

With one input channel the GEMM path and oneDNN both treat the channel as a reduction of length one and
spend their time arranging data; the compiled kernel sums each output row's taps in vector registers
(the same numbers to round-off; ``bench layers`` times both). It applies to NumPy arrays of float32 or
float64, C-contiguous, stride and dilation 1, no
padding left to apply, output rows of at least one vector (8 floats, 4 doubles); :func:`forward` returns
None for anything else, and the caller takes its general path.
"""
from __future__ import annotations

import numpy as np

try:  # built by pip install where a C compiler is present (optional, as the other compiled kernels)
    from . import _conv1c
except ImportError:  # pragma: no cover - depends on the install
    _conv1c = None

_LANES = {4: 8, 8: 4}  # outputs per vector, by item size


def _ones(v) -> bool:
    return all(int(s) == 1 for s in v) if isinstance(v, (tuple, list)) else int(v) == 1


def forward(x, w, b, stride, dilation, out, enabled: bool = True):
    """``y = conv(x, w) + b`` for ``x`` ``(N, 1, H, W)`` and ``w`` ``(F, 1, KH, KW)`` into ``out`` (or a new
    array), or None where this kernel does not apply (see the module)."""
    if not enabled or _conv1c is None or type(x) is not np.ndarray or type(w) is not np.ndarray:
        return None
    if x.ndim != 4 or x.shape[1] != 1 or w.ndim != 4 or w.shape[1] != 1 or x.dtype.char not in "fd":
        return None
    n, _, h, wd = x.shape
    f, _, kh, kw = w.shape
    oh, ow = h - kh + 1, wd - kw + 1
    if oh < 1 or ow < _LANES[x.dtype.itemsize] or not (_ones(stride) and _ones(dilation)):
        return None
    if w.dtype != x.dtype or not (x.flags.c_contiguous and w.flags.c_contiguous):
        return None
    if b is not None and (type(b) is not np.ndarray or b.dtype != x.dtype or b.shape != (f,)
                          or not b.flags.c_contiguous):
        return None
    shape = (n, f, oh, ow)
    if out is None:
        out = np.empty(shape, x.dtype)
    elif (type(out) is not np.ndarray or out.shape != shape or out.dtype != x.dtype
          or not out.flags.c_contiguous):
        return None
    _conv1c.fwd(x.itemsize, x, n, h, wd, w, f, kh, kw, b, out)
    return out
