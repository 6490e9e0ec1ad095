"""What a layer may use besides its own inputs: communicators, array module, dtype, seed, workspaces."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lbannpy.dist import Distribution

from .kernels._buffers import Scratch
from .timer import Timer


class LayerContext:
    """What a layer may use: the world communicator, the array module, dtype, seed and group comms.

    Group communicators are created by ``world.split`` (collective over the world). They are cached by a
    key that is identical on every rank (distribution and dimension names, never the rank's own group), so
    every rank issues the same splits in the same order.
    """

    def __init__(self, comm, xp=np, dtype="float32", seed: int = 0, overlap: bool = True,
                 timer: Timer | None = None, fuse: bool = True):
        self.comm = comm
        # a model built in this context runs a ReLU that only reads a batch-norm inside it, and a ReLU that
        # alone reads its parent's output in place (False: every layer on its own, e.g. to compare)
        self.fuse = fuse
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.seed = int(seed)
        self.overlap = overlap
        self.timer = timer or Timer()
        self._groups: dict = {}  # (kind, distribution, dims) -> communicator
        self._partitions: dict = {}  # partition key -> communicator
        self._tags = 100
        self._workspace = Scratch(xp)
        # the conv kernel set of the run (runtime.kernels; None: lbannpy's own) and, per (layer type, local
        # input shape, local output shape), the set a calibration found faster there (select.kernel_table)
        self.conv_kernels = None
        self.conv_kernel_table: dict = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def group_keys(self) -> tuple[list, list]:
        """The keys of the group communicators made so far: ``(block and grid groups, partitions)``."""
        return list(self._groups), list(self._partitions)

    def block_comm(self, dist: Distribution, dims: Sequence[str] | None = None):
        """Collective over the world (on first use of a partition): the communicator of
        ``dist.block_group``. Distributions that cut the ranks into the same groups share it."""
        key = ("block", dist, None if dims is None else tuple(dims))
        comm = self._groups.get(key)  # looked up before anything is computed: one dict hit per call
        if comm is None:
            comm = self._groups[key] = self._group_comm(dist.block_group_spec(self.rank, dims))
        return comm

    def grid_comm(self, dist: Distribution, dims: Sequence[str]):
        """Collective over the world (on first use of a partition): the communicator of ``dist.group``."""
        key = ("grid", dist, tuple(dims))
        comm = self._groups.get(key)
        if comm is None:
            comm = self._groups[key] = self._group_comm(dist.group_spec(self.rank, dims))
        return comm

    def _group_comm(self, spec):
        # ``spec.key`` names the whole partition of the ranks, the same on every rank, so every rank splits
        # (or reuses) at the same moments; the colour comes from this rank's grid coordinates in O(ndim)
        comm = self._partitions.get(spec.key)
        if comm is None:
            comm = self._partitions[spec.key] = self.comm.group(spec)
        return comm

    def workspace(self, slot: str, shape: Sequence[int], dtype):
        """A reused, uninitialised C-contiguous array for a temporary that lives only inside one layer's
        forward or backward (e.g. a convolution's window gradient until its halo accumulation ends); one
        buffer per slot, shared by every layer, grown to the largest request. A fresh array of that size
        on every call costs a page fault per page, which on a large image costs as much as the arithmetic."""
        return self._workspace.get(slot, shape, dtype)

    def new_tag(self, count: int = 1) -> int:
        """Message tags for a layer's halo plans (identical on all ranks: layers are set up in order)."""
        t = self._tags
        self._tags += count
        return t

