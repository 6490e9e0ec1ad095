"""``python -m lbannpy.bench costmodel``: the strategy cost model against measured training steps.

For a few small models and strategies at 1, 2 and 4 ranks, the step time that
:func:`lbannpy.strategy.evaluate_strategy` predicts for a machine file (by default one that ``python -m
lbannpy.bench calibrate`` writes first, i.e. this machine) is printed next to the median step time of real
training runs (``mpiexec -n P python -m lbannpy.train CONFIG.h5``, ``summary.json``), with the relative
error and, per model and rank count, whether the predicted order of the strategies is the measured one.

The model's per-layer compute t_C comes, as in Jia et al. (2018) §4, from running each layer under each
distribution the strategies give it several times on this machine: :func:`measure_compute_table` runs the
real layer classes as each block-holding rank of that distribution on a loopback communicator (the rank's
own code path: halo packing, interior and boundary apart, with every message completing at once), forward
in layer order and backward in reverse as a step runs them, and keeps the slowest rank's time; the rows go
into the machine model's measured table (``compute.measured`` of a machine file). For P ranks the table is
then scaled by what running P ranks at once on this node costs (P processes run their ranks' stand-ins
together, as ``mpiexec -n P`` does: shared caches and memory bandwidth, and where ranks outnumber the cores,
their time slices), so that its rows are times of a rank among P on the node. Communication is the
calibrated α-β model; ranks that outnumber the cores of a node share them, and their shared-memory copies
are time-sliced too (:meth:`MachineModel.compute_slowdown`). The ``roofline`` column is the same prediction
from the calibrated γ alone, without the table.

The model adds communication to compute (Jia et al. eq. 1), so the training runs reduce gradients without
the background overlap thread (``--overlap`` turns it on). Every rank runs single-threaded (OMP/OpenBLAS/MKL
threads 1), so that one rank is one core's work. The step time the model leaves out: reading the input,
the loss, the trainer's own bookkeeping.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from lbannpy.dist import Distribution
from lbannpy.strategy import (MachineError, MachineModel, baseline_strategies, build_graph, evaluate_strategy,
                              load_machine_model, plan)
from lbannpy.strategy.cost import max_local_shape, required_input
from lbannpy.strategy.graph import INPUT_NAMES, ModelGraph, Node
from lbannpy.strategy.planner import filter_reason

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
TOLERANCE = 0.15  # the acceptance target: |predicted - measured| / measured
OPTIMIZER = {"type": "sgd", "lr": 0.01, "momentum": 0.9}  # every model trains with this


# --------------------------------------------------------------------------------------------------------
# models


@dataclass(frozen=True)
class BenchModel:
    """A small model, its batch size and the synthetic data set it trains on."""

    name: str
    model: Mapping[str, Any]  # the ``model:`` tree of a spec
    batch_size: int
    data: tuple[str, ...]  # arguments of ``python -m lbannpy.data`` after the kind, without -o

    @property
    def kind(self) -> str:
        return self.data[0]


def classifier(size: int = 64, batch: int = 16, width: int = 16) -> BenchModel:
    """Two conv + batch-norm + pool stages and a two-layer fully-connected head, on 3-channel images."""
    layers = [
        {"name": "c1", "type": "conv", "filters": width, "kernel": 3, "padding": 1},
        {"name": "b1", "type": "batchnorm"},
        {"name": "r1", "type": "relu"},
        {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
        {"name": "c2", "type": "conv", "filters": 2 * width, "kernel": 3, "padding": 1},
        {"name": "r2", "type": "relu"},
        {"name": "p2", "type": "pool", "mode": "max", "kernel": 2},
        {"name": "f1", "type": "fc", "units": 64},
        {"name": "r3", "type": "relu"},
        {"name": "f2", "type": "fc", "units": 10},
    ]
    model = {"name": "cls", "input": {"channels": 3, "spatial": [size, size]}, "layers": layers,
             "loss": "cross_entropy"}
    data = ("blobs", "--size", str(size), "--channels", "3", "--classes", "10", "--samples", str(4 * batch))
    return BenchModel("cls", model, batch, data)


def segmenter(size: int = 64, batch: int = 8) -> BenchModel:
    """The zoo's mesh_tiny (strided conv + batch-norm stages, per-pixel output) on mesh-tangling data."""
    from lbannpy import zoo

    model = zoo.get_spec("mesh_tiny", batch_size=batch, input_size=size)["model"]
    return BenchModel("mesh", dict(model, name="mesh"), batch,
                      ("mesh", "--size", str(size), "--samples", str(2 * batch), "-q"))


