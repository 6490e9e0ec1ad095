"""Cluster facts that job scripts depend on, one frozen record per site, read from a site file.

A site says what a node has (GPUs), where jobs go by default (partition), how srun starts MPI ranks
(the ``--mpi`` plugin, set once for the job through ``SLURM_MPI_TYPE`` so that no srun line repeats it),
which lines prepare the environment (``env_setup``: modules, conda; what ``--env-setup`` replaces) and which
set up communication (``comm_setup``: NCCL/UCX variables; kept whatever the environment lines are). Job
parameters that vary per run (nodes, tasks, time) live in :class:`lbannpy.jobs.render.JobSpec`; its defaults
come from here.

A site is a YAML file (``python -m lbannpy.jobs render --site-file SITE.yaml``); the built-in sites are the
files in ``sites/`` beside this module (``python -m lbannpy.jobs list`` prints where), written to be copied.
Files are read safely (:func:`lbannpy.yamlsafe.load`) and every key is checked.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from lbannpy import yamlsafe

SITE_DIR = Path(__file__).resolve().parent / "sites"
BUILTIN_ORDER = ("local", "gpu-cluster", "h100-cluster")
MAX_SITE_BYTES = 1 << 16


class SiteError(ValueError):
    """A site file that cannot be used; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class Site:
    name: str
    description: str
    gpus_per_node: int          # GPUs on one node; 0 = CPU-only site
    partition: str | None       # default partition; None = the cluster's default partition
    mpi: str                    # srun --mpi plugin: pmi2 (MPICH from PyPI/conda) or pmix (Open MPI,
    #                             vendor MPI)
    tasks_per_node: int         # default ranks per node: one per GPU on GPU sites
    cpus_per_task: int          # default cores per rank (OMP/BLAS threads, data loading)
    time: str                   # default wall-clock limit, HH:MM:SS
    env_setup: tuple[str, ...] = ()   # environment lines (modules, conda): --env-setup replaces them
    comm_setup: tuple[str, ...] = ()  # communication settings (NCCL, UCX): always kept
    file: str | None = None     # the site file it was read from


_INTS = ("gpus_per_node", "tasks_per_node", "cpus_per_task")
_LINES = ("env_setup", "comm_setup")


def site_from_dict(tree, where: str) -> Site:
    """A :class:`Site` from a site file's mapping; :class:`SiteError` names ``where`` and the key."""
    if not isinstance(tree, dict):
        keys = ", ".join(f.name for f in fields(Site) if f.name != "file")
        raise SiteError(f"{where}: a site file is a YAML mapping of {keys}")
    known = [f.name for f in fields(Site) if f.name != "file"]
    unknown = sorted(set(tree) - set(known))
    if unknown:
        raise SiteError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; a site has "
                        f"{', '.join(known)}")
    missing = [k for k in known if k not in tree and k not in _LINES]
    if missing:
        raise SiteError(f"{where}: missing key(s) {', '.join(missing)} (see the built-in sites in "
                        f"{SITE_DIR})")
    values = dict(tree)
    for k in _INTS:
        v = values[k]
        low = 0 if k == "gpus_per_node" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise SiteError(f"{where}: {k} must be an integer >= {low}, got {v!r}")
    for k in ("name", "description", "mpi", "time"):
        if not isinstance(values[k], str) or not values[k].strip():
            raise SiteError(f"{where}: {k} must be a non-empty string, got {values[k]!r}")
    if values["partition"] is not None and not isinstance(values["partition"], str):
        raise SiteError(f"{where}: partition must be a string or null, got {values['partition']!r}")
    for k in _LINES:
        lines = values.get(k) or []
        if not isinstance(lines, list) or not all(isinstance(x, str) and "\n" not in x for x in lines):
            raise SiteError(f"{where}: {k} must be a list of one-line shell commands, got {lines!r}")
        values[k] = tuple(lines)
    return Site(**values, file=where)


def load_site(path: str | os.PathLike) -> Site:
    """The site of a YAML file (``--site-file``)."""
    p = Path(path)
    if not p.is_file():
        raise SiteError(f"--site-file {path}: no such file (the built-in sites in {SITE_DIR} are examples)")
    if p.stat().st_size > MAX_SITE_BYTES:
        raise SiteError(f"{path}: {p.stat().st_size} bytes; a site file is a few hundred")
    try:
        tree = yamlsafe.load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, yamlsafe.YamlLimitError, UnicodeDecodeError) as exc:
        raise SiteError(f"{path}: not valid YAML ({exc})") from None
    return site_from_dict(tree, str(path))


def _builtin() -> dict[str, Site]:
    files = sorted(SITE_DIR.glob("*.yaml"), key=lambda f: (BUILTIN_ORDER + (f.stem,)).index(f.stem))
    sites = (load_site(f) for f in files)
    return {s.name: s for s in sites}


SITES: dict[str, Site] = _builtin()
