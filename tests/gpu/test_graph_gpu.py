"""``runtime.cuda_graph`` end to end on GPUs (``mpiexec`` ranks, NCCL): a run whose step cannot be captured
says so in one line and runs eagerly (``auto``), or is refused with that line (``on``), on every rank alike.

On the CUDA stand-in in every test run (``LBANNPY_GPU=real`` for real CuPy/NCCL; see conftest.py).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
from train_util import PY, assert_same_weights, build_config, final_params, make_data, metrics  # noqa: E402

BN_NET = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "f1", "type": "fc", "units": 4},
]
PLAIN_NET = [layer for layer in BN_NET if layer["type"] != "batchnorm"]
GPU = ("--set", "runtime.device=gpu")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("gpu-graph"), blobs_size=8, blobs_samples=16, mesh_size=8,
                     mesh_samples=4)


def config(work, tag, layers, steps=3):
    cfg = {"model": {"name": "g", "input": {"channels": 3, "spatial": [8, 8]}, "layers": layers,
                     "loss": "cross_entropy"},
           "data": {"train": {"path": str(work / "blobs.h5")}},
           "trainer": {"batch_size": 4, "steps": steps, "seed": 5, "dtype": "float64"},
           "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
           "parallel": {"default": {"n": 2}},
           "checkpoint": {"dir": str(work / tag / "ckpt")}, "output": {"dir": str(work / tag / "out")}}
    return build_config(work, tag, cfg)


def train(gpu_run, cfg, *extra, env=None, check=True):
    return gpu_run(["mpiexec", "-n", 2, PY, "-m", "lbannpy.train", cfg, "--quiet", *GPU, *extra], env=env,
                   timeout=240, check=check)


def lines_with(text: str, part: str) -> list[str]:
    return [ln for ln in text.splitlines() if part in ln]


def test_auto_runs_an_uncapturable_step_eagerly_saying_why_once(work, gpu_run):
    """A batch-norm layer (declared uncapturable in the registry): ``auto`` prints one line naming it and
    trains exactly as ``off`` does (float64, bit for bit)."""
    p = train(gpu_run, config(work, "auto", BN_NET), "--set", "runtime.backend=nccl")
    said = lines_with(p.stderr, "step: eager (runtime.cuda_graph auto): not capturable: layer 'b1' "
                                "(batchnorm): its running statistics")
    assert len(said) == 1, p.stderr
    summary = json.loads((work / "auto" / "out" / "summary.json").read_text())
    assert summary["cuda_graph"]["mode"] == "eager" and summary["cuda_graph"]["replays"] == 0, summary
    assert summary["cuda_graph"]["reason"].startswith("layer 'b1' (batchnorm)"), summary
    p = train(gpu_run, config(work, "off", BN_NET), "--set", "runtime.backend=nccl",
              "--set", "runtime.cuda_graph=off")
    assert lines_with(p.stderr, "step: eager (runtime.cuda_graph off)") and "not capturable" not in p.stderr
    assert_same_weights(final_params(work / "off" / "ckpt"), final_params(work / "auto" / "ckpt"), 0.0,
                        "auto's eager fallback against off")
    assert [r["loss"] for r in metrics(work / "auto" / "out")] == [r["loss"] for r in metrics(work / "off" /
                                                                                             "out")]


@pytest.mark.parametrize("layers,backend,named", [
    (BN_NET, "nccl", "layer 'b1' (batchnorm): its running statistics are new arrays each step"),
    (PLAIN_NET, "mpi", "runtime.backend mpi: MPI calls wait on the host for the stream"),
], ids=["uncapturable-layer", "mpi-backend"])
def test_on_refuses_an_uncapturable_run_with_one_line(work, gpu_run, layers, backend, named):
    """``on``: exit status 2 on every rank before any step, one line naming what prevents the capture."""
    tag = f"on-{backend}"
    p = train(gpu_run, config(work, tag, layers), "--set", f"runtime.backend={backend}",
              "--set", "runtime.cuda_graph=on", env={"LBANNPY_CUDA_AWARE_MPI": "1"}, check=False)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    said = lines_with(p.stderr, "runtime.cuda_graph on: the training step cannot be captured: ")
    assert len(said) == 1 and named in said[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert not (work / tag / "out" / "metrics.csv").exists()
