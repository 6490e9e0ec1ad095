"""``--resume`` says the step it resumed from, and on a finished run does nothing: exit 0, one line on
stdout, no checkpoint, metrics or summary rewritten."""
from __future__ import annotations

import os
import subprocess
import sys

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def sh(args, cwd):
    p = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def test_resume_says_its_step_and_a_finished_run_is_left_alone(tmp_path):
    sh(["lbannpy.data", "mesh", "--size", "32", "--samples", "8", "-o", "m.h5", "-q"], tmp_path)
    sh(["lbannpy.config", "zoo", "mesh_tiny", "--input-size", "32", "-o", "m.yaml"], tmp_path)
    sh(["lbannpy.config", "build", "m.yaml", "-o", "m.h5cfg.h5", "--set", "data.train.path=m.h5",
        "--set", "trainer.batch_size=2", "--set", "trainer.steps=6", "--set", "checkpoint.every_steps=2"],
       tmp_path)
    train = ["lbannpy.train", "m.h5cfg.h5", "--set", "output.dir=run", "--quiet"]
    sh(train + ["--set", "trainer.steps=4"], tmp_path)  # stopped at step 4, as a job at its time limit
    p = sh(train + ["--resume"], tmp_path)
    assert "lbannpy.train: resumed from step 4 (run/ckpt/ckpt-00000004); training to step 6" in p.stdout
    run = tmp_path / "run"
    def state():  # metrics.csv is written again at set-up, with the same rows: its content, else the times
        return {f: f.read_bytes() if f.name == "metrics.csv" else f.stat().st_mtime_ns for f in run.rglob("*")
                if f.is_file() and f.name != ".lbannpy.lock"}

    before = state()
    assert any("ckpt-00000006" in str(f) for f in before)
    p = sh(train + ["--resume"], tmp_path)
    assert p.stdout.splitlines() == ["lbannpy.train: already finished: run/ckpt/ckpt-00000006 is step 6 of 6 "
                                     "(trainer.steps); nothing to do"], p.stdout
    assert state() == before  # nothing written: no checkpoint, summary.json or loss.png; the same metrics
