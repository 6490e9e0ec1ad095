"""The rank counts of a scaling sweep that can run, checked when the job is rendered.

A sweep runs its config at P = 1, 2, 4, ... ranks per sample up to the job's ranks, splitting the height
P ways (and, for the weak sweep, the mini-batch P times larger). At a large P a layer's block can be empty
or smaller than its halo; such a point would fail inside the job. :func:`sweep_points` runs the config
checks (``lbannpy.config.validate``: schema, shapes, rank count; not the data, which the job may build, nor
memory, which is the compute node's) for every point, so ``jobs render`` can refuse the job or leave those
points out with a note.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    ranks: int
    problem: str = ""          # "" when both sweeps can run at this rank count


def rank_counts(total: int) -> list[int]:
    """1, 2, 4, ... up to ``total`` ranks."""
    out, p = [], 1
    while p <= total:
        out.append(p)
        p *= 2
    return out


def _base_config(model: str, size: int, config: str | None) -> tuple[dict | None, str]:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy import zoo
    from lbannpy.config import load_config

    if config:
        if not os.path.isfile(config):
            return None, f"the config {config} is not here to check (checked in the job instead)"
        return load_config(config), f"config {config}"
    return zoo.get_spec(model, input_size=size), f"zoo model {model} at {size}x{size}"


def sweep_points(model: str, size: int, config: str | None, total: int) -> tuple[list[Point], str]:
    """Every rank count of the sweep with the problem that stops it ("" when none), and what was checked
    (the config's name, or why nothing could be)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.config import ConfigError, apply_overrides, validate

    base, what = _base_config(model, size, config)
    if base is None:
        return [Point(p) for p in rank_counts(total)], what
    batch = int(validate(base, data=False, memory=False)["trainer"]["batch_size"])
    points = []
    for p in rank_counts(total):
        problem = ""
        for sweep, b in (("strong", batch), ("weak", batch * p)):
            sets = ["parallel.default.n=1", f"parallel.default.h={p}", f"trainer.batch_size={b}"]
            try:
                validate(apply_overrides(base, sets), ranks=p, data=False, memory=False)
            except ConfigError as exc:
                problem = f"{sweep}: {exc.line()}"
                break
        points.append(Point(p, problem))
    return points, what
