"""Job script rendering (lbannpy.jobs): typed parameters, validation, committed scripts, shell syntax.

Serial and fast: nothing here needs SLURM (tests/test_slurm.py submits the scripts).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from lbannpy.jobs import RENDER_ALL, SITES, TEMPLATES, JobSpec, JobSpecError, render, render_all
from lbannpy.jobs import helpers, templates
from lbannpy.jobs.render import shell_word

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
TIMEOUT_S = 60


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)


def assigned(text: str, var: str) -> str:
    """The value a script's line ``var=...`` gives ``var``, as bash computes it."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"{var}="))
    proc = run(["bash", "-c", f'{line}\nprintf "%s" "${var}"'])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def sbatch_options(text: str) -> dict[str, str]:
    opts = {}
    for line in text.splitlines():
        m = re.match(r"^#SBATCH --([a-z-]+)=(.*)$", line)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


# ------------------------------------------------------------------------------------ committed scripts
def test_committed_scripts_equal_a_fresh_render():
    stale = render_all(JOBS, check=True)
    assert not stale, (f"{[str(p) for p in stale]} differ from a fresh render; run "
                       f"`python -m lbannpy.jobs render-all` instead of editing them")
    committed = {p.name for p in JOBS.glob("*.sbatch")}
    assert committed == {f"{spec.template}.sbatch" for spec in RENDER_ALL}, "stray or missing jobs/*.sbatch"


def test_render_all_check_detects_an_edit(tmp_path):
    # negative control for the test above: a hand edit must be caught
    render_all(tmp_path)
    assert render_all(tmp_path, check=True) == []
    victim = tmp_path / "mesh1k.sbatch"
    victim.write_text(victim.read_text().replace("--time=00:30:00", "--time=00:31:00"))
    assert render_all(tmp_path, check=True) == [victim]
    proc = run([sys.executable, "-m", "lbannpy.jobs", "render-all", "--dir", str(tmp_path), "--check"])
    assert proc.returncode == 1 and "mesh1k.sbatch" in proc.stderr


def test_committed_scripts_are_executable():
    for spec in RENDER_ALL:
        path = JOBS / f"{spec.template}.sbatch"
        assert os.access(path, os.X_OK), f"{path} is not executable"


# ------------------------------------------------------------------------------------ rendering
@dataclass(frozen=True)
class RenderCase:
    template: str
    site: str

    @property
    def id(self) -> str:
        return f"{self.template}@{self.site}"


RENDER_CASES = [RenderCase(t, s) for t in TEMPLATES for s in SITES]


