"""End to end: ``python -m lbannpy.train`` under ``mpiexec`` at 1, 2 and 4 ranks.

* equivalence: after N steps the weights of sample-, spatial- and hybrid-parallel runs (with model-parallel
  and 1.5D fully-connected layers) equal the single-rank run of the same global batch (float64: 1e-10);
* learning: the loss falls on a learnable synthetic task;
* resume: a run stopped after a checkpoint and resumed, on the same and on another rank count, ends with
  the weights and metrics of the uninterrupted run;
* failures: malformed input stops every rank within seconds with a message; a killed rank ends the job.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from train_util import (ENV, PY, assert_same_weights, build_config, final_params, make_data, metrics,
                        model_spec, sh)

MPIEXEC = shutil.which("mpiexec")
REPO = Path(__file__).resolve().parents[1]

CLS_LAYERS = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
    {"name": "c2", "type": "conv", "filters": 6, "kernel": 3, "stride": 2, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "f1", "type": "fc", "units": 8},
    {"name": "r3", "type": "relu"},
    {"name": "f2", "type": "fc", "units": 4},
]
SEG_LAYERS = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "stride": 2, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv", "filters": 6, "kernel": 3, "padding": 1},
    {"name": "r2", "type": "relu"},
    {"name": "s", "type": "sum", "parents": ["r2", "r1"]},
    {"name": "predict", "type": "conv", "filters": 2, "kernel": 1},
]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("e2e"), blobs_size=12, blobs_samples=64, mesh_size=32,
                     mesh_samples=24)


def spec(work, kind: str, steps: int, parallel: dict, dtype="float64", tag="run", lr=0.05, opt="sgd",
         comm=None):
    model, data = (model_spec(work, "cls", CLS_LAYERS, 12) if kind == "cls" else
                   model_spec(work, "seg", SEG_LAYERS, 32))
    cfg = {"model": model, "data": data,
           "trainer": {"batch_size": 8, "steps": steps, "seed": 3, "dtype": dtype},
           "optimizer": ({"type": "sgd", "lr": lr, "momentum": 0.9, "weight_decay": 1e-4} if opt == "sgd"
                         else {"type": "adam", "lr": lr}),
           "parallel": parallel,
           "checkpoint": {"dir": str(work / tag / "ckpt"), "every_steps": 0},
           "comm": comm or {},
           "output": {"dir": str(work / tag / "out")}}
    return build_config(work, tag, cfg)


def train(ranks: int, config, *extra, timeout=240, check=True):
    return sh([MPIEXEC, "-n", str(ranks), PY, "-m", "lbannpy.train", str(config), "--quiet", *extra],
              timeout=timeout, check=check)


CLS_RUNS = [
    (2, {"default": {"n": 2}}, "sample"),
    (2, {"default": {"h": 2}, "layers": {"f1": {"c": 2}, "f2": {"c": 2}}}, "spatial+model-parallel-fc"),
    (4, {"default": {"n": 2, "h": 2}, "layers": {"f1": {"n": 2, "c": 2}, "f2": {"n": 2, "c": 2}}},
     "hybrid+1.5d-fc"),
]
SEG_RUNS = [
    (2, {"default": {"h": 2}}, "spatial"),
    (4, {"default": {"n": 2, "w": 2}}, "hybrid"),
]


@pytest.mark.parametrize("kind,runs", [("cls", CLS_RUNS), ("seg", SEG_RUNS)], ids=["classification",
                                                                                      "segmentation"])
def test_distributed_training_equals_single_rank(work, kind, runs):
    steps = 4
    ref = spec(work, kind, steps, {}, tag=f"{kind}-ref")
    train(1, ref)
    want = final_params(work / f"{kind}-ref" / "ckpt")
    for ranks, parallel, name in runs:
        tag = f"{kind}-{name}"
        cfg = spec(work, kind, steps, parallel, tag=tag)
        train(ranks, cfg)
        assert_same_weights(final_params(work / tag / "ckpt"), want, 1e-10, f"{kind} {name} on {ranks} ranks")
        summary = json.loads((work / tag / "out" / "summary.json").read_text())
        assert summary["ranks"] == ranks and summary["steps"] == steps


def test_float32_run_matches_to_roundoff(work):
    ref = spec(work, "cls", 3, {}, dtype="float32", tag="f32-ref")
    train(1, ref)
    cfg = spec(work, "cls", 3, {"default": {"n": 2, "h": 2}}, dtype="float32", tag="f32-4")
    train(4, cfg)
    assert_same_weights(final_params(work / "f32-4" / "ckpt"), final_params(work / "f32-ref" / "ckpt"), 1e-4,
                        "float32 hybrid")


def test_loss_falls_on_a_learnable_task(work):
    cfg = spec(work, "seg", 40, {"default": {"h": 2}}, dtype="float32", tag="learn", lr=0.01, opt="adam")
    train(2, cfg, timeout=400)
    rows = metrics(work / "learn" / "out")
    first = np.mean([float(r["loss"]) for r in rows[:5]])
    last = np.mean([float(r["loss"]) for r in rows[-5:]])
    assert last < 0.7 * first, f"loss went from {first:.4f} to {last:.4f}"
    assert (work / "learn" / "out" / "loss.png").stat().st_size > 1000


def test_resume_equals_uninterrupted_run(work):
    par = {"default": {"h": 2}}
    full = spec(work, "cls", 6, par, tag="full")
    train(2, full)
    want = final_params(work / "full" / "ckpt")
    want_rows = metrics(work / "full" / "out")
    # the interrupted run: stops after 3 steps with a checkpoint; each resume below starts from a copy of
    # its checkpoint and output directories (resume allows other directories without notice)
    train(2, spec(work, "cls", 3, par, tag="resume-first"))
    for ranks_after, par_after, tag in [(2, par, "resume-same"), (1, {}, "resume-1rank"),
                                        (4, {"default": {"n": 2, "w": 2}}, "resume-4ranks")]:
        shutil.copytree(work / "resume-first", work / tag)
        second = spec(work, "cls", 6, par_after, tag=tag)  # the copied checkpoint and output directories
        train(ranks_after, second, "--resume")
        assert_same_weights(final_params(work / tag / "ckpt"), want, 1e-10, f"{tag}")
        rows = metrics(work / tag / "out")
        assert [r["step"] for r in rows] == [r["step"] for r in want_rows]
        for a, b in zip(rows, want_rows):
            assert abs(float(a["loss"]) - float(b["loss"])) <= 1e-10 * max(1.0, abs(float(b["loss"])))


def test_interrupted_checkpoint_write_is_never_newest(work, tmp_path):
    from lbannpy import checkpoint

    cfg = spec(work, "cls", 2, {}, tag="ck")
    train(1, cfg)
    ck = work / "ck" / "ckpt"
    good = checkpoint.candidates(str(ck))[0]
    # a write killed half-way leaves only the temporary name behind: it is never picked
    (ck / "ckpt-00000099.tmp").mkdir()
    (ck / "ckpt-00000099.tmp" / "index.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
    assert checkpoint.candidates(str(ck))[0] == good
    path, data = checkpoint.load_newest(str(ck))
    assert path == good and data["step"] == 2


def test_sigkill_during_checkpoint_writes_never_corrupts_the_newest(tmp_path):
    """A process writing large checkpoints is killed at several moments of a save (after it reports 1, 2
    and 3 finished saves, at once or a little later); whatever it leaves, the newest complete checkpoint
    loads and belongs to a step that was fully written, no older than the last one reported."""
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, numpy as np\n"
        "from lbannpy import checkpoint\n"
        "from lbannpy.comm import SingleCommunicator\n"
        "from lbannpy.layers.param import Param\n"
        "from lbannpy.optim import SGD\n"
        "from lbannpy.dist import Distribution\n"
        "d = Distribution.whole(2, 1)\n"
        "w = np.zeros((1024, 4096))\n"
        "p = Param('w', w.shape, ((0, 1024), (0, 4096)), w, w.copy(), d, ())\n"
        "opt = SGD([p], 0.1, momentum=0.9)\n"
        "opt.state['w']['momentum'] = w.copy()\n"
        "comm = SingleCommunicator()\n"
        "for step in range(1, 1000):\n"
        "    p.value[...] = step\n"
        "    checkpoint.save(comm, sys.argv[1], step, [p], opt, {'step': step})\n"
        "    print(step, flush=True)\n")
    from lbannpy import checkpoint

    ck = tmp_path / "ck"
    for saves, pause in ((1, 0.0), (2, 0.02), (3, 0.06)):
        proc = subprocess.Popen([PY, str(script), str(ck)], env=ENV, stdout=subprocess.PIPE, text=True)
        reported = [int(line) for line, _ in zip(proc.stdout, range(saves))]
        time.sleep(pause)  # where in the next save the kill lands (no duration is asserted)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert reported == list(range(1, saves + 1)), f"the writer ended after reporting {reported}"
        path, data = checkpoint.load_newest(str(ck))
        assert path is not None, f"no complete checkpoint after {saves} reported saves"
        w = data["tensors"]["params/w"]
        assert data["step"] == data["meta"]["step"] and np.all(w == data["step"]), path
        assert data["step"] >= saves, (path, data["step"], saves)


@pytest.mark.parametrize("machine", ["p100", "slow-compute"])
def test_strategy_auto_runs_the_selector_at_start_up(work, machine):
    """strategy: auto plans at start-up and the run uses the plan. On the P100 preset this tiny net is
    cheapest replicated (microseconds of compute, no communication); on a machine whose compute is slow
    next to its links, splitting pays, so the run must split some layer."""
    if machine == "slow-compute":
        tree = yaml.safe_load((REPO / "src" / "machines" / "lassen.yaml").read_text())
        tree["name"] = machine
        tree["compute"] = {"gamma_s_per_flop": 1e-6}  # 1 MFLOP/s: compute dominates every choice
        path = work / "slow-compute.yaml"
        path.write_text(yaml.safe_dump(tree))
        machine = str(path)
    tag = f"auto-{Path(machine).stem}"
    cfg = spec(work, "cls", 2, {"strategy": "auto", "machine": machine}, tag=tag)
    p = train(2, cfg)
    assert "strategy auto on 2 rank(s)" in p.stderr
    summary = json.loads((work / tag / "out" / "summary.json").read_text())
    assert set(summary["distributions"]) == {layer["name"] for layer in CLS_LAYERS}
    if Path(machine).stem == "slow-compute":
        assert any(d != "1" and not d.startswith("r") for d in summary["distributions"].values()), summary


COMM_MODES = [
    ("blocking", {"overlap": False}),
    ("buckets-tiny", {"overlap": True, "bucket_mb": 0.001, "first_bucket_mb": 0.0005}),
    ("buckets-default", {"overlap": True}),
    ("two-chunk-k2", {"overlap": True, "chunks": {"k": 2}}),
    ("replicate-fc-1", {"overlap": True, "replicate_fc": 1}),
    ("replicate-fc-2", {"overlap": True, "bucket_mb": 0.001, "first_bucket_mb": 0.0005, "replicate_fc": 2}),
]


def assert_hidden_fraction_from_its_parts(summary: dict, rows: list[dict]):
    """The summary's hidden fraction is the run's hidden communication time over its communication time,
    summed from the logged rows (not an average of fractions), and each row's hidden time is its fraction
    of its communication time."""
    comm = [float(r["comm_time_s"]) for r in rows]
    hidden = [float(r["hidden_comm_s"]) for r in rows]
    fractions = [float(r["hidden_comm_fraction"]) for r in rows]
    assert len(rows) == summary["steps"] and all(c > 0 for c in comm), rows
    for h, c, f in zip(hidden, comm, fractions):
        assert h == pytest.approx(f * c, rel=1e-12, abs=1e-15), (h, c, f)
    assert summary["hidden_comm_fraction"] == pytest.approx(sum(hidden) / sum(comm), rel=1e-12, abs=1e-15)


@pytest.fixture(scope="module")
def sync_ref(work):
    """The final weights of the single-rank 3-step run that every gradient sync mode must end with (one
    run for all the rank counts: it does not depend on them)."""
    train(1, spec(work, "cls", 3, {}, tag="sync-ref"))
    return final_params(work / "sync-ref" / "ckpt")


@pytest.mark.parametrize("ranks,parallel", [
    (2, {"default": {"n": 2}}),
    (2, {"default": {"h": 2}, "layers": {"f1": {"c": 2}, "f2": {"c": 2}}}),
    (4, {"default": {"n": 2, "h": 2}, "layers": {"f1": {"n": 2, "c": 2}, "f2": {"n": 4}}}),
], ids=["2-sample", "2-spatial-modelparallel-fc", "4-hybrid-1.5d-fc"])
def test_gradient_sync_modes_give_the_same_weights(work, sync_ref, ranks, parallel, request):
    """Blocking sync, overlapped buckets of several sizes and the two-chunk mode end with the weights of
    the single-rank run (float64, 1e-10); the summary reports buckets and the hidden fraction."""
    want = sync_ref
    for name, comm in COMM_MODES:
        # a run directory per case and mode: a fresh run refuses one holding another run's checkpoints
        tag = f"sync-{request.node.callspec.id}-{name}"
        train(ranks, spec(work, "cls", 3, parallel, tag=tag, comm=comm))
        assert_same_weights(final_params(work / tag / "ckpt"), want, 1e-10, f"{name} on {ranks} ranks")
        summary = json.loads((work / tag / "out" / "summary.json").read_text())
        assert summary["buckets"], summary
        assert_hidden_fraction_from_its_parts(summary, metrics(work / tag / "out"))
        if name == "buckets-tiny":
            assert len(summary["buckets"]) > 2, summary["buckets"]
        if name == "two-chunk-k2":
            first = summary["buckets"][0]["params"]
            assert {p.split(".")[0] for p in first} <= {"f1", "f2", "r3"}, first
        if name.startswith("replicate-fc-"):  # no allreduce for them: gathered, computed whole, applied late
            f = int(name[-1])
            in_buckets = {p.split(".")[0] for b in summary["buckets"] for p in b["params"]}
            assert not in_buckets & set(["f1", "f2"][:f]), summary["buckets"]
            assert all("replicated_grad" in summary["layers"][n] for n in ["f1", "f2"][:f]), summary["layers"]


def test_replicated_fc_with_adam_and_a_schedule_equals_single_rank(work):
    """The late update of replicated layers uses the learning rate and Adam moments of its own step."""
    opt = {"type": "adam", "lr": 0.01, "schedule": {"type": "cosine", "warmup_steps": 2}}
    runs = {}
    for ranks, comm in ((1, {}), (2, {"replicate_fc": 2}), (4, {"replicate_fc": 1})):
        tag = f"rep-adam-{ranks}"
        cfg = spec(work, "cls", 4, {"default": {"n": ranks}} if ranks > 1 else {}, tag=tag, comm=comm)
        text = yaml.safe_load((work / f"{tag}.yaml").read_text())
        text["optimizer"] = opt
        (work / f"{tag}.yaml").write_text(yaml.safe_dump(text))
        sh([PY, "-m", "lbannpy.config", "build", str(work / f"{tag}.yaml"), "-o", str(cfg)])
        train(ranks, cfg)
        runs[ranks] = final_params(work / tag / "ckpt")
    assert_same_weights(runs[2], runs[1], 1e-10, "adam, replicate_fc=2 on 2 ranks")
    assert_same_weights(runs[4], runs[1], 1e-10, "adam, replicate_fc=1 on 4 ranks")


def test_replicate_fc_beyond_the_fc_layers_is_refused(work):
    cfg = spec(work, "cls", 1, {"default": {"n": 2}}, tag="rep-bad", comm={"replicate_fc": 3})
    p = train(2, cfg, check=False)
    assert p.returncode != 0 and "comm.replicate_fc = 3 but the model has 2 fully-connected" in p.stderr, \
        p.stderr


def test_trace_shows_bucket_reductions_during_backprop(work):
    """--trace on 2 ranks: bucket reductions on their own thread track overlap the backward of earlier
    layers, and hidden_comm_fraction agrees with the fraction read off the trace."""
    cfg = spec(work, "cls", 4, {"default": {"n": 2}}, tag="trace",
               comm={"overlap": True, "bucket_mb": 0.002, "first_bucket_mb": 0.001})
    train(2, cfg, "--trace")
    out = work / "trace" / "out"
    summary = json.loads((out / "summary.json").read_text())
    for rank in range(2):
        events = json.loads((out / f"trace-rank{rank}.json").read_text())["traceEvents"]
        names = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert "gradient communication" in names
        buckets = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 2]
        bps = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e["ph"] == "X" and e["tid"] == 0 and e["name"].endswith("/bp")]
        assert len(buckets) >= 4 * 2 and bps
        overlapped = [b for b in buckets if any(s < b[1] and b[0] < e for s, e, _ in bps)]
        assert overlapped, "no bucket reduction ran during backprop"
    from lbannpy.comm.overlap import hidden_fraction

    # rank 0's trace against rank 0's summary (written by rank 0): the bucket reductions against the
    # backward spans, over the whole run; the per-layer backward events lie inside those spans
    events = json.loads((out / "trace-rank0.json").read_text())["traceEvents"]
    buckets = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 2]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 0
             and e["name"] == "backward"]
    bps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 0
           and e["name"].endswith("/bp")]
    assert len(spans) == summary["steps"]
    assert all(any(s - 1e-3 <= a and b <= e + 1e-3 for s, e in spans) for a, b in bps)  # µs, round-off
    from_trace = hidden_fraction(buckets, spans)
    assert abs(from_trace - summary["hidden_comm_fraction"]) <= 0.01, (from_trace,
                                                                      summary["hidden_comm_fraction"])


INJECT = """
import sys
from lbannpy import train as T

