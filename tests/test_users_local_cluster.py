"""jobs/local-cluster: a running cluster of another user or checkout is refused (not reused silently), and
the printed hints carry LBANNPY_SLURM_DIR/PORT when the caller set them. The helpers are sourced from
common.sh, which start uses (no SLURM needed)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "jobs" / "local-cluster"


def bash(script: str, env: dict):
    return subprocess.run(["bash", "-c", f"set -euo pipefail; source {HERE}/common.sh; {script}"],
                          env=dict(os.environ, **env), capture_output=True, text=True, timeout=30)


def test_another_checkout_or_user_is_refused(tmp_path):
    env = {"LBANNPY_SLURM_DIR": str(tmp_path), "USER": "alice"}
    assert bash('owner_line /src/a > "$OWNER_FILE"; check_owner /src/a', env).returncode == 0
    p = bash("check_owner /src/b", env)
    assert p.returncode != 0 and "started by user=alice checkout=/src/a" in p.stderr, p.stderr
    assert "LBANNPY_SLURM_REUSE=1" in p.stderr and "LBANNPY_SLURM_DIR=" in p.stderr
    p = bash("check_owner /src/a", dict(env, USER="bob"))
    assert p.returncode != 0 and "this is user=bob" in p.stderr
    assert bash("check_owner /src/b", dict(env, LBANNPY_SLURM_REUSE="1")).returncode == 0
    (tmp_path / "owner").unlink()  # a cluster from before owner files: unknown, refused
    assert bash("check_owner /src/a", env).returncode != 0


def test_hint_carries_the_variables_that_were_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LBANNPY_SLURM")}
    p = subprocess.run(["bash", "-c", f"source {HERE}/common.sh; env_prefix"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert p.stdout == ""
    p = bash("env_prefix", {"LBANNPY_SLURM_DIR": str(tmp_path), "LBANNPY_SLURM_PORT": "7000"})
    assert p.stdout == f"LBANNPY_SLURM_DIR={tmp_path} LBANNPY_SLURM_PORT=7000 "
    text = (HERE / "start").read_text()
    assert "stop with: $(env_prefix)$here/stop" in text and text.count('check_owner "$here"') == 2
