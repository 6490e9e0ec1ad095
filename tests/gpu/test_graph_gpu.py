"""``runtime.cuda_graph`` end to end on GPUs (``mpiexec`` ranks, NCCL): a run whose step cannot be captured
says so in one line and runs eagerly (``auto``), or is refused with that line (``on``), on every rank alike.

On the CUDA stand-in in every test run (``LBANNPY_GPU=real`` for real CuPy/NCCL; see conftest.py).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
from train_util import PY, assert_same_weights, build_config, final_params, make_data, metrics  # noqa: E402

REAL = os.environ.get("LBANNPY_GPU", "") == "real"

BN_NET = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "f1", "type": "fc", "units": 4},
]
PLAIN_NET = [layer for layer in BN_NET if layer["type"] != "batchnorm"]
DROP_NET = BN_NET[:3] + [{"name": "d1", "type": "dropout", "p": 0.25}] + BN_NET[3:]
GPU = ("--set", "runtime.device=gpu")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("gpu-graph"), blobs_size=8, blobs_samples=16, mesh_size=8,
                     mesh_samples=4)


def config(work, tag, layers, steps=3, parallel=None, **extra):
    cfg = {"model": {"name": "g", "input": {"channels": 3, "spatial": [8, 8]}, "layers": layers,
                     "loss": "cross_entropy"},
           "data": {"train": {"path": str(work / "blobs.h5")}},
           "trainer": {"batch_size": 4, "steps": steps, "seed": 5, "dtype": "float64"},
           "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
           "parallel": {"default": {"n": 2}} if parallel is None else parallel,
           "checkpoint": {"dir": str(work / tag / "ckpt")}, "output": {"dir": str(work / tag / "out")}}
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return build_config(work, tag, cfg)


def train(gpu_run, cfg, *extra, env=None, check=True):
    return gpu_run(["mpiexec", "-n", 2, PY, "-m", "lbannpy.train", cfg, "--quiet", *GPU, *extra], env=env,
                   timeout=240, check=check)


def lines_with(text: str, part: str) -> list[str]:
    return [ln for ln in text.splitlines() if part in ln]


def test_auto_runs_an_uncapturable_step_eagerly_saying_why_once(work, gpu_run):
    """The MPI backend (its calls wait on the host for the stream): ``auto`` prints one line naming it and
    trains exactly as ``off`` does (float64, bit for bit)."""
    mpi = ("--set", "runtime.backend=mpi")
    aware = {"LBANNPY_CUDA_AWARE_MPI": "1"}
    p = train(gpu_run, config(work, "auto", DROP_NET), *mpi, env=aware)
    said = lines_with(p.stderr, "step: eager (runtime.cuda_graph auto): not capturable: "
                                "runtime.backend mpi: ")
    assert len(said) == 1, p.stderr
    summary = json.loads((work / "auto" / "out" / "summary.json").read_text())
    assert summary["cuda_graph"]["mode"] == "eager" and summary["cuda_graph"]["replays"] == 0, summary
    assert summary["cuda_graph"]["reason"].startswith("runtime.backend mpi: "), summary
    p = train(gpu_run, config(work, "off", DROP_NET), *mpi, "--set", "runtime.cuda_graph=off", env=aware)
    assert lines_with(p.stderr, "step: eager (runtime.cuda_graph off)") and "not capturable" not in p.stderr
    assert_same_weights(final_params(work / "off" / "ckpt"), final_params(work / "auto" / "ckpt"), 0.0,
                        "auto's eager fallback against off")
    assert [r["loss"] for r in metrics(work / "auto" / "out")] == [r["loss"] for r in metrics(work / "off" /
                                                                                             "out")]


@pytest.mark.parametrize("flags,backend,named", [
    (("--trace",), "nccl", "--trace: per-layer timings need eager steps"),
    ((), "mpi", "runtime.backend mpi: MPI calls wait on the host for the stream"),
], ids=["trace", "mpi-backend"])
def test_on_refuses_an_uncapturable_run_with_one_line(work, gpu_run, flags, backend, named):
    """``on``: exit status 2 on every rank before any step, one line naming what prevents the capture."""
    tag = f"on-{backend}"
    p = train(gpu_run, config(work, tag, PLAIN_NET), *flags, "--set", f"runtime.backend={backend}",
              "--set", "runtime.cuda_graph=on", env={"LBANNPY_CUDA_AWARE_MPI": "1"}, check=False)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    said = lines_with(p.stderr, "runtime.cuda_graph on: the training step cannot be captured: ")
    assert len(said) == 1 and named in said[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert not (work / tag / "out" / "metrics.csv").exists()


# ------------------------------------------------------------------------------- the captured step
def checkpoint_tensors(ckpt_dir) -> dict:
    """Every tensor of the newest checkpoint (parameters, optimizer state, batch-norm running
    statistics), by name."""
    from lbannpy import checkpoint

    _, data = checkpoint.load_newest(str(ckpt_dir))
    return data["tensors"]


def assert_bitwise_same_run(work, tag, ref, what):
    a, b = checkpoint_tensors(work / tag / "ckpt"), checkpoint_tensors(work / ref / "ckpt")
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    assert any("running" in k for k in a) and any(not k.startswith("params/") for k in a), sorted(a)
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{what}: {k} differs by {np.abs(a[k] - b[k]).max():.3g}"
    rows_b = metrics(work / ref / "out")
    # a run stopped early logs its last step too: the reference's steps are compared
    steps = {r["step"] for r in rows_b}
    rows_a = [r for r in metrics(work / tag / "out") if r["step"] in steps]
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b], what
    for key in ("loss", "accuracy", "grad_norm", "lr"):
        assert [r[key] for r in rows_a] == [r[key] for r in rows_b], (what, key)
    ev_a = json.loads((work / tag / "out" / "summary.json").read_text())["validation"]
    ev_b = json.loads((work / ref / "out" / "summary.json").read_text())["validation"]
    assert ev_a == ev_b and ev_a, (what, ev_a, ev_b)


STEPS = 8
STEP_LR = {"type": "sgd", "lr": 0.05, "schedule": {"type": "step", "step_size": 3, "gamma": 0.5}}
# (a cosine schedule spans trainer.steps, so a run stopped early would follow another one)
ADAM_WARMUP = {"type": "adam", "lr": 0.01, "schedule": {"type": "step", "step_size": 2, "gamma": 0.7,
                                                        "warmup_steps": 2}}
# two fully-connected layers, the first of them replicated (comm.replicate_fc: 1)
FC2_NET = BN_NET[:-1] + [{"name": "f0", "type": "fc", "units": 6}, {"name": "r2", "type": "relu"},
                         BN_NET[-1]]
# the U-Net and SegResNet layer types in one small net: circular padding, group and instance norm (running
# statistics), PReLU, a transposed convolution and a bilinear upsampling side by side, a gate (sigmoid, mul),
# a skip concatenation and a global pool under the classifier
UNET_NET = [
    {"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1, "padding_mode": "circular"},
    {"name": "g1", "type": "groupnorm", "groups": 2},
    {"name": "a1", "type": "prelu", "num_parameters": 4},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "u1", "type": "conv_transpose", "filters": 4, "kernel": 2, "stride": 2},
    {"name": "up1", "type": "upsample", "scale": 2, "mode": "linear", "parents": ["p1"]},
    {"name": "s1", "type": "sigmoid"},
    {"name": "m1", "type": "mul", "parents": ["u1", "s1"]},
    {"name": "cat", "type": "concat", "parents": ["m1", "a1"]},
    {"name": "i1", "type": "instancenorm", "affine": True, "track_running_stats": True},
    {"name": "e1", "type": "gelu"},
    {"name": "gp", "type": "global_pool"},
    {"name": "f1", "type": "fc", "units": 4},
]
GRAPHED_RUNS = [  # (ranks, parallel, layers, optimizer, comm, name)
    (1, {}, BN_NET, STEP_LR, {}, "one-gpu-step-lr"),
    (2, {"default": {"n": 2}}, DROP_NET, {}, {}, "sample-dropout"),
    (2, {"default": {"h": 2}}, BN_NET, ADAM_WARMUP, {}, "spatial-adam-warmup"),
    (4, {"default": {"n": 2, "h": 2}}, BN_NET, {}, {}, "hybrid-4"),
    (4, {"default": {"n": 2}, "layers": {"c1": {"n": 2, "c": 2}, "f1": {"n": 2, "c": 2}}}, BN_NET, {}, {},
     "filter-and-fc-split-4"),
    (2, {"default": {"n": 2}}, FC2_NET, ADAM_WARMUP, {"replicate_fc": 1}, "replicated-fc-adam"),
    (2, {"default": {"n": 2}}, BN_NET, dict(ADAM_WARMUP, shard_state=True), {}, "sharded-adam-state"),
    (2, {"default": {"h": 2}}, UNET_NET, ADAM_WARMUP, {}, "unet-layers-spatial"),
]


@pytest.mark.parametrize("ranks,parallel,layers,optimizer,comm,name", GRAPHED_RUNS,
                         ids=[r[-1] for r in GRAPHED_RUNS])
def test_the_captured_step_trains_as_the_eager_one_bit_for_bit(work, gpu_run, ranks, parallel, layers,
                                                               optimizer, comm, name):
    """float64, ``runtime.kernels: own``: with the step captured (``on``) the run ends with the eager run's
    every checkpoint tensor (weights, optimizer state, batch-norm running statistics, dropout's step), its
    logged losses, gradient norms, learning rates and validation metrics, bit for bit; with evaluation and a
    checkpoint every 3 steps, stopped after 5 steps and resumed to 8 (the resumed run warms up and captures
    again); a learning-rate schedule, dropout, a replicated fully-connected layer (updated at the end of the
    captured step instead of before its next forward), sharded optimizer state (refilled in place by each
    checkpoint). A graph that replayed a stale batch would train on one batch only and fail this."""
    common = dict(steps=STEPS, parallel=parallel, optimizer=optimizer, comm=comm,
                  data={"validation": {"fraction": 0.25}}, trainer={"eval_every": 3},
                  output={"log_every": 2}, checkpoint={"every_steps": 3})
    run = ("mpiexec", "-n", ranks, PY, "-m", "lbannpy.train")
    opts = ("--quiet", *GPU, "--set", "runtime.kernels=own")
    if ranks > 1:
        opts += ("--set", "runtime.backend=nccl")
    ref, tag, resumed = f"eager-{name}", f"graph-{name}", f"graph-resumed-{name}"
    gpu_run([*run, config(work, ref, layers, **common), *opts, "--set", "runtime.cuda_graph=off"])
    p = gpu_run([*run, config(work, tag, layers, **common), *opts, "--set", "runtime.cuda_graph=on"])
    assert len(lines_with(p.stderr, "step: one CUDA graph per input shape")) == 1, p.stderr
    s = json.loads((work / tag / "out" / "summary.json").read_text())["cuda_graph"]
    # two eager warm-up steps, one captured (and launched), the rest replayed
    assert s["mode"] == "graph" and s["captures"] == 1 and s["replays"] == STEPS - 3, s
    # a captured or replayed step measures no communication: empty, not 0 (the warm-up steps measure it)
    rows = metrics(work / tag / "out")
    assert all((r["comm_time_s"], r["hidden_comm_fraction"], r["hidden_comm_s"]) == ("", "", "")
               for r in rows if int(r["step"]) > 2) and rows[0]["comm_time_s"] != "", rows
    assert_bitwise_same_run(work, tag, ref, f"captured step, {name}")
    half = dict(common, steps=5)
    gpu_run([*run, config(work, resumed, layers, **half), *opts, "--set", "runtime.cuda_graph=on"])
    gpu_run([*run, config(work, resumed, layers, **common), "--resume", *opts,
             "--set", "runtime.cuda_graph=on"])
    assert_bitwise_same_run(work, resumed, ref, f"captured step resumed after 5 steps, {name}")


def test_a_replayed_unlogged_step_makes_no_host_synchronisation(work, gpu_launch):
    """Counted by the stand-in (real CUDA cannot count them): the replayed steps between logged ones make
    no host synchronisation at all."""
    if REAL:
        pytest.skip("host synchronisations are counted by the CUDA stand-in only")
    cfg = config(work, "graph-syncs", BN_NET, steps=8, output={"log_every": 8})
    rows = gpu_launch(HERE, "syncs", 2, cfg, "--set", "runtime.backend=nccl", "--set",
                      "runtime.kernels=own", "--set", "runtime.cuda_graph=on", timeout=240)
    for row in rows:
        assert row["rc"] == 0 and row["modes"][3:] == ["replayed"] * 5, row
        print(f"rank {row['rank']}: host synchronisations per step {row['per_step']}")
        assert row["per_step"][3:7] == [0, 0, 0, 0], row


# ----------------------------------------------------------------------------------------------- worker
def _syncs(config, *extra):
    """Train with every step's host synchronisations counted and each step's mode (eager, captured,
    replayed) noted."""
    from cupy import _standin as probe

    from lbannpy import train as T
    from lbannpy.training import graphstep

    counts, modes = [], []
    step = T.Trainer.train_step
    run_graph = graphstep.StepGraphs.step

    def noted(self, x, y, body):
        out, how = run_graph(self, x, y, body)
        modes.append(how)
        return out, how

    def counted(self):
        probe.reset_host_syncs()
        row = step(self)
        counts.append(sum(v for (kind, _), v in probe.host_syncs().items() if kind != "get_elapsed_time"))
        return row

    graphstep.StepGraphs.step = noted
    T.Trainer.train_step = counted
    from mpi4py import MPI

    rc = T.main([config, "--quiet", *GPU, *extra])
    return {"rank": MPI.COMM_WORLD.rank, "rc": rc, "per_step": counts, "modes": modes}


if __name__ == "__main__":
    out = {"syncs": _syncs}[sys.argv[1]](*sys.argv[2:])
    print("RESULT " + json.dumps(out), flush=True)
