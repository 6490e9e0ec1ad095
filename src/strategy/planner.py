"""Strategy selection: candidates per layer, cost tables, search, memory limit, baselines.

``plan(spec, ranks, machine)`` builds the model graph, enumerates each layer's candidate distributions
(Jia et al. Table 1 dimensions; fewer ranks than exist allowed, the rest replicate), drops those that cannot
work or do not pay (with the reason kept for ``--explain``), tabulates t_C + t_S per candidate and t_X per
edge and candidate pair, and searches (:mod:`.search`). When the cheapest strategy does not fit the memory
limit, the search is repeated with memory priced in (a Lagrange multiplier on persistent bytes per rank)
until it fits, or the plan fails saying how much the leanest strategy needs.
"""
from __future__ import annotations

import math
import time
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from lbannpy.layers.registry import activation_sharing, layer_classes, layer_spec, split_refusal

from ..dist import Distribution, DIM_NAMES
from .cost import (LayerCost, halo_geometry, layer_cost, layer_memory, max_local_shape, redistribution_matrix,
                   redistribution_time, reduced_dims, required_input)
from .graph import INPUT_NAMES, ModelGraph, Node, build_graph
from ..machine import DEFAULT_MACHINE, Machine as MachineModel, load_machine as load_machine_model
from .search import Problem, SearchResult, eliminate, longest_path_heuristic, shortest_path_chain

GIB = 1024 ** 3


class PlanError(ValueError):
    """No strategy can run: too few ranks, no candidate for a layer, or nothing fits the memory limit."""


@dataclass(frozen=True)
class Candidate:
    dist: Distribution
    cost: LayerCost


@dataclass(frozen=True)
class Dropped:
    dist: Distribution
    reason: str


@dataclass
class StrategyCost:
    """Predicted step time and memory of one assignment of distributions to layers."""

    dists: dict[str, Distribution]
    layer: dict[str, LayerCost]
    transfer_in: dict[str, float]  # t_X of the edges into each layer, seconds
    memory_bytes: int  # per rank: Σ persistent + max transient

    @property
    def compute_s(self) -> float:
        return sum(c.compute_s for c in self.layer.values())

    @property
    def comm_s(self) -> float:
        return sum(c.comm_s for c in self.layer.values()) + sum(self.transfer_in.values())

    @property
    def sync_s(self) -> float:
        """Σ t_S: gradient synchronisation (part of comm_s)."""
        return sum(c.t_s for c in self.layer.values())

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class Plan:
    graph: ModelGraph
    ranks: int
    machine: MachineModel
    memory_limit_bytes: int
    candidates: dict[str, list[Candidate]]
    dropped: dict[str, list[Dropped]]
    result: SearchResult
    chosen: StrategyCost
    messages: list[str] = field(default_factory=list)
    baselines: dict[str, StrategyCost] = field(default_factory=dict)
    heuristic: SearchResult | None = None
    table_seconds: float = 0.0  # building candidates and cost tables
    search_seconds: float = 0.0

    @property
    def choice(self) -> dict[str, Distribution]:
        return self.chosen.dists

    def parallel_layers(self) -> dict[str, dict[str, int]]:
        """The ``parallel.layers`` block of a config: split degrees per layer (``n`` always present)."""
        out = {}
        for name, d in self.choice.items():
            deg = {k: v for k, v in zip(d.dim_names, d.split) if v > 1}
            out[name] = {"n": deg.pop("n", 1), **deg}
        return out


# --------------------------------------------------------------------------------------------------------
# candidates


def divisors(p: int) -> list[int]:
    """The divisors of ``p``, ascending (the split degrees a layer of ``p`` ranks can take)."""
    return [d for d in range(1, p + 1) if p % d == 0]


def enumerate_splits(node: Node, ranks: int) -> list[Distribution]:
    return list(_splits(node.type, len(node.out_shape), ranks))


