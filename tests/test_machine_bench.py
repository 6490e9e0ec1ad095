"""Machine files (presets, validation), the α-β fitting, and the bench entry point."""
from __future__ import annotations

import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from lbannpy.bench.__main__ import SUBCOMMANDS, main as bench_main
from lbannpy.bench.calibrate import fit_alpha_beta, message_sizes
from lbannpy.machine import (MachineError, load_machine, machine_from_dict, preset_names, ring_allreduce_time,
                             ring_from_fit)


@pytest.mark.parametrize("name", ["lassen", "p100", "h100"])
def test_presets_load_with_sources(name):
    m = load_machine(name)
    assert m.name == name and m.source and m.ranks_per_node >= 4
    assert m.intra.beta_s_per_byte > 0 and m.inter.alpha_s > 0 and m.gamma_s_per_flop > 0
    assert name in preset_names()


def test_lassen_numbers_are_the_distconv_model():
    m = load_machine("lassen")
    assert (m.inter.alpha_s, m.inter.beta_s_per_byte) == (1.2e-6, 3.893e-11)
    assert (m.intra.alpha_s, m.intra.beta_s_per_byte) == (8e-6, 2.661e-11)
    assert m.gamma_s_per_flop == 1.075e-13 and m.memory_per_device_gib == 16


def test_allreduce_ring_model():
    m = load_machine("lassen")
    n, p = 1e8, 8
    want = 2 * (p - 1) * 1.2e-6 + 2 * (p - 1) / p * n * 3.893e-11
    assert ring_allreduce_time(n, p, m.ring_link) == pytest.approx(want)
    assert ring_allreduce_time(n, 1, m.ring_link) == 0


@pytest.mark.parametrize("change, match", [
    ({"intra": {"alpha_s": 1e-6}}, "intra.beta_s_per_byte is missing"),
    ({"intra": {"alpha_s": -1.0, "beta_s_per_byte": 1e-9}}, "intra.alpha_s must be >= 0"),
    ({"ranks_per_node": 0}, "ranks_per_node must be a positive integer"),
    ({"compute": {"gamma_s_per_flop": "fast"}}, "compute.gamma_s_per_flop must be a finite number"),
    ({"colour": "red"}, "unknown key"),
    ({"compute": {"gamma_s_per_flop": 1e-12, "colour": "red"}},
     r"unknown key\(s\) \['colour'\] in 'compute'"),
    ({"allreduce": {"alpha_s": 1e-6, "beta_s_per_byte": 1e-9, "threshold": 1}}, "in 'allreduce'"),
    ({"inter": {"alpha_s": 1e-6, "beta_s_per_byte": 0.0}}, r"inter.beta_s_per_byte must be > 0"),
    ({"allreduce": {"alpha_s": 1e-6}}, "allreduce.beta_s_per_byte is missing"),
    ({"memory_per_device_gib": None}, "'memory_per_device_gib' is missing"),
    ({"allreduce": {"algorithm": "tree"}}, "allreduce.algorithm must be one of auto, ring"),
    ({"compute": {"gamma_s_per_flop": 1e-12, "rates": [{"type": "gelu", "per": "byte", "fwd_s": 1e-9}]}},
     r"compute.rates\[0\].per must be one of element, flop"),
    ({"compute": {"gamma_s_per_flop": 1e-12, "rates": [{"type": "gelu", "bwd_data_s": 1e-9}]}},
     "compute.rates.0. needs type"),
    ({"compute": {"gamma_s_per_flop": 1e-12, "rates": [{"type": "gelu", "fwd_s": -1.0}]}},
     r"compute.rates\[0\].fwd_s must be >= 0"),
    ({"compute": {"gamma_s_per_flop": 1e-12, "rates": [{"type": "gelu", "fwd_s": 1e-9, "colour": 1}]}},
     r"unknown key\(s\) \['colour'\] in compute.rates\[0\]"),
], ids=["missing-beta", "negative-alpha", "zero-ranks", "text-gamma", "unknown-key", "unknown-compute-key",
        "unknown-allreduce-key", "zero-beta", "half-a-link", "no-memory", "bad-algorithm", "rate-unit",
        "rate-without-time", "negative-rate", "unknown-rate-key"])
