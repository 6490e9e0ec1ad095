"""SIGTERM and SIGUSR1 (SLURM's time-limit and preemption signals): every rank finishes the current step, the
ranks agree on the step, a checkpoint of that step and the metrics so far are written, every rank exits 4,
and ``--resume`` continues from there."""
from __future__ import annotations

import csv
import json

import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


@pytest.mark.parametrize("sig,target,ranks", [("SIGTERM", 1, 2), ("SIGUSR1", "launcher", 2),
                                              ("SIGTERM", 2, 4), ("SIGTERM", "launcher", 4)])
def test_stop_signal_leaves_a_resumable_checkpoint_and_the_metrics(tmp_path, sig, target, ranks):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 1000})
    job = util.start(tmp_path, cfg, ranks=ranks)
    metrics = tmp_path / "out" / "metrics.csv"
    util.signal_when(job, lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 3,
                     "some steps", target, sig)
    assert job.rank_codes() == [4] * ranks and job.proc.returncode == 4, (job.rank_codes(), job.err[-2000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and lines[0].startswith(f"lbannpy.train: stopped by {sig} after step "), job.err
    step = int(lines[0].split("after step ")[1].split(";")[0])
    assert step >= 1
    # the checkpoint of the step the ranks stopped at is the newest
    path, data = util.newest_checkpoint(tmp_path / "ck")
    assert data["step"] == step, (path, data["step"], step)
    # the metrics so far
    with open(tmp_path / "out" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["step"]) == step and len(rows) == step
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == step
    # resume: two more steps from there
    cfg["trainer"]["steps"] = step + 2
    job = util.run(tmp_path, cfg, ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    assert f"{step + 2} steps" in job.out
    with open(tmp_path / "out" / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, step + 3))
