"""A pre-emption as SLURM delivers it: SIGTERM to every task, then (the rendered job's trap forwarding TERM to
``srun``) SIGTERM again through the launcher a moment later. The second signal comes while the checkpoint of
the first is being written; it must not abandon that checkpoint: every rank exits 4 with the stop line, the
checkpoint of the step the ranks stopped at is complete, and ``--resume`` continues from it."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import time

import pytest
import yaml

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


# FAULT_CKPT_HANG: every checkpoint write after the first steps hangs (a stuck file system)
HANG = """
import os, time
if os.environ.get("FAULT_CKPT_HANG"):
    from lbannpy.training.loop import Trainer
    def save_checkpoint(self, *a, **k):
        time.sleep(3600)
    Trainer.save_checkpoint = save_checkpoint
"""


def _start_hanging(tmp, cfg: dict, env: dict) -> util.Job:
    """:func:`util.start` with checkpoint writes that never finish."""
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    (tmp / "rank.py").write_text(HANG + util.RANK)
    argv = [util.MPIEXEC, "-n", "2", util.PY, str(tmp / "rank.py"), str(tmp / "cfg.yaml"), "--quiet"]
    proc = subprocess.Popen(argv, cwd=tmp, env=dict(util.ENV, FAULT_DIR=str(tmp), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return util.Job(tmp, 2, proc, time.monotonic())


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its launcher, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _slurm_preemption(job: util.Job, ready, delay: float) -> bool:
    """Once ``ready()``: SIGTERM to every rank, ``delay`` s later SIGTERM to the launcher; wait for the job
    (liveness: it must end before the harness's timeout). Leaves nothing running. True when some rank was
    still running as the second signal reached the launcher (the case this test is about; a rank that was
    already gone cannot lose its checkpoint to it, and the launcher's own status is then the signal's)."""
    try:
        pids = job.pids()
        util.wait_for(ready, 90, "some steps")
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        time.sleep(delay)
        # a rank still inside train's main (no exit status written yet); one that has returned, even if its
        # process is still finalizing or not yet reaped, has nothing left to lose to the second signal
        during = any(_alive(pid) and not (job.tmp / f"rc.{r}").exists() for r, pid in enumerate(pids))
        try:
            os.kill(job.proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # the job already ended: the second signal came too late to matter
            during = False
        job.wait(60)
        return during
    finally:
        util.kill(job)


@pytest.mark.parametrize("delay", [0.1, 0.3, 0.5])
def test_second_sigterm_within_the_grace_keeps_the_checkpoint(tmp_path, delay):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 1000})
    job = util.start(tmp_path, cfg, ranks=2)
    metrics = tmp_path / "out" / "metrics.csv"
    during = _slurm_preemption(job, lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 3,
                               delay)
    assert job.rank_codes() == [4, 4], (job.rank_codes(), job.err[-2000:])
    assert job.proc.returncode == 4 or not during, (job.proc.returncode, job.err[-2000:])
    job.assert_no_traceback()
    assert "without a checkpoint" not in job.err, job.err[-2000:]
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and lines[0].startswith("lbannpy.train: stopped by SIGTERM after step "), job.err
    step = int(lines[0].split("after step ")[1].split(";")[0])
    path, data = util.newest_checkpoint(tmp_path / "ck")
    assert data["step"] == step, (path, data["step"], step)
    # the requeued job: --resume continues from that checkpoint
    cfg["trainer"]["steps"] = step + 2
    job = util.run(tmp_path, cfg, ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    assert f"resumed from step {step} " in job.out, job.out
    with open(metrics) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, step + 3))


def test_a_signal_after_the_grace_still_ends_the_job(tmp_path):
    """The grace is the bound: a stop that cannot finish (a checkpoint write that hangs) is ended after
    ``LBANNPY_STOP_GRACE_S`` whatever signals came meanwhile, naming the grace, exit 5 on every rank."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 1000})
    env = {"LBANNPY_STOP_GRACE_S": "2", "FAULT_CKPT_HANG": "1"}
    job = _start_hanging(tmp_path, cfg, env)
    metrics = tmp_path / "out" / "metrics.csv"
    _slurm_preemption(job, lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 3, 0.2)
    assert job.proc.returncode == 5, (job.rank_codes(), job.err[-2000:])
    assert "were not written within 2 s" in job.err, job.err[-2000:]