def test_bad_machine_files_are_refused(change, match):
    """One parser, one way: every reader of machine files (planner, cost model, calibrate, halo bench) gets
    these refusals; the unchanged preset is the control."""
    d = load_machine("p100").to_dict()
    assert machine_from_dict(dict(d), "test.yaml") == load_machine("p100")
    d.update(change)
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(MachineError, match=match):
        machine_from_dict(d, "test.yaml")


def test_unknown_machine_and_oversized_file(tmp_path):
    with pytest.raises(MachineError, match="presets: h100, lassen, p100"):
        load_machine("cray-1")
    big = tmp_path / "big.yaml"
    big.write_text("#" * (2 << 20))
    with pytest.raises(MachineError, match="bytes"):
        load_machine(big)


def test_round_trip(tmp_path):
    import yaml
    m = load_machine("h100")
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(m.to_dict()))
    assert load_machine(f) == m


def test_fit_recovers_alpha_beta():
    a, b = 3e-6, 2e-10
    rng = np.random.default_rng(0)
    pts = [(n, (a + b * n) * (1 + 0.01 * rng.standard_normal())) for n in message_sizes(64 << 20)]
    fa, fb, err = fit_alpha_beta(pts)
    assert fa == pytest.approx(a, rel=0.05) and fb == pytest.approx(b, rel=0.05) and err < 0.05
    alpha, beta = ring_from_fit(fa, fb, 2)
    assert alpha == pytest.approx(fa / 2) and beta == pytest.approx(fb)


def test_message_sizes():
    assert message_sizes(64 << 20)[:3] == [8, 32, 128] and message_sizes(64 << 20)[-1] == 64 << 20


def test_bench_dispatch(capsys):
    assert {"calibrate", "halo", "layers"} <= set(SUBCOMMANDS)
    assert bench_main(["--help"]) == 0 and "calibrate" in capsys.readouterr().out
    assert bench_main(["nonsense"]) == 2 and "unknown subcommand" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install mpich)")
def test_calibrate_writes_a_loadable_machine_file(tmp_path):
    out = tmp_path / "machine.yaml"
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "calibrate", "-o", str(out), "--max-bytes",
                        "4096", "--gemm", "64", "--target-ms", "1", "--batches", "1", "--name", "testbox",
                        "--rate-elements", "4096"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "point to point" in r.stdout and "allreduce over 2 ranks" in r.stdout and "GEMM" in r.stdout
    assert "redistribution (lbannpy shuffle" in r.stdout
    m = load_machine(out)
    assert m.name == "testbox" and m.measured_on["ranks"] == "2" and m.intra.beta_s_per_byte > 0
    assert m.redistribution_link is not None and m.redistribution_link.beta_s_per_byte > 0
    assert "per-type rates" in r.stdout
    from lbannpy.bench.calibrate import RATE_CASES
    from lbannpy.layers.registry import layer_specs
    assert {x.type for x in m.rates} == {c[0] for c in RATE_CASES if c[0] in layer_specs()}
    # the round trip: what calibrate writes is what the planner plans with
    import yaml
    from lbannpy import zoo
    spec = tmp_path / "mesh_tiny.yaml"
    spec.write_text(yaml.safe_dump(zoo.get_spec("mesh_tiny", batch_size=4), sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "lbannpy.strategy", str(spec), "--ranks", "2",
                        "--machine", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "machine testbox" in r.stdout and "predicted step" in r.stdout


def test_calibrate_refuses_to_overwrite_presets():
    from lbannpy.bench.calibrate import check_output, _package_machines_dir
    with pytest.raises(SystemExit, match="refusing"):
        check_output(f"{_package_machines_dir()}/local.yaml")


def test_the_planner_refuses_what_the_machine_parser_refuses(tmp_path, capsys):
    """Negative control of the round trip: a machine file with a key the parser does not know is refused by
    ``python -m lbannpy.strategy --machine`` (exit 2, the key named), not silently planned for."""
    import yaml
    from lbannpy import zoo
    from lbannpy.strategy.__main__ import main as strategy_main
    bad = tmp_path / "machine.yaml"
    bad.write_text(yaml.safe_dump(dict(load_machine("lassen").to_dict(), colour="red")))
    spec = tmp_path / "mesh_tiny.yaml"
    spec.write_text(yaml.safe_dump(zoo.get_spec("mesh_tiny", batch_size=4), sort_keys=False))
    assert strategy_main([str(spec), "--ranks", "2", "--machine", str(bad)]) == 2
    assert "unknown key(s) ['colour']" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["lassen", "p100", "h100"])
def test_to_dict_round_trips_every_field(name, tmp_path):
    import yaml
    m = load_machine(name)
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(m.to_dict()))
    back = load_machine(f)
    assert back == m and back.measured == m.measured and back.measured_on == m.measured_on


