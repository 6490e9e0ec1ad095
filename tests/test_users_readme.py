"""The README and docs/ as a new user meets them: the README's limits (<= 250 lines, no line over 300
characters, no run diary), its two first commands (the contract with CI), every command block of README.md,
docs/tutorial.md and jobs/README.md run as written from an empty directory, links that resolve, and the
generated reference pages equal to a fresh `python -m lbannpy.docs`.

Every fenced block of those pages says what it is: ```bash blocks are run (in order, one directory per
page, ``python`` meaning this interpreter); ```sh blocks need a cluster, a GPU or a pip install and are run
too, with stand-ins on PATH (``sbatch`` checks the script it is given with ``bash -n`` instead of submitting
it; ``pip install`` checks that the extras it names exist) and at the reduced size the page says beside the
block, except the commands in :data:`CHECKED`, each checked by the test named there; ```text, ```yaml and
```python blocks are not commands (the README's command synopsis, a ```text block, is checked against each
command's --help).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TUTORIAL = REPO / "docs" / "tutorial.md"
JOBS_README = REPO / "jobs" / "README.md"
PAGES = (README, TUTORIAL, JOBS_README)
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
LANGS = {"bash": "run", "sh": "run with stand-ins", "text": "not commands", "yaml": "a spec",
         "python": "code"}
# sh commands not run here (they need root, a GPU or the whole suite): the line, or the whole block that
# holds it, and what checks it instead
CHECKED = {
    "pip install -e '.[test,mpich]' && ruff check . && python -m pytest":
        ("line", "test_readme_first_commands_are_what_ci_runs (CI runs it)"),
    "LBANNPY_GPU=real python -m pytest -m gpu": ("line", "test_gpu_commands_exist (needs a GPU)"),
    "jobs/local-cluster/start":
        ("block", "test_local_cluster_block_is_checked (tests/test_users_local_cluster.py runs it)"),
}
# what the README test changes in a sh block to run it on a laptop; the page says it beside the block
REDUCED = {TUTORIAL: (("--size 1024", "--size 256"), ("--input-size 1024", "--input-size 256"))}
SBATCH_STANDIN = r"""#!/bin/bash
# sbatch stand-in (no cluster): checks the script (or --wrap command) it would submit with bash -n
wrap= script=
while [ $# -gt 0 ]; do
  case "$1" in
    --wrap) wrap="$2"; shift 2 ;;
    --wrap=*) wrap="${1#--wrap=}"; shift ;;
    -[nNtpAcoJ]) shift 2 ;;
    -*) shift ;;
    *) script="$1"; shift; break ;;
  esac
done
if [ -n "$wrap" ]; then
  bash -n -c "$wrap" || { echo "sbatch stand-in: --wrap command fails bash -n" >&2; exit 1; }
  echo "sbatch stand-in: --wrap command passes bash -n"
else
  [ -f "$script" ] || { echo "sbatch stand-in: no script $script" >&2; exit 1; }
  head -1 "$script" | grep -q '^#!/bin/bash' || { echo "sbatch stand-in: $script: no bash" >&2; exit 1; }
  bash -n "$script" || { echo "sbatch stand-in: $script fails bash -n" >&2; exit 1; }
  echo "sbatch stand-in: $script passes bash -n (arguments: $*)"
fi
echo "Submitted batch job 1"
"""
PIP_STANDIN = r"""#!/bin/sh
# pip stand-in: installs nothing; `pip install -e '.[EXTRAS]'` checks that setup.cfg declares each extra
for a in "$@"; do
  case "$a" in
    *'[*') for x in $(echo "$a" | sed -e 's/.*\[//' -e 's/\].*//' -e 's/,/ /g'); do
             grep -q "^$x =" "@SETUP@" || { echo "pip stand-in: no extra '$x' in setup.cfg" >&2; exit 1; }
           done ;;
  esac
