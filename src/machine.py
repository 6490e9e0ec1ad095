"""Machines: the one definition of what the cost model, the planner, calibration and the benches know about
the hardware: α-β links, an allreduce choice, a roofline compute rate, memory per device.

A machine file is YAML (read with :func:`lbannpy.yamlsafe.load`: never evaluated, no aliases; at most
``MAX_FILE_BYTES``)::

    name: lassen
    source: where the numbers come from                    # optional (old files: comment)
    ranks_per_node: 4
    cores_per_node: 0                                      # optional: compute slots per node, 0: one a rank
    memory_per_device_gib: 16
    intra: {alpha_s: 8.0e-6, beta_s_per_byte: 2.661e-11}   # point to point within a node
    inter: {alpha_s: 1.2e-6, beta_s_per_byte: 3.893e-11}   # point to point between nodes
    allreduce: {alpha_s: 1.2e-6, beta_s_per_byte: 3.893e-11,   # optional link of the collectives (NCCL ...)
                threshold_bytes: 65536, algorithm: auto}   # recursive doubling below, ring at or above
    redistribution: {alpha_s: 4.0e-5, beta_s_per_byte: 2.0e-10}   # optional: measured lbannpy shuffles
    gradient_sync: allreduce                               # or parameter_server (Jia et al.'s t_S)
    dtype_bytes: 4                                         # optional: bytes per tensor element
    compute:
      gamma_s_per_flop: 1.075e-13                          # sustained, not peak
      mem_s_per_byte: 1.59e-12                             # optional roofline: bytes moved / memory bandwidth
      kernel_overhead_s: 8.0e-6                            # optional: launch + setup per local kernel
      measured:                                            # optional, from the calibration benchmark
        - {type: conv, in: [32, 64, 56, 56], out: [32, 64, 56, 56], fwd_s: 0.004, bwd_data_s: 0.004,
           bwd_weights_s: 0.005}
        - {type: conv, in: [32, 64, 30, 56], out: [32, 64, 28, 56], split: [1, 1, 2, 1], fwd_s: 0.0021}
                                                           # optional split: timed in that split's code path
        - {type: conv, in: [16, 64, 56, 56], out: [16, 64, 56, 56], split: [4, 1, 1, 1], procs: 4,
           fwd_s: 0.0043}                                  # optional procs (with split): timed while that
                                                           # many ranks ran on the node, core sharing included
        - {type: conv, in: [32, 6, 14, 14], out: [32, 16, 10, 10], fwd_s: 0.0006, bwd_data_s: 0.0005,
           bwd_weights_s: 0.0007, kernel: aten}             # optional kernel (conv): the faster set at this
                                                           # shape, whose times the row holds; what
                                                           # `runtime.kernels: auto` takes for the shape
                                                           # optional layout (with kernel: aten):
                                                           # channels_last where the host ATen kernels
                                                           # ran that layout faster here (else nchw)
      rates:                                               # optional, from the calibration benchmark:
        - {type: sigmoid, per: element, fwd_s: 1.1e-9, bwd_data_s: 1.4e-9, bwd_weights_s: 0.0}
        - {type: upsample, params: {mode: linear}, per: element, fwd_s: 2.0e-9, bwd_data_s: 3.1e-9,
           bwd_weights_s: 0.0}                             # seconds per output element of the local block
        - {type: conv_transpose, per: flop, fwd_s: 9.0e-12, bwd_data_s: 9.0e-12, bwd_weights_s: 9.0e-12}
                                                           # or per forward FLOP; params: the values it was
                                                           # timed with that select the row (a layer of the
                                                           # type with other values takes a row without)
      shared:                                              # optional, from the calibration benchmark: what
        - {procs: 2, factor: 1.6, sync_s: 1.5e-4}          # a step loses when procs ranks compute in lockstep
                                                           # on a node (factor on compute beyond the median
                                                           # per-call times; sync_s per blocking exchange)
    measured_on: {date: ..., host: ...}                    # optional, written by `lbannpy.bench calibrate`
    fit: {...}                                             # optional, the calibration's fit errors (not read)

Every key is checked: an unknown key, a missing one, or a value that cannot be right (a negative latency, a
zero bandwidth term, a text where a number belongs) is a :class:`MachineError` naming the file, the key and
the fix. Presets ship in ``lbannpy/machines/NAME.yaml`` (P100 as in Jia et al. 2018, Lassen V100 as in Dryden
et al. 2019, H100; each with its sources in comments) and load by name: ``load_machine("lassen")``.

The default machine, everywhere a machine may be left out (``python -m lbannpy.strategy``, ``plan()``,
``parallel.machine`` of a config), is :data:`DEFAULT_MACHINE`, ``local``: the machine the run is on
(:mod:`lbannpy.local_machine`), i.e. this host's calibration once ``python -m lbannpy.bench calibrate`` wrote
it, else a described model of its CPU. The presets are named: ``lassen`` is the system of Dryden et al. whose
spatial-parallel training lbannpy reproduces (the ``p100`` preset models Jia et al.'s parameter server).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from lbannpy import yamlsafe
from lbannpy.local_machine import LOCAL, local_source

DEFAULT_MACHINE = LOCAL
MAX_FILE_BYTES = 1 << 20  # a machine file is a few kilobytes; refuse anything absurd before reading it
GRADIENT_SYNC = ("allreduce", "parameter_server")  # schemes of the t_S term, see cost.gradient_sync_time
ALLREDUCE_ALGORITHMS = ("auto", "ring", "recursive_doubling")


class MachineError(ValueError):
    """A machine file or name that cannot be used; the message says which key is wrong and how to fix it."""


@dataclass(frozen=True)
class Link:
    """Linear (α-β) model of point-to-point messages, full duplex, no contention."""

    alpha_s: float  # seconds per message (latency)
    beta_s_per_byte: float  # seconds per byte (inverse bandwidth)

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to move ``nbytes`` bytes in ``messages`` messages: ``messages·α + nbytes·β``."""
        return messages * self.alpha_s + nbytes * self.beta_s_per_byte


