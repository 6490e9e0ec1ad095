"""Searches for the cheapest assignment of one candidate per layer, on an abstract cost problem.

The problem (:class:`Problem`) is Jia et al.'s eq. 1 with the costs already tabulated: a vector of node costs
(t_C + t_S) per layer and a matrix of edge costs (t_X) per tensor. The searches know nothing about layers:

* :func:`shortest_path_chain` — Dryden et al. (2019) §V-C: a chain is a DAG of (layer, candidate) vertices;
  dynamic programming along it is a shortest path.
* :func:`eliminate` — Jia et al. (2018) Algorithm 1 (exact): node elimination (one in-edge, one out-edge;
  eq. 2), edge elimination (parallel edges summed; eq. 3), plus the same min-folding for leaves (a node
  with one edge only, folded into its neighbour's node cost) and for isolated nodes; the graph left over is
  enumerated, within a time budget; eliminations are undone in reverse order.
* :func:`longest_path_heuristic` — Dryden's heuristic for branches: optimise the most expensive remaining
  path with the chain search, fix it, repeat.
* :func:`brute_force` — every assignment, for tests.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np


class SearchError(ValueError):
    """A problem the chosen search cannot solve (e.g. a branchy graph given to the chain search)."""


@dataclass
class Problem:
    """Node costs ``(C_v,)`` per node, edges ``(u, v, M)`` with ``M`` of shape ``(C_u, C_v)``; ``order`` is a
    topological order of the nodes (edges go forward in it)."""

    order: list[str]
    node_costs: dict[str, np.ndarray]
    edges: list[tuple[str, str, np.ndarray]] = field(default_factory=list)

    def __post_init__(self):
        pos = {n: i for i, n in enumerate(self.order)}
        if set(pos) != set(self.node_costs):
            raise SearchError("order and node_costs must name the same nodes")
        for u, v, m in self.edges:
            if pos[u] >= pos[v]:
                raise SearchError(f"edge {u}->{v} goes backwards in the topological order")
            if m.shape != (len(self.node_costs[u]), len(self.node_costs[v])):
                raise SearchError(f"edge {u}->{v}: matrix {m.shape} does not match candidate counts "
                                  f"({len(self.node_costs[u])}, {len(self.node_costs[v])})")
        for n, c in self.node_costs.items():
            if len(c) == 0:
                raise SearchError(f"node {n} has no candidates")

    def evaluate(self, assign: Mapping[str, int]) -> float:
        """t_O of an assignment: Σ node costs + Σ edge costs."""
        t = sum(float(self.node_costs[n][assign[n]]) for n in self.order)
        return t + sum(float(m[assign[u], assign[v]]) for u, v, m in self.edges)

    @property
    def size(self) -> int:
        """Number of assignments."""
        return math.prod(len(c) for c in self.node_costs.values())


@dataclass
class SearchResult:
    assign: dict[str, int]
    cost: float
    method: str
    complete: bool = True  # False when a time budget cut the search short (best so far)
    message: str = ""
    final_nodes: int = 0  # nodes left after eliminations (Jia's K)
    seconds: float = 0.0


def brute_force(problem: Problem) -> SearchResult:
    """Minimum over every assignment (exponential; for tests and tiny graphs). The cost of all assignments
    is one array with an axis per node, summed from the broadcast node and edge costs."""
    t0 = time.perf_counter()
    names = problem.order
    axis = {n: i for i, n in enumerate(names)}
    k = len(names)
    if problem.size > 50_000_000:
        raise SearchError(f"brute force over {problem.size:,} assignments is too large")

    def shaped(arr: np.ndarray, axes: Sequence[int]) -> np.ndarray:
        shape = [1] * k
        for a, n in zip(axes, arr.shape):
            shape[a] = n
        if len(axes) == 2 and axes[0] > axes[1]:
            arr = arr.T
            shape = [1] * k
            shape[axes[1]], shape[axes[0]] = arr.shape
        return arr.reshape(shape)

    total = np.zeros([len(problem.node_costs[n]) for n in names])
    for n in names:
        total = total + shaped(np.asarray(problem.node_costs[n], float), [axis[n]])
    for u, v, m in problem.edges:
        total = total + shaped(np.asarray(m, float), [axis[u], axis[v]])
    flat = int(total.argmin())
    idx = np.unravel_index(flat, total.shape)
    assign = {n: int(i) for n, i in zip(names, idx)}
    return SearchResult(assign, problem.evaluate(assign), "brute-force", seconds=time.perf_counter() - t0)


def _chain_dp(unaries: Sequence[np.ndarray], pairs: Sequence[np.ndarray | None]) -> tuple[list[int], float]:
    """Shortest path through a chain: ``pairs[t]`` is the (C_t, C_{t+1}) edge matrix, or None for no edge."""
    dist = unaries[0].astype(float)
    back = []
    for t in range(1, len(unaries)):
        m = pairs[t - 1]
        if m is None:
            tot = dist[:, None] + np.zeros((1, len(unaries[t])))
        else:
            tot = dist[:, None] + m
        arg = tot.argmin(axis=0)
        back.append(arg)
        dist = tot[arg, np.arange(tot.shape[1])] + unaries[t]
    last = int(dist.argmin())
    path = [last]
    for arg in reversed(back):
        path.append(int(arg[path[-1]]))
    return path[::-1], float(dist[last])


def shortest_path_chain(problem: Problem) -> SearchResult:
    """Dryden's shortest path over (layer, candidate) vertices; the problem must be a chain in ``order``."""
    t0 = time.perf_counter()
    order = problem.order
    pos = {n: i for i, n in enumerate(order)}
    pairs: list[np.ndarray | None] = [None] * (len(order) - 1)
    for u, v, m in problem.edges:
        if pos[v] != pos[u] + 1:
            raise SearchError(f"not a chain: edge {u}->{v} skips layers; use eliminate() for branches")
        pairs[pos[u]] = m if pairs[pos[u]] is None else pairs[pos[u]] + m
    path, cost = _chain_dp([problem.node_costs[n] for n in order], pairs)
    return SearchResult(dict(zip(order, path)), cost, "shortest-path", seconds=time.perf_counter() - t0)


