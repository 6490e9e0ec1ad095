"""PyTorch's ATen convolutions on lbannpy's arrays: oneDNN on the CPU, cuDNN on a GPU, zero-copy by DLPack.

Same signatures and semantics as the own kernels of :mod:`.conv` (valid convolutions of the window the layer
hands over, halo and padding included; 1, 2 or 3 spatial dimensions; float32 or float64), so a layer can take
either set (:mod:`.select`). ``torch.from_dlpack`` wraps a NumPy or CuPy array without a copy and
``xp.from_dlpack`` hands the result back the same way; a result goes into a caller's ``out`` buffer with one
copy. On a GPU the calls run on CuPy's current stream (an external stream to torch), so they are ordered with
the surrounding CuPy work without a host synchronisation. Torch is imported on first use only.
"""
from __future__ import annotations

import os

_torch = None


def torch():
    """The torch module, imported once; its intra-op threads follow the rank's thread choice."""
    global _torch
    if _torch is None:
        import torch as t

        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            t.set_num_threads(int(threads))
        _torch = t
    return _torch


def available(device: str = "cpu") -> bool:
    """Whether ATen kernels can run here: torch imports (and, for ``gpu``, sees a CUDA device)."""
    try:
        t = torch()
    except ImportError:
        return False
    return device != "gpu" or bool(t.cuda.is_available())


def _tuple(v, nd: int) -> tuple:
    return tuple(int(s) for s in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def _xp(a):
    import numpy as np

    return np if isinstance(a, np.ndarray) else __import__("cupy")


class _on_stream:
    """CuPy arrays: run torch's kernels on CuPy's current stream; NumPy arrays: nothing to do."""

    def __init__(self, a):
        self.ctx = None
        if _xp(a).__name__ == "cupy":
            t = torch()
            cp = _xp(a)
            self.ctx = t.cuda.stream(t.cuda.ExternalStream(cp.cuda.get_current_stream().ptr))

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _t(a):
    return torch().from_dlpack(a)


def _back(result, like, out=None):
    if out is not None:
        _t(out).copy_(result)
        return out
    return _xp(like).from_dlpack(result)


def conv_forward(x_window, w, b=None, stride=1, dilation=1, out=None):
    """Valid convolution of the window: ``(N, F, *out)``."""
    nd = x_window.ndim - 2
    fn = getattr(torch().nn.functional, f"conv{nd}d")
    with _on_stream(x_window):
        y = fn(_t(x_window), _t(w), None if b is None else _t(b), _tuple(stride, nd), 0,
               _tuple(dilation, nd))
        return _back(y, x_window, out)


def conv_backward_data(dy, w, x_window_shape, stride=1, dilation=1, out=None):
    """Gradient w.r.t. the window, of shape ``x_window_shape``."""
    nd = dy.ndim - 2
    fn = getattr(torch().nn.grad, f"conv{nd}d_input")
    with _on_stream(dy):
        dx = fn(tuple(int(s) for s in x_window_shape), _t(w), _t(dy), _tuple(stride, nd), 0,
                _tuple(dilation, nd))
        return _back(dx, dy, out)


def conv_backward_filter(x_window, dy, w_shape, stride=1, dilation=1):
    """Gradient w.r.t. the filter, of shape ``w_shape``."""
    nd = dy.ndim - 2
    fn = getattr(torch().nn.grad, f"conv{nd}d_weight")
    with _on_stream(dy):
        dw = fn(_t(x_window), tuple(int(s) for s in w_shape), _t(dy), _tuple(stride, nd), 0,
                _tuple(dilation, nd))
        return _back(dw, dy)
