"""``python -m lbannpy.bench overhead --device gpu``: one line and exit 0 without a GPU; the GPU table on
the CuPy stand-in (a subprocess, so this process never imports it as cupy)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_without_a_gpu_one_line_and_exit_0(capsys, monkeypatch):
    from lbannpy.bench import layers, overhead

    monkeypatch.setattr(layers, "gpu_missing", lambda: "no CUDA device")
    assert overhead.main(["--device", "gpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out == "bench overhead --device gpu: skipped, no CUDA device\n"


def test_gpu_table_on_the_cuda_standin():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LBANNPY_STANDIN_DEVICES="4")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "gpu_standin"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(TESTS / "gpu_standin" / "standin_overhead_check.py")], env=env, cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "2 passed" in p.stdout, p.stdout[-2000:]
