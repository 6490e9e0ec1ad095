"""The one array-module switch: NumPy (CPU, first class) or CuPy (GPU). CuPy is imported only when asked for.

Code that computes takes ``xp`` from here (or from :func:`array_module` of an array it was given) and never
branches on the backend itself.
"""
from __future__ import annotations

import importlib
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
                f"the 'cupy' backend needs CuPy and a CUDA GPU ({exc}); install lbannpy[gpu] on a GPU node, "
                f"or use backend 'numpy'") from exc
    raise BackendError(f"unknown array backend {name!r}; use one of {', '.join(_BACKENDS)}")


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