@pytest.mark.parametrize("case", RENDER_CASES, ids=[c.id for c in RENDER_CASES])
def test_every_rendered_script_passes_bash_syntax_check(case, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(render(JobSpec.for_site(case.template, site=case.site)))
    proc = run(["bash", "-n", str(path)])
    assert proc.returncode == 0, proc.stderr


def test_bash_syntax_check_catches_a_broken_script(tmp_path):
    # negative control: the syntax check above can fail
    path = tmp_path / "job.sbatch"
    path.write_text(render(JobSpec.for_site("mesh1k")).replace("done\n", "", 1))
    assert run(["bash", "-n", str(path)]).returncode != 0


@pytest.mark.parametrize("case", RENDER_CASES, ids=[c.id for c in RENDER_CASES])
def test_rendered_script_structure(case):
    text = render(JobSpec.for_site(case.template, site=case.site))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    # every #SBATCH line precedes the first command, or sbatch ignores it
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert "set -euo pipefail" in text
    site = SITES[case.site]
    assert f"site_mpi={shell_word(site.mpi)}" in lines
    assert 'export SLURM_MPI_TYPE="${SLURM_MPI_TYPE:-$site_mpi}"' in lines
    for env_line in site.env_setup:
        assert env_line in lines
    # resources come from the allocation: no srun line re-specifies them (only the sweeps' -n P)
    for ln in lines:
        if ln.lstrip().startswith("srun "):
            ln = ln.split(" python ")[0]  # srun's own options, not the program's
            assert not re.search(r"--(nodes|ntasks|ntasks-per-node|cpus-per-task|gpus|gpus-per-node|time"
                                 r"|mpi)\b"
                                 r"|\s-N\s|\s-c\s|\s-t\s", ln), ln
            assert re.search(r"\s-n\s", ln) is None or '-n "$p"' in ln, ln
    assert re.search(r"@[A-Z_]+@", text) is None, "unfilled placeholder"


def test_sbatch_lines_follow_the_spec():
    spec = JobSpec.for_site("resnet50", site="h100-cluster", nodes=4, tasks_per_node=8, gpus_per_node=8,
                            cpus_per_task=6, time="1-02:00:00", partition="h100-long", account="proj_1",
                            env_setup=("module load nccl", "export FOO=1"))
    text = render(spec)
    assert sbatch_options(text) == {
        "job-name": "lbannpy-resnet50", "nodes": "4", "ntasks-per-node": "8", "cpus-per-task": "6",
        "time": "1-02:00:00", "output": "%x-%j.out", "gpus-per-node": "8", "partition": "h100-long",
        "account": "proj_1", "signal": "B:USR1@120", "open-mode": "append"}
    lines = text.splitlines()
    assert "#SBATCH --requeue" in lines
    assert "module load nccl" in lines and "export FOO=1" in lines
    assert "module load gcc cuda" not in lines and "conda activate lbannpy" not in lines  # replaced
    assert "conda activate lbannpy" in render(JobSpec.for_site("resnet50", site="h100-cluster")).splitlines()
    assert "module load" not in render(JobSpec.for_site("resnet50", site="h100-cluster", env_setup=""))


def test_env_setup_replaces_only_the_environment_and_keeps_communication_settings(tmp_path):
    for site in SITES.values():
        text = render(JobSpec.for_site("mesh1k", site=site.name, env_setup=("module load mine",)))
        lines = text.splitlines()
        assert "module load mine" in lines
        assert not set(site.env_setup) & set(lines)           # the environment lines are replaced
        assert all(c in lines for c in site.comm_setup)       # NCCL/UCX settings are kept
    assert any("NCCL" in c for c in SITES["h100-cluster"].comm_setup)
    p = run([sys.executable, "-m", "lbannpy.jobs", "render", "mesh1k", "--site", "h100-cluster",
             "--nodes", "2", "--env-setup", "source venv/bin/activate", "-o", str(tmp_path / "j.sbatch")])
    assert p.returncode == 0, p.stderr
    assert "replaced site h100-cluster's environment lines (module load gcc cuda;" in p.stderr, p.stderr
    assert "communication settings stay (export NCCL_DEBUG" in p.stderr, p.stderr


def test_sites_are_files_and_a_new_site_is_a_copied_file(tmp_path):
    from lbannpy.jobs.sites import SITE_DIR, SiteError, load_site

    for site in SITES.values():  # the built-in sites are the files in SITE_DIR
        assert load_site(SITE_DIR / f"{site.name}.yaml") == site
    tree = yaml.safe_load((SITE_DIR / "gpu-cluster.yaml").read_text())
    tree.update(name="mine", gpus_per_node=2, tasks_per_node=2, partition="a100", env_setup=["module load x"])
    site_file = tmp_path / "mine.yaml"
    site_file.write_text(yaml.safe_dump(tree))
    out = tmp_path / "mine.sbatch"
    p = run([sys.executable, "-m", "lbannpy.jobs", "render", "resnet50", "--site-file", str(site_file),
             "--nodes", "3", "-o", str(out)])
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    opts = sbatch_options(text)
    assert (opts["gpus-per-node"], opts["ntasks-per-node"], opts["partition"], opts["nodes"]) == (
        "2", "2", "a100", "3")
    assert "module load x" in text.splitlines() and f"the site in\n#   {site_file};" in text
    assert run(["bash", "-n", str(out)]).returncode == 0
    tree["colour"] = "red"
    site_file.write_text(yaml.safe_dump(tree))
    with pytest.raises(SiteError, match="unknown key.*colour"):
        load_site(site_file)
    p = run([sys.executable, "-m", "lbannpy.jobs", "render", "resnet50", "--site-file", str(site_file)])
    assert p.returncode == 2 and "colour" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_site_defaults_fill_unset_fields():
    for site in SITES.values():
        spec = JobSpec.for_site("mesh1k", site=site.name)
        assert (spec.tasks_per_node, spec.gpus_per_node, spec.cpus_per_task, spec.time, spec.partition) == (
            site.tasks_per_node, site.gpus_per_node, site.cpus_per_task, site.time, site.partition)
        opts = sbatch_options(render(spec))
        assert ("gpus-per-node" in opts) == (site.gpus_per_node > 0)
        assert opts.get("partition") == site.partition


def test_local_site_has_no_gpus_and_uses_pmi2():
    local = SITES["local"]
    assert local.gpus_per_node == 0 and local.mpi == "pmi2"
    assert {s.gpus_per_node for s in SITES.values()} >= {4, 8}


def _srun_lines(text: str, module: str) -> list[str]:
    """The srun command lines (continuations joined) that start ``python -m <module>``."""
    joined = text.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip().startswith("srun")
            and f"python -m {module}" in line]


