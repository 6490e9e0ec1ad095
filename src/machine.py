"""Machine descriptions for the cost model: α-β communication links and a compute rate γ.

A machine file is YAML (loaded with ``yaml.safe_load``, never evaluated):

    name: lassen
    source: where the numbers come from
    ranks_per_node: 4
    cores_per_node: 4                                       # optional: compute slots (GPUs, cores) per node
    memory_per_device_gib: 16
    intra: {alpha_s: 8.0e-6, beta_s_per_byte: 2.661e-11}     # point to point within a node
    inter: {alpha_s: 1.2e-6, beta_s_per_byte: 3.893e-11}     # point to point between nodes
    allreduce: {alpha_s: ..., beta_s_per_byte: ...}         # ring model, see allreduce_time
    compute: {gamma_s_per_flop: 1.075e-13}
    measured_on: {date: ..., host: ...}                     # optional, written by `lbannpy.bench calibrate`

Presets ship in ``lbannpy/machines/*.yaml`` and are loaded by name: ``load_machine("lassen")``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

MAX_FILE_BYTES = 1 << 20  # a machine file is a few hundred bytes; refuse anything absurd before reading


class MachineError(ValueError):
    """A machine file that is missing, malformed, or has values that cannot be right."""


@dataclass(frozen=True)
class Link:
    """Linear (α-β) model of one message: ``alpha_s + beta_s_per_byte * nbytes`` seconds."""

    alpha_s: float  # seconds per message
    beta_s_per_byte: float  # seconds per byte

    def time(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte


@dataclass(frozen=True)
class Machine:
    name: str
    ranks_per_node: int
    memory_per_device_gib: float
    intra: Link
    inter: Link
    allreduce: Link
    gamma_s_per_flop: float  # seconds per floating-point operation of one device
    source: str = ""
    measured_on: dict = field(default_factory=dict)
    cores_per_node: int = 0  # compute slots (CPU cores, GPUs) a node's ranks share; 0 = one per rank

    def p2p_time(self, nbytes: float, same_node: bool = True) -> float:
        """Seconds to send ``nbytes`` from one rank to another."""
        return (self.intra if same_node else self.inter).time(nbytes)

    def allreduce_time(self, nbytes: float, ranks: int) -> float:
        """Ring allreduce of ``nbytes`` per rank over ``ranks`` ranks:
        ``2 (p-1) α + 2 (p-1)/p · n · β`` seconds (0 for one rank)."""
        if ranks <= 1:
            return 0.0
        p = ranks
        return 2 * (p - 1) * self.allreduce.alpha_s + 2 * (p - 1) / p * nbytes * self.allreduce.beta_s_per_byte

    def compute_time(self, flops: float) -> float:
        return flops * self.gamma_s_per_flop

    def to_dict(self) -> dict[str, Any]:
        d = {
            "name": self.name,
            "source": self.source,
            "ranks_per_node": self.ranks_per_node,
            "memory_per_device_gib": self.memory_per_device_gib,
            "intra": {"alpha_s": self.intra.alpha_s, "beta_s_per_byte": self.intra.beta_s_per_byte},
            "inter": {"alpha_s": self.inter.alpha_s, "beta_s_per_byte": self.inter.beta_s_per_byte},
            "allreduce": {"alpha_s": self.allreduce.alpha_s, "beta_s_per_byte": self.allreduce.beta_s_per_byte},
            "compute": {"gamma_s_per_flop": self.gamma_s_per_flop},
        }
        if self.cores_per_node:
            d["cores_per_node"] = self.cores_per_node
        if self.measured_on:
            d["measured_on"] = dict(self.measured_on)
        return d


def preset_names() -> list[str]:
    """Names of the machine files shipped with lbannpy."""
    return sorted(p.name[:-5] for p in resources.files("lbannpy").joinpath("machines").iterdir()
                  if p.name.endswith(".yaml"))


def load_machine(path_or_name: str | os.PathLike) -> Machine:
    """A machine from a YAML file path, or a preset name (``lassen``, ``p100``, ``h100``, ...)."""
    text, where = _read(path_or_name)
    import yaml
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MachineError(f"machine file {where} is not valid YAML: {exc}") from exc
    return machine_from_dict(data, where)


def machine_from_dict(data: Any, where: str = "<dict>") -> Machine:
    if not isinstance(data, dict):
        raise MachineError(f"machine file {where}: expected a mapping at the top, got {type(data).__name__}")
    known = {"name", "source", "comment", "ranks_per_node", "cores_per_node", "memory_per_device_gib", "intra",
             "inter", "allreduce", "compute", "measured_on", "fit",
             "gradient_sync", "redistribution"}  # read by the strategy cost model (lbannpy.strategy.machine_model)
    unknown = sorted(set(data) - known)
    if unknown:
        raise MachineError(f"machine file {where}: unknown key(s) {unknown}; known keys are {sorted(known)}")

    def number(value, key: str, positive: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MachineError(f"machine file {where}: {key} must be a finite number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise MachineError(f"machine file {where}: {key} must be {'> 0' if positive else '>= 0'}, got {value}")
        return float(value)

    def section(key: str) -> dict:
        sec = data.get(key)
        if not isinstance(sec, dict):
            raise MachineError(f"machine file {where}: missing section '{key}' (a mapping)")
        return sec

    def link(key: str) -> Link:
        sec = section(key)
        for k in ("alpha_s", "beta_s_per_byte"):
            if k not in sec:
                raise MachineError(f"machine file {where}: {key}.{k} is missing")
        return Link(number(sec["alpha_s"], f"{key}.alpha_s"),
                    number(sec["beta_s_per_byte"], f"{key}.beta_s_per_byte", positive=True))

    for k in ("name", "ranks_per_node", "memory_per_device_gib"):
        if k not in data:
            raise MachineError(f"machine file {where}: '{k}' is missing")
    rpn = data["ranks_per_node"]
    if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
        raise MachineError(f"machine file {where}: ranks_per_node must be a positive integer, got {rpn!r}")
    cores = data.get("cores_per_node", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise MachineError(f"machine file {where}: cores_per_node must be an integer >= 0, got {cores!r}")
    compute = section("compute")
    if "gamma_s_per_flop" not in compute:
        raise MachineError(f"machine file {where}: compute.gamma_s_per_flop is missing")
    measured = data.get("measured_on") or {}
    if not isinstance(measured, dict):
        raise MachineError(f"machine file {where}: measured_on must be a mapping")
    return Machine(
        name=str(data["name"]),
        source=str(data.get("source") or data.get("comment") or ""),
        ranks_per_node=rpn,
        memory_per_device_gib=number(data["memory_per_device_gib"], "memory_per_device_gib", positive=True),
        intra=link("intra"), inter=link("inter"),
        # files written for the strategy model may give only an algorithm threshold here: ring over inter
        allreduce=link("allreduce") if _has_link(data.get("allreduce")) else link("inter"),
        gamma_s_per_flop=number(compute["gamma_s_per_flop"], "compute.gamma_s_per_flop", positive=True),
        measured_on={str(k): str(v) for k, v in measured.items()},
        cores_per_node=cores,
    )


def _has_link(sec) -> bool:
    return isinstance(sec, dict) and ("alpha_s" in sec or "beta_s_per_byte" in sec)


def _read(path_or_name) -> tuple[str, str]:
    path = os.fspath(path_or_name)
    if os.path.sep in path or path.endswith((".yaml", ".yml")) or os.path.exists(path):
        if not os.path.isfile(path):
            raise MachineError(f"machine file {path} does not exist")
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise MachineError(f"machine file {path} is {size} bytes; a machine file is a few hundred bytes "
                               f"(limit {MAX_FILE_BYTES})")
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    res = resources.files("lbannpy").joinpath("machines", f"{path}.yaml")
    if not res.is_file():
        raise MachineError(f"unknown machine {path!r}: not a file, and not a preset (presets: "
                           f"{', '.join(preset_names())}); pass a path to a machine YAML file or run "
                           f"`python -m lbannpy.bench calibrate -o machine.yaml`")
    return res.read_text(encoding="utf-8"), f"preset {path}"
