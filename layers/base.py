"""The layer template: the base class owns distribution, a subclass owns local math.

``forward`` and ``backward`` are fixed here (LBANN's ``forward_prop``): bring every input into the layer's
input distribution (a redistribution planned once, reversed in backprop), call the subclass's
``fp_compute`` / ``bp_compute`` on local arrays, and wrap the result. Subclasses see local ``xp`` arrays
and a :class:`LayerContext`; they never import MPI. A layer that is inherently collective (batch-norm
statistics, a model-parallel fully-connected layer) uses one explicit collective on a group communicator
that the context hands out.

Weight gradients are *local partial sums*; each :class:`Param` names the group over which they must be
summed, and the trainer's gradient synchronisation does that (never the layer).
"""
from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from lbannpy.dist import Box, Distribution, DistributionError, box_shape, shape_str
from lbannpy.shuffle import ShufflePlan, same_layout
from lbannpy.tensor import DistTensor


class LayerError(ValueError):
    """A layer that cannot be built as asked: names the layer, distribution, shapes and the fix."""


@dataclass
class Timer:
    """Accumulates wall time per (layer, phase) and, when tracing, the intervals themselves."""

    totals: dict = field(default_factory=dict)
    events: list | None = None

    def add(self, key: tuple, t0: float, t1: float, track: str = "compute") -> None:
        self.totals[key] = self.totals.get(key, 0.0) + (t1 - t0)
        self.span(key, t0, t1, track)

    def span(self, key: tuple, t0: float, t1: float, track: str = "compute") -> None:
        """An interval for the trace only (e.g. a span enclosing per-layer events), not counted in totals."""
        if self.events is not None:
            self.events.append((track, key, t0, t1))


class LayerContext:
    """What a layer may use: the world communicator, the array module, dtype, seed and group comms.

    Group communicators are created by ``world.split`` (collective over the world). They are cached by a
    key that is identical on every rank (distribution and dimension names, never the rank's own group), so
    every rank issues the same splits in the same order.
    """

    def __init__(self, comm, xp=np, dtype="float32", seed: int = 0, overlap: bool = True,
                 timer: Timer | None = None):
        self.comm = comm
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.seed = int(seed)
        self.overlap = overlap
        self.timer = timer or Timer()
        self._groups: dict = {}  # (kind, distribution, dims) -> communicator
        self._partitions: dict = {}  # partition key -> communicator
        self._tags = 100
        self._workspace: dict = {}

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

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
        dtype = np.dtype(dtype)
        need = math.prod(shape) * dtype.itemsize
        buf = self._workspace.get(slot)
        if buf is None or buf.nbytes < need:
            buf = self._workspace[slot] = None  # drop the smaller buffer before allocating the larger
            buf = self._workspace[slot] = self.xp.empty(need, dtype=np.uint8)
        return buf[:need].view(dtype).reshape(tuple(shape))

    def new_tag(self, count: int = 1) -> int:
        """Message tags for a layer's halo plans (identical on all ranks: layers are set up in order)."""
        t = self._tags
        self._tags += count
        return t


@dataclass
class Param:
    """A trainable tensor. ``value``/``grad`` hold the local piece ``box`` of a ``global_shape`` tensor.

    ``grad`` after backward is a local partial sum; it must be summed over ``reduce_dims`` of ``dist``
    (the layer's distribution the partial sums follow), i.e. over ``dist.block_group(rank, reduce_dims)``.
    """

    name: str
    global_shape: tuple
    box: Box
    value: Any
    grad: Any
    dist: Distribution
    reduce_dims: tuple

    @property
    def size(self) -> int:
        return int(math.prod(box_shape(self.box)))


