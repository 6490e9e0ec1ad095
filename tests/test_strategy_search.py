"""Searches against brute force on random chains and series-parallel graphs with random costs."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from lbannpy.strategy.search import (Problem, SearchError, brute_force, eliminate, longest_path_heuristic,
                                     shortest_path_chain)


@dataclass(frozen=True)
class Case:
    kind: str
    seed: int

    def __str__(self):
        return f"{self.kind}-{self.seed}"


def _series_parallel(rng: random.Random, max_nodes: int = 6):
    """A random two-terminal series-parallel DAG (nodes, edges) by series and parallel composition."""
    count = [0]

    def new():
        count[0] += 1
        return f"v{count[0]}"

    def build(depth):
        r = rng.random()
        if depth > 2 or r < 0.3:
            a = new()
            return [a], [], a, a
        n1, e1, s1, t1 = build(depth + 1)
        n2, e2, s2, t2 = build(depth + 1)
        if r < 0.6:
            return n1 + n2, e1 + e2 + [(t1, s2)], s1, t2
        s, t = new(), new()
        return [s] + n1 + n2 + [t], e1 + e2 + [(s, s1), (s, s2), (t1, t), (t2, t)], s, t

    while True:
        count[0] = 0
        nodes, edges, _, _ = build(0)
        if 2 <= len(nodes) <= max_nodes:
            if rng.random() < 0.3 and len(edges) > 0:  # a duplicated edge: two tensors between two layers
                edges.append(rng.choice(edges))
            return nodes, edges


def _topo(nodes, edges):
    import graphlib
    preds = {n: [u for u, v in edges if v == n] for n in nodes}
    return list(graphlib.TopologicalSorter(preds).static_order())


def _problem(nodes, edges, seed) -> Problem:
    rng = np.random.default_rng(seed)
    cnt = {n: int(rng.integers(1, 9)) for n in nodes}
    order = _topo(nodes, edges)
    return Problem(order, {n: rng.random(cnt[n]) for n in order},
                   [(u, v, rng.random((cnt[u], cnt[v])) * rng.choice([0.1, 1, 10])) for u, v in edges])


def _chain(seed) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    nodes = [f"l{i}" for i in range(n)]
    return _problem(nodes, list(zip(nodes, nodes[1:])), seed)


CASES = [Case("chain", s) for s in range(60)] + [Case("sp", s) for s in range(140)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_search_equals_brute_force(case):
    if case.kind == "chain":
        pr = _chain(case.seed)
    else:
        pr = _problem(*_series_parallel(random.Random(case.seed)), case.seed)
    best = brute_force(pr)
    ex = eliminate(pr)
    assert ex.complete
    assert ex.cost == pytest.approx(best.cost, rel=1e-12, abs=1e-12)
    assert pr.evaluate(ex.assign) == pytest.approx(ex.cost)
    heur = longest_path_heuristic(pr)
    assert heur.cost >= best.cost - 1e-12
    if case.kind == "chain":
        assert shortest_path_chain(pr).cost == pytest.approx(best.cost)
        assert heur.cost == pytest.approx(best.cost)


def test_series_parallel_graphs_reduce_completely():
    sizes = []
    for s in range(50):
        pr = _problem(*_series_parallel(random.Random(1000 + s)), s)
        sizes.append(eliminate(pr).final_nodes)
    assert max(sizes) <= 1


def _non_series_parallel(c: int) -> Problem:
    """The 'N' graph a->c, a->d, b->d plus a->b->... wheatstone bridge: not series-parallel."""
    nodes = ["s", "a", "b", "t"]
    edges = [("s", "a"), ("s", "b"), ("a", "b"), ("a", "t"), ("b", "t")]
    return _problem(nodes, edges, 7) if c == 0 else Problem(
        nodes, {n: np.random.default_rng(i).random(c) for i, n in enumerate(nodes)},
        [(u, v, np.random.default_rng(10 + i).random((c, c))) for i, (u, v) in enumerate(edges)])


def test_bridge_graph_is_enumerated_exactly():
    pr = _non_series_parallel(5)
    ex = eliminate(pr)
    assert ex.cost == pytest.approx(brute_force(pr).cost)


def test_time_budget_returns_best_so_far_with_message():
    nodes = [f"n{i}" for i in range(8)]
    edges = [(u, v) for i, u in enumerate(nodes) for v in nodes[i + 1:]]  # complete DAG: nothing eliminates
    rng = np.random.default_rng(0)
    pr = Problem(nodes, {n: rng.random(12) for n in nodes}, [(u, v, rng.random((12, 12))) for u, v in edges])
    res = eliminate(pr, time_budget_s=0.05)
    assert not res.complete
    assert "time budget" in res.message and "best found so far" in res.message
    assert res.cost == pytest.approx(pr.evaluate(res.assign))


def test_chain_search_refuses_branches():
    pr = _problem(["a", "b", "c"], [("a", "b"), ("a", "c"), ("b", "c")], 0)
    with pytest.raises(SearchError, match="not a chain"):
        shortest_path_chain(pr)


def test_problem_validation():
    with pytest.raises(SearchError, match="does not match"):
        Problem(["a", "b"], {"a": np.ones(2), "b": np.ones(3)}, [("a", "b", np.ones((2, 2)))])
    with pytest.raises(SearchError, match="backwards"):
        Problem(["a", "b"], {"a": np.ones(2), "b": np.ones(2)}, [("b", "a", np.ones((2, 2)))])


def test_negative_control_brute_force_differs_from_a_wrong_answer():
    """The property test can fail: a search that ignores edge costs disagrees with brute force somewhere."""
    wrong = 0
    for s in range(30):
        pr = _chain(s)
        greedy = {n: int(np.argmin(pr.node_costs[n])) for n in pr.order}
        if pr.evaluate(greedy) > brute_force(pr).cost + 1e-12:
            wrong += 1
    assert wrong > 0
