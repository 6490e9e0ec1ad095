"""Failure behaviour of ``python -m lbannpy.train`` under ``mpiexec -n 2``.

Every malformed input stops every rank within seconds with a non-zero exit and a message naming the
problem (and no traceback: these are user errors). Killing one rank mid-step ends the whole job within
60 s, and the last checkpoint stays intact and resumable.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import h5py
import numpy as np
import pytest
import yaml

from lbannpy import checkpoint

MPIEXEC = shutil.which("mpiexec")
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

GOOD = {
    "model": {"name": "m", "input": {"channels": 3, "spatial": [8, 8]},
              "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                         {"name": "r1", "type": "relu"},
                         {"name": "f1", "type": "fc", "units": 2}],
              "loss": "cross_entropy"},
    "data": {"train": {"path": "data.h5"}},
    "trainer": {"batch_size": 4, "steps": 2},
    "optimizer": {"type": "sgd", "lr": 0.01},
}


def _set(tree, path, value):
    keys = path.split(".")
    for k in keys[:-1]:
        tree = tree[int(k)] if isinstance(tree, list) else tree.setdefault(k, {})
    if isinstance(tree, list):
        tree[int(keys[-1])] = value
    else:
        tree[keys[-1]] = value


@dataclass(frozen=True)
class Bad:
    name: str
    edits: tuple = ()        # (dotted key, value) applied to GOOD
    raw: str | None = None   # file content instead of a spec
    suffix: str = ".yaml"
    expect: str = ""         # words the message must contain (case-insensitive)
    args: tuple = ()


CASES = [
    Bad("bad-yaml", raw="model: {input: [unclosed\n", expect="yaml"),
    Bad("wrong-type", (("trainer.batch_size", "eight"),), expect="trainer.batch_size"),
    Bad("unknown-layer", (("model.layers.1.type", "relux"),), expect="relux"),
    Bad("unknown-key", (("trainer.bacth_size", 4),), expect="bacth_size"),
    Bad("missing-parent", (("model.layers.1.parents", ["nope"]),), expect="nope"),
    Bad("cycle", (("model.layers.0.parents", ["r1"]),), expect="cycle"),
    Bad("zero-size", (("model.layers.0.filters", 0),), expect="filters"),
    Bad("negative-size", (("model.input.spatial", [8, -8]),), expect="spatial"),
    Bad("missing-dataset-file", (("data.train.path", "absent.h5"),), expect="absent.h5"),
    Bad("wrong-dataset-shape", (("data.train.path", "wrong.h5"),), expect="wrong.h5"),
    Bad("missing-dataset-name", (("data.train.inputs", "images"),), expect="images"),
    Bad("non-dividing-distribution", (("parallel.default", {"h": 3}),), expect="3"),
    Bad("impossible-distribution", (("parallel.default", {"n": 2, "h": 2}),), expect="rank"),
    Bad("truncated-config", raw="TRUNCATED", suffix=".h5", expect="config"),
    Bad("garbage-config", raw="GARBAGE", suffix=".h5", expect="config"),
    Bad("garbage-checkpoint", args=("--resume",), raw="CKPT", expect="checkpoint"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(0)
    with h5py.File(d / "data.h5", "w") as f:
        f["inputs"] = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
        f["labels"] = rng.integers(0, 2, 16)
    with h5py.File(d / "wrong.h5", "w") as f:
        f["inputs"] = rng.standard_normal((16, 5, 8, 8)).astype(np.float32)
        f["labels"] = rng.integers(0, 2, 16)
    good = d / "good.yaml"
    good.write_text(yaml.safe_dump(GOOD))
    subprocess.run([PY, "-m", "lbannpy.config", "build", str(good), "-o", str(d / "good.h5")], check=True,
                   cwd=d, env=ENV, timeout=60)
    return d


def _prepare(case: Bad, d) -> str:
    path = d / f"{case.name}{case.suffix}"
    if case.raw == "TRUNCATED":
        data = (d / "good.h5").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case.raw == "GARBAGE":
        path.write_bytes(os.urandom(4096))
    elif case.raw == "CKPT":
        spec = yaml.safe_load(yaml.safe_dump(GOOD))
        ck = d / f"ck-{case.name}"
        ck.mkdir(exist_ok=True)
        (ck / "ckpt-00000002.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(2000))
        spec["checkpoint"] = {"dir": str(ck)}
        path.write_text(yaml.safe_dump(spec))
    elif case.raw is not None:
        path.write_text(case.raw)
    else:
        spec = yaml.safe_load(yaml.safe_dump(GOOD))
        for key, value in case.edits:
            _set(spec, key, value)
        path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_stops_every_rank_with_a_message(case, files):
    path = _prepare(case, files)
    # a rank left behind would hang the job: the timeout turns that into a failure
    p = subprocess.run([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.train", path, "--quiet", *case.args],
                       cwd=files, env=ENV, capture_output=True, text=True, timeout=90)
    err = p.stderr
    assert p.returncode != 0, f"exit 0 for {case.name}:\n{p.stdout}\n{err}"
    assert "error" in err.lower(), err
    assert case.expect.lower() in err.lower(), f"message does not name '{case.expect}':\n{err}"
    assert "Traceback" not in err, f"user error printed a traceback:\n{err}"


def _start_long_run(files, tmp_path, name: str, watchdog_s: float, every_steps: int, checkpoints: int):
    """Start a 2-rank run that would train for hours; return once ``checkpoints`` checkpoints exist.
    Returns (spec, config path, the mpiexec process, the two rank pids)."""
    spec = yaml.safe_load(yaml.safe_dump(GOOD))
    spec["data"]["train"]["path"] = str(files / "data.h5")
    spec["trainer"] = {"batch_size": 4, "steps": 100000, "watchdog_s": watchdog_s}
    spec["checkpoint"] = {"dir": str(tmp_path / "ck"), "every_steps": every_steps}
    spec["output"] = {"dir": str(tmp_path / "out")}
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(spec))
    job = subprocess.Popen([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.train", str(cfg), "--quiet"], env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(checkpoint.candidates(str(tmp_path / "ck"))) < checkpoints:
            time.sleep(0.2)
        assert len(checkpoint.candidates(str(tmp_path / "ck"))) >= checkpoints, "no checkpoints were written"
        pids = subprocess.run(["pgrep", "-f", f"lbannpy.train {cfg}"], capture_output=True,
                              text=True).stdout.split()
        ranks = sorted(int(p) for p in pids if int(p) != job.pid)
        assert len(ranks) == 2, f"rank processes not found: {pids}"
    except BaseException:
        job.kill()
        job.wait()
        raise
    return spec, cfg, job, ranks


def test_killed_rank_ends_the_job_and_checkpoint_stays_resumable(files, tmp_path):
    spec, cfg, job, ranks = _start_long_run(files, tmp_path, "long", watchdog_s=30, every_steps=5,
                                            checkpoints=2)
    try:
        os.kill(ranks[-1], signal.SIGKILL)  # one rank dies mid-step
        job.wait(timeout=90)  # the survivor stuck in a collective would hang: a timeout fails the test
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    from lbannpy import checkpoint

    path, data = checkpoint.load_newest(str(tmp_path / "ck"))
    assert data["step"] % 5 == 0
    spec["trainer"]["steps"] = data["step"] + 2
    cfg.write_text(yaml.safe_dump(spec))
    p = subprocess.run([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.train", str(cfg), "--quiet", "--resume"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{data['step'] + 2} steps" in p.stdout


def test_watchdog_names_the_operation_a_stuck_rank_waits_in(files, tmp_path):
    """One rank is frozen (SIGSTOP) mid-run: the other waits in a collective that never completes; its
    watchdog prints what it was waiting in and aborts the job."""
    _, _, job, ranks = _start_long_run(files, tmp_path, "wd", watchdog_s=3, every_steps=20, checkpoints=1)
    frozen = ranks[-1]
    try:
        os.kill(frozen, signal.SIGSTOP)
        _, err = job.communicate(timeout=60)  # without the watchdog the job hangs: a timeout fails it
    finally:
        try:
            os.kill(frozen, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert "no progress" in err and "waiting in:" in err, err[-3000:]