@lru_cache(maxsize=1024)
def _splits(typ: str, ndim: int, ranks: int) -> tuple[Distribution, ...]:
    """Every output split of ``node`` over its parallelisable dimensions whose product divides ``ranks``.

    Spatial splits are kept near-square (each degree at least the next and at most twice the last, e.g.
    h2, h2·w2, h4·w2, h4·w4 as in Dryden et al.); splits larger than the extent are left to the filters.
    """
    names = DIM_NAMES[ndim]
    allowed = layer_spec(typ).split_dims  # Jia et al. Table 1: the output dimensions the type may split
    dims = [d for d in names if d in allowed]
    divs = divisors(ranks)
    out = []

    def rec(i: int, used: int, deg: dict[str, int]):
        if i == len(dims):
            sp = [deg.get(d, 1) for d in names[2:] if d in dims]
            if sp and (any(a < b for a, b in zip(sp, sp[1:])) or sp[0] > 2 * sp[-1]):
                return
            out.append(Distribution.make(ndim, ranks, **deg))
            return
        for d in divs:
            if (ranks // used) % d == 0:
                rec(i + 1, used * d, {**deg, dims[i]: d} if d > 1 else deg)

    rec(0, 1, {})
    return tuple(out)


def filter_reason(node: Node, dist: Distribution, imbalance_tol: float) -> str | None:
    """Why ``dist`` cannot or should not be used for ``node`` (None: keep it)."""
    cut = split_refusal(layer_spec(node.type), node.params, node.in_shape, dist)
    if cut is not None:  # a split the type makes but not with these parameters (a cut channel group)
        return cut[1]
    # where the layer reduces a split dimension whole (global pooling), the split cuts its input there
    reduced = reduced_dims(node, dist)
    shape = tuple(node.in_shape[i] if i in reduced else n for i, n in enumerate(node.out_shape))
    for name, n, p in zip(dist.dim_names, shape, dist.split):
        if p > n:
            return f"empty blocks: {name}{p} > extent {n}"
    ideal = math.prod(shape) / math.prod(dist.split)
    worst = math.prod(max_local_shape(shape, dist))
    if worst > (1 + imbalance_tol) * ideal:
        return (f"load imbalance: the largest block holds {100 * (worst / ideal - 1):.0f}% more than the "
                f"average (limit {100 * imbalance_tol:.0f}%)")
    geo = halo_geometry(node, dist)
    if geo is not None:
        widths = geo[0]
        # an adjoint's halo is in output elements (cost.halo_geometry)
        shape = node.out_shape if node.halo == "adjoint" else node.in_shape
        for name, n, p, (lo, hi) in zip(dist.dim_names[2:], shape[2:], dist.split[2:], widths[2:]):
            small = n // p
            if p > 1 and small < max(lo, hi, 1):
                return (f"block smaller than its halo: {small} input elements along {name} per rank but a "
                        f"halo of {max(lo, hi)}; lower the {name} degree")
    return None


def layer_candidates(node: Node, ranks: int, machine: MachineModel, *, inherited: list[Distribution] = (),
                     reads_input: bool = False, memory_limit_bytes: int | None = None,
                     max_candidates: int = 12, imbalance_tol: float = 0.25, optimizer: str = "sgd"
                     ) -> tuple[list[Candidate], list[Dropped]]:
    """Kept candidates (cheapest standalone first, plus valid distributions ``inherited`` from the parents so
    that a layer can keep its parent's layout for free) and dropped ones with the reason."""
    ndim = len(node.out_shape)
    inherited = [d for d in dict.fromkeys(inherited) if d.ndim == ndim and _allowed(node, d)]
    own = [] if layer_spec(node.type).pointwise and inherited else enumerate_splits(node, ranks)
    kept: list[Candidate] = []
    dropped: list[Dropped] = []
    seen = set()
    for d in own + inherited:
        if d in seen:
            continue
        seen.add(d)
        why = filter_reason(node, d, imbalance_tol)
        if why is None:
            c = _cached_cost(node, d, machine, reads_input, optimizer)
            if memory_limit_bytes is not None and c.mem_bytes > memory_limit_bytes:
                why = (f"memory: {c.mem_bytes / GIB:.2f} GiB per rank for this layer alone > "
                       f"{memory_limit_bytes / GIB:.2f} GiB")
            else:
                kept.append(Candidate(d, c))
                continue
        dropped.append(Dropped(d, why))
    def key(c: Candidate):
        return (c.cost.total_s, math.prod(c.dist.split) != ranks, sum(s > 1 for s in c.dist.split))

    kept.sort(key=key)
    final = kept[:max_candidates]
    # keep the sample-parallel candidate (the data-parallel baseline's layout) when it is valid
    dp = [c for c in kept[max_candidates:] if all(s == 1 for s in c.dist.split[1:])]
    final += dp[:1]
    for i, c in enumerate(kept[max_candidates:]):
        if c not in final:
            dropped.append(Dropped(c.dist, f"pruned: standalone cost {c.cost.total_s * 1e3:.3f} ms ranks "
                                           f"#{max_candidates + i + 1} (keeping the {max_candidates} "
                                           f"cheapest)"))
    return final, dropped


_COST_CACHE: dict[tuple, LayerCost] = {}


def _cached_cost(node: Node, d: Distribution, machine: MachineModel, reads_input: bool, optimizer: str
                 ) -> LayerCost:
    """layer_cost memoised on what it depends on: layers of one shape and kind (Inception, ResNet repeat
    them) share an entry."""
    key = (node.type, node.in_shapes, node.out_shape, node.n_params, node.flops_fwd, node.stencil, node.halo,
           d, machine, id(machine.measured), reads_input, optimizer)
    if machine.rates:  # a rate row may be chosen by the layer's parameters (cost.compute_times)
        key += (tuple(sorted((k, repr(v)) for k, v in node.params.items())),)
    c = _COST_CACHE.get(key)
    if c is None:
        if len(_COST_CACHE) > 200_000:
            _COST_CACHE.clear()
        c = _COST_CACHE[key] = layer_cost(node, d, machine, reads_input, optimizer)
    return c


def _allowed(node: Node, d: Distribution) -> bool:
    allowed = layer_spec(node.type).split_dims
    for name, p in zip(d.dim_names, d.split):
        if p > 1 and name not in allowed:
            return False
    return True


# --------------------------------------------------------------------------------------------------------
# evaluation of a fixed strategy


def _reads_input(node: Node) -> bool:
    return any(p in INPUT_NAMES for p in node.parents)


def evaluate_strategy(graph: ModelGraph, dists: Mapping[str, Distribution], machine: MachineModel,
                      optimizer: str = "sgd") -> StrategyCost:
    """t_O (Jia eq. 1) and per-rank memory of a fixed assignment of output distributions to layers."""
    layer = {}
    tin = {}
    pers, trans = 0, 0
    for node in graph:
        d = dists[node.name]
        c = _cached_cost(node, d, machine, _reads_input(node), optimizer)
        layer[node.name] = c
        pers += c.mem_persistent_bytes
        trans = max(trans, c.mem_transient_bytes)
        t = 0.0
        for p, shape in zip(node.parents, node.in_shapes):
            if p in INPUT_NAMES:
                continue
            t += redistribution_time(shape, dists[p], required_input(node, d, shape), machine)
        tin[node.name] = t
    return StrategyCost(dict(dists), layer, tin, pers + trans)


def strategy_memory(graph: ModelGraph, dists: Mapping[str, Distribution], machine: MachineModel,
                    optimizer: str = "sgd") -> int:
    """Per-rank bytes of a fixed assignment, as :func:`evaluate_strategy` counts them (Σ persistent + max
    transient of :func:`lbannpy.strategy.cost.layer_memory`), without pricing any time: exact on Python
    integers for any layer size, so a set-up can refuse a run before allocating it. Unlike the search,
    which prices each layer alone, it knows the neighbours: a ReLU that runs in its parent's array keeps
    nothing of its own."""
    pers, trans = 0, 0
    shared = _shares_parent_output(graph, dists)
    for node in graph:
        p, t = layer_memory(node, dists[node.name], machine, _reads_input(node), optimizer)
        if node.name in shared:  # the parent's array, overwritten in place: nothing of its own is kept
            p -= math.prod(max_local_shape(node.out_shape, dists[node.name])) * machine.dtype_bytes
        pers += p
        trans = max(trans, t)
    return pers + trans


def _shares_parent_output(graph: ModelGraph, dists: Mapping[str, Distribution]) -> set[str]:
    """Layers whose output is their parent's array (:func:`lbannpy.layers.registry.activation_sharing`,
    the rule the model applies: a ReLU fused into its batch-norm, or overwriting its parent's output)."""
    classes = layer_classes()
    return set(activation_sharing((node.name, classes[node.type], node.parents, dists[node.name])
                                  for node in graph))


def fit_degree(d: int, ranks: int) -> int:
    """Largest divisor of ``ranks`` that is at most ``d``."""
    return max(x for x in divisors(ranks) if x <= max(d, 1))


def baseline_strategies(graph: ModelGraph, ranks: int) -> dict[str, dict[str, Distribution]]:
    """Jia et al.'s baselines: data parallelism (samples over all ranks), model parallelism (output channels
    over all ranks, Krizhevsky 2014), OWT ("one weird trick": data-parallel up to the first fc layer, model-
    parallel from there). Degrees are capped at the extent; leftover ranks replicate."""
    data, model, owt = {}, {}, {}
    seen_fc = False
    for node in graph:
        nd = len(node.out_shape)
        dp = Distribution.make(nd, ranks, n=fit_degree(node.out_shape[0], ranks))
        spec = layer_spec(node.type)
        mp = Distribution.make(nd, ranks, c=fit_degree(node.out_shape[1], ranks))
        if "c" not in spec.split_dims or split_refusal(spec, node.params, node.in_shape, mp):
            mp = Distribution.whole(nd, ranks)  # concat, flatten; a channel group the split would cut
        seen_fc = seen_fc or spec.dense
        data[node.name], model[node.name] = dp, mp
        owt[node.name] = mp if seen_fc else dp
    return {"data-parallel": data, "model-parallel": model, "owt": owt}


# --------------------------------------------------------------------------------------------------------
# the plan


def plan(spec: Mapping[str, Any] | ModelGraph, ranks: int,
         machine: str | MachineModel | Mapping = DEFAULT_MACHINE, *,
         memory_gib: float | None = None, batch_size: int | None = None, search: str = "auto",
         time_budget_s: float = 10.0, max_candidates: int = 12, imbalance_tol: float = 0.25,
         compare: bool = True, heuristic: bool = False) -> Plan:
    """Choose a distribution for every layer of ``spec`` (a full spec, its ``model`` tree, or a graph).

    ``search``: ``auto`` (elimination; the chain shortest path when the graph is a chain), ``elimination``,
    ``shortest-path`` or ``longest-path``. ``heuristic=True`` also runs Dryden's longest-path heuristic for
    comparison.
    """
    t0 = time.perf_counter()
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlanError(f"--ranks must be a positive integer, got {ranks!r}")
    mach = load_machine_model(machine)
    if memory_gib is not None:
        mach = mach.with_memory(memory_gib)
    limit = int(mach.memory_per_device_gib * GIB)
    graph, optimizer = _graph_of(spec, batch_size)
    cands, dropped = _candidates(graph, ranks, mach, limit, max_candidates, imbalance_tol, optimizer)
    order = [n.name for n in graph]
    node_time = {n: np.array([c.cost.total_s for c in cands[n]]) for n in order}
    node_mem = {n: np.array([float(c.cost.mem_persistent_bytes) for c in cands[n]]) for n in order}
    edges = _edges(graph, cands, mach)
    t1 = time.perf_counter()

    children = graph.children()
    is_chain = all(len(n.parents) == 1 for n in graph) and all(len(v) <= 1 for v in children.values())
    method = search if search != "auto" else ("shortest-path" if is_chain else "elimination")
    solvers = {"shortest-path": lambda pr: shortest_path_chain(pr),
               "elimination": lambda pr: eliminate(pr, time_budget_s),
               "longest-path": lambda pr: longest_path_heuristic(pr)}
    if method not in solvers:
        raise PlanError(f"unknown search {search!r}; use auto, elimination, shortest-path or longest-path")
    solve = solvers[method]

    def run(lam: float) -> tuple[SearchResult, StrategyCost]:
        pr = Problem(order, {n: node_time[n] + lam * node_mem[n] for n in order}, edges)
        res = solve(pr)
        dists = {n: cands[n][res.assign[n]].dist for n in order}
        return res, evaluate_strategy(graph, dists, mach, optimizer)

    messages = []
    result, chosen = run(0.0)
    if chosen.memory_bytes > limit:
        result, chosen, note = _fit_memory(run, chosen, limit, ranks, cands)
        messages.append(note)
    if not result.complete:
        messages.append(result.message)
    t2 = time.perf_counter()

    out = Plan(graph, ranks, mach, limit, cands, dropped, result, chosen, messages, table_seconds=t1 - t0,
               search_seconds=t2 - t1)
    if heuristic:
        pr = Problem(order, node_time, edges)
        out.heuristic = longest_path_heuristic(pr)
    if compare:
        for name, dists in baseline_strategies(graph, ranks).items():
            out.baselines[name] = evaluate_strategy(graph, dists, mach, optimizer)
    return out


def _graph_of(spec, batch_size: int | None) -> tuple[ModelGraph, str]:
    """The layer graph of a spec (full, its ``model`` tree, or a graph) and the optimizer it trains with."""
    if isinstance(spec, ModelGraph):
        return spec, "sgd"
    model = spec.get("model", spec)
    if batch_size is None:
        batch_size = int((spec.get("trainer") or {}).get("batch_size", 1)) if "model" in spec else 1
    optimizer = str(((spec.get("optimizer") or {}) if "model" in spec else {}).get("type", "sgd"))
    return build_graph(model, batch_size), optimizer


def _candidates(graph: ModelGraph, ranks: int, mach: MachineModel, limit: int, max_candidates: int,
                imbalance_tol: float, optimizer: str
                ) -> tuple[dict[str, list[Candidate]], dict[str, list[Dropped]]]:
    """Each layer's kept candidate distributions (priced) and the dropped ones with their reasons; a layer
    with none left is a :class:`PlanError` naming the first reasons."""
    cands: dict[str, list[Candidate]] = {}
    dropped: dict[str, list[Dropped]] = {}
    for node in graph:
        inherited = [c.dist for p in node.parents if p not in INPUT_NAMES for c in cands[p]]
        kept, drop = layer_candidates(node, ranks, mach, inherited=inherited, reads_input=_reads_input(node),
                                      memory_limit_bytes=limit, max_candidates=max_candidates,
                                      imbalance_tol=imbalance_tol, optimizer=optimizer)
        if not kept:
            reasons = "; ".join(f"{d.dist}: {d.reason}" for d in drop[:6])
            raise PlanError(f"layer {node.name!r} ({node.type}, output {node.out_shape}) has no usable "
                            f"distribution on {ranks} ranks: {reasons}")
        cands[node.name] = kept
        dropped[node.name] = drop
    return cands, dropped


def _edges(graph: ModelGraph, cands: Mapping[str, list[Candidate]], mach: MachineModel) -> list:
    """``(parent, child, matrix)`` per graph edge: the redistribution seconds from each parent candidate to
    the input each child candidate requires."""
    edges = []
    for node in graph:
        for p, shape in zip(node.parents, node.in_shapes):
            if p in INPUT_NAMES:
                continue
            dsts = [required_input(node, c.dist, shape) for c in cands[node.name]]
            uniq = list(dict.fromkeys(dsts))
            m = redistribution_matrix(shape, [c.dist for c in cands[p]], uniq, mach)
            edges.append((p, node.name, m[:, [uniq.index(d) for d in dsts]]))
    return edges


def _fit_memory(run, first: StrategyCost, limit: int, ranks: int, cands: Mapping[str, list[Candidate]]
                ) -> tuple[SearchResult, StrategyCost, str]:
    """The fastest strategy under the memory ``limit``: memory is priced in (``run(price)``) at growing
    prices until a strategy fits, then the price is bisected down towards faster ones that still fit."""
    lo, hi = 0.0, first.step_s / max(first.memory_bytes - limit, 1)
    ok = None
    for _ in range(40):
        res, sc = run(hi)
        if sc.memory_bytes <= limit:
            ok = (res, sc)
            break
        lo, hi = hi, hi * 4
    if ok is None:
        leanest = max(min(c.cost.mem_persistent_bytes for c in cs) for cs in cands.values())
        raise PlanError(
            f"no strategy fits {limit / GIB:.2f} GiB per rank on {ranks} ranks: the fastest needs "
            f"{first.memory_bytes / GIB:.2f} GiB and even pricing memory in leaves "
            f"{sc.memory_bytes / GIB:.2f} GiB; use more ranks (more spatial parallelism), a smaller batch "
            f"or a larger --memory (the largest layer needs at least {leanest / GIB:.2f} GiB)")
    for _ in range(12):  # bisect towards the smallest price that still fits (faster strategies)
        mid = (lo + hi) / 2
        res, sc = run(mid)
        if sc.memory_bytes <= limit:
            hi, ok = mid, (res, sc)
        else:
            lo = mid
    result, chosen = ok
    note = (f"memory: the fastest strategy needs {first.memory_bytes / GIB:.2f} GiB per rank > limit "
            f"{limit / GIB:.2f} GiB; chose the fastest found that fits ({chosen.memory_bytes / GIB:.2f} GiB, "
            f"{chosen.step_s * 1e3:.2f} ms vs {first.step_s * 1e3:.2f} ms)")
    return result, chosen, note