@pytest.mark.parametrize("site", sorted(n for n, s in SITES.items() if s.gpus_per_node))
def test_gpu_sites_train_and_calibrate_on_their_gpus(site, tmp_path):
    from lbannpy.config import parse_spec
    from lbannpy.config.overrides import apply_overrides
    from lbannpy.zoo import get_spec

    s = SITES[site]
    base = parse_spec(get_spec("lenet5"))
    assert base["runtime"]["device"] == "cpu", "negative control: the zoo's default runtime is the CPU"
    for name, tpl in TEMPLATES.items():
        text = render(JobSpec.for_site(name, site=site))
        opts = sbatch_options(text)
        # one rank per GPU
        assert opts["gpus-per-node"] == str(s.gpus_per_node) == opts["ntasks-per-node"], (name, opts)
        trains = [ln for ln in text.replace("\\\n", " ").splitlines()
                  if ln.strip().startswith("lbannpy_train ")]  # the calls of the job's training function
        assert bool(trains) == (tpl.kind in ("train", "sweep")), (name, trains)
        for line in trains:
            sets = re.findall(r"--set \"?([a-z_.]+=[^ \"]+)", line)
            cfg = apply_overrides(base, [x for x in sets if x.startswith("runtime.")])
            got = {k: cfg["runtime"][k] for k in ("device", "backend")}
            assert got == {"device": "gpu", "backend": "nccl"}, (name, line)
        for line in _srun_lines(text, "lbannpy.bench"):
            assert "--device gpu --backend nccl" in line, (name, line)
        if tpl.kind == "calibrate":
            assert _srun_lines(text, "lbannpy.bench calibrate")
    # the CPU site keeps the config's device: no GPU overrides anywhere
    for name in TEMPLATES:
        assert "runtime.device=gpu" not in render(JobSpec.for_site(name, site="local"))
        assert "--device gpu" not in render(JobSpec.for_site(name, site="local"))


def test_config_default_is_baked_in_and_quoted():
    path = '/data/my run/$HOME "x" {a}b it\'s #1.h5'
    text = render(JobSpec.for_site("resnet50", config=path))
    assert assigned(text, "config_default") == path
    assert 'config="${1:-$config_default}"' in text.splitlines()


def test_value_placeholders_stand_alone_as_shell_words():
    # shell_word's quoting holds only where its word is not inside other quotes or a ${...}
    fragments = [templates.PREAMBLE, templates.CONFIG_ARG, *templates.BODIES.values(),
                 *templates.BUILDERS.values()]
    seen = set()
    for fragment in fragments:
        for line in fragment.splitlines():
            for m in re.finditer(r"@([A-Z_]+)@", line):
                if m.group(1) not in templates.VALUES:
                    continue
                seen.add(m.group(1))
                before, after = line[:m.start()], line[m.end():]
                # a word of its own, or the whole value of an assignment word; outside double quotes
                assert re.search(r"(^|\s)([A-Za-z_][A-Za-z_0-9]*=)?$", before), line
                assert re.match(r"(\s|$)", after) and before.count('"') % 2 == 0, line
    assert seen == set(templates.VALUES)


def test_spec_is_frozen():
    spec = JobSpec.for_site("mesh1k")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nodes = 2  # type: ignore[misc]


# ------------------------------------------------------------------------------------ validation
@dataclass(frozen=True)
class BadSpec:
    name: str
    template: str
    site: str
    overrides: tuple[tuple[str, object], ...]
    message: str          # regex the error must match


