"""Stream capture in the strict CuPy stand-in (tests/gpu_standin/cupy/cuda/_graph.py): its checks run in
subprocesses whose PYTHONPATH starts with tests/gpu_standin, so this process never imports it as ``cupy``."""
from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu_standin import STANDIN, TESTS, standin_env

REAL = Path(os.environ.get("LBANNPY_REAL_CUPY", "/tmp/realcupy"))
REAL_SO = [p for pat in ("cupy/cuda/stream*.so", "cupy/cuda/graph*.so", "cupy/cuda/memory.*.so",
                         "cupy_backends/cuda/api/runtime*.so") for p in sorted(glob.glob(str(REAL / pat)))]


def test_standin_graph_checks():
    if shutil.which("g++") is None:  # the stand-in compiles kernel bodies with it; CI's machines have it
        pytest.fail("g++ not found: the CuPy stand-in compiles ElementwiseKernel bodies with it")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(STANDIN / "standin_graph_check.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    passed = re.search(r"(\d+) passed", p.stdout)
    assert passed and int(passed.group(1)) >= 37, p.stdout[-2000:]


def test_standin_capture_matches_cuda():
    """The checks a real GPU passes too (tests/gpu_standin/capture_parity_check.py), on the stand-in."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--import-mode=importlib", str(STANDIN / "capture_parity_check.py")],
                       env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    passed = re.search(r"(\d+) passed", p.stdout)
    assert passed and int(passed.group(1)) >= 18, p.stdout[-2000:]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found")
@pytest.mark.parametrize("ranks", [2, 3])
def test_standin_graph_replays_nccl_calls(ranks):
    p = subprocess.run([shutil.which("mpiexec"), "-n", str(ranks), sys.executable,
                        str(STANDIN / "standin_graph_mpi_check.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert sorted(re.findall(r"rank (\d+) of (\d+): standin graph nccl ok", out)) == \
        [(str(r), str(ranks)) for r in range(ranks)]


def _standin_signatures() -> dict[str, list[str]]:
    """Parameter names of the stand-in's capture and pool API, read from its source."""
    sigs = {}
    for rel, owners in (("cupy/cuda/__init__.py", {"Stream": "_BaseStream"}), ("cupy/cuda/_graph.py", {}),
                        ("cupy/cuda/memory.py", {}), ("cupy/cuda/runtime.py", {})):
        for node in ast.parse((STANDIN / rel).read_text()).body:
            if isinstance(node, ast.FunctionDef):
                sigs.setdefault(node.name, [a.arg for a in node.args.args])
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef):
                        name = f"{owners.get(node.name, node.name)}.{f.name}"
                        sigs[name] = [a.arg for a in f.args.args]
    return sigs


CAPTURE_API = ["_BaseStream.begin_capture", "_BaseStream.end_capture", "_BaseStream.is_capturing",
               "Graph.launch", "Graph.upload", "MemoryPool.malloc", "get_allocator", "set_allocator",
               "streamBeginCapture", "streamIsCapturing"]


@pytest.mark.skipif(not REAL_SO and os.environ.get("LBANNPY_REQUIRE_REAL_CUPY") != "1",
                    reason=f"reference CuPy wheel not installed under {REAL}")
def test_capture_api_signatures_match_real_cupy():
    """The names the trainer codes against (CuPy's Cython ``embedsignature`` strings in the real wheel)."""
    assert REAL_SO, f"LBANNPY_REQUIRE_REAL_CUPY=1 but no CuPy wheel under {REAL}"
    pat = re.compile(r"\b(" + "|".join(re.escape(n) for n in CAPTURE_API) + r")\(([^()\x00]*)\)")
    real = {}
    for so in REAL_SO:
        for m in pat.finditer(Path(so).read_bytes().decode("latin-1")):
            args = [a.split("=")[0].split()[-1] for a in m.group(2).split(",") if a.strip()]
            if all(a.isidentifier() for a in args):
                real.setdefault(m.group(1), args)
    ours = _standin_signatures()
    assert sorted(real) == sorted(CAPTURE_API), sorted(set(CAPTURE_API) - set(real))
    for name in CAPTURE_API:
        assert ours.get(name) == real[name], (name, ours.get(name), real[name])
