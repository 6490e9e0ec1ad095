"""The layer template's shared pieces: one scratch-buffer mechanism for kernels and layers."""
from __future__ import annotations

import numpy as np

from lbannpy.layers.base import LayerContext
from lbannpy.layers.kernels import _buffers
from lbannpy.layers.kernels import conv as kconv
from lbannpy.layers.kernels import pool as kpool


def test_scratch_reuses_one_buffer_per_slot_and_grows():
    s = _buffers.Scratch(np)
    a = s.get("x", (4, 5), np.float64)
    b = s.get("x", (2, 3), np.float32)  # smaller: the same memory
    assert a.shape == (4, 5) and b.shape == (2, 3) and b.dtype == np.float32
    assert np.shares_memory(a, b)
    c = s.get("x", (10, 10), np.float64)  # larger: a new buffer
    assert c.shape == (10, 10) and not np.shares_memory(a, c)
    d = s.get("y", (2, 3), np.float32)  # another slot never aliases
    assert not np.shares_memory(c, d)


def test_layers_and_kernels_use_the_same_mechanism():
    ctx = LayerContext(None, np, "float64")
    w = ctx.workspace("conv window gradient", (3, 4), np.float64)
    assert isinstance(ctx._workspace, _buffers.Scratch)
    assert np.shares_memory(w, ctx.workspace("conv window gradient", (2, 2), np.float64))
    assert kconv._scratch is _buffers.scratch
    # both compiled kernels take addresses from the shared home, not from each other
    assert kconv._addr is _buffers.addr and kpool._addr is _buffers.addr
    x = np.arange(6.0)
    assert _buffers.addr(x[2:]) - _buffers.addr(x) == 2 * x.itemsize