step, evaluate = T.Trainer.train_step, T.Trainer.evaluate

def train_step(self):  # 100 s more of c1 forward ("fp") in the run's first step
    first = self.step == 0
    row = step(self)
    if first:
        self.timer.totals[("c1", "fp")] += 100.0
    return row

def evaluate_(self):  # and 1000 s in every evaluation pass
    self.timer.totals[("c1", "fp")] = self.timer.totals.get(("c1", "fp"), 0.0) + 1000.0
    return evaluate(self)

T.Trainer.train_step, T.Trainer.evaluate = train_step, evaluate_
sys.exit(T.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("steps", [4, 1])
def test_summary_layer_times_leave_out_warmup_and_evaluation(work, steps):
    """summary.json's per-layer times are means over the training steps after the first: what evaluation
    and the first step (allocations, workspaces) add is left out. With one step there is nothing else to
    time, so that step counts (the control: the injected time shows up)."""
    tag = f"warm-{steps}"
    cfg = spec(work, "cls", steps, {}, tag=tag)
    script = work / "inject.py"
    script.write_text(INJECT)
    sh([PY, str(script), str(cfg), "--quiet", "--set", "data.validation.fraction=0.25",
        "--set", "trainer.eval_every=2"])
    summary = json.loads((work / tag / "out" / "summary.json").read_text())
    fwd = summary["layers"]["c1"]["fp"]
    assert summary["validation"], "the run must have evaluated"
    if steps == 1:
        assert 100.0 <= fwd < 101.0, summary["layers"]["c1"]
    else:
        assert 0.0 < fwd < 1.0, summary["layers"]["c1"]
