"""The benchmark's models (small classifier, segmenter, residual net) and the strategies it compares: Jia et
al.'s baselines, spatial, hybrid and the selector's plan, as per-layer distributions and config blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from lbannpy.dist import Distribution
from lbannpy.machine import Machine
from lbannpy.strategy import baseline_strategies, plan
from lbannpy.strategy.cost import required_input
from lbannpy.strategy.graph import INPUT_NAMES, ModelGraph, Node
from lbannpy.strategy.planner import divisors, fit_degree, filter_reason

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
    # late: loaded when the command runs, so its --help and argument errors come without it
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


def _valid_degree(node: Node, ranks: int, make: Callable[[int], Distribution]) -> Distribution:
    """``make(k)`` for the largest divisor ``k`` of ``ranks`` that gives ``node`` a usable distribution
    (blocks no smaller than their halo, no empty blocks); leftover ranks replicate."""
    for k in reversed(divisors(ranks)):
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
            out[node.name] = Distribution.make(nd, ranks, n=fit_degree(node.out_shape[0], ranks))
    return out


def hybrid_strategy(graph: ModelGraph, ranks: int) -> dict[str, Distribution]:
    """Samples split over half the ranks and height over two (n·h2), fully-connected layers samples only."""
    if ranks < 4:
        return spatial_strategy(graph, ranks)
    out = {}
    for node in graph:
        nd = len(node.out_shape)
        n = fit_degree(node.out_shape[0], ranks // 2)
        if nd > 2:
            out[node.name] = _valid_degree(node, 2, lambda k: Distribution.make(nd, ranks, n=n, h=k))
        else:
            out[node.name] = Distribution.make(nd, ranks, n=fit_degree(node.out_shape[0], ranks))
    return out


STRATEGIES = ("data", "spatial", "model", "owt", "hybrid", "selector")


def strategy_dists(name: str, graph: ModelGraph, ranks: int, machine: Machine
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


def parallel_layers(graph: ModelGraph, dists: Mapping[str, Distribution]) -> dict[str, dict[str, int]]:
    """The ``parallel.layers`` block of a config for ``dists``; the model input (``x``) is read straight
    into the distribution the layers reading it need, as the cost model assumes (no input shuffle)."""
    out = {name: d.degrees() or {"n": 1} for name, d in dists.items()}  # {"n": 1}: held whole on every rank
    for node in graph:
        if any(p in INPUT_NAMES for p in node.parents):
            out["x"] = required_input(node, dists[node.name], graph.input_shape).degrees() or {"n": 1}
            break
    return out
