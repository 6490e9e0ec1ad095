"""``python -m lbannpy.bench layers --models``: the zoo models' conv and batch-norm shapes, and the table of
the ``--quick`` run (tiny inputs; what is checked is the table's shape, not the timings)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from lbannpy.bench import layers  # noqa: E402


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
