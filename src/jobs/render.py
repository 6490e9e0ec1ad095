"""Render SLURM batch scripts from typed parameters.

    spec = JobSpec.for_site("mesh1k", site="gpu-cluster", nodes=4, time="02:00:00")
    text = render(spec)

Scripts are never edited by hand: ``jobs/*.sbatch`` are ``render_all()`` output, checked by a test.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass, fields
from pathlib import Path

from .sites import SITE_DIR, SITES, Site
from .templates import BODIES, BUILDERS, CONFIG_ARG, PREAMBLE, TEMPLATES, USAGE, VALUES

_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+(?:,[A-Za-z0-9_.-]+)*$")
_BARE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")  # characters no shell context expands or splits on
BASH_CHECK_TIMEOUT_S = 60
_CONTROL = ("Cc", "Cs", "Zl", "Zp")  # what a config's string keys refuse (config_types.Str)

DEVICE_NOTE = (
    "Devices: srun gives every rank all of its node's GPUs; the lbannpy runtime (comm/runtime.py) picks",
    "  GPU number SLURM_LOCALID (the node-local rank), so no CUDA_VISIBLE_DEVICES is set here and ranks",
    "  never share a GPU as long as tasks-per-node <= gpus-per-node.",
)


class JobSpecError(ValueError):
    """A job parameter is invalid; the message names the parameter, the value and the fix."""


@dataclass(frozen=True)
class JobSpec:
    """Everything a rendered batch script depends on. Build with :meth:`for_site` to get site defaults."""

    template: str
    site: str | Site                   # a built-in site's name, or a Site (from a site file)
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    time: str                          # HH:MM:SS or D-HH:MM:SS
    partition: str | None = None       # None: the cluster's default partition
    account: str | None = None
    env_setup: tuple[str, ...] | None = None   # the site's set-up lines (None) or lines replacing them
    config: str | None = None          # default config path baked in (the first argument still wins)
    run_dir: str | None = None         # parent of the job's run directory (default: SUBMIT_DIR/run)
    drop_points: bool = False          # sweeps: leave out rank counts that cannot run (else refuse the job)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATES:
            raise JobSpecError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")
        if not isinstance(self.site, Site) and self.site not in SITES:
            raise JobSpecError(f"unknown site {self.site!r}; choose one of {', '.join(SITES)} "
                               f"(or --site-file SITE.yaml: copy one of {SITE_DIR}/*.yaml)")
        for name, low in (("nodes", 1), ("tasks_per_node", 1), ("gpus_per_node", 0), ("cpus_per_task", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise JobSpecError(f"{name} must be an integer, got {value!r}")
            if value < low:
                raise JobSpecError(f"{name} must be >= {low}, got {value}")
        site = site_of(self)
        if self.gpus_per_node > site.gpus_per_node:
            raise JobSpecError(f"gpus_per_node={self.gpus_per_node} but site {site.name!r} has "
                               f"{site.gpus_per_node} GPU(s) per node; use --gpus-per-node "
                               f"<= {site.gpus_per_node}")
        if self.gpus_per_node and self.tasks_per_node > self.gpus_per_node:
            raise JobSpecError(f"tasks_per_node={self.tasks_per_node} > gpus_per_node={self.gpus_per_node}: "
                               f"ranks would share GPUs (the runtime binds rank SLURM_LOCALID to GPU "
                               f"SLURM_LOCALID); use --tasks-per-node <= {self.gpus_per_node}")
        if not isinstance(self.time, str) or not _TIME_RE.match(self.time):
            raise JobSpecError(f"time must be HH:MM:SS or D-HH:MM:SS, got {self.time!r}")
        days, hours, minutes, seconds = _TIME_RE.match(self.time).groups()
        if int(minutes) > 59 or int(seconds) > 59:
            raise JobSpecError(f"time {self.time!r}: minutes and seconds must be < 60")
        if int(days or 0) + int(hours) + int(minutes) + int(seconds) == 0:
            raise JobSpecError(f"time {self.time!r} is zero; give the job a wall-clock limit")
        for name in ("partition", "account"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not _NAME_RE.match(value)):
                raise JobSpecError(f"{name} {value!r} is not a SLURM name (letters, digits, '_', '.', '-', "
                                   f"comma-separated)")
        if self.env_setup is not None and (not isinstance(self.env_setup, tuple)
                                           or not all(isinstance(x, str) for x in self.env_setup)):
            raise JobSpecError("env_setup must be a tuple of shell lines (str), or None for the site's")
        for line in self.env_setup or ():
            if "\n" in line or "\r" in line:
                raise JobSpecError(f"env_setup line {line!r} contains a newline; give one line per entry")
            if line.lstrip().startswith("#SBATCH"):
                raise JobSpecError(f"env_setup line {line!r}: #SBATCH lines after commands are ignored by "
                                   f"sbatch; use the JobSpec fields (nodes, time, ...) instead")
        for name in ("config", "run_dir"):  # the trainer refuses control characters in paths too
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()
                                      or any(unicodedata.category(c) in _CONTROL for c in value)):
                raise JobSpecError(f"{name} must be a non-empty one-line path without control characters, "
                                   f"got {value!r}")
        if self.config is not None and self.template in ("calibrate", "mpi-check", "predict"):
            raise JobSpecError(f"template {self.template!r} takes no config")

    @classmethod
    def for_site(cls, template: str, site: str | Site = "local", **overrides) -> "JobSpec":
        """A JobSpec whose unset fields come from the site (a built-in's name or a :class:`Site`, e.g.
        from :func:`lbannpy.jobs.sites.load_site`). ``None`` values count as unset."""
        if not isinstance(site, Site) and site not in SITES:
            raise JobSpecError(f"unknown site {site!r}; choose one of {', '.join(SITES)} (or --site-file "
                               f"SITE.yaml: copy one of {SITE_DIR}/*.yaml)")
        known = {f.name for f in fields(cls)} - {"template", "site"}
        unknown = set(overrides) - known
        if unknown:
            raise JobSpecError(f"unknown job parameter(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(sorted(known))}")
        s: Site = site if isinstance(site, Site) else SITES[site]
        values = dict(nodes=1, tasks_per_node=s.tasks_per_node, gpus_per_node=s.gpus_per_node,
                      cpus_per_task=s.cpus_per_task, time=s.time, partition=s.partition)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "env_setup" in overrides and overrides["env_setup"] is not None:
            values["env_setup"] = overrides["env_setup"]  # an empty value replaces the site's lines too
        if isinstance(values.get("env_setup"), (list, str)):
            env = values["env_setup"]
            values["env_setup"] = tuple(env.splitlines() if isinstance(env, str) else env)
        return cls(template=template, site=site, **values)


def site_of(spec: JobSpec) -> Site:
    """The :class:`Site` a spec renders for."""
    return spec.site if isinstance(spec.site, Site) else SITES[spec.site]


def _fill(text: str, subs: dict[str, str]) -> str:
    for key, value in subs.items():
        text = text.replace(f"@{key}@", value)
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise AssertionError(f"unfilled placeholders {sorted(set(leftover))} in a template")
    return text


def shell_word(value: str) -> str:
    """``value`` as one bash word that evaluates to exactly ``value``: the one way a rendered script gets a
    name, path or number. Where it stands alone as a word (``run_parent=WORD``, ``cmd WORD``) nothing in it
    is expanded, split or globbed: it is left bare when made only of characters no shell context treats
    specially, else single-quoted with each ``'`` written as ``'\\''``. Bash strings cannot hold NUL."""
    if not isinstance(value, str) or "\0" in value:
        raise JobSpecError(f"cannot write {value!r} into a job script: expected text without NUL")
    if _BARE_WORD.fullmatch(value):
        return value
    return "'" + value.replace("'", "'\\''") + "'"


def comment_text(text: str) -> str:
    """``text`` for a ``#`` comment line: characters that would end the line or hide text (newlines,
    carriage returns, other controls) written as escapes, so nothing after them becomes a command."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def check_syntax(text: str) -> None:
    """Refuse a script that ``bash -n`` rejects: a broken ``--env-setup`` or site line would otherwise show
    only when the job starts, after its wait in the queue."""
    bash = shutil.which("bash")
    if bash is None:
        raise JobSpecError("bash is not on PATH: `jobs render` checks every script it writes with `bash -n`; "
                           "install bash or render on the cluster's login node")
    proc = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True,
                          timeout=BASH_CHECK_TIMEOUT_S)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[0]
        raise JobSpecError(f"the rendered script fails `bash -n` ({comment_text(first)}); check the "
                           f"--env-setup lines and the site's env_setup and comm_setup")


