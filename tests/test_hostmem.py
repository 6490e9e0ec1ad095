"""The training process keeps freed blocks for reuse (lbannpy.hostmem): a step-like pattern of allocations
takes no page faults once warm, where glibc's defaults take hundreds per round (the negative control)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PATTERN = r"""
import resource, sys
import numpy as np
from lbannpy.hostmem import keep_freed_blocks
on = sys.argv[1] == "on" and keep_freed_blocks()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
sizes = [600_000, 150_000, 2_400_000, 40_000, 600_000, 1_200_000]  # bytes, like one step's buffers
def step():
    keep = [np.ones(s // 4, np.float32) for s in sizes]
    del keep[2], keep[0]
    keep.append(np.ones(300_000, np.float32))
for _ in range(3):
    step()
f0 = faults()
for _ in range(50):
    step()
print(on, (faults() - f0) / 50)
"""


def _faults(mode: str) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    on, with_reuse = _faults("on")
    _, default = _faults("off")
    assert on == "True"
    assert with_reuse < 5, with_reuse
    assert default > 100, f"the pattern no longer faults under glibc's defaults ({default}): not a control"


def test_user_tunables_win(monkeypatch):
    from lbannpy.hostmem import keep_freed_blocks

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert keep_freed_blocks() is False
