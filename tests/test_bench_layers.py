"""``python -m lbannpy.bench layers --models``: the zoo models' conv and batch-norm shapes, and the table of
the ``--quick`` run (tiny inputs; what is checked is the table's shape, not the timings); ``--new``: a row
for every new layer type, run where the type is registered and skipped with its reason where not."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from lbannpy.bench import layers, layers_new  # noqa: E402


def test_model_shapes_come_from_the_zoo_specs():
    shapes = layers.model_shapes((("lenet5", 32, 32), ("mesh_tiny", 64, 8)))
    convs = [s for _, s in shapes if s.kind == "conv"]
    assert convs[0].x_shape == (32, 1, 32, 32) and convs[0].filters == 6 and convs[0].kernel == (5, 5)
    assert convs[1].x_shape == (32, 6, 14, 14) and convs[1].filters == 16
    assert len(convs) == 2 + 7  # lenet5's two, mesh_tiny's seven (all distinct)
    first = [s for _, s in shapes if s.x_shape[0] == 8][0]
    assert first.stride == (2, 2) and first.pad == (1, 1)
    # a shape met twice (mesh1k's conv1_2 and conv1_3) is benchmarked once
    mesh = layers.model_shapes((("mesh1k", 64, 2),))
    assert len({s for _, s in mesh}) == len(mesh)
    assert layers.model_shapes(layers.MODEL_RUNS, max_size=256) == layers.model_shapes(layers.MODEL_RUNS[:4])


def test_bench_layers_models_quick_prints_every_shape():
    shapes = layers.model_shapes(layers.QUICK_RUNS)
    n_conv = sum(s.kind == "conv" for _, s in shapes)
    n_bn = len(shapes) - n_conv
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "layers", "--models", "--quick"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"zoo model layer shapes: {n_conv} conv, {n_bn} batchnorm" in r.stdout
    rows = [ln for ln in lines if ln.split()[-1:] and ln.split()[-1].replace(".", "").isdigit()
            and (" conv " in ln or " bn " in ln)]
    assert sum(" conv " in ln for ln in rows) == n_conv * len(layers.CONV_OPS)
    assert sum(" bn " in ln for ln in rows) == n_bn
    assert any(ln.startswith("conv ") and "geometric mean" in ln and "worst" in ln for ln in lines)
    assert any(ln.startswith("batchnorm ") and "geometric mean" in ln for ln in lines)


def test_new_rows_cover_every_contract_type():
    rows = layers_new.new_rows(8)
    types = {r.type for r in rows}
    assert types == {"conv_transpose", "upsample", "instancenorm", "groupnorm", "layernorm", "sigmoid",
                     "tanh", "silu", "identity", "gelu", "elu", "prelu", "softmax", "mul", "pad",
                     "global_pool", "conv"}
    assert {dict(r.params).get("mode") for r in rows if r.type == "pad"} == {None, "reflect", "replicate",
                                                                              "circular"}
    assert {dict(r.params).get("mode") for r in rows if r.type == "upsample"} == {"nearest", "linear"}
    assert any(dict(r.params).get("padding_mode") == "circular" for r in rows if r.type == "conv")
    assert len({r.id for r in rows}) == len(rows) and all(r.torch in layers_new.TORCH_REFS for r in rows)


def test_each_registered_new_row_runs_both_sides_on_the_same_shapes():
    """Every contender of every runnable row runs once at a tiny size (the contenders check PyTorch's output
    shape against the layer's); an unregistered type or parameter says why it is skipped."""
    import numpy as np
    for row in layers_new.new_rows(8):
        why = layers_new.new_row_missing(row)
        if why:
            assert "not registered" in why or "does not take" in why
            continue
        fns = layers_new.new_row_contenders(row, np.dtype("float32"))
        assert "ours" in fns and "torch NCHW" in fns
        for fn in fns.values():
            fn()


def test_bench_layers_new_quick_prints_every_row():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "layers", "--new", "--quick", "--size", "8"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for row in layers_new.new_rows(8):
        mine = [ln for ln in lines if ln.startswith(row.id + " ")]
        assert len(mine) == 1, row.id
        assert "skipped: " in mine[0] or mine[0].split()[len(row.id.split()) + 2].replace(".", "").isdigit()
    if not all(layers_new.new_row_missing(row) for row in layers_new.new_rows(8)):
        assert any(ln.startswith("new layers ratio ours/torch") and "geometric mean" in ln for ln in lines)


def test_a_convolution_row_takes_the_set_and_layout_the_calibration_would_record(monkeypatch):
    """``calibrated_set``: under ``auto`` a convolution row runs lbannpy's own set where the three calls time
    faster on it (as ``bench calibrate --kernels`` picks a shape's ``kernel``), else ATen's with the host
    layout the calibration would record; a run that names ``aten`` never gets the own set."""
    from lbannpy.layers.kernels.select import conv_kernels

    row = next(r for r in layers_new.new_rows(16) if r.type == "conv")
    aten = conv_kernels("aten")
    seen = []

    def sets(own_s, aten_s):
        def fake(shape, dtype, repeats):
            seen.append(shape)
            return {"own": (own_s,) * 3, "aten": (aten_s,) * 3}
        return fake
    monkeypatch.setattr(layers_new, "measure_layouts", lambda *a: (1.0, 0.5))  # channels-last 2x faster
    monkeypatch.setattr(layers_new, "time_sets", sets(1.0, 2.0))
    assert layers_new.calibrated_set(row, aten, "auto").name == "own"
    x = row.shapes[0]
    assert (seen[-1].x_shape, seen[-1].filters, seen[-1].pad) == (x, dict(row.params)["filters"], (1, 1))
    monkeypatch.setattr(layers_new, "time_sets", sets(2.0, 1.0))
    got = layers_new.calibrated_set(row, aten, "auto")
    assert (got.name, got.layout) == ("aten", "channels_last")
    monkeypatch.setattr(layers_new, "time_sets", sets(1.0, 2.0))
    got = layers_new.calibrated_set(row, aten, "aten")
    assert (got.name, got.layout) == ("aten", "channels_last")
