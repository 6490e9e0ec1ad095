"""The README and docs/ as a new user meets them: the README's limits (<= 250 lines, no line over 300
characters, no run diary), its two first commands (the contract with CI), every command of the README's
tutorial and of docs/tutorial.md run as written from an empty directory, links that resolve, and the
generated reference pages equal to a fresh `python -m lbannpy.docs`.

Blocks fenced as ```bash are run (in order, one directory per page, ``python`` meaning this interpreter);
```sh blocks need a cluster, a GPU or a pip install and are only shown.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TUTORIAL = REPO / "docs" / "tutorial.md"


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def run_blocks(blocks: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The blocks as one bash script with ``python`` (and mpiexec's ``python``) this interpreter."""
    bindir = cwd / ".bin"
    bindir.mkdir()
    wrapper = bindir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a symlink would leave the venv
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    script = "set -euo pipefail\n" + "\n".join(blocks)
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_readme_limits():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    long = [(i + 1, len(ln)) for i, ln in enumerate(lines) if len(ln) > 300]
    assert not long, f"README.md lines over 300 characters (line, length): {long}"


def test_readme_is_a_guide_not_a_diary():
    text = README.read_text()
    for pattern, what in ((r"issue #\d+", "issue numbers"), (r"\b20\d\d-\d\d-\d\d\b", "dates of runs"),
                          (r"`[0-9a-f]{7,40}`", "commit hashes"), (r"this 2-core box|this project's machine",
                                                                   "the development machine as 'this'")):
        found = re.findall(pattern, text, re.I)
        assert not found, f"README.md holds {what}: {found[:3]} (history goes to docs/CHANGELOG.md)"


def test_readme_first_commands_are_what_ci_runs():
    text = README.read_text()
    quick = section(text, "## Quick start")
    assert "pip install -e '.[mpich]' && python -m lbannpy.demo" in quick
    assert "pip install -e '.[test,mpich]' && ruff check . && python -m pytest" in quick
    ci = (REPO / ".ci" / "run").read_text()
    for line in ("pip install -q -e '.[test,mpich]'", "-m ruff check .", "-m pytest -q"):
        assert line in ci, f".ci/run no longer runs README command (2): missing {line!r}"


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#:]+)\)", README.read_text()):
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"
    for page in ("config.md", "commands.md", "design.md", "benchmarks.md", "CHANGELOG.md", "tutorial.md"):
        assert (REPO / "docs" / page).is_file(), f"docs/{page} is missing"


def test_generated_docs_are_fresh():
    p = subprocess.run([sys.executable, "-m", "lbannpy.docs", "--check", "-o", str(REPO / "docs")],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr + "\n(regenerate with: python -m lbannpy.docs)"


@pytest.mark.timeout(900)
def test_readme_tutorial_runs_as_written(tmp_path):
    blocks = bash_blocks(section(README.read_text(), "## Tutorial"))
    assert len(blocks) >= 1 and "lbannpy.data blobs" in blocks[0] and "lenet5" in blocks[0]
    p = run_blocks(blocks, tmp_path, 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PyTorch and lbannpy agree to" in p.stdout, p.stdout


@pytest.mark.timeout(900)
def test_docs_tutorial_runs_as_written(tmp_path):
    blocks = bash_blocks(TUTORIAL.read_text())
    assert len(blocks) >= 5, blocks
    p = run_blocks(blocks, tmp_path, 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "mesh-pred.png").is_file() and (tmp_path / "mesh1k-4n.sbatch").is_file()
    rows = (tmp_path / "mesh-run" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 13)], rows  # stopped, resumed
    assert "UNet and lbannpy agree to" in p.stdout, p.stdout[-3000:]  # a PyTorch model in and back out
