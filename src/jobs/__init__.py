"""SLURM batch scripts rendered from typed parameters (``python -m lbannpy.jobs``).

``JobSpec`` (frozen) + a site from ``sites.SITES`` + a template from ``templates.TEMPLATES`` -> a bash
script. The committed ``jobs/*.sbatch`` are ``render_all`` output; ``jobs/local-cluster/start`` starts the
one-node SLURM they are tested on.
"""
from .render import RENDER_ALL, JobSpec, JobSpecError, render, render_all
from .sites import SITES, Site
from .templates import TEMPLATES, Template

__all__ = ["JobSpec", "JobSpecError", "RENDER_ALL", "SITES", "Site", "TEMPLATES", "Template", "render",
           "render_all"]
