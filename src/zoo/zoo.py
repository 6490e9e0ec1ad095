"""The model zoo: ready-made specs (the DESIGN.md YAML tree) for well-known CNNs and the mesh-tangling model.

``get_spec(name)`` returns a fresh dict each call (callers may edit it); ``batch_size`` sets
``trainer.batch_size`` and ``input_size`` the spatial input size (an int for every spatial dimension, or a
list). Specs are read with ``yaml.safe_load`` from the files next to this module.

Every spec names a data file that one ``python -m lbannpy.data`` command makes with the model's input shape
and class count (:func:`data_command`); the spec's header comment and the trainer's missing-file hint print
that command.
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


MESH_CHANNELS = 18   # channels `lbannpy.data mesh` writes (its --channels keeps the first C)
MESH3D_CHANNELS = 14  # channels `lbannpy.data mesh3d` writes (likewise)
BLOBS_MAX_CLASSES = 1000


def data_command(channels: int, spatial: Sequence[int], classes: int, loss: str, path: str,
                 samples: int) -> str | None:
    """The ``python -m lbannpy.data`` command that writes ``path`` with ``samples`` samples shaped for a
    model with this input and output, or None when no generator makes that shape (non-square input, more
    mesh channels than the generator has, segmentation with other than 2 classes)."""
    spatial = [int(s) for s in spatial]
    if len(spatial) == 3 and spatial[1] == spatial[2]:
        return _volume_command(channels, spatial, classes, loss, path, samples)
    if len(spatial) != 2 or spatial[0] != spatial[1]:
        return None
    size = spatial[0]
    if loss == "pixel_cross_entropy":
        if classes != 2 or not 1 <= channels <= MESH_CHANNELS:
            return None
        chan = "" if channels == MESH_CHANNELS else f" --channels {channels}"
        return f"python -m lbannpy.data mesh --size {size} --samples {samples}{chan} -o {path}"
    if not 2 <= classes <= BLOBS_MAX_CLASSES:
        return None
    return (f"python -m lbannpy.data blobs --size {size} --channels {channels} --classes {classes} "
            f"--samples {samples} -o {path}")


def _volume_command(channels: int, spatial: list[int], classes: int, loss: str, path: str,
                    samples: int) -> str | None:
    """``lbannpy.data mesh3d`` for a per-voxel 2-class model on D x N x N volumes (``--depth`` only where
    D differs from N)."""
    if loss != "pixel_cross_entropy" or classes != 2 or not 1 <= channels <= MESH3D_CHANNELS:
        return None
    depth, size = spatial[0], spatial[1]
    extra = (f" --depth {depth}" if depth != size else "") + (
        f" --channels {channels}" if channels != MESH3D_CHANNELS else "")
    return f"python -m lbannpy.data mesh3d --size {size} --samples {samples}{extra} -o {path}"


def spec_data_command(spec: dict[str, Any]) -> str | None:
    """:func:`data_command` for a zoo spec: its input, its last layer's units or filters, its data path, and
    four mini-batches of samples."""
    model = spec["model"]
    last = model["layers"][-1]
    classes = int(last.get("units", last.get("filters", 0)))
    return data_command(int(model["input"]["channels"]), model["input"]["spatial"], classes, model["loss"],
                        spec["data"]["train"]["path"], 4 * int(spec["trainer"]["batch_size"]))


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
