"""The layer template: the base class owns distribution, a subclass owns local math.

``forward`` and ``backward`` are fixed here (LBANN's ``forward_prop``): bring every input into the layer's
input distribution (a redistribution planned once, reversed in backprop), call the subclass's
``fp_compute`` / ``bp_compute`` on local arrays, and wrap the result. Subclasses see local ``xp`` arrays
and a :class:`LayerContext`; they never import MPI. A layer that is inherently collective (batch-norm
statistics, a model-parallel fully-connected layer) uses one explicit collective on a group communicator
that the context hands out.

Stencil layers (a window over space: conv, pool) use the template's halo part: ``plan_halo`` in ``setup``,
``halo_forward`` (the exchange in flight while the interior of the output block is computed, then the
boundary) and ``halo_backward`` (the accumulation in flight while e.g. the weight gradient is computed).
A layer type's declaration (keys and defaults, arity, splits, shape inference) is its ``spec``, registered
beside the class (:mod:`lbannpy.layers.registry`).

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

from lbannpy.dist import Box, Distribution, DistributionError, box_shape, box_size, shape_str
from lbannpy.stencil import Stencil
from lbannpy.shuffle import same_layout, shuffle_plan
from lbannpy.tensor import DistTensor, block_shape

from .kernels._buffers import Scratch


class LayerError(ValueError):
    """A layer that cannot be built as asked: names the layer, distribution, shapes and the fix."""


@dataclass
class Timer:
    """Accumulates time per (layer, phase) and, when tracing, the intervals themselves.

    The time points come from :meth:`now`: the host's ``perf_counter`` seconds, or with a device ``clock``
    (CUDA events recorded on the compute stream: on a GPU the host only *launches* kernels, so host time
    measures launches) marks that become seconds in :meth:`settle`, which reads them all with one host
    synchronisation; ``totals`` and ``events`` hold what has been settled."""

    totals: dict = field(default_factory=dict)
    events: list | None = None
    clock: Any = None            # None: the host clock; else an object with now(), settle() and seconds(mark)
    _pending: list = field(default_factory=list)

    def now(self):
        return time.perf_counter() if self.clock is None else self.clock.now()

    def add(self, key: tuple, t0, t1, track: str = "compute") -> None:
        if self.clock is not None:
            self._pending.append((key, t0, t1, track, True))
            return
        self.totals[key] = self.totals.get(key, 0.0) + (t1 - t0)
        self.span(key, t0, t1, track)

    def span(self, key: tuple, t0, t1, track: str = "compute") -> None:
        """An interval for the trace only (e.g. a span enclosing per-layer events), not counted in totals."""
        if self.clock is not None:
            self._pending.append((key, t0, t1, track, False))
        elif self.events is not None:
            self.events.append((track, key, t0, t1))

    def settle(self) -> None:
        """Turn the device marks recorded so far into seconds (one host synchronisation when any are
        pending; nothing with the host clock)."""
        if self.clock is None or not self._pending:
            return
        self.clock.settle()
        sec = self.clock.seconds
        for key, a, b, track, counted in self._pending:
            t0, t1 = sec(a), sec(b)
            if counted:
                self.totals[key] = self.totals.get(key, 0.0) + (t1 - t0)
            if self.events is not None:
                self.events.append((track, key, t0, t1))
        self._pending.clear()


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

    # -- stencil layers (a window over space: conv, pool) ----------------------------------------------
    def plan_halo(self, in_dist: Distribution, in_shape: tuple, stencil: Stencil) -> None:
        """Called from ``setup`` of a stencil layer: the halo plan of its input window (``self.halo``)."""
        from lbannpy.halo import HaloPlan  # the halo module is only needed by stencil layers

        self.halo = HaloPlan(in_dist, in_shape, stencil, self.ctx.rank, tag=self.ctx.new_tag(2))

    def halo_forward(self, x, compute, window_out=None, prepare=None):
        """Collective over the spatial group: the forward of a stencil layer on its local input ``x``.

        Starts the halo exchange of ``self.halo`` (into ``window_out`` when given) and calls
        ``prepare(window)`` (e.g. to fill padding) while it is in flight; then ``compute(window_piece,
        y_piece, index)`` (``y_piece`` is ``y[index]``, to be written) on the interior of the output block
        (computable from owned input and padding alone), still while it is in flight; waits; and computes
        the boundary pieces from the received window. Without an interior (a block thinner than the stencil)
        it waits and calls ``compute(window, None, None)``, which returns the whole output.
        ``LayerContext.overlap = False`` computes the same pieces after the wait, so turning overlap off
        changes when the interior runs, not its arithmetic (BLAS may round a GEMM differently by size).
        A plan with nothing to exchange (``local``: its interior is the whole output block) fills the window
        and calls ``compute(window, None)`` at once. Returns ``(window, y)``; ``self.halo_received`` holds
        the ghost values received (for ``self.halo.refill``; None for a local plan) until the next call.
        """
        ctx, plan = self.ctx, self.halo
        if plan.local:  # nothing to exchange (one rank, or no split the stencil crosses): no messages
            window = plan.local_window(x, window_out)
            self.halo_received = None
            if prepare is not None:
                prepare(window)
            return window, compute(window, None)
        t0 = ctx.timer.now()
        exchange = plan.start(ctx.comm, x, out=window_out)
        self.halo_received = exchange.received
        window = exchange.window
        if prepare is not None:
            prepare(window)
        split = box_size(plan.interior_box) > 0
        # an interior that is the whole block (no ghosts read) is computed as a fresh array, so kernels that
        # allocate their result (ATen) do not need a second output-sized array to copy from
        whole = split and not plan.boundary_slices
        if split and not whole:
            y = ctx.xp.empty(self._out_block, dtype=x.dtype)

        def out(sl):  # the plan's output slices cover the input's channels in dim 1; the output's may differ
            return (sl[0], slice(None)) + tuple(sl[2:])

        def interior():
            nonlocal y
            if whole:
                y = compute(window[plan.interior_window_slices], None)
                return
            sl = out(plan.interior_slices)
            compute(window[plan.interior_window_slices], y[sl], sl)
        if split and ctx.overlap:
            interior()
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if split:
            if not ctx.overlap:
                interior()
            for osl, wsl in zip(plan.boundary_slices, plan.boundary_window_slices):
                compute(window[wsl], y[out(osl)], out(osl))
        else:
            y = compute(window, None)
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        return window, y

    def halo_backward(self, dwindow, during=None):
        """Collective over the spatial group: the input gradient of a stencil layer from the gradient of its
        window. The halo accumulation (ghost contributions sent back to their owners and added) is in flight
        while ``during()`` runs (e.g. the weight gradient); overlap off runs it after the wait."""
        if self.halo.local:  # nothing to send back: the owned part of the window gradient
            if during is not None:
                during()
            return self.halo.local_gradient(dwindow)
        acc = self.halo.accumulate_start(self.ctx.comm, dwindow)
        if during is not None and self.ctx.overlap:
            during()
        dx = acc.wait()
        if during is not None and not self.ctx.overlap:
            during()
        return dx

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
