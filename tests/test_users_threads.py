"""Threads per rank: chosen by lbannpy (not hidden environment variables), printed once.

Acceptance: the demo's printed commands, rerun verbatim in a clean environment (no OMP_NUM_THREADS or BLAS
variables), run with the thread count the demo ran with, and that count is what every BLAS/OpenMP pool of
the process is limited to. (What the limit is worth in step time is a benchmark's question, not a test's.)
"""
from __future__ import annotations

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


THREAD_LINE = "lbannpy.train: {n} BLAS/OpenMP thread{s} per rank ({why};"


def expected_line(ranks: int) -> str:
    c = choose(None, {}, len(os.sched_getaffinity(0)), ranks)
    return THREAD_LINE.format(n=c.threads, s="" if c.threads == 1 else "s", why=c.why)


def test_demo_commands_rerun_verbatim_in_a_clean_environment(tmp_path):
    p = subprocess.run([PY, "-m", "lbannpy.demo", "--dir", "demo", "--size", "128", "--samples", "16",
                        "--steps", "16", "--ranks", "2", "--batch-size", "4"], cwd=tmp_path, env=clean_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    want = expected_line(2)  # two ranks on this node, no variable set: the node's cores / 2
    assert want in p.stderr, (want, p.stderr)  # the choice is printed where the user sees it
    cmds = [line[2:] for line in p.stdout.splitlines() if line.startswith("+ ")]
    assert any("lbannpy.train" in c for c in cmds), p.stdout
    for c in cmds:
        q = subprocess.run(shlex.split(c), cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                           timeout=600)
        assert q.returncode == 0, c + "\n" + q.stderr[-2000:]
    assert want in q.stderr, (want, q.stderr)  # by hand: the same count for the same reason


POOLS_PY = """
import json, os, sys
from threadpoolctl import threadpool_info
from lbannpy.threads import set_threads
class World:
    rank = 0
choice = set_threads(World(), int(sys.argv[1]) if sys.argv[1] != "-" else None, "t")
print(json.dumps({"threads": choice.threads, "omp": os.environ.get("OMP_NUM_THREADS"),
                  "pools": [(p["internal_api"], p["num_threads"]) for p in threadpool_info()]}))
"""


def test_every_pool_is_limited_to_the_chosen_count():
    import json

    cores = len(os.sched_getaffinity(0))
    for configured, want in (("1", 1), ("-", cores)):
        p = subprocess.run([PY, "-c", POOLS_PY, configured], env=clean_env(), capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout.splitlines()[-1])
        assert got["threads"] == want and got["omp"] == str(want), got
        assert got["pools"], "threadpoolctl found no BLAS/OpenMP pool: NumPy's BLAS should be one"
        assert all(n == want for _, n in got["pools"]), got