def test_one_default_machine_everywhere():
    """``plan()`` and ``parallel.machine`` of a config default to the one DEFAULT_MACHINE (which machine
    that is, and the strategy command's default: tests/test_local_machine.py)."""
    import inspect
    from lbannpy.config import normalize
    from lbannpy.machine import DEFAULT_MACHINE
    from lbannpy.strategy import plan
    spec = {"model": {"input": {"channels": 3, "spatial": [8, 8]},
                      "layers": [{"name": "f1", "type": "fc", "units": 2}]}}
    assert normalize(spec)["parallel"]["machine"] == DEFAULT_MACHINE
    assert inspect.signature(plan).parameters["machine"].default == DEFAULT_MACHINE


def test_rates_round_trip_and_select_by_parameters(tmp_path):
    import yaml
    d = load_machine("lassen").to_dict()
    d["compute"]["rates"] = [{"type": "upsample", "per": "element", "fwd_s": 1e-9},
                             {"type": "upsample", "params": {"mode": "linear"}, "per": "element",
                              "fwd_s": 3e-9, "bwd_data_s": 2e-9},
                             {"type": "conv_transpose", "per": "flop", "fwd_s": 1e-11, "bwd_data_s": 1e-11,
                              "bwd_weights_s": 1e-11}]
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(d))
    m = load_machine(f)
    assert len(m.rates) == 3 and machine_from_dict(m.to_dict()) == m
    assert m.rate("upsample", {"mode": "linear", "scale": 2}).fwd_s == 3e-9
    assert m.rate("upsample", {"mode": "nearest"}).fwd_s == 1e-9
    assert m.rate("conv_transpose", {}).per == "flop" and m.rate("gelu", {}) is None
    assert load_machine("lassen").rates == ()  # the presets price every type by the roofline


def test_layer_rates_are_rows_the_cost_model_prices_by():
    """``layer_rates`` on one rank: a row for each registered type of RATE_CASES, loadable as a machine's
    ``compute.rates``; a layer of a rated type is then priced by its row (rate × its block's elements plus
    the fixed cost of a call), one of an unrated type by the roofline as before."""
    from lbannpy.bench.calibrate import RATE_CASES, layer_rates
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.registry import layer_specs
    from lbannpy.strategy import cost
    from lbannpy.strategy.graph import build_graph
    rows, lines = layer_rates(SingleCommunicator(), np, "cpu", 1024, reps=1)
    rated = [c for c in RATE_CASES if c[0] in layer_specs()]
    assert len(rows) == len(rated) and len(lines) == 1 + len(RATE_CASES)
    tree = load_machine("lassen").to_dict()
    tree["compute"]["rates"] = rows
    m = machine_from_dict(tree)
    assert all(r.fwd_s >= 0 and r.bwd_data_s >= 0 for r in m.rates)
    if not rows:
        pytest.skip("no rated layer type is registered in this build")
    typ, select, extra, n_in, per = rated[0]
    layer = {"name": "a", "type": typ, **extra, **select}
    if n_in > 1:
        layer["parents"] = ["x"] * n_in
    node = build_graph({"input": {"channels": 4, "spatial": [16, 16]}, "layers": [layer]}, 2)["a"]
    rate = m.rate(typ, layer_specs()[typ].resolve(node.params))
    units = max(math.prod(node.in_shape), math.prod(node.out_shape)) if per == "element" else node.flops_fwd
    fwd = cost.compute_times(node, Distribution.make(4, 1), m)[0]
    assert fwd == pytest.approx(m.kernel_overhead_s + rate.fwd_s * units, rel=1e-12)
