"""Values reach the run as given: ``--set`` reads a value by its key's type (a string key takes the text
as it is), rendered jobs quote every value by one function and check the numbers they read from the
environment, ``jobs render`` checks its script with ``bash -n``, and config.h5 links are refused."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import yaml

from . import util

PY = sys.executable
TIMEOUT_S = 120
# every character a path or name can hold in a job, the ones bash treats specially among them
NASTY = "a}b it's #3 $HOME `x` \"q\" {c} \\ ; & | < > ( ) * ? [ ] ! ~"


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


# ------------------------------------------------------------------------------------------- --set values
def test_set_string_key_takes_the_text_with_a_hash_as_given(tmp_path):
    # the old reading: YAML, so ' #3' was a comment and the run wrote into tmp/exp
    util.make_data(tmp_path / "data.h5")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(util.spec(tmp_path, trainer={"steps": 1}, checkpoint={"keep": 0})))
    out = tmp_path / "exp #3"
    proc = run([PY, "-m", "lbannpy.train", str(spec), "--set", f"output.dir={out}", "--quiet"],
               env=util.ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "summary.json").is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("item,key", [("trainer.steps=3 #x", "trainer.steps"),
                                      ("trainer.steps=0x10", "trainer.steps"),
                                      ("model.layers.c1.kernel=[3, 5] # c", "kernel")])
def test_set_number_bool_or_list_with_a_bad_value_is_one_line_exit_2(tmp_path, item, key):
    # the old reading dropped ' #x' and ' # c' as comments and read 0x10 as 16, all without a word
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(util.spec(tmp_path)))  # its first layer is conv c1
    proc = run([PY, "-m", "lbannpy.config", "show", str(spec), "--set", item])
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert key in lines[0] and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------------- rendered jobs
def _stubs(tmp: Path) -> Path:
    """A PATH directory whose ``srun`` writes its arguments (NUL-separated) to $STUB_LOG and exits with
    $STUB_RC, and whose ``scontrol`` only records that it ran."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\nprintf '%s\\0' \"$@\" > \"$STUB_LOG\"\n"
                                  "exit \"${STUB_RC:-0}\"\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho \"scontrol $*\" >> \"$STUB_LOG.scontrol\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def _render(tmp: Path, *args: str) -> Path:
    script = tmp / "job.sbatch"
    proc = run([PY, "-m", "lbannpy.jobs", "render", "resnet50", *args, "-o", str(script)])
    assert proc.returncode == 0, proc.stderr
    assert run(["bash", "-n", str(script)]).returncode == 0
    return script


def _submit(tmp: Path, script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script as SLURM would start it (job 77, one task), with srun and scontrol stood in for."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LBANNPY_"))}
    env = dict(base, SLURM_JOB_ID="77", SLURM_NTASKS="1", STUB_LOG=str(tmp / "srun.log"),
               PATH=f"{_stubs(tmp)}{os.pathsep}{os.environ['PATH']}", **env)
    return run(["bash", str(script), *args], cwd=tmp, env=env)


def _srun_sets(tmp: Path) -> dict[str, str]:
    args = (tmp / "srun.log").read_text().split("\0")[:-1]
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--set")


def _run_dir_line(out: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith("  run_dir=")).split("=", 1)[1]


def test_job_run_dir_with_a_closing_brace_is_the_path_given(tmp_path):
    (tmp_path / "cfg.h5").write_text("")
    parent = tmp_path / "a}b"
    proc = _submit(tmp_path, _render(tmp_path, "--run-dir", str(parent)), "cfg.h5")
    assert proc.returncode == 0, proc.stderr
    assert _run_dir_line(proc.stdout) == f"{parent}/resnet50-77"
    assert (parent / "resnet50-77" / "finished").is_file()