BAD_SPECS = [
    BadSpec("unknown-template", "mesh9k", "local", (), r"unknown template 'mesh9k'.*mesh1k"),
    BadSpec("unknown-site", "mesh1k", "lassen", (), r"unknown site 'lassen'.*gpu-cluster"),
    BadSpec("zero-nodes", "mesh1k", "local", (("nodes", 0),), r"nodes must be >= 1, got 0"),
    BadSpec("float-tasks", "mesh1k", "local", (("tasks_per_node", 2.0),),
            r"tasks_per_node must be an integer"),
    BadSpec("bool-cpus", "mesh1k", "local", (("cpus_per_task", True),), r"cpus_per_task must be an integer"),
    BadSpec("gpus-on-cpu-site", "mesh1k", "local", (("gpus_per_node", 1),),
            r"site 'local' has 0 GPU\(s\) per node"),
    BadSpec("too-many-gpus", "mesh1k", "gpu-cluster", (("gpus_per_node", 8),), r"gpus-per-node <= 4"),
    BadSpec("ranks-share-gpus", "mesh1k", "gpu-cluster", (("tasks_per_node", 8),),
            r"ranks would share GPUs.*--tasks-per-node <= 4"),
    BadSpec("time-format", "mesh1k", "local", (("time", "90"),), r"HH:MM:SS"),
    BadSpec("time-minutes", "mesh1k", "local", (("time", "01:75:00"),), r"minutes and seconds must be < 60"),
    BadSpec("time-zero", "mesh1k", "local", (("time", "00:00:00"),), r"is zero"),
    BadSpec("partition-space", "mesh1k", "local", (("partition", "gpu debug"),), r"not a SLURM name"),
    BadSpec("account-injection", "mesh1k", "local", (("account", "a\n#SBATCH --nodes=99"),),
            r"not a SLURM name"),
    BadSpec("env-sbatch", "mesh1k", "local", (("env_setup", ("#SBATCH --nodes=2",)),), r"#SBATCH lines"),
    BadSpec("config-newline", "mesh1k", "local", (("config", "a.h5\nrm -rf /"),), r"one-line path"),
    BadSpec("config-for-calibrate", "calibrate", "local", (("config", "c.h5"),), r"takes no config"),
    BadSpec("unknown-field", "mesh1k", "local", (("gpus", 2),), r"unknown job parameter\(s\) gpus"),
]


@pytest.mark.parametrize("bad", BAD_SPECS, ids=[b.name for b in BAD_SPECS])
def test_invalid_specs_are_refused_with_a_clear_message(bad):
    with pytest.raises(JobSpecError, match=bad.message):
        JobSpec.for_site(bad.template, site=bad.site, **dict(bad.overrides))


def test_cli_render_writes_a_file_and_refuses_bad_input(tmp_path):
    out = tmp_path / "sub" / "job.sbatch"
    proc = run([sys.executable, "-m", "lbannpy.jobs", "render", "mesh2k", "--site", "gpu-cluster",
                "--nodes", "2", "--time", "00:10:00", "--account", "abc", "--env-setup",
                "module load x\nexport Y=1", "-o", str(out)])
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text == render(JobSpec.for_site("mesh2k", site="gpu-cluster", nodes=2, time="00:10:00",
                                           account="abc", env_setup=("module load x", "export Y=1")))
    assert os.access(out, os.X_OK)
    proc = run([sys.executable, "-m", "lbannpy.jobs", "render", "mesh2k", "--site", "gpu-cluster",
                "--tasks-per-node", "6"])
    assert proc.returncode == 2 and "ranks would share GPUs" in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------------------------ script behaviour
def test_script_outside_slurm_fails_clearly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = run(["bash", str(JOBS / "mesh1k.sbatch")], cwd=tmp_path, env=env)
    assert proc.returncode != 0 and "submit this script with sbatch" in proc.stderr


def test_script_with_missing_config_fails_clearly(tmp_path):
    env = dict(os.environ, SLURM_JOB_ID="7", SLURM_NTASKS="2")
    for name in ("mesh1k", "resnet50", "strategy"):
        proc = run(["bash", str(JOBS / f"{name}.sbatch"), "no-such-config.h5"], cwd=tmp_path, env=env)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert "config 'no-such-config.h5' not found" in proc.stderr
        assert f"template={name}" in proc.stdout  # resolved parameters are printed first


# ------------------------------------------------------------------------------------ helpers
ZOO_SPEC = {
    "model": {"name": "m", "input": {"channels": 3, "spatial": [224, 224]},
              "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3},
                         {"name": "f1", "type": "fc", "units": 10}],
              "loss": "cross_entropy"},
    "data": {"train": {"path": "imagenet.h5", "inputs": "inputs", "labels": "labels"},
             "validate": {"path": "val.h5", "inputs": "inputs", "labels": "labels"}},
    "trainer": {"batch_size": 32, "epochs": 90, "seed": 1},
}