def stable_seed(*parts) -> int:
    """A 32-bit seed from names and numbers, identical on every rank and every run."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class Layer:
    """Base class of every layer. Subclasses set ``type`` and implement ``setup``, ``fp_compute`` and
    ``bp_compute`` (plus ``params`` when trainable)."""

    type = "layer"
    #: tensor dimensions a layer of this type may split (Jia et al., Table 1)
    splittable = ("n", "c", "d", "h", "w")
    #: number of inputs (None: any number >= 1)
    arity: int | None = 1

    def __init__(self, name: str, **params):
        self.name = name
        self.hparams = params
        self.params: list[Param] = []
        self.ctx: LayerContext | None = None
        self.in_shapes: list[tuple] = []
        self.in_dists: list[Distribution] = []
        self.out_shape: tuple = ()
        self.out_dist: Distribution | None = None
        self._in_plans: list = []
        self._parent_dists: list[Distribution] = []
        self.train = True
        # False while backprop wants no gradient w.r.t. this layer's inputs (they are the model input):
        # layers that can skip computing it (conv, fc) return None for it
        self.needs_input_grad = True
        # True for a layer reading only the model input (set by Model): it is back-propagated last, so
        # buffers it holds from its forward to its backward may as well be kept from step to step
        self.keeps_window = False

    # -- set-up --------------------------------------------------------------------------------------
    def configure(self, ctx: LayerContext, in_shapes: Sequence[tuple], parent_dists: Sequence[Distribution],
                  dist: Distribution) -> None:
        """Build the layer for inputs of ``in_shapes`` arriving in ``parent_dists``, computing in ``dist``.

        Called in the same order on every rank (it may create group communicators).
        """
        if self.arity is not None and len(in_shapes) != self.arity:
            raise LayerError(f"layer '{self.name}' ({self.type}) takes {self.arity} input(s), got "
                             f"{len(in_shapes)}")
        self.ctx = ctx
        self.in_shapes = [tuple(s) for s in in_shapes]
        bad = [d for d in self.dist_dims(dist) if d not in self.splittable]
        if bad:
            raise LayerError(
                f"layer '{self.name}' ({self.type}) cannot split dimension(s) {bad} (distribution {dist}, "
                f"input {', '.join(shape_str(s) for s in self.in_shapes)}); a {self.type} layer splits only "
                f"{'/'.join(self.splittable)}")
        try:
            self.setup(dist)
            for s, d in zip(self.in_shapes, self.in_dists):
                d.check_shape(s, f"input of layer '{self.name}'")
            self.out_dist.check_shape(self.out_shape, f"output of layer '{self.name}'")
        except DistributionError as exc:
            raise LayerError(f"layer '{self.name}' ({self.type}): {exc}") from exc
        # no redistribution where every rank already holds the block it needs (equal distributions, or
        # different descriptions of one layout, e.g. whole copies as replicas or along a replicated axis)
        self._in_plans = []
        self._parent_dists = list(parent_dists)
        for s, src, dst in zip(self.in_shapes, parent_dists, self.in_dists):
            same = src == dst or same_layout(src, dst, s)
            self._in_plans.append(None if same else ShufflePlan(src, dst, s, ctx.rank))

    @staticmethod
    def dist_dims(dist: Distribution) -> list[str]:
        return [n for n, p in zip(dist.dim_names, dist.parts) if p > 1]

    def setup(self, dist: Distribution) -> None:
        """Set ``in_dists``, ``out_shape``, ``out_dist``, parameters and plans. Default: elementwise."""
        self.in_dists = [dist] * len(self.in_shapes)
        self.out_shape = self.in_shapes[0]
        self.out_dist = dist

    # -- parameters ------------------------------------------------------------------------------------
    def new_param(self, pname: str, global_shape: tuple, init: np.ndarray | None, box: Box | None,
                  dist: Distribution, reduce_dims: Sequence[str]) -> Param:
        """A parameter initialised identically on all ranks (global values, then this rank's ``box``)."""
        global_shape = tuple(int(s) for s in global_shape)
        box = box or tuple((0, s) for s in global_shape)
        full = np.zeros(global_shape) if init is None else init
        piece = full[tuple(slice(a, b) for a, b in box)]
        xp = self.ctx.xp
        value = xp.asarray(np.ascontiguousarray(piece), dtype=self.ctx.dtype)
        p = Param(f"{self.name}.{pname}", global_shape, box, value, xp.zeros_like(value), dist,
                  tuple(reduce_dims))
        self.params.append(p)
        return p

    def rng(self, what: str) -> np.random.Generator:
        return np.random.default_rng(stable_seed(self.ctx.seed, self.name, what))

    # -- the fixed template ----------------------------------------------------------------------------
    def forward(self, inputs: Sequence[DistTensor]) -> DistTensor:
        ctx = self.ctx
        xs = []
        for i, x in enumerate(inputs):
            plan = self._in_plans[i]
            if plan is None:
                xs.append(x.local)
            else:
                t0 = time.perf_counter()
                xs.append(plan.start(ctx.comm, x.local).wait())
                ctx.timer.add((self.name, "shuffle"), t0, time.perf_counter(), "comm")
        t0 = time.perf_counter()
        y = self.fp_compute(xs)
        ctx.timer.add((self.name, "fp"), t0, time.perf_counter())
        return DistTensor.wrap(y, self.out_shape, self.out_dist, ctx.rank)

    def backward(self, dy: DistTensor) -> list[DistTensor]:
        ctx = self.ctx
        t0 = time.perf_counter()
        dxs = self.bp_compute(dy.local)
        ctx.timer.add((self.name, "bp"), t0, time.perf_counter())
        out = []
        for i, dx in enumerate(dxs):
            plan = self._in_plans[i]
            if dx is None:  # not wanted (needs_input_grad) and not computed
                out.append(None)
            elif plan is None:  # the parent's layout, as the parent gave it
                out.append(DistTensor.wrap(dx, self.in_shapes[i], self._parent_dists[i], ctx.rank))
            else:
                t0 = time.perf_counter()
                back = plan.reverse()
                out.append(DistTensor.wrap(back.start(ctx.comm, dx).wait(), self.in_shapes[i], back.dst_dist,
                                      ctx.rank))
                ctx.timer.add((self.name, "shuffle_bp"), t0, time.perf_counter(), "comm")
        return out

    def state(self) -> dict:
        """Collective over the world: non-parameter state (running statistics, counters) in a
        distribution-independent form of plain numbers and lists, for checkpoints."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`, possibly written under another distribution or rank count."""

    def fp_compute(self, xs: list) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def bp_compute(self, dy) -> list:  # pragma: no cover - abstract
        raise NotImplementedError

    def local_box(self, which: str = "out", i: int = 0) -> Box:
        if which == "out":
            return self.out_dist.box(self.out_shape, self.ctx.rank)
        return self.in_dists[i].box(self.in_shapes[i], self.ctx.rank)

    def __repr__(self) -> str:
        return f"<{self.type} '{self.name}' {self.out_dist}>"
