"""What a layer's checkpointed state is made of (:meth:`lbannpy.layers.base.Layer.state`): tensors, each
this rank's block of a global tensor with the rank that writes it marked. :mod:`lbannpy.checkpoint` writes
and reads them; it re-exports both names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

Box = tuple


def is_writer(dist, reduce_dims: Sequence[str], rank: int) -> bool:
    """Whether ``rank`` writes its block of a tensor laid out by ``dist`` whose block depends only on
    the coordinates outside ``reduce_dims``: replica 0 of the block, coordinate 0 along ``reduce_dims``.
    O(ndim), pure. (A block rule this misjudges is caught when the index is built: blocks must tile.)"""
    if dist.copy_index(rank) != 0:
        return False
    coords = dist.coords(rank)
    names = dist.dim_names
    return all(coords[names.index(d)] == 0 for d in reduce_dims)


@dataclass(frozen=True)
class StateTensor:
    """A layer's non-parameter tensor in a checkpoint: this rank's ``value`` is block ``box`` of a
    ``global_shape`` tensor, written by the rank marked ``writer`` (see :meth:`Layer.state`)."""

    global_shape: tuple
    box: Box
    value: Any
    writer: bool
