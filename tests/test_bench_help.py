"""``python -m lbannpy.bench --help`` says what each subcommand costs: its typical run time on a 2-core
machine, beside its description."""
from __future__ import annotations

import re
import subprocess
import sys

from lbannpy.bench.__main__ import RUN_TIMES, SUBCOMMANDS


def test_every_subcommand_has_a_run_time_in_help():
    assert set(RUN_TIMES) == set(SUBCOMMANDS)
    p = subprocess.run([sys.executable, "-m", "lbannpy.bench", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "2-core machine" in p.stdout, p.stdout
    for name in SUBCOMMANDS:
        (line,) = [ln for ln in p.stdout.splitlines() if ln.split()[:1] == [name]]
        assert re.search(r"\b\d+(\.\d+)? (s|min)\b", line), line
