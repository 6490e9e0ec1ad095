"""The stand-in harness: a layer run as one rank of its real distribution on a loopback communicator, and
chains of them run as a training step runs a rank's layers (Jia et al. 2018 §4: t_C by running the layer
under its configuration)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lbannpy.dist import Distribution
from lbannpy.strategy.cost import max_local_shape, required_input
from lbannpy.strategy.graph import ModelGraph, Node


def local_shapes(node: Node, dist: Distribution) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Input block shapes (every input, in the distribution the layer needs) and output block shape of
    the slowest rank: the shapes a rank's local kernels see."""
    ins = [max_local_shape(s, required_input(node, dist, s)) for s in node.in_shapes]
    return ins, max_local_shape(node.out_shape, dist)


def table_key(node: Node, dist: Distribution) -> tuple:
    """The key :func:`lbannpy.strategy.cost.compute_times` looks a measured entry up by: the layer type, its
    block shapes and the split degrees (whose code path the entry was timed in)."""
    ins, out = local_shapes(node, dist)
    return (node.type, ins[0], out, tuple(dist.split))


def block_ranks(dist: Distribution, limit: int = 8) -> list[int]:
    """The ranks whose local work a stand-in times: one holder of each distinct block (replicas do the same
    work); beyond ``limit`` blocks, the first, the last and evenly spaced ones between (blocks at the edge of
    a spatial split have one halo neighbour per side, inner ones two, and their windows differ)."""
    seen, out = set(), []
    for r in range(dist.ranks):
        c = tuple(dist.coords(r))
        if c not in seen:
            seen.add(c)
            out.append(r)
    if len(out) > limit:
        idx = sorted({round(i * (len(out) - 1) / (limit - 1)) for i in range(limit)})
        out = [out[i] for i in idx]
    return out


class StandIn:
    """``node``'s layer class under its real distribution ``dist``, run by one process as rank ``rank`` on a
    :class:`lbannpy.comm.LoopbackCommunicator`: the rank's own blocks and its real code path (halo packing,
    a convolution split into interior and boundary, the arithmetic around reductions), with every message
    and collective completing at once. Its communication is what the cost model prices apart. Its backward
    includes what the trainer does to the layer's weight block after backprop: the optimizer's update
    (``optimizer``: the spec's ``optimizer`` section) and clearing the gradients. ``ctx`` (a loopback
    :class:`~lbannpy.layers.context.LayerContext` of the same rank) is shared by the stand-ins of one
    chain, as a model's layers share theirs (the convolution workspace). ``overlap``: the runs'
    ``comm.overlap``."""

    def __init__(self, node: Node, dist: Distribution, rank: int, optimizer: Mapping[str, Any] | None = None,
                 ctx=None, overlap: bool = False, dtype: str = "float32", seed: int = 0):
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.comm import LoopbackCommunicator
        from lbannpy.layers.context import LayerContext
        from lbannpy.layers.timer import Timer
        from lbannpy.layers.registry import layer_classes
        from lbannpy.optim import make_optimizer
        from lbannpy.tensor import DistTensor

        self.ctx = ctx or LayerContext(LoopbackCommunicator(dist.ranks, rank), np, dtype, seed,
                                       overlap=overlap, timer=Timer())
        self.rank = rank
        self.layer = layer_classes()[node.type](node.name, **dict(node.params))
        in_dists = [required_input(node, dist, s) for s in node.in_shapes]
        self.layer.configure(self.ctx, [tuple(s) for s in node.in_shapes], in_dists, dist)
        self.matches = (list(self.layer.in_dists) == in_dists
                        and tuple(self.layer.out_shape) == node.out_shape and self.layer.out_dist == dist)
        rng = np.random.default_rng(seed)
        self.xs = [DistTensor(rng.standard_normal(d.local_shape(s, rank)).astype(dtype), s, d, rank)
                   for s, d in zip(node.in_shapes, in_dists)]
        od, out = self.layer.out_dist, tuple(self.layer.out_shape)
        self.dy = DistTensor(rng.standard_normal(od.local_shape(out, rank)).astype(dtype), out, od, rank)
        self.opt = (make_optimizer(dict(optimizer or {"type": "sgd"}), self.layer.params, 1 << 30)
                    if self.layer.params else None)
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        # conv and fc skip dL/dx in a layer that reads the model input: their backward is also timed without
        # it, which splits it into the data gradient and the rest (weight gradient, update)
        self.splits_dx = node.type in ("conv", "fc")
        self.bwd_weights: list[float] = []

    def forward(self, keep: bool = True) -> None:
        t0 = time.perf_counter()
        self.layer.forward(self.xs)
        if keep:
            self.fwd.append(time.perf_counter() - t0)

    def backward(self, keep: bool = True, input_grad: bool = True) -> None:
        """One backward (and update); ``input_grad=False`` times it as the first layer runs it."""
        self.layer.needs_input_grad = input_grad
        t0 = time.perf_counter()
        self.layer.backward(self.dy)
        if self.opt is not None:
            self.opt.step_params(self.layer.params)
            self.opt.finish_step()
            self.opt.zero_grad()
        if keep:
            (self.bwd if input_grad else self.bwd_weights).append(time.perf_counter() - t0)
        self.ctx.timer.totals.clear()
        self.layer.needs_input_grad = True


