"""The one array-module switch: NumPy (CPU, first class) or CuPy (GPU). CuPy is imported only when asked for.

Code that computes takes ``xp`` from here (or from :func:`array_module` of an array it was given) and never
branches on the backend itself.
"""
from __future__ import annotations

import importlib
import os
import sys
import types

import numpy

_BACKENDS = ("numpy", "cupy")


class BackendError(RuntimeError):
    """The requested array backend cannot be used here (e.g. CuPy without a GPU)."""


def get_xp(name: str = "numpy") -> types.ModuleType:
    """The array module called ``name`` ('numpy' or 'cupy'); CuPy is imported on first use."""
    if name == "numpy":
        return numpy
    if name == "cupy":
        try:
            return importlib.import_module("cupy")
        except Exception as exc:  # ImportError, or a CUDA runtime error raised while importing
            raise BackendError(
                f"GPU arrays need CuPy and a CUDA GPU ({exc}); install lbannpy[gpu] on a GPU node, or run "
                f"on the CPU (runtime.device: cpu)") from exc
    raise BackendError(f"unknown array backend {name!r}; use one of {', '.join(_BACKENDS)}")


def launched_ranks_on_node(env=None) -> int | None:
    """The ranks the launcher started on this node, from its environment (``srun``, Hydra's ``mpiexec``,
    Open MPI's ``mpirun``); None when it does not say. Needs no MPI: it is read before MPI starts."""
    env = os.environ if env is None else env
    for var in ("SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        v = env.get(var, "").strip()
        if v.isdigit():
            return int(v)
    # SLURM without --ntasks-per-node: "2(x3),1" lists each node's count; SLURM_NODEID picks this node's
    per_node: list[int] = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        n, _, times = part.strip().partition("(x")
        times = times.rstrip(")") or "1"
        if not (n.isdigit() and times.isdigit()):
            return None
        per_node += [int(n)] * int(times)
    node = env.get("SLURM_NODEID", "0").strip()
    return per_node[int(node)] if per_node and node.isdigit() and int(node) < len(per_node) else None


def device_problem(device: str, backend: str = "auto", share_gpu: bool = False,
                   ranks_on_node: int | None = None) -> str | None:
    """Why ``runtime.device``, ``runtime.backend`` and ``runtime.share_gpu`` cannot run on this machine, as
    one line naming the key to change and its values; None when they can. ``ranks_on_node`` (when known:
    :func:`launched_ranks_on_node`) adds the check of ranks against the GPUs they would share.

    One check for ``validate`` and for the commands that start a Runtime, before MPI starts: each rank of a
    node finds the same answer, so each can end on it alone (exit 2) instead of failing inside the
    Runtime's set-up. Imports CuPy only for ``device: gpu``; touches no GPU (it counts them)."""
    if backend == "nccl" and device != "gpu":
        return (f"runtime.backend: nccl runs on GPUs, but runtime.device is {device!r}; set runtime.backend: "
                f"mpi (or auto) to run on the CPU, or runtime.device: gpu on a GPU node")
    if device != "gpu":
        return None
    key = "runtime.backend: nccl" if backend == "nccl" else "runtime.device: gpu"
    try:
        cupy = get_xp("cupy")
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no CuPy, or a CUDA runtime without a driver
        cause = (f"{exc.__cause__ or exc}".splitlines() or [type(exc).__name__])[0]
        also = " and runtime.backend: mpi (or auto)" if backend == "nccl" else ""
        return (f"{key} needs CuPy and a CUDA GPU, which this machine lacks ({cause}); set runtime.device: "
                f"cpu{also}, or run on a GPU node with lbannpy[gpu] installed")
    if count < 1:
        return (f"{key}, but no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); set runtime.device: cpu, or run on a GPU node")
    if ranks_on_node is None or ranks_on_node <= count:
        return None
    where = f"{ranks_on_node} ranks on this node but {count} GPU(s) visible"
    if not share_gpu:
        return (f"runtime.device: gpu: {where}, so ranks would share a GPU; launch at most {count} rank(s) "
                f"per node, or set runtime.share_gpu: true to allow it")
    if backend == "nccl":
        return (f"runtime.backend: nccl with runtime.share_gpu: true: {where}, and NCCL cannot run two "
                f"ranks on one GPU; set runtime.backend: mpi (or auto), which stages GPU arrays through host "
                f"memory")
    return None


def array_module(arr) -> types.ModuleType:
    """NumPy or CuPy, whichever ``arr`` belongs to (without importing CuPy when it is not loaded)."""
    if type(arr).__module__.startswith("cupy"):
        return sys.modules["cupy"]
    return numpy


def to_numpy(arr) -> numpy.ndarray:
    """A host copy (or the array itself when it is already NumPy)."""
    if isinstance(arr, numpy.ndarray):
        return arr
    return arr.get()


_KERNELS: dict = {}


def module_kernels(xp, key: str, build):
    """Kernels compiled once per array module: ``build(xp)`` for ``(xp, key)``, kept for the process.
    None for NumPy, or for an array module that cannot compile kernels at all (no ``ElementwiseKernel``),
    so the caller takes its array-expression path. A module that has ``ElementwiseKernel`` but fails to
    build one raises :class:`BackendError` with the cause: a silent fallback would run other numerics, or
    make a captured step refuse for the wrong reason."""
    if xp.__name__ == "numpy" or not hasattr(xp, "ElementwiseKernel"):
        return None
    got = _KERNELS.get((xp, key))
    if got is None:
        try:
            got = build(xp)
        except Exception as exc:
            raise BackendError(f"the {xp.__name__} kernels '{key}' could not be built: {type(exc).__name__}: "
                               f"{exc}".splitlines()[0]) from exc
        _KERNELS[(xp, key)] = got
    return got


def flat(a):
    """``a`` flattened, as a view (updates write through it): the optimizer's sharded state
    (``optimizer.shard_state``) updates ranges of parameters this way."""
    if not a.flags.c_contiguous:
        raise ValueError("optimizer.shard_state needs contiguous parameters and state")
    return a.reshape(-1)


def is_gpu_array(arr) -> bool:
    return type(arr).__module__.startswith("cupy")
