"""Batch-norm running statistics of every sample group survive a checkpoint (``n`` split, ``sync: group``).

Two ranks split the samples (``n2``); with ``sync: group`` each keeps the running statistics of its own
sample block, and evaluation uses them. A run that stops after a checkpoint and resumes evaluates exactly
as the uninterrupted run; resumed with another split the statistics are the average of the groups.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from lbannpy import checkpoint

MPIEXEC = shutil.which("mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
PY = sys.executable
LAYERS = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "group"},
    {"name": "r1", "type": "relu"},
    {"name": "d1", "type": "dropout", "p": 0.2},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "f1", "type": "fc", "units": 4},
]


def sh(cmd, timeout=240):
    p = subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bn")
    sh([PY, "-m", "lbannpy.data", "blobs", "--size", "12", "--samples", "64", "--classes", "4",
        "-o", d / "blobs.h5"])
    return d


def config(d, tag: str, steps: int, parallel: dict):
    cfg = {"model": {"name": "bn", "input": {"channels": 3, "spatial": [12, 12]}, "layers": LAYERS,
                     "loss": "cross_entropy"},
           "data": {"train": {"path": str(d / "blobs.h5")}, "validation": {"fraction": 0.25}},
           "trainer": {"batch_size": 8, "steps": steps, "seed": 5, "dtype": "float64", "eval_every": 100},
           "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
           "parallel": parallel,
           "checkpoint": {"dir": str(d / tag / "ckpt"), "every_steps": 0},
           "output": {"dir": str(d / tag / "out")}}
    (d / f"{tag}.yaml").write_text(yaml.safe_dump(cfg))
    sh([PY, "-m", "lbannpy.config", "build", d / f"{tag}.yaml", "-o", d / f"{tag}.h5"])
    return d / f"{tag}.h5"


def train(ranks, cfg, *extra):
    sh([MPIEXEC, "-n", ranks, PY, "-m", "lbannpy.train", cfg, "--quiet", *extra])


RESTORE = """
import json, sys
import numpy as np
from lbannpy.comm import Runtime
from lbannpy.config import load_config
from lbannpy.training.loop import Trainer

with Runtime() as rt:
    trainer = Trainer(load_config(sys.argv[1]), rt, quiet=True)
    trainer.setup(resume=True)  # the newest checkpoint, resharded to this run's split
    ev = trainer.evaluate()
    b1 = next(layer for layer in trainer.model.layers if layer.name == "b1")
    if rt.rank == 0:
        print("RESULT " + json.dumps({"step": trainer.step, "eval": ev,
                                      "running_mean": np.asarray(b1.running_mean).tolist(),
                                      "running_var": np.asarray(b1.running_var).tolist()}))
"""


def restored(ranks, cfg) -> dict:
    """What ``--resume`` restores on ``ranks`` ranks (a finished run trains and writes nothing more): the
    step, an evaluation from the restored statistics, and rank 0's batch-norm running statistics."""
    p = sh([MPIEXEC, "-n", ranks, PY, "-c", RESTORE, cfg])
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def last_eval(d, tag):
    _, data = checkpoint.load_newest(str(d / tag / "ckpt"))
    return data["meta"]["evals"][-1], data


N2 = {"default": {"n": 2}}


@pytest.mark.timeout(400)
def test_group_statistics_resume_evaluates_as_the_uninterrupted_run(blobs):
    d = blobs
    train(2, config(d, "full", 6, N2))
    want6, full = last_eval(d, "full")
    train(2, config(d, "part", 3, N2))  # stops after 3 steps, evaluates, checkpoints
    want3, part = last_eval(d, "part")
    # the two sample groups' statistics are kept apart (they differ: one row for both would change
    # every evaluation below)
    rm = part["tensors"]["state/b1/running_mean"]
    assert rm.shape == (2, 6) and not np.allclose(rm[0], rm[1], rtol=1e-3)
    # resumed with nothing left to train: evaluation straight from the restored statistics
    got3 = restored(2, config(d, "part", 3, N2))
    assert got3["step"] == 3 and abs(got3["eval"]["loss"] - want3["loss"]) <= 1e-12 * abs(want3["loss"]), \
        (got3, want3)
    train(2, config(d, "part", 6, N2), "--resume")
    got6, data6 = last_eval(d, "part")
    for k in want6:
        assert abs(got6[k] - want6[k]) <= 1e-10 * max(1.0, abs(want6[k])), (k, got6, want6)
    for k in ("state/b1/running_mean", "state/b1/running_var"):
        np.testing.assert_allclose(data6["tensors"][k], full["tensors"][k], rtol=1e-12)


@pytest.mark.timeout(400)
def test_group_statistics_are_averaged_when_the_split_changes(blobs):
    d = blobs
    train(2, config(d, "avg", 3, N2))
    _, part = last_eval(d, "avg")
    one = restored(1, config(d, "avg", 3, {}))  # one rank: one group, the average of the two
    assert one["step"] == 3
    for k in ("running_mean", "running_var"):
        assert np.shape(one[k]) == (6,)
        np.testing.assert_allclose(one[k], part["tensors"][f"state/b1/{k}"].mean(axis=0), rtol=1e-12)
