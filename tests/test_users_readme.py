"""The README's cluster section, run as written at a small size (the data and input side 1024 -> 128,
64 samples -> 8): the spec from the zoo, built against the data file, validated for 2 ranks."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def cluster_commands() -> list[str]:
    text = README.read_text()
    sec = text[text.index("## The mesh-tangling models on a cluster"):]
    block = sec[sec.index("```bash") + 7:sec.index("```", sec.index("```bash") + 7)]
    block = re.sub(r"\\\n\s*", " ", block)  # continuation lines
    cmds = []
    for line in block.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("python -m lbannpy.data") or line.startswith("python -m lbannpy.config"):
            cmds.append(line)
    return cmds


def test_readme_cluster_commands_run_at_a_small_size(tmp_path):
    cmds = cluster_commands()
    assert [c.split()[2] for c in cmds] == ["lbannpy.data", "lbannpy.config", "lbannpy.config"], cmds
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for c in cmds:
        c = c.replace("--size 1024", "--size 128").replace("--input-size 1024", "--input-size 128")
        c = c.replace("--samples 64", "--samples 8")
        argv = [sys.executable if a == "python" else a for a in shlex.split(c)]
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, c + "\n" + p.stdout[-2000:] + p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "lbannpy.config", "validate", "mesh1k-config.h5",
                        "--ranks", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    # the build checks the data: a spec left at another input size is refused there, not at train time
    p = subprocess.run([sys.executable, "-m", "lbannpy.config", "build", "mesh1k.yaml", "-o", "x.h5",
                        "--set", "data.train.path=mesh1k.h5", "--set", "model.input.spatial=[256, 256]"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "(N, 18, 256, 256)" in p.stderr, p.stderr
