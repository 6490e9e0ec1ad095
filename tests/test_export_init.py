"""Weights in: a step-0 checkpoint (``checkpoint.at_start``), exported, and given back with ``--init``
reproduces the run (another seed, unshuffled data: the seed then decides nothing else); without it the
weights differ. ``--init`` of the checkpoint file itself does the same; a mismatching file is refused."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import yaml

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
PY = sys.executable
LAYERS = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
    {"name": "b1", "type": "batchnorm"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "f1", "type": "fc", "units": 3},
]


def sh(cmd, cwd, check=True):
    p = subprocess.run(cmd, env=ENV, cwd=cwd, capture_output=True, text=True, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def params(path):
    from lbannpy import checkpoint

    tensors = checkpoint.load(str(path))["tensors"]
    return {k[len("params/"):]: v for k, v in tensors.items() if k.startswith("params/")}


def test_init_from_exported_step0_reproduces_a_run(tmp_path):
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["inputs"] = rng.standard_normal((16, 2, 8, 8))
        f["labels"] = rng.integers(0, 3, 16)
    spec = {"model": {"name": "tiny", "input": {"channels": 2, "spatial": [8, 8]}, "layers": LAYERS},
            "data": {"train": {"path": "data.h5", "shuffle": False}},
            "trainer": {"batch_size": 4, "steps": 6, "seed": 1, "dtype": "float64"},
            "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    def train(name, *extra):
        sh([PY, "-m", "lbannpy.train", "spec.yaml", "--quiet", "--set", f"checkpoint.dir={name}/ckpt",
            "--set", f"output.dir={name}/run", *extra], cwd=tmp_path)
        return params(tmp_path / name / "ckpt" / "ckpt-00000006")

    a = train("a", "--set", "checkpoint.at_start=true")
    step0 = tmp_path / "a" / "ckpt" / "ckpt-00000000"
    assert step0.is_dir()
    p0 = params(step0)
    assert any(np.abs(p0[k] - a[k]).max() > 1e-6 for k in a)  # the run moved away from its start
    sh([PY, "-m", "lbannpy.export", str(step0), "-o", "w0.safetensors", "--dtype", "float64"], cwd=tmp_path)

    b = train("b", "--set", "trainer.seed=2", "--init", "w0.safetensors")
    c = train("c", "--set", "trainer.seed=2")
    d = train("d", "--set", "trainer.seed=2", "--set", f"model.init={step0}")
    for k in a:
        np.testing.assert_array_equal(b[k], a[k])
        np.testing.assert_array_equal(d[k], a[k])
    assert any(np.abs(c[k] - a[k]).max() > 1e-6 for k in a)  # another seed without --init: another run
    e = train("e", "--set", "trainer.seed=2", "--init", "w0.safetensors", "--set", "data.train.shuffle=true")
    assert any(np.abs(e[k] - a[k]).max() > 1e-6 for k in a)  # shuffled: the order differs, so the run does

    # a file for another model is refused once, without a traceback
    spec["model"]["layers"][0]["filters"] = 5
    spec["model"]["layers"][1:2] = []
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(spec))
    p = sh([PY, "-m", "lbannpy.train", "other.yaml", "--quiet", "--init", "w0.safetensors"], cwd=tmp_path,
           check=False)
    assert p.returncode == 2
    assert "c1.weight" in p.stderr and "(5, 2, 3, 3)" in p.stderr and "Traceback" not in p.stderr, p.stderr
