"""The layer template: the base class owns distribution, a subclass owns local math.

``forward`` and ``backward`` are fixed here (LBANN's ``forward_prop``): bring every input into the layer's
input distribution (a redistribution planned once, reversed in backprop), call the subclass's
``fp_compute`` / ``bp_compute`` on local arrays, and wrap the result. Subclasses see local ``xp`` arrays
and a :class:`~lbannpy.layers.context.LayerContext`; they never import MPI. A layer that is inherently
collective (batch-norm statistics, a model-parallel fully-connected layer) uses one explicit collective on
a group communicator that the context hands out.

Stencil layers (a window over space: conv, pool) derive from :class:`~lbannpy.layers.halo_layer.HaloLayer`,
the template's halo part. A layer type's declaration (keys and defaults, arity, splits, shape inference)
is its ``spec``, registered beside the class (:mod:`lbannpy.layers.registry`).

Weight gradients are *local partial sums*; each :class:`~lbannpy.layers.param.Param` names the group over
which they must be summed, and the trainer's gradient synchronisation does that (never the layer).
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

import numpy as np

from lbannpy.dist import Box, Distribution, DistributionError, shape_str
from lbannpy.shuffle import same_layout, shuffle_plan
from lbannpy.tensor import DistTensor, block_shape

from .context import LayerContext
from .param import Param


class LayerError(ValueError):
    """A layer that cannot be built as asked: names the layer, distribution, shapes and the fix."""



def stable_seed(*parts) -> int:
    """A 32-bit seed from names and numbers, identical on every rank and every run."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class Layer:
    """Base class of every layer. Subclasses set ``type`` and implement ``setup``, ``fp_compute`` and
    ``bp_compute`` (plus ``params`` when trainable)."""

    type = "layer"
    #: the type's declaration (:class:`lbannpy.layers.registry.LayerSpec`), set with ``type``,
    #: ``splittable`` and ``arity`` by ``@register(spec)``
    spec = None
    #: tensor dimensions a layer of this type may split (Jia et al., Table 1)
    splittable = ("n", "c", "d", "h", "w")
    #: number of inputs (None: any number >= 1)
    arity: int | None = 1
    #: the layer's backward may read its own output (False: a reader may overwrite the output when it is
    #: the only reader)
    output_kept = True
    #: a pointwise layer that can run inside a ``fuses_relu`` parent, or overwrite its input in place
    fusable_activation = False
    #: the layer can apply a following ``fusable_activation`` itself (sets ``fuse_relu`` when the model
    #: asks)
    fuses_relu = False

    def __init__(self, name: str, **params):
        self.name = name
        # the declared defaults filled in once here, so that ``setup`` reads ``hparams[key]`` and repeats none
        self.hparams = self.spec.resolve(params) if self.spec is not None else params
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
            # from the cache that also serves the reverse plans (src/shuffle.py): one plan per layout pair
            self._in_plans.append(None if same else shuffle_plan(src, dst, s, ctx.rank))
        self._cache_step_geometry()

    @property
    def in_plans(self) -> Sequence:
        """Per input, the :class:`~lbannpy.shuffle.ShufflePlan` into this layer's layout (None: none);
        read-only (fixed at set-up)."""
        return self._in_plans

    @property
    def parent_dists(self) -> Sequence[Distribution]:
        """Per input, the distribution its parent hands it in; read-only (fixed at set-up)."""
        return self._parent_dists

    def _cache_step_geometry(self) -> None:
        """What every step's ``forward``/``backward`` needs and set-up fixed: whether any input moves, this
        rank's output block and the blocks of the input gradients in the layouts they are handed back in,
        so a step wraps its tensors with one shape comparison each and no cache lookup."""
        rank = self.ctx.rank
        self._moves = any(p is not None for p in self._in_plans)
        self._out_block = block_shape(self.out_dist, tuple(self.out_shape), rank)
        self._back_plans = [None if plan is None else plan.reverse() for plan in self._in_plans]
        self._grad_geom = []
        for s, back, src in zip(self.in_shapes, self._back_plans, self._parent_dists):
            d = src if back is None else back.dst_dist
            self._grad_geom.append((s, d, block_shape(d, tuple(s), rank)))

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
                  dist: Distribution, reduce_dims: Sequence[str], lazy: bool = False) -> Param:
        """A parameter initialised identically on all ranks (global values, then this rank's ``box``);
        ``lazy``: see :class:`Param` (its layer adds gradients only through ``accumulate``/``grad_into``)."""
        global_shape = tuple(int(s) for s in global_shape)
        box = box or tuple((0, s) for s in global_shape)
        full = np.zeros(global_shape) if init is None else init
        piece = full[tuple(slice(a, b) for a, b in box)]
        xp = self.ctx.xp
        value = xp.asarray(np.ascontiguousarray(piece), dtype=self.ctx.dtype)
        p = Param(f"{self.name}.{pname}", global_shape, box, value, xp.zeros_like(value), dist,
                  tuple(reduce_dims), lazy)
        self.params.append(p)
        return p

    def rng(self, what: str) -> np.random.Generator:
        return np.random.default_rng(stable_seed(self.ctx.seed, self.name, what))

    # -- the fixed template ----------------------------------------------------------------------------
    def forward(self, inputs: Sequence[DistTensor]) -> DistTensor:
        ctx = self.ctx
        timer = ctx.timer
        if self._moves:
            # every redistribution is posted before any is waited for, so those of several inputs overlap
            t0 = timer.now()
            moving = [None if plan is None else plan.start(ctx.comm, x.local)
                      for plan, x in zip(self._in_plans, inputs)]
            xs = [x.local if h is None else h.wait() for h, x in zip(moving, inputs)]
            timer.add((self.name, "shuffle"), t0, timer.now(), "comm")
        else:
            xs = [x.local for x in inputs]
        t0 = timer.now()
        y = self.fp_compute(xs)
        timer.add((self.name, "fp"), t0, timer.now())
        return DistTensor.trusted(y, self.out_shape, self.out_dist, ctx.rank, self._out_block)

    def backward(self, dy: DistTensor) -> list[DistTensor]:
        ctx = self.ctx
        timer = ctx.timer
        t0 = timer.now()
        dxs = self.bp_compute(dy.local)
        timer.add((self.name, "bp"), t0, timer.now())
        rank, trusted = ctx.rank, DistTensor.trusted
        if not self._moves:  # every gradient goes back in its parent's layout, as the parent gave it
            return [None if dx is None else trusted(dx, s, d, rank, b)
                    for dx, (s, d, b) in zip(dxs, self._grad_geom)]
        # the reverse redistributions of all inputs are posted before any is waited for (the parents'
        # backward needs every one of them, so none can be left in flight past this call)
        t0 = timer.now()
        moving = [None if b is None or dx is None else b.start(ctx.comm, dx)
                  for b, dx in zip(self._back_plans, dxs)]
        out = []
        for dx, h, (s, d, b) in zip(dxs, moving, self._grad_geom):
            if dx is None:  # not wanted (needs_input_grad) and not computed
                out.append(None)
            else:  # the parent's layout: as the parent gave it, or brought back by the reverse plan
                out.append(trusted(dx if h is None else h.wait(), s, d, rank, b))
        if any(h is not None for h in moving):
            timer.add((self.name, "shuffle_bp"), t0, timer.now(), "comm")
        return out

    def state(self) -> dict:
        """Not collective: non-parameter state (running statistics, counters) for checkpoints, name ->
        a plain number (the same on every rank; rank 0's is kept) or a
        :class:`lbannpy.checkpoint.StateTensor` (this rank's block of a tensor, its writer marked)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore :meth:`state`, possibly written under another distribution or rank count: plain
        numbers as written, tensors as :class:`lbannpy.checkpoint.StateReader` (``read(box)``). Called
        first on a shallow copy of the layer (a dry run that must fail before anything changes), so it
        assigns attributes rather than writing into existing arrays."""

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
