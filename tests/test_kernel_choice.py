"""Conv kernel sets chosen per layer shape by a calibration (issue #18): machine rows that name a set, the
cost model pricing a layer with the chosen set's times, ``bench calibrate --kernels`` writing such rows, and
a run with ``runtime.kernels: auto`` taking each layer's set from the machine file (checked bit for bit
against runs with one set everywhere)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from lbannpy.dist import Distribution
from lbannpy.machine import MachineError, load_machine, machine_from_dict
from lbannpy.strategy import cost
from lbannpy.strategy.graph import build_graph
from train_util import ENV, PY, build_config, final_params, make_data, model_spec, sh

MPIEXEC = shutil.which("mpiexec")
ROW = {"type": "conv", "in": [8, 3, 12, 12], "out": [8, 4, 12, 12], "fwd_s": 0.5, "bwd_data_s": 0.25,
       "bwd_weights_s": 0.125}


def _tree(rows):
    tree = load_machine("lassen").to_dict()
    tree["compute"]["measured"] = rows
    return tree


def test_machine_rows_name_a_kernel_set_and_round_trip():
    m = machine_from_dict(_tree([{**ROW, "kernel": "own"}, {**ROW, "in": [8, 4, 12, 12], "kernel": "aten"},
                                 {**ROW, "in": [8, 4, 6, 6], "out": [8, 4, 6, 6]}]))
    assert m.kernels == {("conv", (8, 3, 12, 12), (8, 4, 12, 12)): "own",
                         ("conv", (8, 4, 12, 12), (8, 4, 12, 12)): "aten"}
    again = machine_from_dict(m.to_dict())
    assert again.kernels == m.kernels and again.measured == m.measured


def test_a_bad_kernel_row_is_refused():
    with pytest.raises(MachineError, match="kernel must be one of own, aten, got 'cudnn'"):
        machine_from_dict(_tree([{**ROW, "kernel": "cudnn"}]))


def test_machine_rows_name_the_atens_host_layout_and_round_trip():
    m = machine_from_dict(_tree([{**ROW, "kernel": "aten", "layout": "channels_last"},
                                 {**ROW, "in": [8, 4, 12, 12], "kernel": "aten", "layout": "nchw"},
                                 {**ROW, "in": [8, 5, 12, 12], "kernel": "aten"}]))
    assert m.layouts == {("conv", (8, 3, 12, 12), (8, 4, 12, 12)): "channels_last",
                         ("conv", (8, 4, 12, 12), (8, 4, 12, 12)): "nchw"}
    again = machine_from_dict(m.to_dict())
    assert again.layouts == m.layouts and again.kernels == m.kernels
    for bad in ({"kernel": "aten", "layout": "nhwc"}, {"kernel": "own", "layout": "channels_last"},
                {"layout": "channels_last"}):
        with pytest.raises(MachineError, match="layout must be one of nchw, channels_last and come with "
                                               "kernel: aten"):
            machine_from_dict(_tree([{**ROW, **bad}]))


def test_calibration_records_channels_last_only_where_it_is_faster_by_the_margin(monkeypatch):
    """``bench calibrate --kernels``: an ATen row says ``layout: channels_last`` where that layout timed at
    least CHANNELS_LAST_MARGIN faster on the slowest rank, ``nchw`` where not; an own row and a one-channel
    convolution (no such layout) say nothing."""
    pytest.importorskip("torch")
    from lbannpy.bench import kernel_choice as kc
    from lbannpy.bench import layout_choice
    from lbannpy.bench.layer_shapes import LayerShape
    from lbannpy.comm import SingleCommunicator

    def shape(c, side):
        return LayerShape("conv", (2, c, side, side), 4, (3, 3), (1, 1), (1, 1), (1, 1))
    shapes = [("m", shape(6, 12)), ("m", shape(6, 10)), ("m", shape(1, 12)), ("m", shape(6, 8))]
    sets = {12: "aten", 10: "aten", 8: "own"}
    ratio = {12: 10.0, 10: layout_choice.CHANNELS_LAST_MARGIN * 0.9}
    seen = []

    def time_sets(s, dtype, repeats, adaptive=True):
        fast, slow = (1e-3,) * 3, (2e-3,) * 3
        return {"own": fast, "aten": slow} if sets[s.x_shape[2]] == "own" else {"own": slow, "aten": fast}

    def measure_layouts(x, w, stride, dilation, dtype="float32"):
        seen.append((x, w))
        return ratio[x[2] - 2], 1.0
    monkeypatch.setattr(kc, "conv_shapes", lambda items, quick=False: shapes)
    monkeypatch.setattr(kc, "time_sets", time_sets)
    monkeypatch.setattr(kc, "measure_layouts", measure_layouts)
    rows, lines = kc.measure_kernels(SingleCommunicator(), ["m"], True)
    assert [(r["in"][1:3], r["kernel"], r.get("layout")) for r in rows] == [
        ([6, 12], "aten", "channels_last"), ([6, 10], "aten", "nchw"), ([1, 12], "aten", None),
        ([6, 8], "own", None)]
    assert seen == [((2, 6, 14, 14), (4, 6, 3, 3)), ((2, 6, 12, 12), (4, 6, 3, 3))]  # the layer's windows
    assert any(line.endswith("aten channels_last") for line in lines), lines
    m = machine_from_dict(_tree(rows))
    assert m.layouts == {("conv", (2, 6, 12, 12), (2, 4, 12, 12)): "channels_last",
                         ("conv", (2, 6, 10, 10), (2, 4, 10, 10)): "nchw"}


def test_measure_layouts_times_both_layouts_on_a_bounded_stand_in(monkeypatch):
    pytest.importorskip("torch")
    from lbannpy.bench import layout_choice

    monkeypatch.setattr(layout_choice, "MEASURE_ELEMENTS", 1 << 12)
    nchw, cl = layout_choice.measure_layouts((1, 6, 600, 700), (4, 6, 3, 3), 1, 1, np.float64)
    assert 0 < nchw < 1 and 0 < cl < 1


def test_the_cost_model_prices_a_layer_with_the_chosen_sets_times():
    spec = {"input": {"channels": 3, "spatial": [12, 12]},
            "layers": [{"name": "c", "type": "conv", "filters": 4, "kernel": 3, "padding": 1}]}
    node = {n.name: n for n in build_graph(spec, 8).nodes}["c"]
    m = machine_from_dict(_tree([{**ROW, "kernel": "aten"}]))
    assert cost.compute_times(node, Distribution.make(4, 1), m) == (0.5, 0.25, 0.125)


LAYERS = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "padding": 1},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv", "filters": 8, "kernel": 3, "padding": 1, "stride": 2},
    {"name": "c3", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
    {"name": "f1", "type": "fc", "units": 4},
]


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_a_calibrated_machine_chooses_each_layers_set(tmp_path):
    pytest.importorskip("torch")
    from lbannpy.bench.kernel_choice import conv_shapes, out_shape

    work = make_data(tmp_path, blobs_size=12, blobs_samples=32, mesh_size=16, mesh_samples=2)
    model, data = model_spec(work, "cls", LAYERS, 12)

    def cfg(tag, kernels, machine=None):
        return {"model": model, "data": data, "trainer": {"batch_size": 8, "steps": 3, "seed": 3},
                "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "runtime": {"kernels": kernels},
                "parallel": {"machine": str(machine)} if machine else {},
                "checkpoint": {"dir": str(work / tag / "ckpt")}, "output": {"dir": str(work / tag / "out")}}

    def run(tag, kernels, machine=None):
        config = build_config(work, tag, cfg(tag, kernels, machine))
        p = sh([MPIEXEC, "-n", "1", PY, "-m", "lbannpy.train", config])
        return final_params(work / tag / "ckpt"), p.stdout

    build_config(work, "spec", cfg("spec", "auto"))
    shapes = [s for _, s in conv_shapes([str(work / "spec.yaml")])]
    assert [s.x_shape for s in shapes] == [(8, 3, 12, 12), (8, 6, 12, 12), (8, 8, 6, 6)]

    def machine(sets):
        rows = [{"type": "conv", "in": list(s.x_shape), "out": list(out_shape(s)), "fwd_s": 1e-3,
                 "kernel": k} for s, k in zip(shapes, sets)]
        path = work / f"machine-{'-'.join(sets)}.yaml"
        path.write_text(yaml.safe_dump(_tree(rows)))
        return path

    own, _ = run("own", "own")
    aten, _ = run("aten", "aten")
    assert any(not np.array_equal(own[k], aten[k]) for k in own), "the two sets must be told apart"
    chose_own, out = run("auto-own", "auto", machine(["own"] * 3))
    assert "conv kernels: own at 3 layer(s)" in out
    chose_aten, _ = run("auto-aten", "auto", machine(["aten"] * 3))
    for name, (got, want) in {"own": (chose_own, own), "aten": (chose_aten, aten)}.items():
        for k in want:
            assert np.array_equal(got[k], want[k]), f"auto with every shape on {name}: {k} differs"
    _, out = run("auto-mixed", "auto", machine(["own", "aten", "own"]))
    assert "conv kernels: aten at 1 layer(s), own at 2 layer(s)" in out, out


def test_calibrate_kernels_writes_rows_the_planner_reads(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "machine.yaml"
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "calibrate", "-o", str(out), "--max-bytes",
                        "4096", "--gemm", "64", "--target-ms", "1", "--batches", "1", "--quick",
                        "--kernels", "lenet5:16:2"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conv kernel sets at 2 layer shape(s) of lenet5:16:2" in r.stdout, r.stdout
    m = load_machine(out)
    whole = {("conv", (2, 1, 16, 16), (2, 6, 12, 12)), ("conv", (2, 6, 6, 6), (2, 16, 2, 2))}
    assert whole <= set(m.kernels)  # and the blocks of the splits (calibrate_layers), which name a set too
    assert set(m.kernels.values()) <= {"own", "aten"}
    spec = tmp_path / "lenet5.yaml"
    sh([PY, "-m", "lbannpy.config", "zoo", "lenet5", "--input-size", "16", "-o", spec])
    r = subprocess.run([sys.executable, "-m", "lbannpy.strategy", str(spec), "--ranks", "2", "--machine",
                        str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "predicted step" in r.stdout, r.stdout + r.stderr


def test_calibrate_refuses_an_unknown_model_at_once(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "calibrate", "-o", str(tmp_path / "m.yaml"),
                        "--kernels", "nosuchnet"], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode != 0 and "--kernels" in r.stderr and "nosuchnet" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "m.yaml").exists()


def test_calibration_names_a_transposed_convolutions_host_layout(tmp_path, monkeypatch):
    """``bench calibrate --kernels`` times a transposed convolution whose space is whole on ATen's set in
    both host layouts (the layer itself, :func:`lbannpy.bench.layout_choice.layer_layouts`) and records
    ``kernel: aten`` with ``layout: channels_last`` where that layout is the faster by the margin; a run on
    that machine file hands the layer that layout (its native operator on channels-last operands)."""
    pytest.importorskip("torch")
    from lbannpy.bench import calibrate_layers as cl
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.kernels.select import kernel_table

    spec = tmp_path / "up.yaml"
    spec.write_text(yaml.safe_dump({
        "model": {"input": {"channels": 4, "spatial": [8, 8]},
                  "layers": [{"name": "t", "type": "conv_transpose", "filters": 4, "kernel": 2,
                              "stride": 2}]},
        "trainer": {"batch_size": 2}}))
    asked = []

    def layer_layouts(typ, params, in_shape, dtype="float32"):
        asked.append((typ, tuple(in_shape)))
        return 2.0, 1.0  # channels-last twice as fast
    monkeypatch.setattr(cl, "layer_layouts", layer_layouts)
    rows, _ = cl.measure_split_layers(SingleCommunicator(), np, [str(spec)], quick=True)
    mine = [r for r in rows if r["type"] == "conv_transpose"]
    whole = [r for r in mine if "split" not in r]
    assert len(whole) == 1 and whole[0]["kernel"] == "aten" and whole[0]["layout"] == "channels_last", mine
    assert asked and all(t == "conv_transpose" for t, _ in asked)
    m = machine_from_dict(_tree(rows))
    table = kernel_table("auto", "cpu", m)
    key = ("conv_transpose", (2, 4, 8, 8), (2, 4, 16, 16))
    assert table[key].name == "aten" and table[key].layout == "channels_last"
