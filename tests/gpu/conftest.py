"""The GPU tiers: every test in this directory is marked ``gpu`` and runs its ranks under ``mpiexec``.

Where they run
--------------
* Default (every ``python -m pytest`` and CI): on the strict CUDA/CuPy/NCCL stand-in in
  ``tests/gpu_standin``, which is put first on the workers' ``PYTHONPATH`` so that ``import cupy`` finds it
  (nowhere else in the suite is it importable). MPICH gives each rank ``MPI_LOCALRANKID``, so rank r is on
  device r.
* ``LBANNPY_GPU=real python -m pytest -m gpu``: the same tiers on the installed CuPy and NCCL. Without a GPU
  (no CuPy, no device, or fewer devices than a test's ranks) the tier is skipped with one line saying why.

Workers print one ``RESULT {json}`` line per rank; :func:`gpu_launch` returns them sorted by rank and fails
with the workers' output when the job fails.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "gpu_standin"
MPIEXEC = shutil.which("mpiexec")
REAL = os.environ.get("LBANNPY_GPU", "") == "real"
_HERE = str(Path(__file__).resolve().parent)


def real_gpus() -> tuple[int, str]:
    """``(number of CUDA devices, why none)`` of the installed CuPy, asked in a child process (an import
    of CuPy without a driver must not touch this one)."""
    code = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return 0, "asking CuPy for its devices timed out"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return 0, f"CuPy cannot see a GPU ({last})"
    n = int(p.stdout.split()[-1])
    return n, "" if n else "CuPy sees no CUDA device"


def pytest_collection_modifyitems(config, items):
    mine = [it for it in items if str(it.fspath).startswith(_HERE + os.sep)]
    for it in mine:
        it.add_marker(pytest.mark.gpu)
    if not REAL or not mine:
        return
    n, why = real_gpus()
    if n:
        config._lbannpy_real_gpus = n
        return
    line = f"GPU tiers skipped: LBANNPY_GPU=real but {why}"
    if len(mine) == len(items) or (config.option.markexpr or "").strip() == "gpu":
        pytest.exit(line, returncode=0)
    skip = pytest.mark.skip(reason=line)
    for it in mine:
        it.add_marker(skip)


def worker_env(extra: dict | None = None) -> dict:
    """The environment of a worker job: one BLAS thread per rank, and the stand-in first on the path
    unless the real GPU tier was asked for."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    paths = [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    if not REAL:
        paths.insert(0, str(STANDIN))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra or {})
    return env


def results(proc: subprocess.CompletedProcess, ranks: int) -> list[dict]:
    assert proc.returncode == 0, (f"rc {proc.returncode}\nstdout:\n{proc.stdout[-5000:]}\n"
                                  f"stderr:\n{proc.stderr[-8000:]}")
    # ranks' lines can reach the launcher's stdout glued together: take every "RESULT {...}" anywhere
    dec, rows = json.JSONDecoder(), []
    for part in proc.stdout.split("RESULT ")[1:]:
        rows.append(dec.raw_decode(part)[0])
    assert len(rows) == ranks, f"{len(rows)} results from {ranks} ranks\n{proc.stdout[-3000:]}"
    return sorted(rows, key=lambda row: row["rank"])


def skip_unless_gpus(config, ranks: int) -> None:
    """On real GPUs (``LBANNPY_GPU=real``), skip a test whose job needs more GPUs than the node has (NCCL and
    the runtime give every rank its own device)."""
    have = getattr(config, "_lbannpy_real_gpus", None)
    if REAL and have is not None and have < ranks:
        pytest.skip(f"LBANNPY_GPU=real: {ranks} ranks need {ranks} GPUs, this node has {have}")


@pytest.fixture
def gpu_run(request):
    """``gpu_run(cmd, env=None, timeout=240, check=True)``: run a command (an ``mpiexec`` job) with the
    workers' environment (:func:`worker_env`); fails with its output when it fails and ``check``. A job of
    ``runtime.device=gpu`` on more ranks than the node has GPUs is skipped (:func:`skip_unless_gpus`)."""
    def go(cmd, env: dict | None = None, timeout: float = 240, check: bool = True):
        assert MPIEXEC, "mpiexec not found (pip install mpich)"
        words = [str(c) for c in cmd]
        if words[:1] == ["mpiexec"] and "-n" in words and "runtime.device=gpu" in words:
            skip_unless_gpus(request.config, int(words[words.index("-n") + 1]))
        if not REAL:
            assert (STANDIN / "cupy").is_dir(), f"the CUDA stand-in is missing: {STANDIN}/cupy"
        cmd = [MPIEXEC if c == "mpiexec" else str(c) for c in cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=worker_env(env),
                           cwd=str(ROOT))
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                                 f"{p.stderr[-5000:]}")
        return p

    return go


@pytest.fixture
def gpu_launch(request):
    """``gpu_launch(script, case, ranks, *args, env=None, timeout=240)``: run ``script case args`` under
    ``mpiexec -n ranks`` and return the per-rank results."""
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    if not REAL:
        assert (STANDIN / "cupy").is_dir(), f"the CUDA stand-in is missing: {STANDIN}/cupy"

    def launch(script, case: str, ranks: int, *args: str, env: dict | None = None, timeout: float = 240):
        skip_unless_gpus(request.config, ranks)
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(script), case, *map(str, args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=worker_env(env),
                              cwd=str(ROOT))
        return results(proc, ranks)

    return launch