# --------------------------------------------------------------------------------------------------------
# pure α-β collectives (Thakur, Rabenseifner & Gropp 2005)


def ring_allreduce_time(nbytes: float, p: int, link: Link) -> float:
    """Seconds of a ring allreduce of ``nbytes`` bytes per rank over ``p`` ranks:
    ``2(p-1)·α + 2(p-1)/p·nbytes·β`` (0 for one rank)."""
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes * link.beta_s_per_byte


def allreduce_time(nbytes_: float, p: int, link: Link, machine: "Machine") -> float:
    """Seconds to allreduce ``nbytes_`` bytes over ``p`` ranks: recursive doubling ``⌈log2 p⌉(α + nβ)`` below
    the machine's threshold, ring ``2(p-1)α + 2(p-1)/p·nβ`` at or above it. ``link`` is the one the group's
    ranks span, replaced by the machine's ``allreduce`` link where its file gives one."""
    if p <= 1 or nbytes_ <= 0:
        return 0.0
    link = machine.allreduce_link or link
    algo = machine.allreduce_algorithm
    if algo == "auto":
        algo = "recursive_doubling" if nbytes_ < machine.allreduce_threshold_bytes else "ring"
    if algo == "recursive_doubling":
        return math.ceil(math.log2(p)) * (link.alpha_s + nbytes_ * link.beta_s_per_byte)
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes_ * link.beta_s_per_byte


def allgather_time(nbytes_total: float, p: int, link: Link) -> float:
    """Seconds of a Bruck allgather of ``nbytes_total`` bytes in all: ``⌈log2 p⌉α + (p-1)/p·nβ``."""
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * link.alpha_s + (p - 1) / p * nbytes_total * link.beta_s_per_byte


