"""PyTorch references of the layer types, one module per family (``REFS``: type -> ``f(layer, ins,
params)`` on float64 tensors); :func:`layer_cases._apply` looks a type up here after its own branches.
A family's module is found by walking this package, so a new family adds a file and edits nothing else."""
from __future__ import annotations

import importlib
import pkgutil

REFS: dict = {}

for _mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    _refs = getattr(importlib.import_module(f"{__name__}.{_mod.name}"), "REFS", {})
    dup = set(_refs) & set(REFS)
    if dup:
        raise ValueError(f"torch reference of {sorted(dup)} defined twice (tests/torch_refs/{_mod.name}.py)")
    REFS.update(_refs)
