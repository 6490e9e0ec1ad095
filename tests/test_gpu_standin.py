"""The strict CuPy stand-in (tests/gpu_standin): its own checks, in subprocesses so that this process never
imports it as ``cupy``."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
STANDIN = TESTS / "gpu_standin"


def standin_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LBANNPY_STANDIN_DEVICES="4")
    env.update(extra)
    return env


def test_normal_run_does_not_see_the_standin():
    assert str(STANDIN) not in sys.path
    mod = sys.modules.get("cupy")
    assert mod is None or "gpu_standin" not in (getattr(mod, "__file__", "") or "")


def test_standin_checks():
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(STANDIN / "standin_checks.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]


def test_standin_kernels_and_the_batchnorm_gpu_path():
    """ElementwiseKernel/ReductionKernel bodies compiled for the host; batch-norm's kernels checked against
    the host's compiled ones and counted (tests/gpu_standin/standin_kernels_check.py)."""
    if shutil.which("g++") is None:  # the stand-in compiles kernel bodies with it; CI's machines have it
        pytest.fail("g++ not found: the CuPy stand-in compiles ElementwiseKernel bodies with it")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(STANDIN / "standin_kernels_check.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    passed = re.search(r"(\d+) passed", p.stdout)
    assert passed and int(passed.group(1)) >= 42, p.stdout[-2000:]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("ranks", [2, 3])
def test_standin_nccl_moves_bytes_over_mpi(ranks):
    p = subprocess.run([shutil.which("mpiexec"), "-n", str(ranks), sys.executable,
                        str(STANDIN / "standin_mpi_check.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    # ranks share the pipe, so lines may interleave: look for each rank's line anywhere
    assert sorted(re.findall(r"rank (\d+) of (\d+): standin nccl ok", out)) == \
        [(str(r), str(ranks)) for r in range(ranks)]
