"""Fully-connected layer: ``y = x @ W^T + b`` with ``x`` ``(N, in)``, ``W`` ``(out, in)`` (PyTorch's
``nn.Linear`` layout), ``b`` ``(out,)``. Plain GEMMs; the distributed layer decides which block of
``x``, ``W`` and ``y`` each rank holds."""
from __future__ import annotations

from lbannpy.backend import array_module


def fc_forward(x, w, b=None):
    y = x @ w.T
    if b is not None:
        y += b
    return y


def fc_backward_data(dy, w):
    """``dx = dy @ W``."""
    return dy @ w


def fc_backward_filter(x, dy, out=None):
    """``dW = dy^T @ x`` (summed over the local samples; the caller reduces over sample groups), into
    ``out`` when given."""
    if out is None:
        return dy.T @ x
    return array_module(dy).matmul(dy.T, x, out=out)


def fc_backward_bias(dy):
    return dy.sum(axis=0)