def ring_from_fit(a: float, b: float, p: int) -> tuple[float, float]:
    """α (seconds), β (seconds per byte) of the ring model from a fitted allreduce time ``a + b·n`` over
    ``p`` ranks (the inverse of :func:`ring_allreduce_time`)."""
    return a / (2 * (p - 1)), b * p / (2 * (p - 1))


# --------------------------------------------------------------------------------------------------------
# the machine


RATE_UNITS = ("element", "flop")  # what a rate row's seconds are per (cost.compute_times)


@dataclass(frozen=True)
class Rate:
    """Seconds per unit of local work of one layer type, measured by ``bench calibrate`` on a block of its
    own kernels: per output element (``per: element``: pointwise, normalisation, resampling layers, whose
    time neither FLOPs nor bytes predict on a CPU, where exp/erf/tanh cost tens of cycles an element) or
    per forward FLOP (``per: flop``: GEMM layers whose rate differs from the plain GEMM's γ). ``params``:
    the layer parameters it was timed with that select it (``(("mode", "linear"),)``); a row without
    serves every layer of the type that no row with parameters matches."""

    type: str
    per: str
    fwd_s: float
    bwd_data_s: float
    bwd_weights_s: float
    params: tuple[tuple[str, Any], ...] = ()

    def matches(self, params: Mapping[str, Any]) -> bool:
        return all(params.get(k) == v for k, v in self.params)


