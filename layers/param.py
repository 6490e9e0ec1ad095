"""A layer's trainable tensor: this rank's piece, its gradient and the group its partial sums span."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lbannpy.dist import Box, Distribution, box_shape


@dataclass
class Param:
    """A trainable tensor. ``value``/``grad`` hold the local piece ``box`` of a ``global_shape`` tensor.

    ``grad`` after backward is a local partial sum; it must be summed over ``reduce_dims`` of ``dist``
    (the layer's distribution the partial sums follow), i.e. over ``dist.block_group(rank, reduce_dims)``.

    A ``lazy`` parameter's layer adds its gradient through :meth:`accumulate` / :meth:`grad_into` only; the
    optimizer then marks ``grad`` ``stale`` between steps instead of writing zeros over it, and the first
    contribution of a step overwrites it (a weight-sized pass saved per step, two for a fully-connected layer
    whose product is written straight into ``grad``). Whoever reads ``grad`` after backward (the overlap
    engine, the optimizer) calls :meth:`settle` first, which zeroes a gradient that got no contribution.
    """

    name: str
    global_shape: tuple
    box: Box
    value: Any
    grad: Any
    dist: Distribution
    reduce_dims: tuple
    lazy: bool = False
    stale: bool = False

    @property
    def size(self) -> int:
        return int(math.prod(box_shape(self.box)))

    def accumulate(self, g) -> None:
        """Add one contribution ``g`` to ``grad`` (written over it when ``grad`` is stale)."""
        if self.stale:
            self.grad[...] = g
            self.stale = False
        else:
            self.grad += g

    def grad_into(self):
        """``grad`` when this step's first contribution may be written straight into it (it then counts
        as made), else None (add into it)."""
        if self.stale:
            self.stale = False
            return self.grad
        return None

    def settle(self) -> None:
        """Before ``grad`` is read: a stale gradient (no contribution this step) becomes zeros."""
        if self.stale:
            self.grad[...] = 0
            self.stale = False