def test_job_config_default_with_a_closing_brace_is_the_path_given(tmp_path):
    config = tmp_path / "c}x.h5"
    config.write_text("")
    proc = _submit(tmp_path, _render(tmp_path, "--config", str(config), "--run-dir", str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert f"config={config} (given)" in proc.stdout
    args = (tmp_path / "srun.log").read_text().split("\0")
    assert args[:4] == ["python", "-m", "lbannpy.train", str(config)]


def test_job_run_dir_with_a_quote_passes_bash_and_is_the_path_given(tmp_path):
    (tmp_path / "cfg.h5").write_text("")
    parent = tmp_path / "it's"
    proc = _submit(tmp_path, _render(tmp_path, "--run-dir", str(parent)), "cfg.h5")
    assert proc.returncode == 0, proc.stderr
    assert _run_dir_line(proc.stdout) == f"{parent}/resnet50-77"


def test_job_run_dir_with_shell_characters_reaches_the_trainer_as_given(tmp_path):
    from lbannpy.config import apply_overrides, load_config

    (tmp_path / "cfg.h5").write_text("")
    parent = tmp_path / NASTY
    proc = _submit(tmp_path, _render(tmp_path, "--run-dir", str(parent)), "cfg.h5")
    assert proc.returncode == 0, proc.stderr
    run_dir = f"{parent}/resnet50-77"
    assert _run_dir_line(proc.stdout) == run_dir and Path(run_dir, "finished").is_file()
    sets = _srun_sets(tmp_path)
    assert sets == {"output.dir": run_dir, "checkpoint.dir": f"{run_dir}/ckpt"}
    # and the trainer reads those --set values back as the same paths
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(util.spec(tmp_path)))
    cfg = apply_overrides(load_config(str(spec)), [f"{k}={v}" for k, v in sets.items()])
    assert cfg["output"]["dir"] == run_dir and cfg["checkpoint"]["dir"] == f"{run_dir}/ckpt"


@pytest.mark.parametrize("value", ["ten", "a[$(touch pwned)]", "-1", "1.5"])
def test_job_numeric_environment_variable_is_checked_at_start(tmp_path, value):
    # the old job read it in shell arithmetic after a run stopped: "ten: unbound variable", and an array
    # subscript in it ran a command
    (tmp_path / "cfg.h5").write_text("")
    proc = _submit(tmp_path, _render(tmp_path, "--run-dir", str(tmp_path)), "cfg.h5",
                   LBANNPY_MAX_REQUEUES=value, STUB_RC="4")
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert "LBANNPY_MAX_REQUEUES" in lines[0] and "whole number" in lines[0]
    assert not (tmp_path / "srun.log").exists(), "the job started a run before checking its variables"
    assert not (tmp_path / "pwned").exists()


def test_render_refuses_a_script_bash_cannot_parse(tmp_path):
    out = tmp_path / "job.sbatch"
    proc = run([PY, "-m", "lbannpy.jobs", "render", "resnet50", "--env-setup", "if true", "-o", str(out)])
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "bash -n" in lines[0], proc.stderr
    assert not out.exists()


def _words():
    """Every printable ASCII character alone, newline, and a few hundred seeded random strings of them."""
    alphabet = [chr(c) for c in range(32, 127)] + ["\n"]
    rng = random.Random(44)
    words = alphabet + ["", "''", "'\\''", "\n\n", " \n "]
    words += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(400)]
    return words


def test_shell_word_round_trips_every_printable_character_and_newline(tmp_path):
    from lbannpy.jobs.render import shell_word

    words = _words()
    lines = []
    for w in words:  # as an assignment's value, and as a command's argument
        lines += [f"v={shell_word(w)}", "printf '%s\\0' \"$v\"", f"printf '%s\\0' {shell_word(w)}"]
    script = tmp_path / "words.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(lines) + "\n")
    check = run(["bash", "-n", str(script)])
    assert check.returncode == 0, check.stderr
    proc = subprocess.run(["bash", str(script)], capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.decode().split("\0")[:-1]
    assert got == [w for w in words for _ in (0, 1)]


def test_rendered_scripts_compute_the_config_path_given(tmp_path):
    from lbannpy.jobs import JobSpec, render

    words = [w for w in _words() if w.strip() and "\n" not in w]
    lines = []
    for w in words[::8]:  # a real rendered job each (each render runs bash -n)
        text = render(JobSpec.for_site("resnet50", config=w))
        lines += [next(ln for ln in text.splitlines() if ln.startswith("config_default=")),
                  "printf '%s\\0' \"$config_default\""]
    proc = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split("\0")[:-1] == words[::8]


# ------------------------------------------------------------------------------------------- config.h5
def _config_with_link(tmp: Path, link) -> Path:
    from lbannpy.config import load_config, save_config

    spec = tmp / "spec.yaml"
    spec.write_text(yaml.safe_dump(util.spec(tmp)))
    other = dict(load_config(str(spec)), comm=dict(load_config(str(spec))["comm"], bucket_mb=1.5))
    save_config(other, str(tmp / "other.h5"))
    path = tmp / "config.h5"
    save_config(load_config(str(spec)), str(path))
    with h5py.File(path, "a") as f:
        del f["comm"]
        f["comm"] = link
    return path


@pytest.mark.parametrize("target", ["other.h5", "missing.h5"], ids=["external", "dangling"])
def test_config_external_link_is_refused_naming_it(tmp_path, target):
    # followed, the settings came from other.h5 without a word; dangling, it read "unexpected dataset"
    path = _config_with_link(tmp_path, h5py.ExternalLink(target, "/comm"))
    proc = run([PY, "-m", "lbannpy.config", "show", str(path)])
    lines = error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr, proc.stdout[-500:])
    assert "comm" in lines[0] and "external link" in lines[0] and target in lines[0], lines
