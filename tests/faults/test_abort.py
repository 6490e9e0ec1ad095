"""Abort discipline: an exception or a signal on any one rank (or a signal to the launcher) ends every rank
within seconds, with one line on stderr and no Python traceback there (it goes to the run directory)."""
from __future__ import annotations


import pytest

from lbannpy import checkpoint

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


@pytest.fixture()
def long_run(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 20})
    return tmp_path, cfg


@pytest.mark.parametrize("sig,target,ranks", [
    ("SIGINT", 1, 2),            # Ctrl-C reaching one rank (srun forwards it to one task)
    ("SIGINT", "launcher", 2),   # Ctrl-C at the terminal
    ("SIGINT", 3, 4),
    ("SIGINT", "launcher", 4),
    ("SIGHUP", 0, 2),            # the terminal went away
])
def test_signal_to_one_rank_ends_every_rank(long_run, sig, target, ranks):
    tmp, cfg = long_run
    job = util.start(tmp, cfg, ranks=ranks)
    # liveness: every rank ends before the harness's own timeout after the signal (no duration asserted)
    util.signal_when(job, lambda: checkpoint.candidates(str(tmp / "ck")), "the first checkpoint", target, sig)
    job.assert_every_rank_failed()
    job.assert_no_traceback()
    assert f"{sig} received" in job.err, job.err[-2000:]
    # what was complete stays complete: the checkpoints written before the signal load
    path, data = util.newest_checkpoint(tmp / "ck")
    assert path is not None and data["step"] % 20 == 0


def test_signal_during_setup_ends_every_rank(tmp_path):
    """Set-up is interruptible too: a rank blocked in a collective of set-up (here: waiting for a rank that
    sits in a long read) still ends when one rank gets SIGINT."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path)
    job = util.start(tmp_path, cfg, ranks=2, env={"FAULT_SETUP_SLEEP": "1:60"})
    util.signal_when(job, lambda: (tmp_path / "setup.1").exists(), "rank 1 in set-up", 0, "SIGINT")
    job.assert_every_rank_failed()
    job.assert_no_traceback()


def test_exception_on_one_rank_one_line_traceback_in_run_dir(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120})
    job = util.run(tmp_path, cfg, ranks=2, env={"FAULT_RAISE": "1:3"}, timeout=60)
    job.assert_every_rank_failed()
    job.assert_no_traceback()
    log = tmp_path / "out" / "failure-rank1.log"
    line = [ln for ln in job.err.splitlines() if "injected fault" in ln]
    want = f"lbannpy: rank 1 of 2 failed: RuntimeError: injected fault at step 3 (traceback in {log})"
    assert line == [want], job.err[-2000:]
    assert "Traceback" in log.read_text() and "train_step" in log.read_text()


def test_gpu_device_without_cupy_is_one_line(tmp_path):
    """A configuration this machine cannot run: exit 2 on every rank, one line naming the key (#44)."""
    pytest.importorskip("mpi4py")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, runtime={"device": "gpu"})
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    job.assert_every_rank_failed()
    job.assert_no_traceback()
    assert job.rank_codes() == [2, 2] and job.proc.returncode == 2, (job.rank_codes(), job.err[-2000:])
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "CuPy" in lines[0] and "runtime.device: cpu" in lines[0], job.err[-2000:]