def eliminate(problem: Problem, time_budget_s: float | None = None) -> SearchResult:
    """Jia et al. Algorithm 1: exact node/edge elimination, enumeration of the rest, undo.

    With ``time_budget_s`` the enumeration of the final graph stops when the budget is spent and the best
    assignment found so far is returned with ``complete=False`` and a message.
    """
    t0 = time.perf_counter()
    cost, edges, rest, undo = _reduce(problem)
    best_a, complete, message = _enumerate(rest, cost, edges, t0, time_budget_s)
    assign = _unwind(undo, dict(best_a))
    total = problem.evaluate(assign)
    return SearchResult(assign, total, "elimination", complete, message, len(rest), time.perf_counter() - t0)


def _reduce(problem: Problem) -> tuple[dict, dict, list[str], list[tuple]]:
    """Node and edge eliminations (eq. 2, 3) and leaf folding until none applies; returns the reduced node
    costs and edges, the layers left (in problem order) and the undo log that recovers the eliminated
    layers' choices from their neighbours'."""
    cost = {n: np.asarray(c, dtype=float).copy() for n, c in problem.node_costs.items()}
    edges: dict[tuple[str, str], np.ndarray] = {}
    out_n: dict[str, set[str]] = {n: set() for n in problem.order}
    in_n: dict[str, set[str]] = {n: set() for n in problem.order}

    def add_edge(u: str, v: str, m: np.ndarray) -> None:
        if (u, v) in edges:  # edge elimination (eq. 3): parallel edges are summed
            edges[(u, v)] = edges[(u, v)] + m
        else:
            edges[(u, v)] = np.asarray(m, dtype=float)
            out_n[u].add(v)
            in_n[v].add(u)

    def drop_edge(u: str, v: str) -> np.ndarray:
        out_n[u].discard(v)
        in_n[v].discard(u)
        return edges.pop((u, v))

    for u, v, m in problem.edges:
        add_edge(u, v, m)
    alive = set(problem.order)
    undo: list[tuple] = []
    work = list(reversed(problem.order))
    while work:
        j = work.pop()
        if j not in alive:
            continue
        ins, outs = len(in_n[j]), len(out_n[j])
        if ins == 1 and outs == 1:  # node elimination (eq. 2)
            (i,), (k,) = tuple(in_n[j]), tuple(out_n[j])
            m1, m2 = drop_edge(i, j), drop_edge(j, k)
            tot = m1[:, :, None] + cost[j][None, :, None] + m2[None, :, :]
            arg = tot.argmin(axis=1)
            add_edge(i, k, np.take_along_axis(tot, arg[:, None, :], axis=1)[:, 0, :])
            undo.append(("node", j, i, k, arg))
            touched = (i, k)
        elif ins + outs == 1:  # a leaf: fold min over its candidates into its neighbour's node cost
            if ins:
                (i,) = tuple(in_n[j])
                tot = drop_edge(i, j) + cost[j][None, :]
                arg = tot.argmin(axis=1)
                cost[i] = cost[i] + tot[np.arange(len(arg)), arg]
                undo.append(("from", j, i, arg))
                touched = (i,)
            else:
                (k,) = tuple(out_n[j])
                tot = drop_edge(j, k) + cost[j][:, None]
                arg = tot.argmin(axis=0)
                cost[k] = cost[k] + tot[arg, np.arange(len(arg))]
                undo.append(("to", j, k, arg))
                touched = (k,)
        elif ins + outs == 0 and len(alive) > 1:
            undo.append(("alone", j, int(cost[j].argmin())))
            touched = ()
        else:
            continue
        alive.discard(j)
        work.extend(touched)
    return cost, edges, [n for n in problem.order if n in alive], undo


