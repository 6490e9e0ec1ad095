"""The machine the cost model prices by default is the one the run is on (lbannpy.local_machine): this
host's calibration once `bench calibrate` wrote one, else a described local CPU model; the strategy output
says which and how to calibrate; and on a recorded calibration of the 2-core development box the predicted
step of lenet5 and mesh_tiny at 1 and 2 ranks (the strategy's plans, and every layer split 2 ways along n, h
or c) is within 2x of the step measured there (recorded beside it by ``lbannpy.bench.calibrate_steps``: no
timing here).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lbannpy import local_machine, zoo
from lbannpy.bench.calibrate_steps import dists_of
from lbannpy.machine import load_machine
from lbannpy.strategy.graph import build_graph
from lbannpy.strategy.planner import evaluate_strategy, plan

DATA = Path(__file__).resolve().parent / "data"
CALIBRATION = DATA / "machine-cpu-2core.yaml"
MEASURED = DATA / "measured-steps-cpu-2core.yaml"


def strategy(tmp_path, machine_dir, *extra):
    spec = tmp_path / "lenet5.yaml"
    if not spec.exists():
        subprocess.run([sys.executable, "-m", "lbannpy.config", "zoo", "lenet5", "-o", str(spec)], check=True,
                       capture_output=True, timeout=120)
    env = dict(os.environ, LBANNPY_MACHINE_DIR=str(machine_dir), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "lbannpy.strategy", str(spec), "--ranks", "2", *extra],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_uncalibrated_host_is_a_described_cpu_model_and_the_output_says_how_to_calibrate(tmp_path):
    out = strategy(tmp_path, tmp_path / "none")
    (line,) = [ln for ln in out.splitlines() if ln.startswith("machine: ")]
    assert "priced on local-cpu (not measured: a model of this host" in line, line
    assert " cores, " in line, line
    assert "`python -m lbannpy.bench calibrate` measures this host and writes" in line, line
    assert str(tmp_path / "none" / f"{local_machine.host()}.yaml") in line, line
    tree = local_machine.uncalibrated_tree()
    assert tree["cores_per_node"] == tree["ranks_per_node"] >= 1
    assert load_machine(tree).name == "local-cpu"


def test_a_calibration_of_this_host_is_the_default(tmp_path):
    cal = tmp_path / "machines"
    cal.mkdir()
    shutil.copy(CALIBRATION, cal / f"{local_machine.host()}.yaml")
    out = strategy(tmp_path, cal)
    (line,) = [ln for ln in out.splitlines() if ln.startswith("machine: ")]
    assert line.startswith("machine: priced on cpu-2core, measured on "), line
    # a preset named on the command line is said to be another system
    out = strategy(tmp_path, cal, "--machine", "lassen")
    assert "priced on lassen, a model of another system, not this host" in out, out


CASES = yaml.safe_load(MEASURED.read_text())["cases"]


def _case_id(case) -> str:
    return f"{case['model']}-{case['ranks']}-{case['plan']}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_predicted_step_on_a_recorded_calibration_is_within_2x_of_the_measured_step(case):
    """Every recorded plan (the strategy's at 1 and 2 ranks, and the 2-rank n, h, c splits) is priced within
    2x of its measured step; the strategy's plan is still the one ``strategy`` chooses on that machine."""
    spec = zoo.get_spec(case["model"], batch_size=case["batch_size"])
    graph = build_graph(spec["model"], case["batch_size"])
    machine = load_machine(str(CALIBRATION))
    predicted = evaluate_strategy(graph, dists_of(graph, case["ranks"], case["layers"]), machine).step_s
    ratio = case["median_step_s"] / predicted
    assert 0.5 <= ratio <= 2.0, (f"{_case_id(case)}: predicted {predicted * 1e3:.2f} ms, measured "
                                 f"{case['median_step_s'] * 1e3:.2f} ms ({ratio:.2f}x)")
    if case["plan"] == "strategy":
        chosen = plan(spec, case["ranks"], machine, compare=False)
        assert chosen.parallel_layers() == case["layers"], (
            f"{_case_id(case)}: strategy now chooses another plan than the one measured; record again with "
            f"python -m lbannpy.bench.calibrate_steps")
        assert chosen.chosen.step_s == pytest.approx(predicted)


def test_the_recording_covers_1_and_2_ranks_of_both_models_and_the_one_dimension_splits():
    got = {(c["model"], c["ranks"], c["plan"]) for c in CASES}
    for model in ("lenet5", "mesh_tiny"):
        assert {(model, 1, "strategy"), (model, 2, "strategy")} <= got
        # a one-dimension plan equal to the strategy's is recorded once, under "strategy"
        assert len({p for m, r, p in got if m == model and r == 2}) >= 3


def test_a_calibration_measures_what_2_rank_plans_need():
    """The lockstep cost of ranks sharing the node, and the blocks of the split layers, are in the file."""
    machine = load_machine(str(CALIBRATION))
    assert {p for p, _, _ in machine.shared} == {1, 2}
    factor, sync = machine.shared_at(2)
    assert factor >= 1 and sync > 0
    split_rows = [k for k in machine.measured if len(k) == 5 and k[4] == 2]
    assert {k[0] for k in split_rows} >= {"conv", "fc", "batchnorm", "relu", "pool"}
    assert {tuple(k[3]) for k in split_rows} >= {(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1)}


def test_the_lassen_preset_is_far_from_this_box():
    """The comparison can fail: the lassen preset (4 V100s a node) is far from the measured steps."""
    for case in CASES:
        spec = zoo.get_spec(case["model"], batch_size=case["batch_size"])
        graph = build_graph(spec["model"], case["batch_size"])
        far = evaluate_strategy(graph, dists_of(graph, case["ranks"], case["layers"]), load_machine("lassen"))
        assert case["median_step_s"] / far.step_s > 2.0, _case_id(case)


def test_the_default_machine_everywhere_is_local(tmp_path, monkeypatch):
    """``parallel.machine`` defaults to ``local``, which loads this host's calibration or the CPU model."""
    from lbannpy.config import validate
    from lbannpy.machine import DEFAULT_MACHINE

    assert DEFAULT_MACHINE == "local"
    assert validate(zoo.get_spec("lenet5"), data=False, memory=False)["parallel"]["machine"] == "local"
    monkeypatch.setenv("LBANNPY_MACHINE_DIR", str(tmp_path))
    assert load_machine("local").name == "local-cpu"
    shutil.copy(CALIBRATION, tmp_path / f"{local_machine.host()}.yaml")
    assert load_machine("local").name == "cpu-2core"


def test_calibrate_without_o_writes_the_calibration_the_default_reads(tmp_path):
    env = dict(os.environ, LBANNPY_MACHINE_DIR=str(tmp_path / "m"), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "calibrate", "--max-bytes", "4096", "--gemm",
                        "64", "--target-ms", "1", "--batches", "1", "--rate-elements", "4096"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    written = tmp_path / "m" / f"{local_machine.host()}.yaml"
    assert f"wrote {written}" in r.stdout, r.stdout[-2000:]
    assert {"batchnorm", "relu", "pool"} <= {rate.type for rate in load_machine(str(written)).rates}
    out = strategy(tmp_path, tmp_path / "m")
    assert f"machine: priced on {local_machine.host()}, measured on {local_machine.host()}" in out, out
