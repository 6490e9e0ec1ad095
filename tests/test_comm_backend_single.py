"""``runtime.backend: single`` (issue #16): with the default overlap it trains on one process (nothing to
reduce, so no MPI thread and no MPI_THREAD_MULTIPLE needed), and under a launcher that started more than
one rank it refuses to start with one line instead of running independent 1-rank jobs."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lbannpy.comm import CommError, Runtime, SingleCommunicator, make_communicator
from lbannpy.comm.overlap import OverlapEngine

MPIEXEC = shutil.which("mpiexec")


class P:
    def __init__(self, name, n):
        self.name, self.grad = name, np.zeros(n)


def test_overlap_on_one_process_needs_no_thread():
    params = [P(f"l{i}.w", 10 + i) for i in range(4)]
    with Runtime(backend="single") as rt:
        # thread_level is None without MPI: before the fix this raised "needs MPI_THREAD_MULTIPLE"
        eng = OverlapEngine(params, [rt.world] * 4, bucket_bytes=200, first_bucket_bytes=100, overlap=True,
                            thread_multiple=rt.thread_multiple, xp=rt.xp)
        try:
            assert eng._thread is None
            eng.start_step()
            for i, p in enumerate(params):
                p.grad[...] = i + 1
            for i in reversed(range(4)):
                eng.layer_done(f"l{i}")
            seen = []
            eng.finish(on_bucket=lambda ps: seen.extend(p.name for p in ps))
            assert sorted(seen) == sorted(p.name for p in params)
            assert [float(p.grad[0]) for p in params] == [1.0, 2.0, 3.0, 4.0]
        finally:
            eng.close()


def test_an_mpi_thread_still_needs_thread_multiple():
    class Two(SingleCommunicator):  # stands for an MPI communicator of two ranks
        backend = "mpi"
        size = 2

        def dup(self):
            return self

    with pytest.raises(CommError, match="MPI_THREAD_MULTIPLE"):
        OverlapEngine([P("a.w", 3)], [Two()], overlap=True, thread_multiple=False)


@pytest.mark.parametrize("var", [("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")])
def test_single_under_a_multi_rank_launcher_is_refused(monkeypatch, var):
    monkeypatch.setenv(var[0], "1")
    monkeypatch.setenv(var[1], "2")
    for fn in (lambda: Runtime(backend="single").__enter__(), lambda: make_communicator("single")):
        with pytest.raises(CommError, match="launcher started 2 ranks") as err:
            fn()
        assert "\n" not in str(err.value)
    monkeypatch.setenv(var[1], "1")  # one rank under a launcher is fine
    assert isinstance(make_communicator("single"), SingleCommunicator)


def test_single_under_mpiexec_refuses_on_every_rank(tmp_path):
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    script = tmp_path / "single.py"
    # each rank writes its outcome to its own file: two ranks' lines on one forwarded stdout can interleave
    script.write_text(textwrap.dedent('''
        import os, sys
        from lbannpy.comm import CommError, Runtime
        out = os.path.join(sys.argv[1], "rank-" + os.environ.get("PMI_RANK", "?"))
        try:
            with Runtime(backend="single"):
                open(out, "w").write("STARTED")
        except CommError as exc:
            open(out, "w").write(f"REFUSED {exc}")
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    outcomes = {f.name: f.read_text() for f in tmp_path.glob("rank-*")}
    assert sorted(outcomes) == ["rank-0", "rank-1"], outcomes
    assert all(o.startswith("REFUSED backend 'single' runs one process") for o in outcomes.values()), outcomes