@dataclass(frozen=True)
class Machine:
    name: str
    intra: Link  # point to point within a node
    inter: Link  # point to point between nodes
    ranks_per_node: int
    memory_per_device_gib: float
    gamma_s_per_flop: float  # seconds per floating-point operation of one rank, sustained
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
    # (type, local input shape, local output shape) -> the kernel set a calibration found faster there
    kernels: Mapping[tuple, str] = field(default_factory=dict, compare=False)
    # (type, local input shape, local output shape) -> the host layout a calibration found faster there for
    # the ATen set (``layout:`` of a row with ``kernel: aten``); a run's conv takes no other (layers/conv.py)
    layouts: Mapping[tuple, str] = field(default_factory=dict, compare=False)
    # Compute slots (CPU cores, or devices) of one node that its ranks share; 0 = at least one per rank, the
    # case of one rank per GPU. γ, mem_s_per_byte and measured tables are per rank with a slot to itself.
    cores_per_node: int = 0
    # How weight gradients are synchronised (t_S): "allreduce" (Thakur et al., what the runtime does) or
    # "parameter_server" (Jia et al. 2018 §5.1: each copy sends its gradients to a server and receives the
    # updated weights back), for reproducing that paper's cost model.
    gradient_sync: str = "allreduce"
    source: str = ""  # where the numbers come from
    measured_on: Mapping[str, str] = field(default_factory=dict, compare=False)  # date, host of a calibration
    # per-type rates of layers that neither γ nor the streaming rate price well (see Rate); none: roofline
    rates: tuple[Rate, ...] = ()
    # (procs, factor, sync_s) rows measured by `bench calibrate`: with procs ranks computing in lockstep on a
    # node (and whatever else runs there), a step's compute takes factor times the median per-call times
    # that γ, the rates and the measured rows are, and each blocking exchange waits sync_s beyond its α-β
    # time for the partner (see shared_at); none: 1 and 0
    shared: tuple[tuple[int, float, float], ...] = ()

    def rate(self, typ: str, params: Mapping[str, Any]) -> Rate | None:
        """The rate row of layer type ``typ`` for a layer with (resolved) ``params``: the matching row with
        the most parameters, None when the machine has none for the type."""
        best = None
        for r in self.rates:
            if r.type == typ and r.matches(params) and (best is None or len(r.params) > len(best.params)):
                best = r
        return best

    @classmethod
    def from_dict(cls, tree: Any, name: str | None = None) -> "Machine":
        """Build from the YAML tree described in the module docstring (see :func:`machine_from_dict`)."""
        return machine_from_dict(tree, name=name)

    def to_dict(self) -> dict[str, Any]:
        """The YAML tree of this machine: ``machine_from_dict(m.to_dict()) == m``."""
        return _to_dict(self)

    @property
    def ring_link(self) -> Link:
        """The link a ring allreduce runs over: the file's ``allreduce`` link, else the inter-node one."""
        return self.allreduce_link or self.inter

    def kernel_time(self, flops: float, nbytes: float) -> float:
        """Seconds of one local kernel, roofline: ``max(γ·flops, nbytes·mem_s_per_byte) + kernel overhead``
        (``nbytes``: bytes read and written)."""
        return max(flops * self.gamma_s_per_flop, nbytes * self.mem_s_per_byte) + self.kernel_overhead_s

    def with_memory(self, gib: float) -> "Machine":
        return replace(self, memory_per_device_gib=float(gib))

    def with_layout(self, ranks_per_node: int) -> "Machine":
        """The same machine with another number of ranks started on each node (the job's layout)."""
        return replace(self, ranks_per_node=int(ranks_per_node))

    def compute_slowdown(self, ranks: int) -> float:
        """Factor (>= 1) on every rank's compute time, and on its messages (shared-memory copies its core
        makes), when the ranks of a node outnumber its compute slots:
        ``ranks_on_node / cores_per_node`` ranks share each core by time slicing (nodes are filled in rank
        order, ``ranks_per_node`` each; 1 when ``cores_per_node`` is 0, one slot per rank); times the
        measured lockstep factor of that many ranks (:meth:`shared_at`)."""
        over = 1.0 if self.cores_per_node <= 0 else max(1.0, self.ranks_on_node(ranks) / self.cores_per_node)
        return over * self.shared_at(ranks)[0]

    def shared_at(self, ranks: int) -> tuple[float, float]:
        """``(factor, sync_s)`` of the measured ``shared`` row for the ranks a job of ``ranks`` puts on a
        node: the row of the most procs not above them (a calibration measures the counts it ran), else
        ``(1, 0)``."""
        on_node = self.ranks_on_node(ranks)
        rows = [r for r in self.shared if r[0] <= on_node]
        if not rows:
            return 1.0, 0.0
        _, factor, sync = max(rows)
        return factor, sync

    def ranks_on_node(self, ranks: int) -> int:
        """Ranks that run on one node when a job has ``ranks`` in all (nodes filled in rank order)."""
        return max(1, min(int(ranks), self.ranks_per_node))

    def link(self, span_ranks: int) -> Link:
        """Link used by a group whose ranks lie within ``span_ranks`` consecutive ranks (nodes are filled in
        rank order, ``ranks_per_node`` each)."""
        return self.intra if span_ranks <= self.ranks_per_node else self.inter


# --------------------------------------------------------------------------------------------------------
# the parser: one way to validate


_LINK_KEYS = ("alpha_s", "beta_s_per_byte")
_TOP_KEYS = ("name", "source", "comment", "ranks_per_node", "cores_per_node", "memory_per_device_gib",
             "intra", "inter", "allreduce", "redistribution", "gradient_sync", "dtype_bytes", "compute",
             "measured_on", "fit")
_SECTION_KEYS = {"intra": _LINK_KEYS, "inter": _LINK_KEYS, "redistribution": _LINK_KEYS,
                 "allreduce": _LINK_KEYS + ("threshold_bytes", "algorithm"),
                 "compute": ("gamma_s_per_flop", "mem_s_per_byte", "kernel_overhead_s", "measured",
                             "rates", "shared")}
_RATE_KEYS = ("type", "per", "params", "fwd_s", "bwd_data_s", "bwd_weights_s")
_MEASURED_KEYS = ("type", "in", "out", "split", "procs", "fwd_s", "bwd_data_s", "bwd_weights_s", "kernel",
                  "layout")
KERNEL_SETS = ("own", "aten")  # the conv kernel sets a measured row may name (layers/kernels/select.py)
LAYOUTS = ("nchw", "channels_last")  # the host layouts of the ATen set a measured row may name


