"""Small steps the batch scripts call as ``python -m lbannpy.jobs ...``.

- :func:`adapt_spec`: resize a zoo spec (image size, data path, steps, batch) for a job's default config;
- :func:`synth_images`: random images and labels shaped like a spec's input, for throughput jobs;
- :func:`config_value`: one key of a config.h5 (read through ``python -m lbannpy.config show``) or spec;
- :func:`scaling_table`: step times of the strong/weak sweep runs, with speedup and efficiency.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

# summary.json keys tried, in order, for the time of one training step (seconds). The first one present
# (top level, or one level down, e.g. {"timing": {"median_step_s": ...}}) is used and named in scaling.csv.
STEP_TIME_KEYS = ("median_step_s", "step_time_s", "time_per_step_s", "mean_step_s", "step_s")

CONFIG_SHOW_TIMEOUT_S = 120


class JobHelperError(RuntimeError):
    """A helper step cannot do its job; the message says what is missing and where."""


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _load_spec(path: Path) -> dict:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.yamlsafe import YamlLimitError, load

    try:
        spec = load(Path(path).read_text())
    except FileNotFoundError:
        raise JobHelperError(f"spec {path} not found") from None
    except YamlLimitError as exc:
        raise JobHelperError(f"spec {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise JobHelperError(f"spec {path} is not valid YAML: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise JobHelperError(f"spec {path} has no 'model' mapping; expected a spec from "
                             f"`python -m lbannpy.config zoo NAME`")
    return spec


def adapt_spec(src: Path, dst: Path, *, size: int | None = None, data: str | None = None,
               samples: int | None = None, steps: int | None = None, batch_size: int | None = None) -> dict:
    """Copy spec ``src`` to ``dst`` with the job's sizes.

    size: every spatial extent of ``model.input.spatial`` (pixels); data: the path of every ``data.*``
    section; steps: ``trainer.steps`` (replaces ``epochs``); batch_size: ``trainer.batch_size``, else the
    spec's batch capped at ``samples`` so a tiny data set still fills a batch.
    """
    spec = _load_spec(src)
    for name, value in (("size", size), ("samples", samples), ("steps", steps), ("batch_size", batch_size)):
        if value is not None and value < 1:
            raise JobHelperError(f"{name} must be >= 1, got {value}")
    if size is not None:
        inp = spec["model"].setdefault("input", {})
        if not isinstance(inp, dict):
            raise JobHelperError(f"spec {src}: model.input is not a mapping")
        dims = len(inp.get("spatial") or [0, 0])
        inp["spatial"] = [int(size)] * dims
    if data is not None:
        sections = spec.setdefault("data", {})
        if not isinstance(sections, dict):
            raise JobHelperError(f"spec {src}: data is not a mapping")
        sections.setdefault("train", {"inputs": "inputs", "labels": "labels"})
        for section in sections.values():
            if isinstance(section, dict):
                section["path"] = str(data)
    trainer = spec.setdefault("trainer", {})
    if steps is not None:
        trainer.pop("epochs", None)
        trainer["steps"] = int(steps)
    if batch_size is not None:
        trainer["batch_size"] = int(batch_size)
    elif samples is not None and isinstance(trainer.get("batch_size"), int):
        trainer["batch_size"] = min(trainer["batch_size"], int(samples))
    write_atomic(dst, yaml.safe_dump(spec, sort_keys=False))
    return spec


def _spec_classes(spec: dict) -> int:
    """Output classes: the units of the last layer that has them (the classifier)."""
    for layer in reversed(spec["model"].get("layers") or []):
        if isinstance(layer, dict) and isinstance(layer.get("units"), int):
            return layer["units"]
    raise JobHelperError("spec has no layer with 'units' (a classifier); cannot choose label classes")


def synth_images(like: Path, out: Path, samples: int, seed: int = 0) -> tuple[tuple[int, ...], int]:
    """Write ``samples`` random images shaped like ``like``'s model input (N, C, *spatial, float32) and
    uniform labels over its classes (int64) to HDF5 ``out``, under the dataset names of data.train."""
    import h5py
    import numpy as np

    spec = _load_spec(like)
    inp = spec["model"].get("input") or {}
    channels, spatial = inp.get("channels"), inp.get("spatial")
    if not isinstance(channels, int) or not spatial or not all(isinstance(s, int) for s in spatial):
        raise JobHelperError(f"spec {like}: model.input needs integer channels and spatial, got {inp}")
    if samples < 1:
        raise JobHelperError(f"samples must be >= 1, got {samples}")
    classes = _spec_classes(spec)
    train = (spec.get("data") or {}).get("train") or {}
    inputs_name, labels_name = train.get("inputs", "inputs"), train.get("labels", "labels")
    shape = (samples, channels, *spatial)
    rng = np.random.default_rng(seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with h5py.File(tmp, "w") as f:
        images = f.create_dataset(inputs_name, shape=shape, dtype="float32")
        for i in range(samples):  # one sample at a time: 224^2 x 3 x 64 would be fine, 2k^2 would not
            images[i] = rng.standard_normal(shape[1:], dtype=np.float32)
        f.create_dataset(labels_name, data=rng.integers(0, classes, size=samples, dtype=np.int64))
    tmp.replace(out)
    return shape, classes


def config_value(config: Path, key: str, python: str = sys.executable):
    """The value at dotted ``key`` of ``config`` (config.h5), read from ``python -m lbannpy.config show``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.yamlsafe import load as load_bounded

    if not Path(config).is_file():
        raise JobHelperError(f"config {config} not found")
    if Path(config).suffix in (".yaml", ".yml"):
        # the trainer also runs a YAML spec directly; read it the same safe way
        return _lookup(_load_spec(Path(config)), key, config)
    try:
        proc = subprocess.run([python, "-m", "lbannpy.config", "show", str(config)], capture_output=True,
                              text=True, timeout=CONFIG_SHOW_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise JobHelperError(f"`python -m lbannpy.config show {config}` took more than "
                             f"{CONFIG_SHOW_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        raise JobHelperError(f"`python -m lbannpy.config show {config}` failed ({proc.returncode}): "
                             f"{proc.stderr.strip()[-2000:]}")
    try:
        node = load_bounded(proc.stdout)
    except (yaml.YAMLError, ValueError) as exc:
        raise JobHelperError(f"`python -m lbannpy.config show {config}` printed no YAML: {exc}") from None
    return _lookup(node, key, config)


def _lookup(node, key: str, config: Path):
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise JobHelperError(f"config {config} has no key {key!r} (missing at {part!r})")
        node = node[part]
    return node


@dataclass(frozen=True)
class ScalingRow:
    sweep: str          # 'strong' or 'weak'
    ranks: int          # ranks per sample
    step_s: float       # seconds per training step
    speedup: float      # strong: P_b*T_b/T_P; weak: P*T_b/T_P (scaled speedup); P_b, T_b: smallest run
    efficiency: float   # speedup / P
    key: str            # the summary.json key step_s came from


def step_time(summary: dict) -> tuple[float, str]:
    """Seconds per step from a summary.json mapping, and the key it came from."""
    candidates = [(k, summary.get(k)) for k in STEP_TIME_KEYS]
    for outer, inner in summary.items():
        if isinstance(inner, dict):
            candidates += [(f"{outer}.{k}", inner.get(k)) for k in STEP_TIME_KEYS]
    for key, value in candidates:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and value > 0:
            return float(value), key
    raise JobHelperError(f"summary has none of the step-time keys {', '.join(STEP_TIME_KEYS)} (top level or "
                         f"one level down) with a positive number; its keys: {', '.join(map(str, summary))}")


_RUN_DIR_RE = re.compile(r"^(strong|weak)-(\d+)$")


def scaling_table(run_dir: Path) -> list[ScalingRow]:
    """Rows for every ``run_dir/{strong,weak}-P/summary.json``, sorted by sweep then P."""
    run_dir = Path(run_dir)
    runs: dict[str, list[tuple[int, float, str]]] = {}
    for sub in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        m = _RUN_DIR_RE.match(sub.name)
        if not m or not sub.is_dir():
            continue
        summary_path = sub / "summary.json"
        if not summary_path.is_file():
            raise JobHelperError(f"{summary_path} is missing: the run in {sub} did not finish")
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise JobHelperError(f"{summary_path} is not valid JSON: {exc}") from None
        if not isinstance(summary, dict):
            raise JobHelperError(f"{summary_path} does not hold a JSON object")
        try:
            t, key = step_time(summary)
        except JobHelperError as exc:
            raise JobHelperError(f"{summary_path}: {exc}") from None
        runs.setdefault(m.group(1), []).append((int(m.group(2)), t, key))
    if not runs:
        raise JobHelperError(f"no strong-P/ or weak-P/ run directories under {run_dir}")
    rows = []
    for sweep in sorted(runs):
        points = sorted(runs[sweep])
        p_b, t_b, _ = points[0]
        for p, t, key in points:
            speedup = p_b * t_b / t if sweep == "strong" else p * t_b / t
            rows.append(ScalingRow(sweep, p, t, speedup, speedup / p, key))
    return rows


def format_scaling(rows: list[ScalingRow]) -> tuple[str, str]:
    """(CSV text, aligned table text) of ``rows``."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["sweep", "ranks", "step_s", "speedup", "efficiency", "key"])
    for r in rows:
        w.writerow([r.sweep, r.ranks, f"{r.step_s:.6g}", f"{r.speedup:.4f}", f"{r.efficiency:.4f}", r.key])
    table = [f"{'sweep':<7}{'ranks':>6}{'step_s':>12}{'speedup':>9}{'efficiency':>11}  key"]
    table += [f"{r.sweep:<7}{r.ranks:>6}{r.step_s:>12.5g}{r.speedup:>9.2f}{r.efficiency:>11.2f}  {r.key}"
              for r in rows]
    return buf.getvalue(), "\n".join(table) + "\n"
