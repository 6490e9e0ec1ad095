"""End to end with the new losses: ``python -m lbannpy.train`` of a small conv net with ``mse`` on
per-pixel float targets at the output's (stride-2) resolution, on 2 ranks splitting the height (uneven
blocks), ends with the weights of the single-rank run (float64, 1e-10), and so do ``bce_with_logits``
(targets in [0, 1]) and ``dice`` (classes at the output's resolution); ``predict`` writes the raw outputs
of the mse model; ``config validate`` and ``data check`` take the targets and refuse wrong ones."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from train_util import PY, assert_same_weights, build_config, final_params, metrics, sh

MPIEXEC = shutil.which("mpiexec")
SIZE, OUT = 18, 9  # input 18x18, the stride-2 output 9x9: two uneven row blocks (5, 4) on 2 ranks
LAYERS = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv", "filters": 2, "kernel": 3, "stride": 2, "padding": 1},
]


def _data(path: Path, targets_shape=(2, OUT, OUT), dtype=np.float32, n=16, loss="mse") -> Path:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)
    # a learnable field: each target channel a smoothed, subsampled mix of the input channels
    y = np.stack([x[:, :2, ::2, ::2].mean(axis=1), x[:, 1:, ::2, ::2].sum(axis=1)], axis=1)
    y = np.resize(y, (n,) + tuple(targets_shape)).astype(dtype)
    if loss == "bce_with_logits":
        y = 1 / (1 + np.exp(-y))
    elif loss == "dice":
        y = y.argmax(axis=1)
    with h5py.File(path, "w") as f:
        f["inputs"], f["labels"] = x, y
    return path


def _spec(work: Path, tag: str, parallel: dict, data: Path, steps: int = 3, loss: str = "mse") -> dict:
    return {"model": {"name": "field", "input": {"channels": 3, "spatial": [SIZE, SIZE]}, "layers": LAYERS,
                      "loss": loss},
            "data": {"train": {"path": str(data)}},
            "trainer": {"batch_size": 4, "steps": steps, "seed": 3, "dtype": "float64"},
            "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
            "parallel": parallel, "checkpoint": {"dir": str(work / tag / "ckpt"), "every_steps": 0},
            "output": {"dir": str(work / tag / "out")}}


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("loss,column", [("mse", None), ("bce_with_logits", "accuracy"), ("dice", "dice")])
def test_two_ranks_splitting_h_equal_one_rank(tmp_path, loss, column):
    data = _data(tmp_path / "field.h5", loss=loss)
    ref = build_config(tmp_path, "ref", _spec(tmp_path, "ref", {}, data, loss=loss))
    split = build_config(tmp_path, "h2", _spec(tmp_path, "h2", {"default": {"h": 2}}, data, loss=loss))
    sh([MPIEXEC, "-n", "1", PY, "-m", "lbannpy.train", ref, "--quiet"])
    sh([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.train", split, "--quiet"])
    assert_same_weights(final_params(tmp_path / "h2" / "ckpt"), final_params(tmp_path / "ref" / "ckpt"),
                        1e-10, f"{loss}, h split on 2 ranks")
    rows, rows_ref = metrics(tmp_path / "h2" / "out"), metrics(tmp_path / "ref" / "out")
    assert len(rows) == 3 and "loss" in rows[0]
    assert {"accuracy", "dice"} & set(rows[0]) == ({column} if column else set()), rows[0]
    for a, b in zip(rows, rows_ref):
        assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-10 * abs(float(b["loss"]))
    if loss != "mse":
        return
    out = tmp_path / "pred.h5"
    p = sh([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.predict", split, "--checkpoint", tmp_path / "h2" / "ckpt",
            "--data", data, "-o", out])
    assert "loss" in p.stdout, p.stdout
    with h5py.File(out, "r") as f:
        assert "probabilities" not in f and f["outputs"].shape == (16, 2, OUT, OUT)
        assert (f["outputs"][:] < 0).any()  # raw outputs, no softmax


def test_config_and_data_check_take_targets_and_refuse_wrong_ones(tmp_path):
    good = _data(tmp_path / "good.h5")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(tmp_path, "v", {}, good)))
    sh([PY, "-m", "lbannpy.config", "validate", spec])
    ok = sh([PY, "-m", "lbannpy.data", "check", good, "--spec", spec, "-q"])
    assert ok.stdout.startswith("ok: 16 samples") and "float targets (2, 9, 9)" in ok.stdout, ok.stdout
    cases = {"shape": (_data(tmp_path / "shape.h5", (2, SIZE, SIZE)), "has shape (16, 2, 18, 18), mse needs "
                       "float targets of the output's shape (16, 2, 9, 9)"),
             "dtype": (_data(tmp_path / "int.h5", dtype=np.int64), "has dtype int64; mse targets must be "
                       "floating point")}
    for what, (path, phrase) in cases.items():
        spec.write_text(yaml.safe_dump(_spec(tmp_path, "v", {}, path)))
        p = sh([PY, "-m", "lbannpy.config", "validate", spec], check=False)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and phrase in lines[0], (what, p.stderr)
        p = sh([PY, "-m", "lbannpy.data", "check", path, "--spec", spec, "-q"], check=False)
        assert p.returncode == 1 and p.stdout.startswith("shape: "), (what, p.stdout, p.stderr)