def _sweep_ranks(spec: JobSpec, tpl) -> tuple[str, str]:
    """The sweep's rank counts (shell words) and the comment lines on what was checked and dropped."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from .points import sweep_points

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.config import ConfigError

    total = spec.nodes * spec.tasks_per_node
    try:
        points, what = sweep_points(tpl.model, tpl.size, spec.config, total)
    except ConfigError as exc:
        raise JobSpecError(f"{tpl.name}: the config to sweep is not valid: {exc.line()}") from None
    bad = [pt for pt in points if pt.problem]
    if bad and not spec.drop_points:
        first = bad[0]
        raise JobSpecError(f"{tpl.name} on {total} ranks: the sweep point at {first.ranks} rank(s) per "
                           f"sample cannot run ({what}: {first.problem})"
                           + (f"; so can't {', '.join(str(b.ranks) for b in bad[1:])}" if bad[1:] else "")
                           + "; use fewer ranks, another config, or --drop-points to leave such points out")
    keep = [str(pt.ranks) for pt in points if not pt.problem]
    if not keep:
        raise JobSpecError(f"{tpl.name} on {total} ranks: no sweep point can run ({what}: {bad[0].problem})")
    note = [f"# Rank counts checked by `jobs render` ({comment_text(what)})."]
    note += [f"# Left out: {pt.ranks} rank(s) per sample ({comment_text(pt.problem)})" for pt in bad]
    return " ".join(keep), "\n".join(note) + "\n"


def _header(spec: JobSpec, tpl, site: Site) -> list[str]:
    """The ``#!``, ``#SBATCH`` and comment lines (comments: the usage, filled with the values as text)."""
    sbatch = [
        f"--job-name=lbannpy-{tpl.name}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.tasks_per_node}",
        f"--cpus-per-task={spec.cpus_per_task}",
        f"--time={spec.time}",
        "--output=%x-%j.out",
        "--open-mode=append",   # a requeued job's starts share one log
        "--signal=B:USR1@120",  # to the script, whose trap passes it on: checkpoint, exit 4, requeue, resume
        "--requeue",
    ]
    if spec.gpus_per_node:
        sbatch.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.partition:
        sbatch.append(f"--partition={spec.partition}")
    if spec.account:
        sbatch.append(f"--account={spec.account}")
    shown = {"TEMPLATE": tpl.name, "MODEL": tpl.model, "SIZE": str(tpl.size), "SAMPLES": str(tpl.samples),
             "STEPS": str(tpl.steps), "RUN_DIR_SHOWN": f"{spec.run_dir or 'SUBMIT_DIR/run'}/{tpl.name}-JOBID"}
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {opt}" for opt in sbatch]
    lines += [
        "#",
        f"# lbannpy job '{tpl.name}': {tpl.description}.",
        f"# Site '{comment_text(site.name)}': {comment_text(site.description)}.",
        "# Rendered by `python -m lbannpy.jobs render` from src/jobs/templates.py and the site in",
        "#   " + comment_text(f"{site.file}" if spec.site is site else f"src/jobs/sites/{site.name}.yaml")
        + "; do not edit, re-render",
        "# (jobs/*.sbatch: `python -m lbannpy.jobs render-all`).",
        "#",
    ]
    lines += ["# " + comment_text(_fill(u, shown)) for u in USAGE[tpl.kind]]
    lines += [
        "# sbatch options on the command line (--nodes, --ntasks-per-node, --time, ...) win over the #SBATCH",
        "#   lines above; srun lines take their sizes from the allocation.",
    ]
    if tpl.kind != "strategy":
        lines += ["# " + line for line in DEVICE_NOTE]
    return lines + [""]


