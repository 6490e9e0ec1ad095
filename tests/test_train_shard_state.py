"""``optimizer.shard_state`` end to end (``python -m lbannpy.train`` under ``mpiexec``): the optimizer state
of replicated parameters split over their replicas (ZeRO stage 1) changes no bit of a run — weights and the
optimizer state in its checkpoints equal the unsharded run's exactly, with SGD (momentum, weight decay,
Nesterov) and Adam, buckets of every size, data-parallel, spatial and hybrid layouts — while each rank keeps
its share of every replicated bucket's state only; checkpoints move between sharded and unsharded runs."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from train_util import PY, build_config, make_data, model_spec, sh

MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")

CLS = [  # no bias before a batch-norm: its gradient is zero, its value round-off (no relative error)
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "c2", "type": "conv", "filters": 5, "kernel": 3, "stride": 2, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "f1", "type": "fc", "units": 7},
    {"name": "r3", "type": "relu"},
    {"name": "f2", "type": "fc", "units": 4},
]
SEG = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "stride": 2, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv", "filters": 6, "kernel": 3, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "predict", "type": "conv", "filters": 2, "kernel": 1},
]
OPTS = {"sgd": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
        "nesterov": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True},
        "adam": {"type": "adam", "lr": 0.01, "weight_decay": 1e-3}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("shard"), blobs_size=12, blobs_samples=32, mesh_size=16,
                     mesh_samples=16)


def run(work, tag, ranks, kind, parallel, opt, shard, steps, comm=None, dtype="float64", *extra):
    model, data = model_spec(work, "cls", CLS, 12) if kind == "cls" else model_spec(work, "seg", SEG, 16)
    cfg = {"model": model, "data": data, "trainer": {"batch_size": 8, "steps": steps, "seed": 5,
                                                      "dtype": dtype},
           "optimizer": dict(OPTS[opt], shard_state=shard), "parallel": parallel, "comm": comm or {},
           "checkpoint": {"dir": str(work / tag / "ckpt"), "every_steps": 0},
           "output": {"dir": str(work / tag / "out")}}
    sh([MPIEXEC, "-n", ranks, PY, "-m", "lbannpy.train", build_config(work, tag, cfg), "--quiet", *extra],
       timeout=300)
    return work / tag


def tensors(out) -> dict:
    """Every tensor of the newest checkpoint: parameters, optimizer state, layer state."""
    from lbannpy import checkpoint

    _, data = checkpoint.load_newest(str(out / "ckpt"))
    return data["tensors"]


def assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())}"
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{what}: {k} differs by {np.abs(a[k] - b[k]).max():.3g}"


def shares(out) -> list:
    return [b["state_share"] for b in json.loads((out / "out" / "summary.json").read_text())["buckets"]]


CASES = [  # ranks, model, layout, optimizer, comm
    (2, "cls", {"default": {"n": 2}}, "sgd", {"bucket_mb": 0.001, "first_bucket_mb": 0.0005}),
    (2, "seg", {"default": {"h": 2}}, "adam", {}),
    (4, "cls", {"default": {"n": 2, "h": 2}, "layers": {"f1": {"n": 2, "c": 2}, "f2": {"n": 4}}}, "nesterov",
     {"overlap": False}),
    (4, "seg", {"default": {"n": 2, "w": 2}}, "sgd", {"bucket_mb": 0.002, "first_bucket_mb": 0.001}),
]


@pytest.mark.parametrize("ranks,kind,parallel,opt,comm", CASES,
                         ids=["2-sample-tiny-buckets-sgd", "2-spatial-adam", "4-hybrid-nesterov-blocking",
                              "4-hybrid-seg-buckets"])
def test_sharded_state_changes_no_bit(work, ranks, kind, parallel, opt, comm):
    tag = f"{kind}-{ranks}-{opt}"
    whole = run(work, f"{tag}-whole", ranks, kind, parallel, opt, False, 4, comm)
    split = run(work, f"{tag}-split", ranks, kind, parallel, opt, True, 4, comm)
    a, b = tensors(whole), tensors(split)
    assert sum(1 for k in a if not k.startswith("params/")) > len(CLS) // 2, sorted(a)  # state is there
    assert_identical(b, a, f"{tag}: sharded against whole")
    assert set(shares(whole)) == {1.0}
    got = shares(split)
    assert got and all(0 < s <= 0.75 for s in got), got  # rank 0 keeps its share of every bucket only
    assert sum(got) / len(got) <= (0.6 if ranks == 2 else 0.5), got


def test_checkpoints_move_between_sharded_and_whole_runs(work):
    par = {"default": {"n": 2}}
    full = tensors(run(work, "mv-full", 2, "cls", par, "sgd", True, 6))
    for first, then, tag in [(False, True, "mv-whole-then-split"), (True, False, "mv-split-then-whole"),
                             (True, True, "mv-split-then-split")]:
        base = run(work, f"{tag}-a", 2, "cls", par, "sgd", first, 3)
        shutil.copytree(base, work / tag)
        after = tensors(run(work, tag, 2, "cls", par, "sgd", then, 6, None, "float64", "--resume"))
        assert_identical(after, full, tag)
    # on another rank count the sums run in another order: equal to round-off
    shutil.copytree(work / "mv-split-then-split-a", work / "mv-4")
    after = tensors(run(work, "mv-4", 4, "cls", {"default": {"n": 4}}, "sgd", True, 6, None, "float64",
                        "--resume"))
    for k in full:
        err = np.abs(after[k] - full[k]).max() / max(np.abs(full[k]).max(), 1e-30)
        assert err <= 1e-10, (k, err)


def test_shard_state_is_not_part_of_the_computation():
    """What ``--resume`` compares leaves shard_state out (resuming across it needs no --force)."""
    from lbannpy.training.ckpt import computation, digest

    base = {"model": {"layers": CLS}, "trainer": {"dtype": "float64"},
            "optimizer": dict(OPTS["sgd"], shard_state=False)}
    assert digest(computation(base)) == digest(computation(dict(base, optimizer=dict(OPTS["sgd"],
                                                                                      shard_state=True))))
    assert digest(computation(base)) != digest(computation(dict(base, optimizer=dict(OPTS["sgd"], lr=0.1,
                                                                                      shard_state=False))))
