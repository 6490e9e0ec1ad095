"""Numerical health: a non-finite loss or gradient norm stops the run at the step it appears, naming the first
place that went non-finite on that step; a checkpoint is never written with non-finite parameters.

The loss is reduced over all samples before the trainer sees it, so every rank sees the same value and
decides alike without communicating; only the diagnosis (on the failing step, once) gathers one small
object from every rank.
"""
from __future__ import annotations

import math

from .errors import NonFinite


def loss_is_finite(loss: float) -> bool:
    return math.isfinite(loss)


def _finite(xp, a) -> bool:
    return a is None or bool(xp.isfinite(a).all())


def first_nonfinite(world, model, x_local, xp) -> str:
    """Who calls: every rank, on the step whose loss is non-finite (collective: one allgather). Where the
    values first went non-finite, in the order the forward pass made them: the input batch, then for each
    layer its parameters and its output."""
    places = [("the input batch", x_local)]
    acts = model.activations()
    for layer in model.layers:
        for p in layer.params:
            places.append((f"the parameters of layer '{layer.name}' ({p.name})", p.value))
        out = acts.get(layer.name)
        if out is not None:
            places.append((f"the output of layer '{layer.name}'", getattr(out, "local", out)))
    return _first(world, xp, places, "every input, parameter and layer output is finite (the loss itself "
                                     "overflowed)")


def _first(world, xp, places: list, none: str) -> str:
    """Collective (one allgather): the first of ``places`` (name, array) that is non-finite on any rank,
    with the lowest rank holding it; ``none`` when every one is finite everywhere."""
    mine = next((i for i, (_, a) in enumerate(places) if not _finite(xp, a)), len(places))
    found = world.allgather_obj(mine)
    first = min(found)
    if first == len(places):
        return none
    return f"{places[first][0]} (rank {found.index(first)})"


def check_loss(world, step: int, loss: float, model, x_local, xp) -> None:
    """Raise :class:`NonFinite` for a non-finite ``loss`` of ``step`` (every rank alike)."""
    if not loss_is_finite(loss):
        raise NonFinite(step, f"loss {loss}", first_nonfinite(world, model, x_local, xp))


def first_nonfinite_gradient(world, model, xp) -> str:
    """Who calls: every rank, on the step whose gradient norm is non-finite (collective: one allgather). The
    first parameter gradient that is non-finite in the order backprop made them (from the last layer)."""
    places = [(f"the gradient of layer '{layer.name}' ({p.name})", p.grad) for layer in reversed(model.layers)
              for p in layer.params]
    return _first(world, xp, places, "every gradient is finite (their squared sum overflowed)")


def check_grad_norm(world, step: int, norm: float, model, xp) -> None:
    """Raise :class:`NonFinite` for a non-finite gradient ``norm`` of ``step`` (every rank alike: the norm
    is reduced over all ranks)."""
    if not math.isfinite(norm):
        raise NonFinite(step, f"gradient norm {norm}", first_nonfinite_gradient(world, model, xp))


def check_params(world, step: int, model, xp) -> None:
    """Who calls: every rank, before writing a checkpoint (collective: one allgather). Raise
    :class:`NonFinite` when any parameter is non-finite, so the last good checkpoint stays the newest."""
    bad = next((f"the parameters of layer '{layer.name}' ({p.name})" for layer in model.layers
                for p in layer.params if not _finite(xp, p.value)), None)
    found = world.allgather_obj(bad)
    where = next(((r, b) for r, b in enumerate(found) if b), None)
    if where is not None:
        raise NonFinite(step, "non-finite parameters", f"{where[1]} (rank {where[0]})")


def json_safe(obj):
    """``obj`` with every non-finite float replaced by None (NaN and Infinity are not JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    try:
        import numpy as np

        if isinstance(obj, np.floating):
            return json_safe(float(obj))
    except ImportError:
        pass
    return obj