def render(spec: JobSpec) -> str:
    """The batch script for ``spec`` (a complete bash file, checked with ``bash -n``)."""
    tpl = TEMPLATES[spec.template]
    site = site_of(spec)
    values = {"TEMPLATE": tpl.name, "SITE": site.name, "MPI": site.mpi, "MODEL": tpl.model,
              "SIZE": str(tpl.size), "SAMPLES": str(tpl.samples), "STEPS": str(tpl.steps),
              "CONFIG_DEFAULT": spec.config or ""}
    assert set(values) == set(VALUES), "every value placeholder is filled by shell_word"
    subs = {name: shell_word(value) for name, value in values.items()}
    # shell code: the run directory's parent, and for a job that holds GPUs the overrides that compute on
    # them (one rank per GPU, checked in JobSpec; CuPy arrays, NCCL), winning over the config's runtime
    subs["RUN_PARENT"] = shell_word(spec.run_dir) if spec.run_dir else '"${SLURM_SUBMIT_DIR:-$PWD}/run"'
    gpu = spec.gpus_per_node > 0
    subs["TRAIN_DEVICE"] = " --set runtime.device=gpu --set runtime.backend=nccl" if gpu else ""
    subs["BENCH_DEVICE"] = " --device gpu --backend nccl" if gpu else ""
    env_lines = list(site.env_setup if spec.env_setup is None else spec.env_setup)
    origin = "site" if spec.env_setup is None else "replaced with --env-setup"
    subs["SITE_ENV"] = (f"# environment set-up ({origin})\n" + "\n".join(env_lines) + "\n"
                        if env_lines else "")
    if site.comm_setup:  # communication settings stay whatever --env-setup says
        subs["SITE_ENV"] += ("# communication settings (site; --env-setup keeps them)\n"
                             + "\n".join(site.comm_setup) + "\n")
    if tpl.kind == "sweep":
        subs["RANKS"], subs["RANK_NOTE"] = _sweep_ranks(spec, tpl)
    text = "\n".join(_header(spec, tpl, site)) + "\n" + _fill(PREAMBLE, subs)
    if tpl.kind in BUILDERS:
        subs["BUILD"] = _fill(BUILDERS[tpl.kind], subs)
        text += _fill(CONFIG_ARG, subs)
    text += _fill(BODIES[tpl.kind], subs)
    check_syntax(text)
    return text


# The committed scripts: every template for the local one-node cluster.
RENDER_ALL: tuple[JobSpec, ...] = tuple(JobSpec.for_site(name, site="local") for name in TEMPLATES)


def render_all(out_dir: Path, check: bool = False) -> list[Path]:
    """Write (or with ``check`` compare) ``out_dir/<template>.sbatch`` for RENDER_ALL.

    Returns the files written, or with ``check`` the files that differ from a fresh render.
    """
    out_dir = Path(out_dir)
    changed = []
    for spec in RENDER_ALL:
        path = out_dir / f"{spec.template}.sbatch"
        text = render(spec)
        if check:
            if not path.is_file() or path.read_text() != text:
                changed.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".sbatch.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        tmp.replace(path)
        changed.append(path)
    return changed
