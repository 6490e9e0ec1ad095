"""Fully-connected layer: ``y = x @ W^T + b`` with ``x`` ``(N, in)``, ``W`` ``(out, in)`` (PyTorch's
``nn.Linear`` layout), ``b`` ``(out,)``. Plain GEMMs; the distributed layer decides which block of
``x``, ``W`` and ``y`` each rank holds."""
from __future__ import annotations


def fc_forward(x, w, b=None):
    y = x @ w.T
    if b is not None:
        y += b
    return y


def fc_backward_data(dy, w):
    """``dx = dy @ W``."""
    return dy @ w


def fc_backward_filter(x, dy):
    """``dW = dy^T @ x`` (summed over the local samples; the caller reduces over sample groups)."""
    return dy.T @ x


def fc_backward_bias(dy):
    return dy.sum(axis=0)
