"""``bench checkpoint`` prints the cost of verification (a small zoo model here; mesh1k 1024² is the
default): write time with and without the checksums, read time verified and unverified."""
from __future__ import annotations

import re
import subprocess
import sys


def test_bench_checkpoint_prints_the_cost_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lbannpy.bench", "checkpoint", "--model", "mesh_tiny", "--size",
                        "64", "--repeat", "1", "--dir", str(tmp_path / "ck")], capture_output=True, text=True,
                       timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"write ([\d.]+) s with checksums, ([\d.]+) s without \(checksums ([\d.]+) s = ([\d.]+) % "
                  r"of the write; target <= 5 %\); read ([\d.]+) s verified, ([\d.]+) s unverified", r.stdout)
    assert m, r.stdout
    w, w0, c = (float(m.group(i)) for i in (1, 2, 3))
    assert c > 0 and abs(w - w0 - c) < 2e-3, r.stdout  # the checksums were timed inside the write
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("ckpt-"))
    assert kept == ["ckpt-00000001"]
