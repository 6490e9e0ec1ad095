"""The machine a run is on, for the cost model: ``parallel.machine: local`` (the default) and ``python -m
lbannpy.strategy`` without ``--machine``.

* When ``python -m lbannpy.bench calibrate`` has measured this host, its file is the machine:
  :func:`calibration_path` (``~/.config/lbannpy/machines/HOST.yaml``; ``LBANNPY_MACHINE_DIR`` moves the
  folder), which calibrate writes beside its ``-o`` file.
* Otherwise a described model of a local CPU (:func:`uncalibrated`): this host's cores and memory, with
  rates assumed for a current x86 core (its ``source`` says which), and the strategy output says so and how to
  calibrate.

:func:`describe` is the line a strategy report prints about the machine it priced.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

LOCAL = "local"  # the name that means "the machine this runs on"
UNCALIBRATED = "local-cpu"  # the name of the described model used until a calibration exists
CALIBRATE = "python -m lbannpy.bench calibrate"

# Assumed rates of one core of a current x86 CPU running lbannpy's kernels (one BLAS thread per rank):
# sustained conv/GEMM rate, streaming rate, fixed cost per layer call, shared-memory MPI within a node, and
# a 10 Gb/s Ethernet between nodes. A calibration replaces all of them with measured ones.
ASSUMED = {"gflops_per_core": 50.0, "stream_gb_s_per_core": 8.0, "layer_call_s": 2.0e-5,
           "intra_alpha_s": 5.0e-6, "intra_gb_s": 8.0, "inter_alpha_s": 3.0e-5, "inter_gb_s": 1.2}


def host() -> str:
    """This host's name, as ``bench calibrate`` records it."""
    return socket.gethostname() or "localhost"


def calibration_dir() -> Path:
    """Where this host's calibration is kept: ``$LBANNPY_MACHINE_DIR``, else
    ``$XDG_CONFIG_HOME/lbannpy/machines`` (``~/.config/lbannpy/machines``)."""
    if os.environ.get("LBANNPY_MACHINE_DIR"):
        return Path(os.environ["LBANNPY_MACHINE_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "lbannpy" / "machines"


def calibration_path() -> Path:
    """The file ``bench calibrate`` writes for this host and ``parallel.machine: local`` reads."""
    return calibration_dir() / f"{host()}.yaml"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return 8.0


def uncalibrated_tree() -> dict:
    """The machine tree of the described local CPU model (see :data:`ASSUMED`)."""
    a, cores, mem = ASSUMED, _cores(), _memory_gib()
    return {
        "name": UNCALIBRATED,
        "source": (f"not measured: a model of this host ({host()}: {cores} cores, {mem:.0f} GiB) with rates "
                   f"assumed for one core of a current x86 CPU: {a['gflops_per_core']:g} GFLOP/s, "
                   f"{a['stream_gb_s_per_core']:g} GB/s streaming, {a['layer_call_s'] * 1e6:g} us per layer "
                   f"call, shared-memory MPI {a['intra_alpha_s'] * 1e6:g} us + {a['intra_gb_s']:g} GB/s"),
        "ranks_per_node": cores, "cores_per_node": cores,
        "memory_per_device_gib": round(mem / cores, 3),
        "intra": {"alpha_s": a["intra_alpha_s"], "beta_s_per_byte": 1e-9 / a["intra_gb_s"]},
        "inter": {"alpha_s": a["inter_alpha_s"], "beta_s_per_byte": 1e-9 / a["inter_gb_s"]},
        "compute": {"gamma_s_per_flop": 1e-9 / a["gflops_per_core"],
                    "mem_s_per_byte": 1e-9 / a["stream_gb_s_per_core"],
                    "kernel_overhead_s": a["layer_call_s"]},
    }


def local_source() -> str | dict:
    """What :func:`lbannpy.machine.load_machine` reads for ``local``: this host's calibration file when one
    exists (:func:`calibration_path`), else the tree of the described CPU model (:func:`uncalibrated_tree`).
    This module imports no other: the machine module asks it."""
    path = calibration_path()
    return str(path) if path.is_file() else uncalibrated_tree()


def describe(machine) -> str:
    """One line: which machine a plan was priced on, and how to price it on this host's measured rates."""
    cal = calibration_path()
    if machine.name == UNCALIBRATED:
        return (f"priced on {UNCALIBRATED} ({machine.source}); `{CALIBRATE}` measures this host and writes "
                f"{cal}, which the default machine (parallel.machine: local) then is")
    on = machine.measured_on or {}
    if on:
        where = f"measured on {on.get('host', '?')}" + (f" {on['date']}" if on.get("date") else "")
        mine = on.get("host") == host()
        return (f"priced on {machine.name}, {where}" + ("" if mine else
                f" (not this host, {host()}: `{CALIBRATE}` measures this one)"))
    return (f"priced on {machine.name}, a model of another system, not this host ({host()}); "
            f"`{CALIBRATE}` measures this one, and without --machine the strategy uses it")