class _Reader:
    """Checks of one machine tree; every message starts with ``machine file WHERE:``."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, msg: str) -> MachineError:
        return MachineError(f"machine file {self.where}: {msg}")

    def number(self, value: Any, key: str, positive: bool = False) -> float:
        """A finite number, ``>= 0`` (``> 0`` with ``positive``)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(f"{key} must be a finite number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise self.fail(f"{key} must be {'> 0' if positive else '>= 0'}, got {value!r}")
        return float(value)

    def integer(self, value: Any, key: str, low: int, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.fail(f"{key} must be {what}, got {value!r}")
        return value

    def mapping(self, tree: Mapping, key: str, required: bool) -> Mapping | None:
        sec = tree.get(key)
        if sec is None and not required:
            return None
        if not isinstance(sec, Mapping):
            raise self.fail(f"'{key}' must be a mapping" + (" (missing)" if sec is None else
                                                             f", got {type(sec).__name__}"))
        unknown = sorted(set(sec) - set(_SECTION_KEYS[key]))
        if unknown:
            raise self.fail(f"unknown key(s) {unknown} in '{key}'; known keys are {list(_SECTION_KEYS[key])}")
        return sec

    def link(self, sec: Mapping, key: str) -> Link:
        for k in _LINK_KEYS:
            if k not in sec:
                raise self.fail(f"{key}.{k} is missing: '{key}' must be a mapping with alpha_s (seconds per "
                                f"message) and beta_s_per_byte (seconds per byte)")
        # a zero β would be an infinitely fast link: no measurement gives that
        return Link(self.number(sec["alpha_s"], f"{key}.alpha_s"),
                    self.number(sec["beta_s_per_byte"], f"{key}.beta_s_per_byte", positive=True))

    def measured(self, rows: Any) -> tuple[dict[tuple, tuple[float, float, float]], dict[tuple, str],
                                           dict[tuple, str]]:
        """The measured times by key, the kernel set of the rows that name one, and their layout."""
        if rows is None:
            return {}, {}, {}
        if not isinstance(rows, list):
            raise self.fail(f"compute.measured must be a list of rows, got {type(rows).__name__}")
        out, kernels, layouts = {}, {}, {}
        for i, row in enumerate(rows):
            what = f"compute.measured[{i}]"
            try:
                if not isinstance(row, Mapping):
                    raise ValueError(f"a row is a mapping, got {type(row).__name__}")
                unknown = sorted(set(row) - set(_MEASURED_KEYS))
                if unknown:
                    raise ValueError(f"unknown key(s) {unknown}")
                key = (str(row["type"]), tuple(int(s) for s in row["in"]), tuple(int(s) for s in row["out"]))
                if row.get("split") is not None:  # timed in that split's code path (see cost.compute_times)
                    key += (tuple(int(s) for s in row["split"]),)
                if row.get("procs") is not None:  # timed with that many ranks running on the node
                    procs = row["procs"]
                    if len(key) < 4 or isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
                        raise ValueError(f"procs must be a positive integer and come with split, "
                                         f"got {procs!r}")
                    key += (procs,)
                out[key] = tuple(self.number(row.get(k, 0.0), f"{what}.{k}")
                                 for k in ("fwd_s", "bwd_data_s", "bwd_weights_s"))
                if "fwd_s" not in row:
                    raise KeyError("fwd_s")
                if "kernel" in row:  # read for the layer types that have kernel sets (convolutions)
                    if row["kernel"] not in KERNEL_SETS:
                        raise ValueError(f"kernel must be one of {', '.join(KERNEL_SETS)}, got "
                                         f"{row['kernel']!r}")
                    kernels[key[:3]] = row["kernel"]
                if "layout" in row:  # the host layout of the ATen set (layers/conv.py Conv._channels_last)
                    if row["layout"] not in LAYOUTS or row.get("kernel") != "aten":
                        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} and come with kernel: "
                                         f"aten, got {row['layout']!r} with kernel {row.get('kernel')!r}")
                    layouts[key[:3]] = row["layout"]
            except (KeyError, TypeError, ValueError) as exc:
                raise self.fail(f"{what} needs type, in, out, fwd_s (and bwd_data_s, bwd_weights_s, split, "
                                f"procs, kernel, layout): {exc!r}") from None
        return out, kernels, layouts


    def shared(self, rows: Any) -> tuple[tuple[int, float, float], ...]:
        """The ``compute.shared`` rows, by procs (see :meth:`Machine.shared_at`)."""
        if rows is None:
            return ()
        if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
            raise self.fail("compute.shared must be a list of mappings {procs, factor, sync_s}")
        out = []
        for i, row in enumerate(rows):
            unknown = sorted(set(row) - {"procs", "factor", "sync_s"})
            if unknown or "procs" not in row or "factor" not in row:
                raise self.fail(f"compute.shared[{i}] needs procs and factor (and sync_s), got {dict(row)!r}")
            out.append((self.integer(row["procs"], f"compute.shared[{i}].procs", 1, "a positive integer"),
                        self.number(row["factor"], f"compute.shared[{i}].factor", positive=True),
                        self.number(row.get("sync_s", 0.0), f"compute.shared[{i}].sync_s")))
        return tuple(sorted(out))

    def rates(self, rows: Any) -> tuple[Rate, ...]:
        """The ``compute.rates`` rows (see :class:`Rate`)."""
        if rows is None:
            return ()
        if not isinstance(rows, list):
            raise self.fail(f"compute.rates must be a list of rows, got {type(rows).__name__}")
        out = []
        for i, row in enumerate(rows):
            what = f"compute.rates[{i}]"
            if not isinstance(row, Mapping):
                raise self.fail(f"{what} must be a mapping, got {type(row).__name__}")
            unknown = sorted(set(row) - set(_RATE_KEYS))
            if unknown:
                raise self.fail(f"unknown key(s) {unknown} in {what}; known keys are {list(_RATE_KEYS)}")
            if not isinstance(row.get("type"), str) or "fwd_s" not in row:
                raise self.fail(f"{what} needs type (a layer type) and fwd_s (and per, bwd_data_s, "
                                f"bwd_weights_s, params)")
            per = row.get("per", "element")
            if per not in RATE_UNITS:
                raise self.fail(f"{what}.per must be one of {', '.join(RATE_UNITS)}, got {per!r}")
            params = row.get("params") or {}
            if not isinstance(params, Mapping) or not all(
                    isinstance(v, (str, int, float, bool)) for v in params.values()):
                raise self.fail(f"{what}.params must map parameter names to plain values, got {params!r}")
            out.append(Rate(row["type"], per, *(self.number(row.get(k, 0.0), f"{what}.{k}")
                                                 for k in ("fwd_s", "bwd_data_s", "bwd_weights_s")),
                            tuple(sorted((str(k), v) for k, v in params.items()))))
        return tuple(out)


