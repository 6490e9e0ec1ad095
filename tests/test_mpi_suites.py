"""Launch the MPI test suites (tests/mpi) under mpiexec, one pytest test per rank count, and check that
failures end MPI jobs instead of hanging them.

``LBANNPY_MPI_PYTEST_ARGS`` passes extra arguments to the inner pytest (e.g. ``-k halo``);
``LBANNPY_MPI_SUITE_TIMEOUT`` bounds each mpiexec run (seconds, default 420).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
MPIEXEC = shutil.which("mpiexec")
SUITE_TIMEOUT = float(os.environ.get("LBANNPY_MPI_SUITE_TIMEOUT", "420"))  # seconds per mpiexec run

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")


def mpi_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(LBANNPY_MPI_TESTS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_mpi(nprocs: int, argv: list[str], env: dict, cwd: Path, timeout: float):
    """``mpiexec -n nprocs python argv...``; returns (returncode or None on timeout, output, seconds)."""
    cmd = [MPIEXEC, "-n", str(nprocs), sys.executable, *argv]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, time.monotonic() - start
    return proc.returncode, proc.stdout, time.monotonic() - start


def tail(text: str, n: int = 12000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


@dataclass(frozen=True)
class Suite:
    nprocs: int
    marker: str = ""  # restrict to tests with this marker

    @property
    def id(self) -> str:
        return f"np{self.nprocs}" + (f"-{self.marker}" if self.marker else "")


SUITES = [Suite(1), Suite(2), Suite(3), Suite(4), Suite(8, "ranks8")]


@needs_mpiexec
@pytest.mark.timeout(SUITE_TIMEOUT + 60)
@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.id)
def test_mpi_suite(suite, tmp_path):
    argv = ["-m", "mpi4py", "-m", "pytest", str(TESTS / "mpi"), "-q", "--color=no", "-p", "no:cacheprovider",
            "-o", "console_output_style=classic"]
    if suite.marker:
        argv += ["-m", suite.marker]
    argv += shlex.split(os.environ.get("LBANNPY_MPI_PYTEST_ARGS", ""))
    logdir = tmp_path / "ranks"
    code, out, secs = run_mpi(suite.nprocs, argv, mpi_env(LBANNPY_MPI_LOGDIR=logdir), TESTS.parent,
                              SUITE_TIMEOUT)
    if code == 5:
        pytest.fail(f"no MPI tests were selected for {suite.id}: a suite that runs nothing proves nothing")
    if code != 0:
        logs = ""
        for log in sorted(logdir.glob("rank*.log")):
            logs += f"\n===== {log.name} =====\n{tail(log.read_text(errors='replace'), 4000)}"
        what = "timed out" if code is None else f"exited with {code}"
        pytest.fail(f"MPI suite {suite.id} {what} after {secs:.1f} s\n{tail(out)}{logs}", pytrace=False)


# -------------------------------------------------------------------------------------------------------
# failure behaviour: the harness and the Runtime end jobs instead of hanging them

HARNESS_TESTS = """
import numpy as np

def test_fails_on_last_rank_only(comm):
    assert comm.rank != comm.size - 1, "deliberate failure on the last rank"

def test_fine(comm):
    comm.barrier()
"""

HANG_TESTS = """
import numpy as np

def test_fails_then_collective(comm):
    assert comm.rank != comm.size - 1, "deliberate failure before a collective"
    comm.allreduce(np.ones(1))
"""


def harness_dir(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "suite"
    d.mkdir()
    shutil.copy(TESTS / "mpi" / "conftest.py", d / "conftest.py")
    (d / "test_case.py").write_text(textwrap.dedent(body))
    return d


@needs_mpiexec
def test_harness_fails_every_rank_when_one_fails(tmp_path):
    d = harness_dir(tmp_path, HARNESS_TESTS)
    code, out, secs = run_mpi(3, ["-m", "mpi4py", "-m", "pytest", str(d), "-q", "--color=no", "-p",
                                  "no:cacheprovider"], mpi_env(), d, 120)
    assert code not in (0, None), f"a test failing on rank 2 must fail the job (code {code}):\n{tail(out)}"
    assert "failed on rank(s) [2] of 3" in out, f"rank 0 must report rank 2's failure:\n{tail(out)}"
    assert "deliberate failure on the last rank" in out, tail(out)
    assert "1 failed, 1 passed" in out, f"the test after the failure must still run:\n{tail(out)}"


@needs_mpiexec
def test_harness_aborts_when_a_failed_rank_skips_a_collective(tmp_path):
    d = harness_dir(tmp_path, HANG_TESTS)
    code, out, secs = run_mpi(3, ["-m", "mpi4py", "-m", "pytest", str(d), "-q", "--color=no", "-p",
                                  "no:cacheprovider"], mpi_env(LBANNPY_MPI_SKEW_TIMEOUT=3), d, 90)
    assert code is not None, f"the job hung (killed after {secs:.0f} s):\n{tail(out)}"
    # ended by the outcome agreement's abort (LBANNPY_MPI_SKEW_TIMEOUT=3), not by the per-test timeout
    assert code != 0 and "a rank is stuck" in out and "Aborting the MPI job" in out, \
        f"code {code} after {secs:.1f} s:\n{tail(out)}"
    assert "Timeout" not in out, f"the per-test timeout ended the job, not the agreement:\n{tail(out)}"
    assert "[rank 2 of 3]" in out and "deliberate failure before a collective" in out, tail(out)


RUNTIME_SCRIPT = """
import sys
from lbannpy.comm import Runtime

with Runtime(backend="mpi") as rt:
    if rt.rank == 1 and sys.argv[1] == "fail":
        raise ValueError("deliberate failure on rank 1")
    rt.world.barrier()  # rank 0 waits here for a rank that never comes
print("clean exit", rt.rank)
"""


@needs_mpiexec
@pytest.mark.parametrize("mode", ["fail", "ok"])
def test_runtime_exception_ends_every_rank(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(RUNTIME_SCRIPT)
    code, out, secs = run_mpi(2, [str(script), mode], mpi_env(), tmp_path, 60)
    assert code is not None, f"job hung for {secs:.0f} s:\n{out}"
    if mode == "ok":  # negative control: the same job without the exception exits cleanly
        assert code == 0 and out.count("clean exit") == 2, f"code {code}:\n{out}"
        return
    assert code != 0, f"job with a failing rank exited 0:\n{out}"
    # ended by the failing rank's MPI_Abort (the launcher's report of it), not by a timeout or a watchdog
    assert "MPI_Abort(MPI_COMM_WORLD, 1)" in out, out
    assert "lbannpy: rank 1 of 2 failed: ValueError: deliberate failure on rank 1" in out, out
    # once: the failing rank must not go on (and print it again) after MPI_Abort hands over to the launcher
    assert out.count("Traceback") == 1 and "clean exit" not in out, out