def residual(size: int = 32, batch: int = 16, width: int = 16, units: int = 512) -> BenchModel:
    """A residual block (sum of two branches) and a fat fully-connected layer (16 * (size/2)^2 x units
    weights: an allreduce of several MiB in data parallelism)."""
    layers = [
        {"name": "c1", "type": "conv", "filters": width, "kernel": 3, "padding": 1},
        {"name": "b1", "type": "batchnorm"},
        {"name": "r1", "type": "relu"},
        {"name": "c2", "type": "conv", "filters": width, "kernel": 3, "padding": 1},
        {"name": "b2", "type": "batchnorm"},
        {"name": "r2", "type": "relu"},
        {"name": "s1", "type": "sum", "parents": ["r2", "r1"]},
        {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
        {"name": "f1", "type": "fc", "units": units},
        {"name": "r3", "type": "relu"},
        {"name": "f2", "type": "fc", "units": 10},
    ]
    model = {"name": "res", "input": {"channels": 8, "spatial": [size, size]}, "layers": layers,
             "loss": "cross_entropy"}
    data = ("blobs", "--size", str(size), "--channels", "8", "--classes", "10", "--samples", str(4 * batch))
    return BenchModel("res", model, batch, data)


def default_models(quick: bool = False) -> list[BenchModel]:
    if quick:
        return [classifier(size=16, batch=4, width=4)]
    return [classifier(), segmenter(), residual()]


# --------------------------------------------------------------------------------------------------------
# strategies


def _fit(d: int, ranks: int) -> int:
    """Largest divisor of ``ranks`` that is at most ``d``."""
    return max(x for x in range(1, ranks + 1) if ranks % x == 0 and x <= max(d, 1))


def _valid_degree(node: Node, ranks: int, make: Callable[[int], Distribution]) -> Distribution:
    """``make(k)`` for the largest divisor ``k`` of ``ranks`` that gives ``node`` a usable distribution
    (blocks no smaller than their halo, no empty blocks); leftover ranks replicate."""
    for k in sorted((x for x in range(1, ranks + 1) if ranks % x == 0), reverse=True):
        d = make(k)
        if filter_reason(node, d, imbalance_tol=1.0) is None:
            return d
    return make(1)


def spatial_strategy(graph: ModelGraph, ranks: int) -> dict[str, Distribution]:
    """Every layer with space split along height (Dryden et al.'s spatial parallelism); fully-connected
    layers, which have no space, split samples."""
    out = {}
    for node in graph:
        nd = len(node.out_shape)
        if nd > 2:
            out[node.name] = _valid_degree(node, ranks, lambda k: Distribution.make(nd, ranks, h=k))
        else:
            out[node.name] = Distribution.make(nd, ranks, n=_fit(node.out_shape[0], ranks))
    return out


def hybrid_strategy(graph: ModelGraph, ranks: int) -> dict[str, Distribution]:
    """Samples split over half the ranks and height over two (n·h2), fully-connected layers samples only."""
    if ranks < 4:
        return spatial_strategy(graph, ranks)
    out = {}
    for node in graph:
        nd = len(node.out_shape)
        n = _fit(node.out_shape[0], ranks // 2)
        if nd > 2:
            out[node.name] = _valid_degree(node, 2, lambda k: Distribution.make(nd, ranks, n=n, h=k))
        else:
            out[node.name] = Distribution.make(nd, ranks, n=_fit(node.out_shape[0], ranks))
    return out


STRATEGIES = ("data", "spatial", "model", "owt", "hybrid", "selector")


def strategy_dists(name: str, graph: ModelGraph, ranks: int, machine: MachineModel
                   ) -> dict[str, Distribution]:
    """The distributions of strategy ``name`` (one of :data:`STRATEGIES`) for every layer of ``graph``:
    Jia et al.'s baselines (``data``, ``model``, ``owt``), :func:`spatial_strategy`, :func:`hybrid_strategy`,
    or the selector's plan on ``machine`` (``selector``; priced without this benchmark's layer table, which
    holds only the shapes of the strategies it compares)."""
    if name in ("data", "model", "owt"):
        key = {"data": "data-parallel", "model": "model-parallel", "owt": "owt"}[name]
        return baseline_strategies(graph, ranks)[key]
    if name == "spatial":
        return spatial_strategy(graph, ranks)
    if name == "hybrid":
        return hybrid_strategy(graph, ranks)
    if name == "selector":
        return dict(plan(graph, ranks, machine, compare=False).choice)
    raise ValueError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")


def _degrees(d: Distribution) -> dict[str, int]:
    """Split degrees of the axes a distribution splits (replicated axes are held whole)."""
    deg = {k: v for i, (k, v) in enumerate(zip(d.dim_names, d.split)) if v > 1 and i not in d.replicate}
    return deg or {"n": 1}


def parallel_layers(graph: ModelGraph, dists: Mapping[str, Distribution]) -> dict[str, dict[str, int]]:
    """The ``parallel.layers`` block of a config for ``dists``; the model input (``x``) is read straight
    into the distribution the layers reading it need, as the cost model assumes (no input shuffle)."""
    out = {name: _degrees(d) for name, d in dists.items()}
    for node in graph:
        if any(p in INPUT_NAMES for p in node.parents):
            out["x"] = _degrees(required_input(node, dists[node.name], graph.input_shape))
            break
    return out


# --------------------------------------------------------------------------------------------------------
# measured compute table (Jia et al. 2018 §4: t_C by running the layer under its configuration)


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
    work); beyond ``limit`` blocks, the first, the last and evenly spaced ones between (blocks at the edge of a
    spatial split have one halo neighbour per side, inner ones two, and their windows differ)."""
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
    :class:`~lbannpy.layers.base.LayerContext` of the same rank) is shared by the stand-ins of one chain, as
    a model's layers share theirs (the convolution workspace). ``overlap``: the runs' ``comm.overlap``."""

    def __init__(self, node: Node, dist: Distribution, rank: int, optimizer: Mapping[str, Any] | None = None,
                 ctx=None, overlap: bool = False, dtype: str = "float32", seed: int = 0):
        from lbannpy.comm import LoopbackCommunicator
        from lbannpy.layers.base import LayerContext, Timer
        from lbannpy.layers.registry import layer_classes
        from lbannpy.optim import make_optimizer
        from lbannpy.tensor import DistTensor

        self.ctx = ctx or LayerContext(LoopbackCommunicator(dist.ranks, rank), np, dtype, seed,
                                       overlap=overlap, timer=Timer())
        self.rank = rank
        self.layer = layer_classes()[node.type](node.name, **dict(node.params))
        in_dists = [required_input(node, dist, s) for s in node.in_shapes]
        self.layer.configure(self.ctx, [tuple(s) for s in node.in_shapes], in_dists, dist)
        self.matches = (list(self.layer.in_dists) == in_dists and tuple(self.layer.out_shape) == node.out_shape
                        and self.layer.out_dist == dist)
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


def _chains_plan(graph: ModelGraph, strategies: Sequence[Mapping[str, Distribution]]
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


def _build_chains(plans, ranks_of: Callable[[list], list[int]], optimizer, overlap: bool
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
                    notes.append(f"{node.name} ({node.type}) under {d}: the layer needs other input or output "
                                 f"distributions than the cost model assumes; left to the roofline")
                    continue
                chain.append((key, si))
            chains.append(chain)
    return chains, notes


def _run_chains(chains, rounds: int, between: Callable[[], None] = lambda: None) -> Calls:
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


def _corun_worker(plans, rank, rounds, optimizer, overlap, barrier, conn) -> None:
    """One of the processes of :func:`_corun_calls`: times rank ``rank``'s chains while the others time theirs."""
    try:
        chains, notes = _build_chains(plans, lambda nodes: [rank], optimizer, overlap)
        barrier.wait(timeout=300)
        calls = _run_chains(chains, rounds, lambda: barrier.wait(timeout=300))
        conn.send(("ok", calls, notes))
    except BaseException as exc:  # the parent raises it, with this rank named
        import traceback
        try:
            barrier.abort()
        except Exception:
            pass
        conn.send(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}", []))
    finally:
        conn.close()


def _corun_calls(plans, procs: int, rounds: int, optimizer, overlap: bool, timeout: float = 900
                 ) -> tuple[Calls, list[str]]:
    """Every rank 0..procs-1 runs its own chains in a process of its own, all at once (rounds start
    together, as a training step's ranks do); returns every rank's calls."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    workers = []
    for rank in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_corun_worker, name=f"lbannpy-table-r{rank}",
                        args=(plans, rank, rounds, optimizer, overlap, barrier, send), daemon=True)
        p.start()
        send.close()
        workers.append((rank, p, recv))
    calls: Calls = {}
    notes: list[str] = []
    errors = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p, recv in workers:
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                errors.append(f"rank {rank}: no result within {timeout:.0f} s")
                continue
            try:
                status, got, n = recv.recv()
            except EOFError:
                errors.append(f"rank {rank}: the process ended without a result (exit code {p.exitcode})")
                continue
            if status != "ok":
                errors.append(got)
                continue
            if rank == 0:
                notes += n
            for key, per_rank in got.items():
                calls.setdefault(key, {})[rank] = per_rank[rank]
    finally:
        for _, p, recv in workers:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            recv.close()
    if errors:
        raise RuntimeError(f"timing the layer table with {procs} processes failed: " + "; ".join(errors))
    return calls, notes


def shared_node_factor(rows: Sequence[TableRow], calls: Calls) -> tuple[float, dict[int, float]]:
    """What running a node's ranks at once costs over each running alone: per rank, the sum of its co-run
    call times over the sum, for the same calls, of the alone-timed entries ``rows`` (forward, backward,
    backward without dL/dx); the factor is the largest (the slowest rank sets the pace). Sums over all of a
    rank's calls, because where ranks share a core a call either runs whole or takes a whole time slice of
    another rank longer: one key's few calls say little, their sum says what sharing costs."""
    by_key = {r.key: r for r in rows}
    per_rank: dict[int, list[float]] = {}
    for key, ranks in calls.items():
        row = by_key.get(key)
        if row is None:
            continue
        for rank, (f, b, w) in ranks.items():
            acc = per_rank.setdefault(rank, [0.0, 0.0])
            acc[0] += sum(f) + sum(b) + sum(w)
            acc[1] += len(f) * row.fwd_s + len(b) * row.bwd_s + len(w) * (row.bwd_s - row.bwd_data_s)
    factors = {r: t / a for r, (t, a) in per_rank.items() if a > 0}
    return (max(factors.values()) if factors else 1.0), factors


def measure_compute_table(graph: ModelGraph, strategies: Sequence[Mapping[str, Distribution]], reps: int = 5,
                          optimizer: Mapping[str, Any] | None = None, log: Callable[[str], None] | None = None,
                          overlap: bool = False, procs: int = 1) -> tuple[list[TableRow], list[str]]:
    """Time every (layer, distribution) that ``strategies`` give the layers of ``graph``, Jia et al.'s t_C:
    a :class:`StandIn` per layer, strategy and block-holding rank (:func:`block_ranks`), a rank's stand-ins
    run as a training step runs them (forward in order, backward in reverse), so that between two uses of a
    tensor the caches see the traffic of the other layers, as in the real step. ``reps`` rounds go through
    every chain in turn after a warm-up round (a burst of other load on the machine spoils one call of many
    entries rather than every call of a few). A rank's time for a key is the median of its calls; the
    entry's is that of the slowest rank, forward and backward apart (ranks meet at every halo exchange and
    reduction, so the slowest rank sets the pace of each phase). These rows, keyed (type, in, out, split),
    are times of a rank with a core to itself.

    ``procs > 1`` (every strategy then on ``procs`` ranks): besides, ``procs`` processes run ranks
    0..procs-1 at once (:func:`_corun_calls`), as ``mpiexec -n procs`` runs them on this node, and every row
    is scaled by :func:`shared_node_factor`: the rows, keyed (type, in, out, split, procs), are times of a
    rank among ``procs`` on the node, sharing its cores, caches and memory bandwidth, which
    :func:`lbannpy.strategy.cost.compute_times` then uses unscaled. Returns the rows and notes on entries left
    to the roofline (layers a stand-in cannot reproduce, or two layers of different parameters sharing a
    key)."""
    if procs > 1:
        bad = sorted({d.ranks for dists in strategies for d in dists.values()} - {procs})
        if bad:
            raise ValueError(f"measure_compute_table: procs={procs} times strategies on {procs} ranks, got "
                             f"some on {bad}")
    plans, names, notes = _chains_plan(graph, strategies)

    def ranks_of(nodes):
        return sorted({r for _, d, _ in nodes for r in block_ranks(d)}) or [0]

    chains, n = _build_chains(plans, ranks_of, optimizer, overlap)
    notes += n
    calls = _run_chains(chains, reps)
    del chains
    rows = []
    for key, per_rank in calls.items():
        fwd = max(statistics.median(f) for f, _, _ in per_rank.values())
        total = max(statistics.median(b) for _, b, _ in per_rank.values())
        weights = [statistics.median(w) for _, _, w in per_rank.values() if w]
        data = max(0.0, total - max(weights)) if weights else 0.0
        rows.append(TableRow(key, fwd, total, data))
    factor = 1.0
    if procs > 1:
        co, _ = _corun_calls(plans, procs, max(reps, 1), optimizer, overlap)
        factor, per_rank_f = shared_node_factor(rows, co)
        rows = [TableRow(r.key + (procs,), r.fwd_s * factor, r.bwd_s * factor, r.bwd_data_s * factor)
                for r in rows]
        if log:
            log(f"  {procs} ranks at once on this node: each rank's calls took "
                + ", ".join(f"{per_rank_f[r]:.2f}" for r in sorted(per_rank_f))
                + f" times its alone-timed entries; the table keeps {factor:.2f} times them")
    if log:
        for row, (key, per_rank) in zip(rows, calls.items()):
            split = "x".join(str(x) for x in key[3]) if len(key) > 3 else "-"
            log(f"  {names[key]:8s} {key[0]:9s} {split:9s} in {str(key[1]):22s} out {str(key[2]):20s} "
                f"fwd {row.fwd_s * 1e3:8.3f} ms  bwd {row.bwd_s * 1e3:8.3f} ms  ({len(per_rank)} rank(s))")
    return rows, notes


def time_input_read(path: str, graph: ModelGraph, dists: Mapping[str, Distribution], reps: int = 5
                    ) -> TableRow:
    """A table row for reading the slowest rank's block of one mini-batch of ``path``, in the distribution
    the layer reading the model input needs (what the trainer's reader reads, labels included, with no
    prefetch: h5py holds the GIL while it reads, so on the CPU the read does not hide behind NumPy work):
    the median of ``reps`` reads after one."""
    from lbannpy.data.reader import HDF5Reader

    first = next(n for n in graph if any(p in INPUT_NAMES for p in n.parents))
    in_dist = required_input(first, dists[first.name], graph.input_shape)
    block = max_local_shape(graph.input_shape, in_dist)
    reader = HDF5Reader(path, dist=in_dist, rank=0, batch_size=graph.batch_size, seed=1, shuffle=True,
                        prefetch=False)  # rank 0 holds the largest block
    times = []
    try:
        for i in range(max(reps, 1) + 1):
            t0 = time.perf_counter()
            reader.next()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        reader.close()
    return TableRow(("input", block, block), statistics.median(times), 0.0)


def with_table(machine: MachineModel, rows: Sequence[TableRow]) -> MachineModel:
    """``machine`` with ``rows`` added to its measured table (see :meth:`TableRow.to_yaml`)."""
    measured = dict(machine.measured)
    for r in rows:
        measured[r.key] = (r.fwd_s, r.bwd_data_s, r.bwd_s - r.bwd_data_s)
    return replace(machine, measured=measured)


# --------------------------------------------------------------------------------------------------------
# measured training steps


def thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = "1"
    return env


def _run(cmd: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), env=thread_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{what}: `{' '.join(cmd)}` exited {p.returncode}\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-2000:]}")
    return p


def prepare(model: BenchModel, work: str, timeout: float = 300) -> tuple[str, str]:
    """Write the model's data set and config (``config.h5``) under ``work``; returns their paths."""
    import yaml

    data = os.path.join(work, f"{model.name}-data.h5")
    _run([sys.executable, "-m", "lbannpy.data", *model.data, "-o", data], timeout, f"data for {model.name}")
    spec = {"model": dict(model.model), "data": {"train": {"path": data}},
            "trainer": {"batch_size": model.batch_size, "steps": 1, "seed": 1},
            "optimizer": dict(OPTIMIZER),
            "checkpoint": {"dir": os.path.join(work, "ckpt"), "every_steps": 0},
            "output": {"dir": os.path.join(work, "run"), "log_every": 1}}
    spec_path = os.path.join(work, f"{model.name}.yaml")
    with open(spec_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    cfg = os.path.join(work, f"{model.name}.h5")
    _run([sys.executable, "-m", "lbannpy.config", "build", spec_path, "-o", cfg], timeout,
         f"config for {model.name}")
    return cfg, data


def measure_step(config: str, ranks: int, layers: Mapping[str, Mapping[str, int]], steps: int, out_dir: str,
                 overlap: bool = False, timeout: float = 600) -> float:
    """Median step time (seconds) of ``steps`` optimizer steps of ``mpiexec -n ranks python -m lbannpy.train
    config`` with ``parallel.layers`` set to ``layers`` and ``comm.overlap`` to ``overlap``, from the run's
    ``summary.json``."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise RuntimeError("mpiexec not found: install an MPI (pip install mpich) or run under srun")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.train", config, "--quiet",
           "--set", f"trainer.steps={steps}", "--set", "parallel.layers=" + json.dumps(dict(layers)),
           "--set", f"comm.overlap={'true' if overlap else 'false'}",
           "--set", f"output.dir={out_dir}", "--set", f"checkpoint.dir={out_dir}/ckpt"]
    _run(cmd, timeout, f"training on {ranks} rank(s)")
    with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    t = summary.get("median_step_s")
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise RuntimeError(f"{out_dir}/summary.json has no usable median_step_s: {t!r}")
    return float(t)


# --------------------------------------------------------------------------------------------------------
# other work on the machine


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot, all cores (``/proc/stat``; Linux), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (a training run: mpiexec and its ranks)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherLoad:
    """Cores that other processes kept busy during a ``with`` block: the machine's busy CPU time less this
    process's and its children's, over the wall time (nan where ``/proc/stat`` cannot be read)."""

    cores = math.nan

    def __enter__(self) -> "OtherLoad":
        self._busy, self._own, self._t = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = busy_cpu_seconds(), time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            self.cores = max(0.0, (busy - self._busy) - (own_cpu_seconds() - self._own)) / wall


@dataclass
class Quiet:
    """Measure while the machine is otherwise idle, as far as it goes: before a measurement, wait (from a
    budget for the whole benchmark) until other processes keep fewer than ``threshold`` cores busy; repeat
    a training run during which they kept more, up to ``retries`` times. Whatever was measured last is
    kept, with its other load printed next to it."""

    budget_s: float = 300.0
    threshold: float = 0.25  # cores
    retries: int = 2
    waited_s: float = 0.0

    def wait(self) -> float:
        """Other load (cores) over the last one-second sample before returning (nan: no budget, no wait)."""
        if self.budget_s <= 0:
            return math.nan
        while True:
            with OtherLoad() as load:
                time.sleep(1.0)
            self.waited_s += 1.0
            if not load.cores > self.threshold or self.waited_s >= self.budget_s:
                return load.cores


# --------------------------------------------------------------------------------------------------------
# the comparison


@dataclass
class Case:
    model: str
    strategy: str  # name, or several joined by '=' where they give the same distributions
    ranks: int
    predicted_s: float
    roofline_s: float  # the same prediction from the calibrated roofline, without the table
    measured: list[float]
    layers: dict
    other: list[float] = field(default_factory=list)  # cores other processes kept busy during each run

    @property
    def measured_s(self) -> float:
        return statistics.median(self.measured)

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def ranking(cases: Sequence[Case], attr: str) -> list[str]:
    return [c.strategy for c in sorted(cases, key=lambda c: getattr(c, attr))]


def format_table(cases: Sequence[Case]) -> str:
    """The result table: one row per case, then one ranking line per (model, ranks) with more than one
    distinct strategy, then how many cases are within :data:`TOLERANCE`."""
    w = max([8] + [len(c.strategy) for c in cases])
    head = (f"{'model':6s} {'strategy':{w}s} {'ranks':>5s} {'predicted ms':>12s} {'measured ms':>11s} "
            f"{'error %':>8s} {'roofline ms':>11s} {'other load':>10s}")
    lines = [head, "-" * len(head)]
    for c in cases:
        other = max(c.other) if c.other else math.nan
        lines.append(f"{c.model:6s} {c.strategy:{w}s} {c.ranks:5d} {c.predicted_s * 1e3:12.2f} "
                     f"{c.measured_s * 1e3:11.2f} {100 * c.error:+8.1f} {c.roofline_s * 1e3:11.2f} "
                     f"{other:10.2f}")
    lines.append("")
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault((c.model, c.ranks), []).append(c)
    matched = total = 0
    for (m, p), cs in groups.items():
        if len(cs) < 2:
            lines.append(f"ranking {m:6s} {p} rank(s): one distinct strategy, nothing to rank")
            continue
        pred, meas = ranking(cs, "predicted_s"), ranking(cs, "measured_s")
        ok = pred == meas
        matched += ok
        total += 1
        swapped = ""
        if not ok:  # how far apart the measurements of the pairs the model orders the other way are
            t = {c.strategy: c.measured_s for c in cs}
            pairs = [(a, b) for i, a in enumerate(pred) for b in pred[i + 1:]
                     if meas.index(a) > meas.index(b)]
            apart = [f"{a}/{b} measured {100 * abs(t[a] - t[b]) / min(t[a], t[b]):.1f} % apart"
                     for a, b in pairs]
            swapped = f" ({', '.join(apart)})"
        lines.append(f"ranking {m:6s} {p} rank(s): predicted {' < '.join(pred)}; "
                     f"measured {' < '.join(meas)}; {'match' if ok else 'DIFFERENT'}{swapped}")
    within = sum(abs(c.error) <= TOLERANCE for c in cases)
    lines.append(f"rankings matching: {matched} of {total}")
    lines.append(f"within {100 * TOLERANCE:.0f}%: {within} of {len(cases)} cases")
    return "\n".join(lines)


def run_benchmark(models: Sequence[BenchModel], ranks: Sequence[int], strategies: Sequence[str],
                  machine: MachineModel, work: str, steps: int, repeats: int, reps: int = 5,
                  overlap: bool = False, quiet: Quiet | None = None, log: Callable[[str], None] = print
                  ) -> tuple[list[Case], list[str]]:
    """Predict and measure every (model, strategy, ranks); returns the cases and notes."""
    quiet = quiet or Quiet(budget_s=0.0)
    cases: list[Case] = []
    notes: list[str] = []
    todo = []
    for bm in models:
        graph = build_graph(bm.model, bm.batch_size)
        per_ranks = {}
        for p in ranks:
            mach_p = machine.with_layout(p)  # mpiexec starts all p ranks on this host
            named: dict[str, dict[str, Distribution]] = {}
            for s in strategies:
                d = strategy_dists(s, graph, p, mach_p)
                same = next((k for k, v in named.items() if v == d), None)
                if same is not None:  # e.g. every strategy on one rank: one case, named by all of them
                    named[f"{same}={s}"] = named.pop(same)
                else:
                    named[s] = d
            per_ranks[p] = named
        all_dists = [d for named in per_ranks.values() for d in named.values()]
        config, data = prepare(bm, work)
        log(f"{bm.name}: timing {len(graph)} layers under every local shape the strategies give them")
        quiet.wait()
        with OtherLoad() as load:
            rows, n = [], []
            for p, named in per_ranks.items():  # timed with as many ranks on the node as the runs have
                r_p, n_p = measure_compute_table(graph, list(named.values()), reps=reps, optimizer=OPTIMIZER,
                                                 log=log, overlap=overlap, procs=p)
                rows += r_p
                n += [x for x in n_p if x not in n]
            inputs = {r.key: r for r in (time_input_read(data, graph, d, reps) for d in all_dists)}
        for r in inputs.values():
            log(f"  {'(input)':8s} {'read':9s} block {str(r.key[1]):19s} {r.fwd_s * 1e3:8.3f} ms")
        rows += list(inputs.values())
        log(f"  (other processes kept {load.cores:.2f} cores busy meanwhile)")
        notes += [f"{bm.name}: {x}" for x in n]
        for p, named in per_ranks.items():
            mach_p = with_table(machine.with_layout(p), rows)
            roof_p = machine.with_layout(p)
            for s, d in named.items():
                pred = evaluate_strategy(graph, d, mach_p).step_s
                roof = evaluate_strategy(graph, d, roof_p).step_s
                c = Case(bm.name, s, p, pred, roof, [], parallel_layers(graph, d))
                cases.append(c)
                todo.append((c, config))
    for r in range(repeats):  # repeats are interleaved so that a burst of load elsewhere hits one of each
        for c, config in todo:
            for attempt in range(quiet.retries + 1):
                quiet.wait()
                out = os.path.join(work, "runs", f"{c.model}-{c.strategy}-{c.ranks}-{r}-{attempt}")
                with OtherLoad() as load:
                    t = measure_step(config, c.ranks, c.layers, steps, out, overlap)
                log(f"  run {r + 1}/{repeats}: {c.model} {c.strategy} on {c.ranks} rank(s): "
                    f"{t * 1e3:.2f} ms per step (predicted {c.predicted_s * 1e3:.2f} ms); other processes "
                    f"kept {load.cores:.2f} cores busy")
                if not load.cores > quiet.threshold or quiet.waited_s >= quiet.budget_s:
                    break
            c.measured.append(t)
            c.other.append(load.cores)
    return cases, notes


# --------------------------------------------------------------------------------------------------------


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def calibrate_here(path: str, quick: bool, timeout: float = 600) -> None:
    """``python -m lbannpy.bench calibrate -o path`` on this machine (2 ranks)."""
    cmd = [sys.executable, "-m", "lbannpy.bench", "calibrate", "-o", path]
    if quick:
        cmd.append("--quick")
    p = _run(cmd, timeout, "calibration")
    print(p.stdout.rstrip(), flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench costmodel", description=__doc__.split("\n")[0])
    ap.add_argument("--machine", default=None,
                    help="machine file or preset (default: run `python -m lbannpy.bench calibrate` first)")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated (default 1,2,4)")
    ap.add_argument("--strategies", default="data,spatial,model",
                    help=f"comma-separated, from {', '.join(STRATEGIES)} (default data,spatial,model)")
    ap.add_argument("--models", default=None, help="comma-separated subset of cls, mesh, res (default all)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per training run (default 10)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="training runs per case; the median of their median step times is reported")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per layer for the compute table")
    ap.add_argument("--work", default=None,
                    help="directory for data, configs and runs (default: a temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="one tiny model, 3 steps, 1 repeat, quick calibration: the code path in seconds")
    ap.add_argument("--overlap", action="store_true",
                    help="train with comm.overlap (gradients reduced on a background thread in backprop); "
                         "by default off, as the cost model adds communication to compute (Jia et al. eq. 1)")
    ap.add_argument("--idle-wait", type=float, default=300.0,
                    help="seconds the whole benchmark may wait for other processes to leave the CPUs before "
                         "measuring (default 300; 0: measure at once)")
    ap.add_argument("--other-load", type=float, default=0.25,
                    help="cores of other load above which a training run is repeated, up to twice "
                         "(default 0.25)")
    ap.add_argument("--json", default=None, help="also write the cases to this JSON file")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if any(os.environ.get(var) != "1" for var in THREAD_VARS):
        # this process times layers too, with one BLAS thread as every rank has; the BLAS library read its
        # thread count when NumPy was imported, so start again with the variables set
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "lbannpy.bench", "costmodel", *argv], thread_env())
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies or not ranks or min(ranks) < 1:
        raise SystemExit(f"lbannpy.bench costmodel: --strategies from {', '.join(STRATEGIES)} and --ranks "
                         f"positive integers, got {args.strategies!r} and {args.ranks!r}")
    models = default_models(args.quick)
    if args.models:
        want = [m.strip() for m in args.models.split(",")]
        models = [m for m in models if m.name in want]
        if not models:
            raise SystemExit(f"lbannpy.bench costmodel: no model among {want}; models: cls, mesh, res")
    steps, repeats = (3, 1) if args.quick else (args.steps, args.repeats)
    reps = 2 if args.quick else args.reps
    if args.machine is not None:  # a bad machine file is refused before any data is written or run
        try:
            load_machine_model(args.machine)
        except MachineError as exc:
            raise SystemExit(f"lbannpy.bench costmodel: --machine: {exc}") from None

    with tempfile.TemporaryDirectory(prefix="lbannpy-costmodel-") as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        quiet = Quiet(budget_s=0.0 if args.quick else args.idle_wait, threshold=args.other_load)
        load0 = _loadavg()
        t0 = time.perf_counter()
        machine_path = args.machine
        if machine_path is None:
            machine_path = os.path.join(work, "machine.yaml")
            print(f"calibrating this machine: python -m lbannpy.bench calibrate -o {machine_path}",
                  flush=True)
            quiet.wait()
            with OtherLoad() as load:
                calibrate_here(machine_path, args.quick)
            print(f"(other processes kept {load.cores:.2f} cores busy meanwhile)", flush=True)
        machine = load_machine_model(machine_path)
        print(f"machine {machine.name}: gamma {machine.gamma_s_per_flop:.3e} s/FLOP, intra alpha "
              f"{machine.intra.alpha_s:.2e} s, beta {machine.intra.beta_s_per_byte:.2e} s/B, "
              f"cores per node {machine.cores_per_node or 'one per rank'}", flush=True)
        from lbannpy.layers.kernels import conv as kconv
        print(f"conv kernels: {'compiled (_cconv)' if kconv.USE_COMPILED else 'NumPy'} "
              f"(LBANNPY_CONV_KERNEL=numpy picks NumPy) in the layer table and the runs alike", flush=True)
        cases, notes = run_benchmark(models, ranks, strategies, machine, work, steps, repeats, reps,
                                     overlap=args.overlap, quiet=quiet)
        print(f"\npredicted: cost model with the measured layer table; roofline: the same without it. "
              f"measured: median step of lbannpy.train ({steps} steps, comm.overlap "
              f"{'on' if args.overlap else 'off'}), median of {repeats} run(s). "
              f"{time.perf_counter() - t0:.0f} s, {quiet.waited_s:.0f} s of it waiting for other processes "
              f"to leave the CPUs; load average {load0} before, {_loadavg()} after. other load: cores that "
              f"other processes kept busy during the run (the most of its repeats).\n")
        print(format_table(cases))
        for n in notes:
            print(f"note: {n}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump([{"model": c.model, "strategy": c.strategy, "ranks": c.ranks,
                            "predicted_s": c.predicted_s, "roofline_s": c.roofline_s,
                            "measured_s": c.measured,
                            "other_load_cores": [None if math.isnan(x) else x for x in c.other],
                            "error": c.error} for c in cases], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