done
echo "pip stand-in: nothing installed"
"""


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)


def fenced(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return FENCE.findall(text)


def sh_commands(block: str) -> list[str]:
    """The commands of a block: its lines with continuations joined, comments and blanks left out."""
    joined = block.replace("\\\n", " ")
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def runnable_sh(page: Path) -> list[str]:
    """The page's sh blocks as they run here: CHECKED commands left out, REDUCED sizes put in."""
    out = []
    for lang, body in fenced(page.read_text()):
        if lang != "sh":
            continue
        if any(k in body for k, (scope, _) in CHECKED.items() if scope == "block"):
            out.append("")
            continue
        cmds = [c for c in sh_commands(body) if not any(k in c for k in CHECKED)]
        for old, new in REDUCED.get(page, ()):
            cmds = [c.replace(old, new) for c in cmds]
        out.append("\n".join(cmds))
    return out


def run_blocks(blocks: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The blocks as one bash script with ``python`` (and mpiexec's ``python``) this interpreter, and the
    ``sbatch`` and ``pip`` stand-ins on PATH."""
    bindir = cwd / ".bin"
    bindir.mkdir()
    wrapper = bindir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a symlink would leave the venv
    wrapper.chmod(0o755)
    pip = PIP_STANDIN.replace("@SETUP@", str(REPO / "setup.cfg"))
    for name, text in (("sbatch", SBATCH_STANDIN), ("pip", pip)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
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


def page_blocks(page: Path) -> list[str]:
    """The page's bash blocks and its runnable sh blocks (:func:`runnable_sh`), in the page's order."""
    sh = iter(runnable_sh(page))
    return [body if lang == "bash" else next(sh) for lang, body in fenced(page.read_text())
            if lang in ("bash", "sh")]


def test_every_block_says_what_it_is():
    for page in PAGES:
        for lang, body in fenced(page.read_text()):
            assert lang in LANGS, (f"{page.relative_to(REPO)}: a block fenced as ```{lang} (say bash: run, "
                                   f"sh: run with stand-ins, or text): {body[:80]!r}")


def test_reduced_sizes_are_said_beside_the_block():
    for page, pairs in REDUCED.items():
        prose = FENCE.sub("", page.read_text())
        for old, new in pairs:
            assert new.split()[-1] in prose and f"`{new}`" in prose, f"{page.name} does not say {new!r}"


def test_checked_commands_are_on_the_pages():
    text = "\n".join(p.read_text() for p in PAGES)
    for cmd, how in CHECKED.items():
        assert cmd in text, f"CHECKED names {cmd!r}, which no page holds any more ({how})"


@pytest.mark.timeout(900)
def test_readme_runs_as_written(tmp_path):
    """Every command of the README: the quick start's demo (pip a stand-in), the tutorial, the cluster job
    (rendered, sbatch checking it with bash -n)."""
    blocks = page_blocks(README)
    assert any("lbannpy.data blobs" in b and "lenet5" in b for b in blocks)
    assert any("lbannpy.demo" in b for b in blocks) and any("jobs render mesh1k" in b for b in blocks)
    p = run_blocks(blocks, tmp_path, 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "PyTorch and lbannpy agree to" in p.stdout, p.stdout
    assert "mesh-tangling demo on 2 rank(s)" in p.stdout, p.stdout[-3000:]
    assert "sbatch stand-in: mesh1k-2n.sbatch passes bash -n" in p.stdout, p.stdout[-3000:]


@pytest.mark.timeout(900)
def test_docs_tutorial_runs_as_written(tmp_path):
    blocks = page_blocks(TUTORIAL)
    assert len(blocks) >= 6, blocks
    p = run_blocks(blocks, tmp_path, 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "mesh-pred.png").is_file() and (tmp_path / "mesh1k-4n.sbatch").is_file()
    rows = (tmp_path / "mesh-run" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 13)], rows  # stopped, resumed
    assert "UNet and lbannpy agree to" in p.stdout, p.stdout[-3000:]  # a PyTorch model in and back out
    assert "sbatch stand-in: mesh1k-2n.sbatch passes bash -n (arguments: mesh1k-config.h5)" in p.stdout
    assert (tmp_path / "mesh1k-config.h5").is_file()  # the cluster block's config, at the reduced size


@pytest.mark.timeout(300)
def test_jobs_readme_runs_as_written(tmp_path):
    """jobs/README.md from a directory holding a copy of jobs/ (as the repository root does): its sbatch
    lines checked by the stand-in, its rendering commands run."""
    shutil.copytree(REPO / "jobs", tmp_path / "jobs", ignore=shutil.ignore_patterns("README.md"))
    blocks = page_blocks(JOBS_README)
    p = run_blocks(blocks, tmp_path, 280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    for script in ("jobs/mesh1k.sbatch", "jobs/resnet50.sbatch"):
        assert f"sbatch stand-in: {script} passes bash -n" in out, out
    assert "--wrap command passes bash -n" in out, out
    assert (tmp_path / "my.sbatch").is_file() and (tmp_path / "my-resnet.sbatch").is_file()


def test_readme_command_synopsis_matches_help():
    """Every line of the README's command list names a command whose --help shows each option it lists."""
    section_text = section(README.read_text(), "## The commands")
    (synopsis,) = [body for lang, body in fenced(section_text) if lang == "text"]
    for line in synopsis.splitlines():
        cmd = line.split("#")[0].split()
        if cmd[:2] == ["python", "-m"]:
            argv = cmd[2:4] if len(cmd) > 3 and re.fullmatch(r"[a-z][a-z-]*", cmd[3]) else cmd[2:3]
        else:
            continue
        p = subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, f"{' '.join(argv)} --help: {p.stderr[-500:]}"
        for opt in re.findall(r"(--[a-z][a-z-]*)", line.split("#")[0]):
            assert opt in p.stdout, f"README lists {opt} for {' '.join(argv)}; its --help does not"


def test_gpu_commands_exist():
    """The GPU block (not run without a GPU): its marker, options and script exist and it parses."""
    (block,) = [b for lang, b in fenced(section(README.read_text(), "## GPUs")) if lang == "sh"]
    assert subprocess.run(["bash", "-n", "-c", block]).returncode == 0
    assert "gpu:" in (REPO / "setup.cfg").read_text()  # the pytest marker -m gpu selects
    p = subprocess.run([sys.executable, "-m", "lbannpy.bench", "peer", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert "--device" in p.stdout and "--rounds" in p.stdout, p.stdout
    assert subprocess.run(["bash", "-n", str(REPO / "tests" / "gpu" / "real_shared_gpu.sh")]).returncode == 0


def test_local_cluster_block_is_checked():
    """jobs/README.md's one-node SLURM block needs root: it parses, its scripts exist and are executable,
    and tests/test_users_local_cluster.py runs them."""
    (block,) = [b for lang, b in fenced(JOBS_README.read_text()) if lang == "sh" and "local-cluster" in b]
    assert subprocess.run(["bash", "-n", "-c", block]).returncode == 0
    for script in ("start", "stop"):
        assert os.access(REPO / "jobs" / "local-cluster" / script, os.X_OK)
    assert "local-cluster" in (REPO / "tests" / "test_users_local_cluster.py").read_text()


def test_zoo_prints_the_data_command_its_callers_use(tmp_path, monkeypatch):
    """`config zoo NAME` prints the data command of its model; the pages and the demo that make data for a
    zoo model run that command (their own file name and -q aside)."""
    from lbannpy import zoo

    def args(cmd: str) -> list[str]:
        words = cmd.split("#")[0].split()
        out = []
        for i, w in enumerate(words):
            if w in ("-q",) or (i and words[i - 1] == "-o") or w == "-o":
                continue
            out.append(w)
        return out

    pairs = 0
    for page in (README, TUTORIAL):
        for _, body in fenced(page.read_text()):
            cmds = sh_commands(body)
            for i, c in enumerate(cmds):
                m = re.search(r"lbannpy\.config zoo (\w+)(?: --input-size (\d+))?", c)
                data = [d for d in cmds[:i] if "lbannpy.data " in d]
                if m and data:
                    spec = zoo.get_spec(m.group(1), input_size=int(m.group(2)) if m.group(2) else None)
                    assert args(data[-1]) == args(zoo.spec_data_command(spec)), (page.name, data[-1])
                    pairs += 1
    assert pairs >= 3, pairs
    import lbannpy.demo as demo

    ran = []
    monkeypatch.setattr(demo, "run", lambda cmd, **kw: ran.append(["python"] + cmd[1:]))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):  # the run's summary.json: nothing was trained
        demo.main(["--dir", "x"])
    data = [" ".join(c) for c in ran if "lbannpy.data" in c]
    want = zoo.spec_data_command(zoo.get_spec("mesh_tiny", input_size=128))
    assert data and args(data[0]) == args(want), ran
