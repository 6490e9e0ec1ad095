"""Scratch buffers and raw addresses, shared by the kernels and the layer context.

A fresh multi-MB array costs a page fault per 4 KiB on every call once malloc has handed the previous one
back to the system, which on a large image costs as much as the arithmetic. So temporaries that live only
inside one call (the compiled convolution's phase splits and padded ``dy``) or inside one layer's forward or
backward (a convolution's window gradient until its halo accumulation ends) come from a :class:`Scratch`:
one uninitialised buffer per slot, grown to the largest request and reused. A result handed to a caller
must never be such a view.
"""
from __future__ import annotations

import math
import threading
from typing import Sequence

import numpy as np


class Scratch:
    """Reused, uninitialised C-contiguous arrays of one array module (``xp``), one buffer per slot."""

    def __init__(self, xp=np):
        self.xp = xp
        self._bufs: dict = {}
        # (slot, shape, dtype) -> the view handed out last time: the same request every step costs one
        # dictionary hit; views of a slot are dropped when its buffer grows
        self._views: dict = {}

    def get(self, slot: str, shape: Sequence[int], dtype):
        key = (slot, tuple(shape), dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        dtype = np.dtype(dtype)
        need = math.prod(shape) * dtype.itemsize
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < need:
            buf = self._bufs[slot] = None  # drop the smaller buffer before allocating the larger
            self._views = {k: v for k, v in self._views.items() if k[0] != slot}
            buf = self._bufs[slot] = self.xp.empty(need, dtype=np.uint8)
        view = self._views[key] = buf[:need].view(dtype).reshape(tuple(shape))
        return view


_THREAD = threading.local()


def scratch(slot: str, shape: Sequence[int], dtype):
    """A NumPy scratch array of this thread (the compiled kernels' temporaries; threads never share one)."""
    s = getattr(_THREAD, "scratch", None)
    if s is None:
        s = _THREAD.scratch = Scratch(np)
    return s.get(slot, shape, dtype)


def addr(a) -> int:
    """The address of a NumPy array's first element (for the compiled kernels)."""
    return a.__array_interface__["data"][0]
