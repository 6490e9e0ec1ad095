"""The GPU tiers: every test in this directory is marked ``gpu`` and runs its ranks under ``mpiexec``.

Where they run
--------------
* Default (every ``python -m pytest`` and CI): on the strict CUDA/CuPy/NCCL stand-in in
  ``tests/gpu_standin``, which is put first on the workers' ``PYTHONPATH`` so that ``import cupy`` finds it
  (nowhere else in the suite is it importable). MPICH gives each rank ``MPI_LOCALRANKID``, so rank r is on
  device r.
* ``LBANNPY_GPU=real python -m pytest -m gpu``: the same tiers on the installed CuPy and NCCL. Without a GPU
  (no CuPy or no device) the tier is skipped with one line saying why. On fewer devices than a job's
  ranks, the job runs with its ranks sharing the devices over the host-staged MPI backend
  (``runtime.backend: mpi``, ``runtime.share_gpu: true``, ``LBANNPY_CUDA_AWARE_MPI=0``); a test of NCCL
  itself (marked ``nccl_only``) is skipped there, saying so.
* ``staged=True`` (``gpu_run``, ``gpu_launch``): the same host-staged sharing on the stand-in, all ranks on
  one device (``LBANNPY_STANDIN_DEVICES=1``), beside the NCCL and CUDA-aware MPI runs.

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


def pytest_configure(config):
    config.addinivalue_line("markers", "nccl_only: a GPU tier that tests NCCL itself; skipped where ranks "
                                       "share a GPU (NCCL cannot)")


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


# a job whose ranks share GPUs: the host-staged MPI backend; the workers of gpu_launch read the LBANNPY_TEST_*
HOST_STAGED_ENV = {"LBANNPY_CUDA_AWARE_MPI": "0", "LBANNPY_TEST_BACKEND": "mpi",
                   "LBANNPY_TEST_SHARE_GPU": "1"}


def must_share(request, ranks: int, staged: bool) -> bool:
    """Whether a job of ``ranks`` GPU ranks runs host-staged with ranks sharing devices: asked for
    (``staged``), or ``LBANNPY_GPU=real`` on a node with fewer GPUs than ranks. A test marked ``nccl_only``
    is skipped then, saying why."""
    have = getattr(request.config, "_lbannpy_real_gpus", None)
    if not (staged or (REAL and have is not None and have < ranks)):
        return False
    if request.node.get_closest_marker("nccl_only") is not None:
        pytest.skip(f"{ranks} ranks share {have if REAL else 1} GPU(s) here, and this test is of NCCL, which "
                    f"cannot run two ranks on one device")
    return True


def host_staged(words: list[str], env: dict | None) -> tuple[list[str], dict]:
    """``words`` and ``env`` of a training job turned host-staged: backend mpi, GPUs shared, no CUDA-aware
    MPI; on the stand-in all ranks on one device. A case of a CUDA-aware MPI (``LBANNPY_CUDA_AWARE_MPI=1``) is
    skipped on a real GPU, saying so: the MPI there may not be one."""
    if REAL and (env or {}).get("LBANNPY_CUDA_AWARE_MPI") == "1":
        pytest.skip("a case of a CUDA-aware MPI; ranks sharing a GPU here run host-staged instead")
    words = ["runtime.backend=mpi" if w == "runtime.backend=nccl" else w for w in words]
    if "runtime.device=gpu" in words and "runtime.share_gpu=true" not in words:
        words += ["--set", "runtime.share_gpu=true"]
    env = {**HOST_STAGED_ENV, **({} if REAL else {"LBANNPY_STANDIN_DEVICES": "1"}), **(env or {})}
    return words, env


@pytest.fixture
def gpu_run(request):
    """``gpu_run(cmd, env=None, timeout=240, check=True, staged=False)``: run a command (an ``mpiexec`` job)
    with the workers' environment (:func:`worker_env`); fails with its output when it fails and ``check``.
    A job of ``runtime.device=gpu`` with ``staged`` or on more ranks than the node has GPUs runs
    host-staged with its ranks sharing the devices (:func:`must_share`, :func:`host_staged`)."""
    def go(cmd, env: dict | None = None, timeout: float = 240, check: bool = True, staged: bool = False):
        assert MPIEXEC, "mpiexec not found (pip install mpich)"
        words = [str(c) for c in cmd]
        if words[:1] == ["mpiexec"] and "-n" in words and "runtime.device=gpu" in words:
            if must_share(request, int(words[words.index("-n") + 1]), staged):
                words, env = host_staged(words, env)
        cmd = words
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
    """``gpu_launch(script, case, ranks, *args, env=None, timeout=240, staged=False)``: run ``script case
    args`` under ``mpiexec -n ranks`` and return the per-rank results; host-staged as in ``gpu_run`` (the
    worker reads ``LBANNPY_TEST_BACKEND`` and ``LBANNPY_TEST_SHARE_GPU``)."""
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    if not REAL:
        assert (STANDIN / "cupy").is_dir(), f"the CUDA stand-in is missing: {STANDIN}/cupy"

    def launch(script, case: str, ranks: int, *args: str, env: dict | None = None, timeout: float = 240,
               staged: bool = False):
        args = [str(a) for a in args]
        if must_share(request, ranks, staged):
            args, env = host_staged(args, env)
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(script), case, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=worker_env(env),
                              cwd=str(ROOT))
        return results(proc, ranks)

    return launch
