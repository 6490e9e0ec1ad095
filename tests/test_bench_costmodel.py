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
from lbannpy.machine import PRESETS, Machine, MachineError, load_machine, machine_from_dict
from lbannpy.strategy import build_graph, evaluate_strategy
from lbannpy.strategy.cost import compute_times

MPIEXEC = shutil.which("mpiexec")


def _cpu_machine(cores: int, ranks_per_node: int) -> Machine:
    tree = dict(PRESETS["p100"], ranks_per_node=ranks_per_node, cores_per_node=cores)
    return Machine.from_dict(tree)


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
        m = load_machine(name)
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


def test_communication_is_time_sliced_where_ranks_share_cores():
    """Messages between ranks of one CPU node are copies their cores make: every communication term (halo,
    internal reductions, gradient sync, redistribution) doubles with two ranks per core, and the search
    sees the same numbers as evaluate_strategy."""
    from lbannpy.strategy import plan
    from lbannpy.strategy.cost import layer_cost, redistribution_matrix, redistribution_time

    model = {"input": {"channels": 4, "spatial": [16, 16]},
             "layers": [{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1},
                        {"name": "b", "type": "batchnorm"},
                        {"name": "f", "type": "fc", "units": 16}]}
    g = build_graph(model, 8)
    free, shared = _cpu_machine(0, 4), _cpu_machine(2, 4)
    seen = {"halo_s": 0.0, "internal_comm_s": 0.0, "allreduce_s": 0.0}
    for node in g:
        nd = len(node.out_shape)
        for d in (Distribution.make(nd, 4, n=2, h=2) if nd == 4 else Distribution.make(nd, 4, n=4),
                  Distribution.make(nd, 4, c=2)):
            a, b = layer_cost(node, d, free), layer_cost(node, d, shared)
            for term in seen:
                assert getattr(b, term) == pytest.approx(2 * getattr(a, term))
                seen[term] = max(seen[term], getattr(a, term))
    assert all(v > 0 for v in seen.values())  # every kind of term was exercised
    shape, src, dst = (8, 8, 16, 16), Distribution.make(4, 4, n=4), Distribution.make(4, 4, h=4)
    t_free = redistribution_time(shape, src, dst, free)
    t_shared = redistribution_time(shape, src, dst, shared)
    assert t_free > 0 and t_shared == pytest.approx(2 * t_free)
    assert redistribution_matrix(shape, [src], [dst], shared)[0, 0] == pytest.approx(t_shared)
    p = plan(g, 4, shared, max_candidates=6, compare=False)
    assert p.chosen.step_s == pytest.approx(p.result.cost, rel=1e-9)


def test_measured_entries_of_a_split_win_over_a_block_timed_alone():
    model = {"input": {"channels": 4, "spatial": [16, 16]},
             "layers": [{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1}]}
    node = next(iter(build_graph(model, 8)))
    m = _cpu_machine(0, 4)
    h2 = Distribution.make(4, 2, h=2)
    key = ("conv", (8, 4, 8, 16), (8, 8, 8, 16))  # the blocks of h2 (input without its halo)
    alone = replace(m, measured={key: (1e-3, 2e-3, 3e-3)})
    both = replace(m, measured={key: (1e-3, 2e-3, 3e-3), key + ((1, 1, 2, 1),): (4e-3, 5e-3, 6e-3)})
    assert compute_times(node, h2, alone) == pytest.approx((1e-3, 2e-3, 3e-3))
    assert compute_times(node, h2, both) == pytest.approx((4e-3, 5e-3, 6e-3))
    # a file row with split degrees is read into that key
    row = {"type": "conv", "in": list(key[1]), "out": list(key[2]), "split": [1, 1, 2, 1], "fwd_s": 4e-3,
           "bwd_data_s": 5e-3, "bwd_weights_s": 6e-3}
    tree = dict(PRESETS["p100"], compute=dict(PRESETS["p100"]["compute"], measured=[row]))
    assert compute_times(node, h2, Machine.from_dict(tree)) == pytest.approx((4e-3, 5e-3, 6e-3))
    bad = dict(tree, compute=dict(tree["compute"], measured=[dict(row, split="two")]))
    with pytest.raises(MachineError, match="split"):
        Machine.from_dict(bad)