def test_adapt_spec_resizes(tmp_path):
    src, dst = tmp_path / "zoo.yaml", tmp_path / "spec.yaml"
    src.write_text(yaml.safe_dump(ZOO_SPEC))
    proc = run([sys.executable, "-m", "lbannpy.jobs", "adapt-spec", str(src), "-o", str(dst), "--size", "64",
                "--data", "d.h5", "--samples", "4", "--steps", "3"])
    assert proc.returncode == 0, proc.stderr
    spec = yaml.safe_load(dst.read_text())
    assert spec["model"]["input"] == {"channels": 3, "spatial": [64, 64]}
    assert spec["data"]["train"]["path"] == "d.h5" and spec["data"]["validate"]["path"] == "d.h5"
    assert spec["trainer"] == {"batch_size": 4, "seed": 1, "steps": 3}  # batch capped at samples
    helpers.adapt_spec(src, dst, size=32, batch_size=2)
    spec = yaml.safe_load(dst.read_text())
    assert spec["trainer"]["batch_size"] == 2 and spec["trainer"]["epochs"] == 90
    assert spec["model"]["input"]["spatial"] == [32, 32]


def test_adapt_spec_refuses_a_non_spec(tmp_path):
    src = tmp_path / "zoo.yaml"
    src.write_text("- just\n- a list\n")
    with pytest.raises(helpers.JobHelperError, match="no 'model' mapping"):
        helpers.adapt_spec(src, tmp_path / "out.yaml", size=8)


@pytest.mark.parametrize("text,message", [
    ("a: &x [1, 2]\nb: *x\nmodel: {}\n", "alias"),
    ("model: {}\nmodel: {}\n", "duplicate key 'model'"),
])
def test_adapt_spec_reads_specs_with_the_bounded_loader(tmp_path, text, message):
    src = tmp_path / "zoo.yaml"
    src.write_text(text)
    with pytest.raises(helpers.JobHelperError, match=message):
        helpers.adapt_spec(src, tmp_path / "out.yaml", size=8)


def test_synth_images_shapes(tmp_path):
    h5py = pytest.importorskip("h5py")
    spec_path = tmp_path / "spec.yaml"
    helpers.write_atomic(spec_path, yaml.safe_dump(ZOO_SPEC))
    helpers.adapt_spec(spec_path, spec_path, size=16)
    shape, classes = helpers.synth_images(spec_path, tmp_path / "img.h5", samples=5)
    assert shape == (5, 3, 16, 16) and classes == 10
    with h5py.File(tmp_path / "img.h5", "r") as f:
        assert f["inputs"].shape == (5, 3, 16, 16) and f["inputs"].dtype == "float32"
        labels = f["labels"][()]
        assert labels.shape == (5,) and labels.min() >= 0 and labels.max() < 10


def _write_run(run_dir: Path, name: str, summary: dict) -> None:
    (run_dir / name).mkdir(parents=True)
    (run_dir / name / "summary.json").write_text(json.dumps(summary))


def test_scaling_table(tmp_path):
    _write_run(tmp_path, "strong-1", {"median_step_s": 4.0})
    _write_run(tmp_path, "strong-2", {"median_step_s": 2.5})
    _write_run(tmp_path, "strong-4", {"median_step_s": 1.0})
    _write_run(tmp_path, "weak-1", {"timing": {"step_time_s": 2.0}})
    _write_run(tmp_path, "weak-2", {"timing": {"step_time_s": 2.5}})
    (tmp_path / "input").mkdir()  # other directories are ignored
    rows = helpers.scaling_table(tmp_path)
    got = [(r.sweep, r.ranks, r.step_s, round(r.speedup, 6), round(r.efficiency, 6), r.key) for r in rows]
    assert got == [
        ("strong", 1, 4.0, 1.0, 1.0, "median_step_s"),
        ("strong", 2, 2.5, 1.6, 0.8, "median_step_s"),
        ("strong", 4, 1.0, 4.0, 1.0, "median_step_s"),
        ("weak", 1, 2.0, 1.0, 1.0, "timing.step_time_s"),
        ("weak", 2, 2.5, 1.6, 0.8, "timing.step_time_s"),
    ]
    proc = run([sys.executable, "-m", "lbannpy.jobs", "scaling", str(tmp_path), "-o",
                str(tmp_path / "s.csv")])
    assert proc.returncode == 0, proc.stderr
    csv_lines = (tmp_path / "s.csv").read_text().splitlines()
    assert csv_lines[0] == "sweep,ranks,step_s,speedup,efficiency,key"
    assert csv_lines[2] == "strong,2,2.5,1.6000,0.8000,median_step_s"
    assert "efficiency" in proc.stdout and len(proc.stdout.splitlines()) == 6


