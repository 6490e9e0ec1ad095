"""The machine as the cost model sees it: α-β links, allreduce choice, γ per FLOP, memory per device.

A machine file is YAML (read with ``yaml.safe_load``)::

    name: p100
    ranks_per_node: 4
    cores_per_node: 0                                      # compute slots per node; 0 = one per rank (GPUs)
    memory_per_device_gib: 16
    intra: {alpha_s: 1.0e-5, beta_s_per_byte: 5.0e-11}    # NVLink within a node
    inter: {alpha_s: 2.0e-5, beta_s_per_byte: 1.0e-10}    # InfiniBand between nodes
    allreduce: {threshold_bytes: 65536}                    # recursive doubling below, ring at or above
    redistribution: {alpha_s: 4.0e-5, beta_s_per_byte: 2.0e-10}   # optional: measured all-to-all of blocks
    gradient_sync: allreduce                               # or parameter_server (Jia et al.'s t_S)
    compute:
      gamma_s_per_flop: 1.8e-13                            # sustained, not peak
      mem_s_per_byte: 1.9e-12                              # roofline: bytes moved / memory bandwidth
      kernel_overhead_s: 1.0e-5                            # launch + setup per local kernel
      measured:                                            # optional, from the calibration benchmark
        - {type: conv, in: [32, 64, 56, 56], out: [32, 64, 56, 56], fwd_s: 0.004, bwd_data_s: 0.004,
           bwd_weights_s: 0.005}
        - {type: conv, in: [32, 64, 30, 56], out: [32, 64, 28, 56], split: [1, 1, 2, 1], fwd_s: 0.0021,
           bwd_data_s: 0.0021, bwd_weights_s: 0.0026}   # optional split: timed in that split's code path
        - {type: conv, in: [16, 64, 56, 56], out: [16, 64, 56, 56], split: [4, 1, 1, 1], procs: 4,
           fwd_s: 0.0043, bwd_data_s: 0.0044, bwd_weights_s: 0.0052}  # optional procs (with split): timed
                                                       # while that many ranks ran on the node, core sharing
                                                       # included (cost.compute_times scales it no further)
        - {type: input, in: [8, 3, 224, 224], out: [8, 3, 224, 224], fwd_s: 0.002}   # reading a block of it

``load_machine_model(NAME_OR_PATH)`` reads a file, or a preset: ``src/machines/NAME.yaml`` (P100 as in Jia et
al. 2018, Lassen V100 as in Dryden et al. 2019, H100; each with its sources in comments).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


GRADIENT_SYNC = ("allreduce", "parameter_server")  # schemes of the t_S term, see cost.gradient_sync_time


class MachineError(ValueError):
    """A machine file or name that cannot be used; the message says which key is wrong and how to fix it."""


@dataclass(frozen=True)
class Link:
    alpha_s: float  # seconds per message (latency)
    beta_s_per_byte: float  # seconds per byte (inverse bandwidth)

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to move ``nbytes`` in ``messages`` messages (α-β model, full duplex, no contention)."""
        return messages * self.alpha_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class MachineModel:
    name: str
    intra: Link
    inter: Link
    ranks_per_node: int
    memory_per_device_gib: float
    gamma_s_per_flop: float  # seconds per floating-point operation, sustained
    mem_s_per_byte: float = 0.0  # seconds per byte of local memory traffic (roofline); 0 = compute bound
    kernel_overhead_s: float = 0.0  # seconds of fixed cost per local kernel call
    allreduce_threshold_bytes: int = 65536  # Thakur et al.: recursive doubling below, ring at or above
    allreduce_algorithm: str = "auto"  # auto | ring | recursive_doubling
    allreduce_link: Link | None = None  # overrides the link α/β for allreduces (e.g. NCCL measured)
    # overrides the link α/β for redistributions (shuffle_times' per-message α and per-received-byte β):
    # what `bench calibrate` measures of lbannpy's own shuffles, packing and copies included
    redistribution_link: Link | None = None
    dtype_bytes: int = 4  # bytes per tensor element (float32)
    measured: Mapping[tuple, tuple[float, float, float]] = field(default_factory=dict, compare=False)
    # Compute slots (CPU cores, or devices) of one node that its ranks share; 0 = at least one per rank, the
    # case of one rank per GPU. γ, mem_s_per_byte and measured tables are per rank with a slot to itself.
    cores_per_node: int = 0
    # How weight gradients are synchronised (t_S): "allreduce" (Thakur et al., what the runtime does) or
    # "parameter_server" (Jia et al. 2018 §5.1: each copy sends its gradients to a server and receives the
    # updated weights back), for reproducing that paper's cost model.
    gradient_sync: str = "allreduce"

    @classmethod
    def from_dict(cls, tree: Mapping[str, Any], name: str | None = None) -> "MachineModel":
        """Build from the YAML tree described in the module docstring."""
        if not isinstance(tree, Mapping):
            raise MachineError(f"a machine file must hold a mapping, got {type(tree).__name__}")
        name = str(tree.get("name", name or "machine"))

        def link(key: str) -> Link:
            sub = tree.get(key)
            if not isinstance(sub, Mapping) or "alpha_s" not in sub or "beta_s_per_byte" not in sub:
                raise MachineError(f"machine {name!r}: '{key}' must be a mapping with alpha_s (seconds per "
                                   f"message) and beta_s_per_byte (seconds per byte)")
            return Link(_pos(name, f"{key}.alpha_s", sub["alpha_s"], zero=True),
                        _pos(name, f"{key}.beta_s_per_byte", sub["beta_s_per_byte"], zero=True))

        comp = tree.get("compute")
        if not isinstance(comp, Mapping) or "gamma_s_per_flop" not in comp:
            raise MachineError(f"machine {name!r}: 'compute' must be a mapping with gamma_s_per_flop (seconds per "
                               f"floating-point operation)")
        ar = tree.get("allreduce") or {}
        if not isinstance(ar, Mapping):
            raise MachineError(f"machine {name!r}: 'allreduce' must be a mapping")
        algo = str(ar.get("algorithm", "auto"))
        if algo not in ("auto", "ring", "recursive_doubling"):
            raise MachineError(f"machine {name!r}: allreduce.algorithm must be auto, ring or recursive_doubling")
        ar_link = None
        if "alpha_s" in ar or "beta_s_per_byte" in ar:
            ar_link = Link(_pos(name, "allreduce.alpha_s", ar.get("alpha_s", 0.0), zero=True),
                           _pos(name, "allreduce.beta_s_per_byte", ar.get("beta_s_per_byte", 0.0), zero=True))
        rd = tree.get("redistribution")
        rd_link = None
        if rd is not None:
            if not isinstance(rd, Mapping) or "alpha_s" not in rd or "beta_s_per_byte" not in rd:
                raise MachineError(f"machine {name!r}: 'redistribution' must be a mapping with alpha_s and "
                                   f"beta_s_per_byte")
            rd_link = Link(_pos(name, "redistribution.alpha_s", rd["alpha_s"], zero=True),
                           _pos(name, "redistribution.beta_s_per_byte", rd["beta_s_per_byte"], zero=True))
        measured = {}
        for i, row in enumerate(comp.get("measured") or []):
            try:
                key = (str(row["type"]), tuple(int(s) for s in row["in"]), tuple(int(s) for s in row["out"]))
                if row.get("split") is not None:  # timed in the code path of that split (see cost.compute_times)
                    key += (tuple(int(s) for s in row["split"]),)
                if row.get("procs") is not None:  # timed with that many ranks running on the node
                    procs = row["procs"]
                    if len(key) < 4 or isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
                        raise ValueError(f"procs must be a positive integer and come with split, got {procs!r}")
                    key += (procs,)
                measured[key] = (float(row["fwd_s"]), float(row.get("bwd_data_s", 0.0)),
                                 float(row.get("bwd_weights_s", 0.0)))
            except (KeyError, TypeError, ValueError) as exc:
                raise MachineError(f"machine {name!r}: compute.measured[{i}] needs type, in, out, fwd_s "
                                   f"(and bwd_data_s, bwd_weights_s, split, procs): {exc!r}") from None
        rpn = tree.get("ranks_per_node", 1)
        if not isinstance(rpn, int) or rpn < 1:
            raise MachineError(f"machine {name!r}: ranks_per_node must be a positive integer, got {rpn!r}")
        cores = tree.get("cores_per_node", 0)
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise MachineError(f"machine {name!r}: cores_per_node must be an integer >= 0 (0: one compute slot "
                               f"per rank), got {cores!r}")
        sync = str(tree.get("gradient_sync", "allreduce"))
        if sync not in GRADIENT_SYNC:
            raise MachineError(f"machine {name!r}: gradient_sync must be one of {', '.join(GRADIENT_SYNC)}, "
                               f"got {sync!r}")
        return cls(
            name=name, intra=link("intra"), inter=link("inter"), ranks_per_node=rpn,
            memory_per_device_gib=_pos(name, "memory_per_device_gib", tree.get("memory_per_device_gib", 16)),
            gamma_s_per_flop=_pos(name, "compute.gamma_s_per_flop", comp["gamma_s_per_flop"]),
            mem_s_per_byte=_pos(name, "compute.mem_s_per_byte", comp.get("mem_s_per_byte", 0.0), zero=True),
            kernel_overhead_s=_pos(name, "compute.kernel_overhead_s", comp.get("kernel_overhead_s", 0.0),
                                   zero=True),
            allreduce_threshold_bytes=int(ar.get("threshold_bytes", 65536)), allreduce_algorithm=algo,
            allreduce_link=ar_link, redistribution_link=rd_link, dtype_bytes=int(tree.get("dtype_bytes", 4)), measured=measured,
            cores_per_node=cores, gradient_sync=sync)

    def with_memory(self, gib: float) -> "MachineModel":
        from dataclasses import replace
        return replace(self, memory_per_device_gib=float(gib))

    def with_layout(self, ranks_per_node: int) -> "MachineModel":
        """The same machine with another number of ranks started on each node (the job's layout)."""
        from dataclasses import replace
        return replace(self, ranks_per_node=int(ranks_per_node))

    def compute_slowdown(self, ranks: int) -> float:
        """Factor (>= 1) on every rank's compute time, and on its messages (shared-memory copies its core
        makes), when the ranks of a node outnumber its compute slots:
        ``ranks_on_node / cores_per_node`` ranks share each core by time slicing. Nodes are filled in rank
        order, ``ranks_per_node`` each; 1 when ``cores_per_node`` is 0 (one slot per rank)."""
        if self.cores_per_node <= 0:
            return 1.0
        return max(1.0, self.ranks_on_node(ranks) / self.cores_per_node)

    def ranks_on_node(self, ranks: int) -> int:
        """Ranks that run on one node when a job has ``ranks`` in all (nodes filled in rank order)."""
        return max(1, min(int(ranks), self.ranks_per_node))

    def link(self, span_ranks: int) -> Link:
        """Link used by a group whose ranks lie within ``span_ranks`` consecutive ranks (nodes are filled in
        rank order, ``ranks_per_node`` each)."""
        return self.intra if span_ranks <= self.ranks_per_node else self.inter


