"""The model zoo: ready-made specs (the DESIGN.md YAML tree) for well-known CNNs and the mesh-tangling model.

``get_spec(name)`` returns a fresh dict each call (callers may edit it); ``batch_size`` sets
``trainer.batch_size`` and ``input_size`` the spatial input size (an int for every spatial dimension, or a
list). Specs are read with ``yaml.safe_load`` from the files next to this module.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import yaml

HERE = Path(__file__).resolve().parent


class ZooError(ValueError):
    """An unknown model name or an option the model cannot take."""


def names() -> list[str]:
    """Names of the zoo models, sorted."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def path(name: str) -> Path:
    """Path of the YAML file of zoo model ``name``."""
    p = HERE / f"{name}.yaml"
    if not p.is_file():
        raise ZooError(f"no zoo model {name!r}; available: {', '.join(names())}")
    return p


def get_spec(name: str, batch_size: int | None = None, input_size: int | Sequence[int] | None = None
             ) -> dict[str, Any]:
    """The spec of zoo model ``name`` (a dict in the DESIGN.md tree), optionally with another batch size
    and input size. The shapes are not checked here; ``lbannpy.strategy.graph.build_graph`` does that."""
    spec = yaml.safe_load(path(name).read_text())
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ZooError(f"batch_size must be a positive integer, got {batch_size!r}")
        spec.setdefault("trainer", {})["batch_size"] = batch_size
    if input_size is not None:
        spatial = spec["model"]["input"]["spatial"]
        if isinstance(input_size, int) and not isinstance(input_size, bool):
            new = [input_size] * len(spatial)
        else:
            new = [int(s) for s in input_size]
        if len(new) != len(spatial) or any(s < 1 for s in new):
            raise ZooError(f"input_size for {name!r} must be a positive int or {len(spatial)} positive ints "
                           f"(spatial dims {spatial}), got {input_size!r}")
        spec["model"]["input"]["spatial"] = new
    return spec