def machine_from_dict(tree: Any, where: str = "<dict>", name: str | None = None) -> Machine:
    """The one parser of machine trees (module docstring). ``name`` is used where the tree has none."""
    r = _Reader(where)
    if not isinstance(tree, Mapping):
        raise r.fail(f"expected a mapping at the top, got {type(tree).__name__}")
    unknown = sorted(set(tree) - set(_TOP_KEYS))
    if unknown:
        raise r.fail(f"unknown key(s) {unknown}; known keys are {list(_TOP_KEYS)}")
    intra = r.link(r.mapping(tree, "intra", True), "intra")
    inter = r.link(r.mapping(tree, "inter", True), "inter")
    if "name" not in tree and name is None:
        raise r.fail("'name' is missing")
    for k in ("ranks_per_node", "memory_per_device_gib"):
        if k not in tree:
            raise r.fail(f"'{k}' is missing")
    comp = r.mapping(tree, "compute", True)
    if "gamma_s_per_flop" not in comp:
        raise r.fail("compute.gamma_s_per_flop is missing (seconds per floating-point operation)")
    ar = r.mapping(tree, "allreduce", False) or {}
    ar_link = r.link(ar, "allreduce") if any(k in ar for k in _LINK_KEYS) else None
    algo = ar.get("algorithm", "auto")
    if algo not in ALLREDUCE_ALGORITHMS:
        raise r.fail(f"allreduce.algorithm must be one of {', '.join(ALLREDUCE_ALGORITHMS)}, got {algo!r}")
    rd = r.mapping(tree, "redistribution", False)
    sync = tree.get("gradient_sync", "allreduce")
    if sync not in GRADIENT_SYNC:
        raise r.fail(f"gradient_sync must be one of {', '.join(GRADIENT_SYNC)}, got {sync!r}")
    measured_on = tree.get("measured_on") or {}
    if not isinstance(measured_on, Mapping):
        raise r.fail("measured_on must be a mapping")
    measured, kernels, layouts = r.measured(comp.get("measured"))
    return Machine(
        name=str(tree.get("name", name)), intra=intra, inter=inter,
        ranks_per_node=r.integer(tree["ranks_per_node"], "ranks_per_node", 1, "a positive integer"),
        memory_per_device_gib=r.number(tree["memory_per_device_gib"], "memory_per_device_gib", positive=True),
        gamma_s_per_flop=r.number(comp["gamma_s_per_flop"], "compute.gamma_s_per_flop", positive=True),
        mem_s_per_byte=r.number(comp.get("mem_s_per_byte", 0.0), "compute.mem_s_per_byte"),
        kernel_overhead_s=r.number(comp.get("kernel_overhead_s", 0.0), "compute.kernel_overhead_s"),
        allreduce_threshold_bytes=r.integer(ar.get("threshold_bytes", 65536), "allreduce.threshold_bytes", 0,
                                            "an integer >= 0 (bytes)"),
        allreduce_algorithm=algo, allreduce_link=ar_link,
        redistribution_link=None if rd is None else r.link(rd, "redistribution"),
        dtype_bytes=r.integer(tree.get("dtype_bytes", 4), "dtype_bytes", 1, "a positive integer (bytes)"),
        measured=measured, kernels=kernels, layouts=layouts, rates=r.rates(comp.get("rates")),
        shared=r.shared(comp.get("shared")),
        cores_per_node=r.integer(tree.get("cores_per_node", 0), "cores_per_node", 0,
                                 "an integer >= 0 (0: one compute slot per rank)"),
        gradient_sync=sync, source=str(tree.get("source") or tree.get("comment") or ""),
        measured_on={str(k): str(v) for k, v in measured_on.items()})