def test_entries_timed_with_the_nodes_ranks_running_are_used_unscaled():
    """A row timed while as many ranks ran on the node as the job puts there (``procs``) already holds what
    sharing the cores costs: no slowdown on top. Other layouts fall back to the split's row, scaled."""
    model = {"input": {"channels": 4, "spatial": [16, 16]},
             "layers": [{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1}]}
    node = next(iter(build_graph(model, 8)))
    h4 = Distribution.make(4, 4, h=4)
    key = ("conv", (8, 4, 4, 16), (8, 8, 4, 16), (1, 1, 4, 1))  # the blocks of h4 (input without its halo)
    m = replace(_cpu_machine(2, 4), measured={key: (1e-3, 2e-3, 3e-3), key + (4,): (5e-3, 7e-3, 9e-3)})
    assert m.compute_slowdown(4) == 2.0 and m.ranks_on_node(4) == 4
    assert compute_times(node, h4, m) == pytest.approx((5e-3, 7e-3, 9e-3))
    assert compute_times(node, h4, m, needs_dx=False) == pytest.approx((5e-3, 0.0, 9e-3))
    # the same job spread over two nodes (2 ranks on each): the row of 4 on a node does not apply
    two_nodes = m.with_layout(2)
    assert two_nodes.ranks_on_node(4) == 2
    assert compute_times(node, h4, two_nodes) == pytest.approx((1e-3, 2e-3, 3e-3))
    # a file row with procs is read into that key; procs needs split and a positive integer
    row = {"type": "conv", "in": list(key[1]), "out": list(key[2]), "split": list(key[3]), "procs": 4,
           "fwd_s": 5e-3, "bwd_data_s": 7e-3, "bwd_weights_s": 9e-3}
    y = cm.TableRow(key + (4,), 5e-3, 16e-3, 7e-3).to_yaml()
    assert {k: v for k, v in y.items() if not k.endswith("_s")} == {
        k: v for k, v in row.items() if not k.endswith("_s")}
    assert [y[k] for k in ("fwd_s", "bwd_data_s", "bwd_weights_s")] == pytest.approx([5e-3, 7e-3, 9e-3])
    tree = dict(PRESETS["p100"], ranks_per_node=4, cores_per_node=2,
                compute=dict(PRESETS["p100"]["compute"], measured=[row]))
    assert compute_times(node, h4, Machine.from_dict(tree)) == pytest.approx((5e-3, 7e-3, 9e-3))
    for bad in (dict(row, procs=0), dict(row, procs="4"), {k: v for k, v in row.items() if k != "split"}):
        with pytest.raises(MachineError, match="procs"):
            Machine.from_dict(dict(tree, compute=dict(tree["compute"], measured=[bad])))


def test_shared_node_factor_hand_computed():
    rows = [cm.TableRow(("a",), 1.0, 3.0, 1.0), cm.TableRow(("b",), 2.0, 2.0, 0.0)]
    calls = {("a",): {0: ([2.0, 2.0], [6.0], [4.0]), 1: ([1.0], [3.0], [])},
             ("b",): {0: ([4.0], [4.0], []), 1: ([2.0], [2.0], [])},
             ("c",): {0: ([100.0], [], [])}}  # no alone-timed row: left out
    # rank 0: (2+2+6+4) + (4+4) = 22 over (1+1+3+2) + (2+2) = 11 -> 2; rank 1: 8 over 8 -> 1
    factor, per_rank = cm.shared_node_factor(rows, calls)
    assert per_rank == {0: pytest.approx(2.0), 1: pytest.approx(1.0)} and factor == pytest.approx(2.0)
    assert cm.shared_node_factor(rows, {}) == (1.0, {})


def test_compute_table_with_the_ranks_running_at_once():
    bm = cm.classifier(size=16, batch=4, width=4)
    g = build_graph(bm.model, bm.batch_size)
    m = _cpu_machine(2, 2)
    dists = [cm.strategy_dists(s, g, 2, m) for s in ("data", "spatial")]
    logged = []
    rows, notes = cm.measure_compute_table(g, dists, reps=1, optimizer=cm.OPTIMIZER, procs=2,
                                           log=logged.append)
    assert not notes
    assert {r.key for r in rows} == {cm.table_key(n, d[n.name]) + (2,) for d in dists for n in g}
    assert all(r.fwd_s > 0 and r.bwd_s > 0 and math.isfinite(r.fwd_s + r.bwd_s) for r in rows)
    assert any("2 ranks at once on this node" in line for line in logged)
    tabled = cm.with_table(m, rows)
    for d in dists:
        for n in g:
            row = next(r for r in rows if r.key == cm.table_key(n, d[n.name]) + (2,))
            want = (row.fwd_s, row.bwd_data_s, row.bwd_s - row.bwd_data_s)
            assert compute_times(n, d[n.name], tabled) == want
    with pytest.raises(ValueError, match="procs=4"):
        cm.measure_compute_table(g, dists, reps=1, procs=4)


