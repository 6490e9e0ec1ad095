"""``bench scale --real`` under ``mpiexec -n 16`` (oversubscribed): a small model splitting samples and space
sets up and trains on 16 real ranks, and its plans send exactly the bytes the rank simulator predicts.
Bigger runs (32, 64 ranks) take minutes on a small machine and stay out of the default run:
``mpiexec -n 64 python -m lbannpy.bench scale --real``."""
from __future__ import annotations

import math
import re
import sys

import pytest

from test_mpi_suites import MPIEXEC, mpi_env, run_mpi, tail

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
def test_sixteen_real_ranks_match_the_simulator(tmp_path):
    env = mpi_env(MPIR_CVAR_CH4_PROGRESS_THROTTLE=1, MPIR_CVAR_POLLS_BEFORE_YIELD=1)
    code, out, secs = run_mpi(16, ["-m", "lbannpy.bench", "scale", "--real", "--steps", "2",
                                   "--data-dir", str(tmp_path)], env, tmp_path, timeout=120)
    assert code == 0, f"exit {code} after {secs:.0f} s:\n{tail(out)}"
    assert "on 16 ranks, split n4·h2·w2" in out, tail(out)
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(\S+)\s+(\S+)?\s*$", line)
        if m:
            rows[m.group(1).strip()] = m.groups()[1:]
    for key in ("halo bytes/step (rank 0)", "allreduce bytes/step (rank 0)"):
        real, sim = rows[key]
        assert int(real) == int(sim) > 0, (key, real, sim, out)
    for key in ("set-up s (wall)", "index µs/layer", "step overhead µs/layer"):
        # measured, so only their form is checked here: a finite number in both columns (a missing or
        # unformatted figure fails); their size is judged by the benchmark, not by a unit test
        assert all(math.isfinite(float(v)) for v in rows[key]), (key, rows[key])
    print(out, file=sys.stderr)