def _pos(machine: str, key: str, v: Any, zero: bool = False) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise MachineError(f"machine {machine!r}: {key} must be a number, got {v!r}") from None
    if f < 0 or (f == 0 and not zero):
        raise MachineError(f"machine {machine!r}: {key} must be {'>= 0' if zero else '> 0'}, got {v!r}")
    return f


class _Presets(Mapping):
    """The machine files shipped in ``src/machines`` (``p100``, ``lassen``, ``h100``, with their sources in
    comments) as YAML trees, read when first asked for: the one definition of each preset."""

    def _names(self) -> list[str]:
        return sorted(f.stem for f in machines_dir().glob("*.yaml"))

    def __getitem__(self, name: str) -> dict[str, Any]:
        f = machines_dir() / f"{name}.yaml"
        if not f.is_file():
            raise KeyError(name)
        return yaml.safe_load(f.read_text())

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


PRESETS: Mapping[str, dict[str, Any]] = _Presets()


def machines_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "machines"


def load_machine_model(name_or_path: str | Path | Mapping[str, Any] | MachineModel = "p100") -> MachineModel:
    """A :class:`MachineModel` from a mapping, a YAML path, ``src/machines/NAME.yaml`` or a preset name."""
    if isinstance(name_or_path, MachineModel):
        return name_or_path
    if isinstance(name_or_path, Mapping):
        return MachineModel.from_dict(name_or_path)
    s = str(name_or_path)
    p = Path(s)
    candidates = [p] if (p.suffix in (".yaml", ".yml") or p.exists()) else [machines_dir() / f"{s}.yaml"]
    for f in candidates:
        if f.is_file():
            try:
                tree = yaml.safe_load(f.read_text())
            except yaml.YAMLError as exc:
                raise MachineError(f"machine file {f}: not valid YAML ({exc})") from None
            return MachineModel.from_dict(tree, name=f.stem)
    if p.suffix in (".yaml", ".yml"):
        raise MachineError(f"machine file {s} does not exist")
    raise MachineError(f"unknown machine {s!r}: give a YAML file or one of {sorted(PRESETS)}")