def _to_dict(m: Machine) -> dict[str, Any]:
    def link(x: Link) -> dict[str, float]:
        return {"alpha_s": x.alpha_s, "beta_s_per_byte": x.beta_s_per_byte}

    allreduce: dict[str, Any] = link(m.allreduce_link) if m.allreduce_link else {}
    allreduce.update(threshold_bytes=m.allreduce_threshold_bytes, algorithm=m.allreduce_algorithm)
    compute: dict[str, Any] = {"gamma_s_per_flop": m.gamma_s_per_flop, "mem_s_per_byte": m.mem_s_per_byte,
                               "kernel_overhead_s": m.kernel_overhead_s}
    if m.measured:
        rows = []
        for key, (fwd, bwd_d, bwd_w) in m.measured.items():
            row: dict[str, Any] = {"type": key[0], "in": list(key[1]), "out": list(key[2])}
            if len(key) > 3:
                row["split"] = list(key[3])
            if len(key) > 4:
                row["procs"] = key[4]
            row.update(fwd_s=fwd, bwd_data_s=bwd_d, bwd_weights_s=bwd_w)
            if key[:3] in m.kernels:
                row["kernel"] = m.kernels[key[:3]]
            if key[:3] in m.layouts:
                row["layout"] = m.layouts[key[:3]]
            rows.append(row)
        compute["measured"] = rows
    if m.rates:
        compute["rates"] = [{"type": r.type, **({"params": dict(r.params)} if r.params else {}), "per": r.per,
                             "fwd_s": r.fwd_s, "bwd_data_s": r.bwd_data_s, "bwd_weights_s": r.bwd_weights_s}
                            for r in m.rates]
    if m.shared:
        compute["shared"] = [{"procs": p, "factor": f, "sync_s": s} for p, f, s in m.shared]
    d: dict[str, Any] = {"name": m.name, "source": m.source, "ranks_per_node": m.ranks_per_node}
    if m.cores_per_node:  # 0, one compute slot per rank, is the default
        d["cores_per_node"] = m.cores_per_node
    d.update(memory_per_device_gib=m.memory_per_device_gib, intra=link(m.intra), inter=link(m.inter),
             allreduce=allreduce)
    if m.redistribution_link:
        d["redistribution"] = link(m.redistribution_link)
    d.update(gradient_sync=m.gradient_sync, dtype_bytes=m.dtype_bytes, compute=compute)
    if m.measured_on:
        d["measured_on"] = dict(m.measured_on)
    return d