@pytest.mark.parametrize("summary, message", [
    ({"loss": 0.1, "steps": 3}, r"none of the step-time keys.*its keys: loss, steps"),
    ({"median_step_s": "fast"}, r"none of the step-time keys"),
    ({"median_step_s": 0.0}, r"none of the step-time keys"),
], ids=["no-key", "not-a-number", "zero"])
def test_scaling_refuses_unusable_summaries(tmp_path, summary, message):
    _write_run(tmp_path, "strong-1", summary)
    with pytest.raises(helpers.JobHelperError, match=message):
        helpers.scaling_table(tmp_path)


def test_scaling_refuses_an_unfinished_run(tmp_path):
    (tmp_path / "strong-2").mkdir()
    with pytest.raises(helpers.JobHelperError, match=r"strong-2/summary.json is missing"):
        helpers.scaling_table(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run([sys.executable, "-m", "lbannpy.jobs", "scaling", str(empty)])
    assert proc.returncode == 2 and "no strong-P/ or weak-P/ run directories" in proc.stderr


def test_config_value_reads_a_yaml_spec(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(ZOO_SPEC))
    proc = run([sys.executable, "-m", "lbannpy.jobs", "config-value", str(spec), "trainer.batch_size"])
    assert proc.returncode == 0 and proc.stdout.strip() == "32", proc.stderr
    proc = run([sys.executable, "-m", "lbannpy.jobs", "config-value", str(spec), "trainer.nope"])
    assert proc.returncode == 2 and "has no key 'trainer.nope'" in proc.stderr
    with pytest.raises(helpers.JobHelperError, match="not found"):
        helpers.config_value(tmp_path / "missing.h5", "trainer.batch_size")


# ------------------------------------------------------------------------------- requeue, run dir, sweeps
def test_sweep_points_that_cannot_run_are_refused_or_dropped_with_a_note():
    # mesh1k at 1024x1024: the last block's 16 rows cannot be split 32 ways
    spec = dict(site="h100-cluster", nodes=4)  # 4 x 8 ranks: P = 1 .. 32
    with pytest.raises(JobSpecError, match=r"mesh1k on 32 ranks: the sweep point at 32 rank\(s\).*'h'.*"
                                           r"--drop-points"):
        render(JobSpec.for_site("mesh1k", **spec))
    text = render(JobSpec.for_site("mesh1k", drop_points=True, **spec))
    assert "for p in 1 2 4 8 16; do" in text
    assert re.search(r"^# Left out: 32 rank\(s\) per sample \(.*split 32 ways", text, re.M), text
    # 2 nodes: every point runs, nothing left out
    text = render(JobSpec.for_site("mesh1k", site="h100-cluster", nodes=2))
    assert "for p in 1 2 4 8 16; do" in text and "# Left out" not in text


def test_cli_drop_points(tmp_path):
    base = [sys.executable, "-m", "lbannpy.jobs", "render", "mesh1k", "--site", "h100-cluster",
            "--nodes", "4"]
    proc = run(base)
    assert proc.returncode == 2 and "--drop-points" in proc.stderr and proc.stdout == "", proc.stderr
    proc = run(base + ["--drop-points"])
    assert proc.returncode == 0 and "# Left out: 32 rank(s)" in proc.stdout, proc.stderr


def test_run_dir_and_requeue_lines():
    text = render(JobSpec.for_site("resnet50", run_dir="/scratch/me"))
    assert "run_parent=/scratch/me" in text.splitlines()
    assert 'run_dir="${LBANNPY_RUN_DIR:-$run_parent/$template-$SLURM_JOB_ID}"' in text.splitlines()
    text = render(JobSpec.for_site("resnet50"))
    assert 'run_parent="${SLURM_SUBMIT_DIR:-$PWD}/run"' in text.splitlines()
    assert "trap 'lbannpy_forward USR1' USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert '--set "checkpoint.dir=$out/ckpt"' in text