def test_cores_per_node_in_machine_files(tmp_path):
    with pytest.raises(MachineError, match="cores_per_node"):
        Machine.from_dict(dict(PRESETS["p100"], cores_per_node=-1))
    d = load_machine("p100").to_dict()
    assert "cores_per_node" not in d
    d["cores_per_node"] = 2
    m = machine_from_dict(d, "test.yaml")
    assert m.cores_per_node == 2 and m.to_dict()["cores_per_node"] == 2
    with pytest.raises(MachineError, match="cores_per_node"):
        machine_from_dict(dict(d, cores_per_node="two"), "test.yaml")


# --------------------------------------------------------------------------------------------------------
# python -m lbannpy.bench costmodel

from lbannpy.bench import costmodel as cm  # noqa: E402


def test_strategies_are_runnable_distributions():
    bm = cm.classifier(size=16, batch=4, width=4)
    g = build_graph(bm.model, bm.batch_size)
    m = load_machine("p100")
    for name in ("data", "spatial", "model", "hybrid"):
        dists = cm.strategy_dists(name, g, 4, m)
        assert set(dists) == {n.name for n in g}
        assert all(d.ranks == 4 for d in dists.values())
        layers = cm.parallel_layers(g, dists)
        assert "x" in layers and all(v >= 1 for deg in layers.values() for v in deg.values())
    spatial = cm.strategy_dists("spatial", g, 2, m)
    assert spatial["c1"].split == (1, 1, 2, 1) and spatial["f1"].split == (2, 1)
    # the model input is read in the distribution its first layer needs, channel-replicated axes whole
    model = cm.strategy_dists("model", g, 2, m)
    assert cm.parallel_layers(g, model)["x"] == {"n": 1}
    assert cm.parallel_layers(g, cm.strategy_dists("data", g, 2, m))["x"] == {"n": 2}
    with pytest.raises(ValueError, match="unknown strategy"):
        cm.strategy_dists("diagonal", g, 2, m)


def test_compute_table_keys_are_what_the_cost_model_looks_up():
    bm = cm.classifier(size=16, batch=4, width=4)
    g = build_graph(bm.model, bm.batch_size)
    m = load_machine("p100")
    dists = [cm.strategy_dists(s, g, 2, m) for s in ("data", "model")]
    rows, notes = cm.measure_compute_table(g, dists, reps=1, optimizer=cm.OPTIMIZER)
    assert not notes
    keys = {r.key for r in rows}
    assert keys == {cm.table_key(n, d[n.name]) for d in dists for n in g}
    assert all(r.fwd_s > 0 and r.bwd_s > 0 and math.isfinite(r.fwd_s + r.bwd_s) for r in rows)
    tabled = cm.with_table(m, rows)
    for d in dists:
        for n in g:
            f, bd, bw = compute_times(n, d[n.name], tabled)
            row = next(r for r in rows if r.key == cm.table_key(n, d[n.name]))
            # the table, not the roofline; the data gradient apart (a layer reading the input skips it)
            assert (f, bd, bw) == (row.fwd_s, row.bwd_data_s, row.bwd_s - row.bwd_data_s)
            assert compute_times(n, d[n.name], tabled, needs_dx=False)[1] == 0.0
    assert all(r.bwd_data_s >= 0 and (r.bwd_data_s == 0 or r.key[0] in ("conv", "fc")) for r in rows)
    assert any(r.bwd_data_s > 0 for r in rows if r.key[0] == "conv")
    # a channel-split conv is timed with its own block of filters
    c1 = next(r for r in rows if r.key[0] == "conv" and r.key[2][1] == 2)
    assert c1.key[1][1] == 3


