"""Element-wise layers: ReLU, leaky ReLU and dropout (with a split-independent mask).

Dropout masks come from a counter-based hash (a chain of splitmix64 finalisers) of
``(seed, step, layer_id, global coordinates)``: an element's mask bit depends only on its global index, so
any distribution of the tensor over ranks draws the same mask, and nothing has to be stored between the
forward and backward pass beyond the keys.
"""
from __future__ import annotations

import numpy

from lbannpy.backend import array_module, get_xp

from .batchnorm import relu_mask

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def relu_forward(x, out=None):
    """``max(x, 0)`` (NaN propagates, as in PyTorch); into ``out`` when given (``out=x``: in place)."""
    xp = array_module(x)
    if out is None:
        return xp.maximum(x, x.dtype.type(0))
    xp.maximum(x, x.dtype.type(0), out=out)
    return out


def relu_backward(dy, x):
    """``dy`` where ``x > 0``, else 0 (ReLU's subgradient at 0 is 0, as in PyTorch). ``x`` may as well be
    the ReLU's output: it is positive exactly where the input is. One compiled pass on NumPy arrays."""
    return relu_mask(dy, x)


def leaky_relu_forward(x, slope=0.01):
    xp = array_module(x)
    return xp.where(x > 0, x, x * x.dtype.type(slope))


def leaky_relu_backward(dy, x, slope=0.01):
    xp = array_module(x)
    return xp.where(x > 0, dy, dy * dy.dtype.type(slope))


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (used to derive the per-layer, per-step key)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _mix(xp, z):
    """splitmix64 finaliser, element-wise on a uint64 array (wrapping arithmetic)."""
    z = z + xp.uint64(_GOLDEN)
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_M1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_M2)
    return z ^ (z >> xp.uint64(31))


def dropout_mask(seed, step, layer_id, global_box, p, xp=None, dtype=numpy.float32):
    """Multiplier of the elements in ``global_box`` (``((start, stop), ...)`` in global coordinates):
    ``1/(1-p)`` where kept, ``0`` where dropped; each element is dropped with probability ``p``.

    The result depends only on ``(seed, step, layer_id)`` and each element's global coordinates.
    ``xp`` is the array module of the result (NumPy by default; a module or 'numpy'/'cupy'). ``step`` is an
    int, or a one-element uint64 array of ``xp`` (a step counter in device memory: the key is then derived
    on the device, so a replayed launch draws the mask of the counter's current value).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if xp is None or isinstance(xp, str):
        xp = get_xp(xp or "numpy")
    ndim = len(global_box)
    key = _mix_int(int(seed) & _MASK64)
    if not hasattr(step, "reshape"):
        key = _mix_int(key ^ (int(step) & _MASK64))
        key = _mix_int(key ^ (int(layer_id) & _MASK64))
        h = xp.full((1,) * ndim, key, dtype=xp.uint64)
    else:  # the same splitmix64 chain, on the device counter
        h = _mix(xp, step.reshape((1,) * ndim) ^ xp.uint64(key))
        h = _mix(xp, h ^ xp.uint64(int(layer_id) & _MASK64))
    for i, (lo, hi) in enumerate(global_box):
        if lo < 0 or hi < lo:
            raise ValueError(f"dropout box {tuple(global_box)}: need 0 <= start <= stop in every dimension")
        shape = [1] * ndim
        shape[i] = hi - lo
        coord = xp.arange(lo, hi, dtype=xp.uint64).reshape(shape)
        h = _mix(xp, h ^ coord)
    # top 53 bits as a uniform integer in [0, 2**53); drop when below p * 2**53
    threshold = xp.uint64(min(int(p * (1 << 53)), 1 << 53))
    keep = (h >> xp.uint64(11)) >= threshold
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return keep.astype(dtype) * numpy.dtype(dtype).type(scale)


def dropout_forward(x, mask):
    return x * mask


def dropout_backward(dy, mask):
    return dy * mask