@dataclass
class TableRow:
    key: tuple  # (type, input block, output block[, split degrees[, ranks on the node while timed]])
    fwd_s: float
    bwd_s: float  # the whole backward with the weight update
    bwd_data_s: float = 0.0  # the part of it a layer reading the model input skips (conv, fc: dL/dx)

    def to_yaml(self) -> dict:
        typ, inn, out = self.key[:3]
        row = {"type": typ, "in": list(inn), "out": list(out)}
        if len(self.key) > 3:
            row["split"] = list(self.key[3])
        if len(self.key) > 4:
            row["procs"] = int(self.key[4])
        return {**row, "fwd_s": self.fwd_s, "bwd_data_s": self.bwd_data_s,
                "bwd_weights_s": self.bwd_s - self.bwd_data_s}


Calls = dict  # key -> rank -> ([forward s], [backward s], [backward without dL/dx s])


def chains_plan(graph: ModelGraph, strategies: Sequence[Mapping[str, Distribution]]
                 ) -> tuple[list[list[tuple[Node, Distribution, tuple]]], dict[tuple, str], list[str]]:
    """Per strategy, the (node, distribution, table key) a stand-in chain times, and the notes on keys that
    two layers of different parameters share (the table keeps the first)."""
    params_of: dict[tuple, tuple] = {}
    names: dict[tuple, str] = {}
    plans, notes = [], []
    for dists in strategies:
        nodes = []
        for node in graph:
            if node.type == "flatten":
                continue
            key = table_key(node, dists[node.name])
            params = tuple(sorted(node.params.items()))
            if params_of.setdefault(key, params) != params:
                notes.append(f"{node.name}: {key} is also a {node.type} of other parameters; the table "
                             f"keeps the first")
                continue
            names.setdefault(key, node.name)
            nodes.append((node, dists[node.name], key))
        plans.append(nodes)
    return plans, names, notes


def build_chains(plans, ranks_of: Callable[[list], list[int]], optimizer, overlap: bool
                  ) -> tuple[list[list[tuple[tuple, StandIn]]], list[str]]:
    """Stand-in chains, one per (plan, rank in ``ranks_of(plan)``), and notes on layers left out."""
    chains, notes = [], []
    for nodes in plans:
        for rank in ranks_of(nodes):
            chain, ctx = [], None
            for node, d, key in nodes:
                si = StandIn(node, d, rank, optimizer, ctx=ctx, overlap=overlap)
                ctx = si.ctx
                if not si.matches:
                    notes.append(f"{node.name} ({node.type}) under {d}: the layer needs other input or "
                                 f"output distributions than the cost model assumes; left to the roofline")
                    continue
                chain.append((key, si))
            chains.append(chain)
    return chains, notes


def run_chains(chains, rounds: int, between: Callable[[], None] = lambda: None) -> Calls:
    """``rounds`` rounds through every chain (forward in order, backward in reverse, and again with conv and
    fc backward without dL/dx) after a warm-up round; ``between()`` before each round. Returns the calls."""
    for r in range(max(rounds, 1) + 1):
        between()
        for chain in chains:
            for _, si in chain:
                si.forward(keep=r > 0)
            for _, si in reversed(chain):
                si.backward(keep=r > 0)
            if any(si.splits_dx for _, si in chain):  # again, conv and fc without dL/dx
                for _, si in chain:
                    si.forward(keep=False)
                for _, si in reversed(chain):
                    si.backward(keep=r > 0 and si.splits_dx, input_grad=not si.splits_dx)
    calls: Calls = {}
    for chain in chains:
        for key, si in chain:
            f, b, w = calls.setdefault(key, {}).setdefault(si.rank, ([], [], []))
            f.extend(si.fwd)
            b.extend(si.bwd)
            w.extend(si.bwd_weights)
    return calls
