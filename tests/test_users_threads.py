"""Threads per rank: chosen by lbannpy (not hidden environment variables), printed once.

Acceptance: the demo's printed commands, rerun verbatim in a clean environment (no OMP_NUM_THREADS or BLAS
variables), give the demo's step time within 1.5x.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys


from lbannpy.threads import choose

PY = sys.executable


def test_choice_precedence():
    env = {"OMP_NUM_THREADS": "3", "SLURM_CPUS_PER_TASK": "4"}
    assert choose(5, env, 16, 2).threads == 5 and choose(5, env, 16, 2).why == "runtime.threads"
    assert choose(0, env, 16, 2).threads == 3
    assert choose(None, {"SLURM_CPUS_PER_TASK": "4"}, 16, 2).threads == 4
    c = choose(0, {}, 16, 4)
    assert c.threads == 4 and "16 core(s) / 4 rank(s)" in c.why
    assert choose(0, {}, 2, 4).threads == 1  # never zero
    assert choose(0, {"OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "x"}, 8, 1).threads == 8


def clean_env():
    keep = ("PATH", "HOME", "TMPDIR", "LANG", "PYENV_ROOT")
    return {k: os.environ[k] for k in keep if k in os.environ}


def test_demo_commands_rerun_verbatim_in_a_clean_environment(tmp_path):
    p = subprocess.run([PY, "-m", "lbannpy.demo", "--dir", "demo", "--size", "128", "--samples", "16",
                        "--steps", "16", "--ranks", "2", "--batch-size", "4"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "BLAS/OpenMP thread" in p.stderr, p.stderr  # the choice is printed where the user sees it
    with open(tmp_path / "demo" / "run" / "summary.json") as f:
        demo_step = json.load(f)["median_step_s"]
    cmds = [line[2:] for line in p.stdout.splitlines() if line.startswith("+ ")]
    assert any("lbannpy.train" in c for c in cmds), p.stdout
    for c in cmds:
        q = subprocess.run(shlex.split(c), cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=600)
        assert q.returncode == 0, c + "\n" + q.stderr[-2000:]
    assert "1 BLAS/OpenMP thread per rank" in q.stderr or "threads per rank" in q.stderr, q.stderr
    with open(tmp_path / "demo" / "run" / "summary.json") as f:
        again = json.load(f)["median_step_s"]
    print(f"demo median step {demo_step * 1e3:.1f} ms; rerun by hand {again * 1e3:.1f} ms")
    assert again <= 1.5 * demo_step and demo_step <= 1.5 * again