# --------------------------------------------------------------------------------------------------------
# files and presets


def machines_dir() -> Path:
    """The folder of the shipped presets (``src/machines``, installed as ``lbannpy/machines``)."""
    return Path(str(resources.files("lbannpy").joinpath("machines")))


def preset_names() -> list[str]:
    """Names of the machine files shipped with lbannpy."""
    return sorted(f.stem for f in machines_dir().glob("*.yaml"))


class _Presets(Mapping):
    """The shipped machine files as YAML trees, read when first asked for: the one definition of each
    preset."""

    def __getitem__(self, name: str) -> dict[str, Any]:
        f = machines_dir() / f"{name}.yaml"
        if not f.is_file():
            raise KeyError(name)
        return _parse_yaml(f.read_text(encoding="utf-8"), f"preset {name}")

    def __iter__(self) -> Iterator[str]:
        return iter(preset_names())

    def __len__(self) -> int:
        return len(preset_names())


PRESETS: Mapping[str, dict[str, Any]] = _Presets()


def load_machine(source: str | os.PathLike | Mapping[str, Any] | Machine = DEFAULT_MACHINE) -> Machine:
    """A :class:`Machine` from a YAML file path, a preset name (``lassen``, ``p100``, ``h100``), a tree, or a
    machine (returned as it is)."""
    if isinstance(source, Machine):
        return source
    if isinstance(source, str) and source == LOCAL:  # this host: its calibration file, else the CPU model
        source = local_source()
    if isinstance(source, Mapping):
        return machine_from_dict(source)
    path = os.fspath(source)
    if os.path.sep in path or path.endswith((".yaml", ".yml")) or os.path.exists(path):
        if not os.path.isfile(path):
            raise MachineError(f"machine file {path} does not exist")
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise MachineError(f"machine file {path} is {size} bytes; a machine file is a few kilobytes "
                               f"(limit {MAX_FILE_BYTES})")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return machine_from_dict(_parse_yaml(text, path), path, name=Path(path).stem)
    if path not in preset_names():
        raise MachineError(f"unknown machine {path!r}: not a file, and not a preset (presets: "
                           f"{', '.join(preset_names())}); pass a path to a machine YAML file or run "
                           f"`python -m lbannpy.bench calibrate -o machine.yaml`")
    return machine_from_dict(PRESETS[path], f"preset {path}", name=path)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yamlsafe.load(text)
    except yamlsafe.YamlLimitError as exc:
        raise MachineError(f"machine file {where}:{exc}") from None
    except yaml.YAMLError as exc:
        raise MachineError(f"machine file {where} is not valid YAML: {exc}") from None
