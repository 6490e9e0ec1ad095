"""A rendered job that is signalled mid-run checkpoints, requeues itself and resumes, on the one-node SLURM
(marked ``slurm``; the cluster comes from tests/test_slurm.py's fixture, with its skip and failure rules).

The signal is the one ``--signal=B:USR1@120`` sends the batch shell before the time limit (``scancel
--batch --signal=USR1``); the reference is the same job left alone. SLURM holds a requeued job for a while
before it may start again; the test lifts that hold (``scontrol update StartTime=now``) instead of
waiting it out.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_slurm import FLAKY_MPI_INIT, JOBS, TERMINAL, jobcomp_line
from test_slurm import cluster  # noqa: F401  (the fixture)

# The job runs three srun steps (a reference run, the signalled run, the requeued run), and srun's PMI2 with
# the PyPI MPICH fails now and then on this kind of machine at MPI_Init or at the end of a step ("failed to
# send temp kvs to compute nodes"; an upstream MPICH/UCX and SLURM pmi2 problem, not lbannpy's), often
# enough that a CI run would fail on it more than on lbannpy: opt in with LBANNPY_SLURM_REQUEUE=1
OPT_IN = pytest.mark.skipif(os.environ.get("LBANNPY_SLURM_REQUEUE") != "1",
                            reason="srun's PMI2 fails now and then here (see the comment); "
                                   "LBANNPY_SLURM_REQUEUE=1 runs it")
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500), FLAKY_MPI_INIT, OPT_IN]

STEPS = 600


def losses(run: Path) -> list[tuple[int, float]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f)]


def show(c, job_id: str) -> str:
    return c.cmd("scontrol", "show", "job", "-o", job_id).stdout


def field(record: str, key: str) -> str:
    m = re.search(rf"\b{key}=(\S+)", record)
    return m.group(1) if m else ""


def sbatch(c, tmp_path: Path, config: Path, run: Path) -> str:
    env = c.env(LBANNPY_RUN_DIR=str(run))
    proc = subprocess.run(["sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={run}.out",
                           "--time=00:20:00", str(JOBS / "resnet50.sbatch"), str(config)],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_end(c, job_id: str, timeout: float, release_requeued: bool = False) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = show(c, job_id)
        state = field(record, "JobState")
        if state in TERMINAL:
            return record
        if release_requeued and state == "PENDING" and field(record, "Reason") == "BeginTime":
            c.cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        time.sleep(0.5)
    c.cmd("scancel", job_id)
    pytest.fail(f"job {job_id} did not end in {timeout} s: {show(c, job_id)}")


def test_signalled_job_requeues_resumes_and_ends_with_the_losses_of_an_uninterrupted_run(
        cluster, tmp_path):  # noqa: F811  (the fixture)
    py = sys.executable
    subprocess.run([py, "-m", "lbannpy.data", "mesh", "--size", "64", "--samples", "8", "-o",
                    str(tmp_path / "mesh.h5"), "-q"], check=True, timeout=120, capture_output=True)
    subprocess.run([py, "-m", "lbannpy.config", "zoo", "mesh_tiny", "-o", str(tmp_path / "spec.yaml"),
                    "--batch-size", "2"], check=True, timeout=120, capture_output=True)
    config = tmp_path / "config.h5"
    subprocess.run([py, "-m", "lbannpy.config", "build", str(tmp_path / "spec.yaml"), "-o", str(config),
                    "--set", f"data.train.path={tmp_path / 'mesh.h5'}", "--set", f"trainer.steps={STEPS}"],
                   check=True, timeout=120, capture_output=True)

    ref = tmp_path / "reference"
    record = wait_end(cluster, sbatch(cluster, tmp_path, config, ref), 600)
    assert (field(record, "JobState"), field(record, "Restarts")) == ("COMPLETED", "0"), record
    want = losses(ref)
    assert [s for s, _ in want] == list(range(1, STEPS + 1))

    run = tmp_path / "signalled"
    job = sbatch(cluster, tmp_path, config, run)
    deadline = time.monotonic() + 300
    while not ((run / "metrics.csv").is_file() and len(losses(run)) >= 10):
        assert time.monotonic() < deadline, f"no 10 steps in 300 s: {show(cluster, job)}"
        record = show(cluster, job)
        assert field(record, "JobState") in ("PENDING", "RUNNING", "CONFIGURING"), record
        time.sleep(0.2)
    sig = cluster.cmd("scancel", "--batch", "--signal=USR1", job)
    assert sig.returncode == 0, sig.stderr
    record = wait_end(cluster, job, 900, release_requeued=True)
    log = Path(f"{run}.out").read_text()
    print(log)
    assert (field(record, "JobState"), field(record, "ExitCode")) == ("COMPLETED", "0:0"), record + log
    assert field(record, "Restarts") == "1", record  # requeued once, by the job itself
    assert "JobState=COMPLETED" in jobcomp_line(cluster, job)
    assert "got SIGUSR1" in log and "requeued, the next start resumes" in log, log
    assert "resuming from the newest checkpoint" in log and "(start 1)" in log, log
    stopped = int(re.search(r"stopped by SIGUSR1 after step (\d+)", log).group(1))
    assert 10 <= stopped < STEPS, stopped  # it really stopped mid-run
    got = losses(run)
    assert [s for s, _ in got] == [s for s, _ in want], "the steps of the resumed run"
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6, abs=0), \
        [(s, a, b) for (s, a), (_, b) in zip(got, want) if abs(a - b) > 1e-6 * abs(b)][:5]