def _enumerate(rest: list[str], cost: dict, edges: dict, t0: float, time_budget_s: float | None
               ) -> tuple[dict[str, int], bool, str]:
    """The best assignment of the layers left, by enumeration (each layer's cheapest candidate first), with
    ``complete=False`` and a message when the time budget ran out."""
    complete, message = True, ""
    best_a: dict[str, int] = {}
    best = math.inf
    if not rest:
        return best_a, complete, message
    rest_edges = [(u, v, m) for (u, v), m in edges.items()]
    n_comb = math.prod(len(cost[n]) for n in rest)
    start = {n: int(cost[n].argmin()) for n in rest}
    ranges = [range(len(cost[n])) for n in rest]
    checked = 0
    for combo in itertools.chain([tuple(start[n] for n in rest)], itertools.product(*ranges)):
        a = dict(zip(rest, combo))
        c = sum(cost[n][a[n]] for n in rest) + sum(m[a[u], a[v]] for u, v, m in rest_edges)
        if c < best:
            best, best_a = float(c), a
        checked += 1
        if time_budget_s is not None and checked % 512 == 0 and time.perf_counter() - t0 > time_budget_s:
            complete = False
            message = (f"time budget of {time_budget_s:g} s hit after {checked - 1:,} of {n_comb:,} "
                       f"assignments of the {len(rest)} layers left after eliminations; returning the best "
                       f"found so far (raise the budget for the optimum)")
            break
    return best_a, complete, message


def _unwind(undo: list[tuple], assign: dict[str, int]) -> dict[str, int]:
    """The eliminated layers' choices, from the last elimination back to the first."""
    for step in reversed(undo):
        kind, j = step[0], step[1]
        if kind == "node":
            _, _, i, k, arg = step
            assign[j] = int(arg[assign[i], assign[k]])
        elif kind in ("from", "to"):
            assign[j] = int(step[3][assign[step[2]]])
        else:
            assign[j] = step[2]
    return assign


def longest_path_heuristic(problem: Problem) -> SearchResult:
    """Dryden et al. §V-C: take the most expensive path through layers not yet fixed (weights: each layer's
    cheapest node cost), choose its candidates by the chain search given the layers already fixed, fix them,
    and repeat with the next path until every layer is fixed. Not exact on branchy graphs."""
    t0 = time.perf_counter()
    order = problem.order
    preds: dict[str, list[str]] = {n: [] for n in order}
    adj: dict[tuple[str, str], np.ndarray] = {}
    for u, v, m in problem.edges:
        preds[v].append(u)
        adj[(u, v)] = adj[(u, v)] + m if (u, v) in adj else m
    weight = {n: float(np.min(problem.node_costs[n])) for n in order}
    fixed: dict[str, int] = {}
    while len(fixed) < len(order):
        best: dict[str, tuple[float, str | None]] = {}
        for n in order:
            w = 0.0 if n in fixed else weight[n] + 1e-12
            p = max(((best[u][0], u) for u in preds[n]), default=(0.0, None))
            best[n] = (p[0] + w, p[1])
        end = max(order, key=lambda n: best[n][0])
        path = [end]
        while best[path[-1]][1] is not None:
            path.append(best[path[-1]][1])
        path = [n for n in reversed(path) if n not in fixed]
        # path nodes not fixed, in order; consecutive ones may be joined by an edge
        unaries = []
        for n in path:
            u = problem.node_costs[n].astype(float).copy()
            for (a, b), m in adj.items():
                if a == n and b in fixed:
                    u += m[:, fixed[b]]
                elif b == n and a in fixed:
                    u += m[fixed[a], :]
            unaries.append(u)
        pairs = [adj.get((a, b)) for a, b in zip(path, path[1:])]
        choice, _ = _chain_dp(unaries, pairs)
        fixed.update(zip(path, choice))
    return SearchResult(fixed, problem.evaluate(fixed), "longest-path", seconds=time.perf_counter() - t0)
