"""Layer cases of the layer families beyond tests/mpi/test_layers.py, one module per family, each with
``cases(size) -> list[layer_cases.Case]`` (every split the family allows at ``size`` ranks, uneven blocks
included). tests/mpi/test_layers_families.py runs them against PyTorch on the CPU,
tests/gpu/test_layers_gpu.py on the CUDA stand-in (or a real GPU). A family adds a file here and its
reference in tests/torch_refs/."""
from __future__ import annotations

import importlib
import pkgutil


def families() -> dict:
    """Family name -> its ``cases`` function, in name order."""
    out = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        out[mod.name] = importlib.import_module(f"{__name__}.{mod.name}").cases
    return out


def all_cases(size: int) -> list:
    return [case for cases in families().values() for case in cases(size)]