def test_format_table_rankings_and_tolerance():
    def case(s, p, pred, meas):
        return cm.Case("m", s, p, pred, pred / 10, [meas], {}, [0.0])
    cases = [case("data=spatial", 1, 1.0, 1.0),
             case("data", 2, 0.50, 0.52), case("spatial", 2, 0.60, 0.70),
             case("data", 4, 0.30, 0.40), case("spatial", 4, 0.20, 0.45)]
    text = cm.format_table(cases)
    assert "m      1 rank(s): one distinct strategy" in text
    assert "2 rank(s): predicted data < spatial; measured data < spatial; match" in text
    assert ("4 rank(s): predicted spatial < data; measured data < spatial; DIFFERENT (spatial/data measured "
            "12.5 % apart)") in text
    assert "rankings matching: 1 of 2" in text
    assert "within 15%: 3 of 5 cases" in text  # errors 0, -4 %, -14 %, -25 %, -56 %


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
def test_costmodel_quick_run(tmp_path):
    """The whole benchmark on one tiny model at 1 and 2 ranks: calibration, table, real training runs."""
    out = tmp_path / "cases.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "costmodel", "--quick", "--ranks", "1,2",
                        "--work", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("model "))
    assert lines[head].split()[:4] == ["model", "strategy", "ranks", "predicted"]
    rows = []
    for ln in lines[head + 2:]:
        if not ln.strip():
            break
        rows.append(ln.split())
    cases = __import__("json").loads(out.read_text())
    assert len(rows) == len(cases) >= 2
    assert {int(row[2]) for row in rows} == {1, 2}
    for row, c in zip(rows, cases):
        pred, meas = float(row[3]), float(row[4])
        assert math.isfinite(pred) and pred > 0 and math.isfinite(meas) and meas > 0
        assert c["predicted_s"] > 0 and all(t > 0 for t in c["measured_s"])
        assert pred == pytest.approx(c["predicted_s"] * 1e3, abs=0.01)
    assert any(ln.startswith("ranking cls    2 rank(s): predicted ") for ln in lines)
    assert "within 15%: " in r.stdout and f" of {len(cases)} cases" in r.stdout
    machine = load_machine(tmp_path / "work" / "machine.yaml")  # written by calibrate --quick
    assert machine.cores_per_node >= 1 and machine.mem_s_per_byte > 0 and machine.kernel_overhead_s > 0


def test_input_read_is_priced_where_measured(tmp_path):
    """A measured ("input", block, block) entry is the read time of the layer reading the model input, in
    the block its distribution gives; scaled like compute where ranks share cores; 0 without an entry."""
    from lbannpy.strategy.cost import layer_cost

    model = {"input": {"channels": 3, "spatial": [8, 8]},
             "layers": [{"name": "c", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                        {"name": "r", "type": "relu"}]}
    g = build_graph(model, 4)
    conv, relu = g["c"], g["r"]
    n2, c2 = Distribution.make(4, 2, n=2), Distribution.make(4, 2, c=2)
    m = replace(_cpu_machine(1, 2), measured={("input", (2, 3, 8, 8), (2, 3, 8, 8)): (1e-3, 0.0, 0.0),
                                              ("input", (4, 3, 8, 8), (4, 3, 8, 8)): (3e-3, 0.0, 0.0)})
    assert layer_cost(conv, n2, m, reads_input=True).input_s == pytest.approx(2e-3)  # 2 ranks on 1 core
    assert layer_cost(conv, c2, m, reads_input=True).input_s == pytest.approx(6e-3)  # whole batch each
    assert layer_cost(relu, n2, m, reads_input=False).input_s == 0.0
    plain = layer_cost(conv, n2, _cpu_machine(1, 2), reads_input=True)
    with_read = layer_cost(conv, n2, m, reads_input=True)
    assert plain.input_s == 0.0 and with_read.compute_s == pytest.approx(plain.compute_s + 2e-3)


def test_time_input_read_reads_the_block_the_first_layer_needs(tmp_path):
    bm = cm.classifier(size=16, batch=4, width=4)
    g = build_graph(bm.model, bm.batch_size)
    m = load_machine("p100")
    config, data = cm.prepare(bm, str(tmp_path))
    assert os.path.isfile(config)
    for name, block in (("data", (2, 3, 16, 16)), ("spatial", (4, 3, 8, 16)), ("model", (4, 3, 16, 16))):
        row = cm.time_input_read(data, g, cm.strategy_dists(name, g, 2, m), reps=1)
        assert row.key == ("input", block, block) and row.fwd_s > 0 and row.bwd_s == 0.0


def test_costmodel_refuses_a_missing_machine_file_before_any_work(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    work = tmp_path / "work"
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "costmodel", "--machine",
                        str(tmp_path / "nope.yaml"), "--work", str(work)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "--machine" in r.stderr and "nope.yaml does not exist" in r.stderr
    assert not work.exists() or not any(work.iterdir())
