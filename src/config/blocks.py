"""Every layer's blocks under the written split: refused here, before a job, where the model build would
refuse them on every rank at start-up (a split degree larger than a tensor extent leaves ranks with empty
blocks; more sample parts than samples in the batch).

Pure: the graph's shapes and :func:`lbannpy.model.layer_dist`, the trainer's own choice of each layer's
distribution, with no communicator and no array.
"""
from __future__ import annotations

from ..dist import DIM_NAMES
from ..config_errors import ConfigError


def check_blocks(cfg: dict, ranks: int, graph) -> None:
    """Raise ConfigError naming the first layer whose input or output block would be empty on some rank
    when ``cfg`` runs on ``ranks`` ranks. ``parallel.strategy: auto`` chooses valid splits itself."""
    # late: the layer registry and the model import lbannpy.config (through the layers' value types)
    from ..layers.registry import layer_spec, reduced_dims, split_refusal
    from ..model import ModelError, effective_default, layer_dist

    par = cfg["parallel"]
    if par.get("strategy") == "auto":
        return
    batch = int(cfg["trainer"]["batch_size"])
    default, _ = effective_default(par.get("default") or {}, ranks, batch)
    overrides = par.get("layers") or {}
    for node in graph:
        where = f"parallel.layers.{node.name}" if node.name in overrides else "parallel.default"
        ndim = len(node.out_shape)
        try:
            dist = layer_dist(node.type, layer_spec(node.type).split_dims, ndim, ranks, default,
                              overrides.get(node.name))
        except ModelError as exc:
            raise ConfigError(where, f"layer '{node.name}': {exc}",
                              "split only the dimensions it has") from None
        cut = split_refusal(layer_spec(node.type), node.params, node.in_shape, dist)
        if cut is not None:  # a split the type makes, but not of this layer (a channel group it would cut)
            dim, why, fix = cut
            raise ConfigError(f"{where}.{dim}", f"layer '{node.name}' ({node.type}): {why}",
                              f"{fix}, for this layer alone in parallel.layers.{node.name}")
        parts = dict(zip(DIM_NAMES[ndim], dist.parts))
        if parts.get("n", 1) > batch:
            raise ConfigError(f"{where}.n", f"layer '{node.name}': a batch of {batch} sample(s) cannot be "
                                            f"split {parts['n']} ways over the samples",
                              f"use trainer.batch_size >= {parts['n']} or a smaller n")
        shapes = [("output", node.out_shape)]
        shapes += [("input", s) for s in node.in_shapes if len(s) == ndim]
        # where the layer reduces a split dimension whole (global pooling) the split cuts its input only
        whole = reduced_dims(layer_spec(node.type), node.in_shape, node.out_shape, dist)
        for kind, shape in shapes:
            for d, (name, extent) in enumerate(zip(DIM_NAMES[ndim], shape)):
                if d == 0 or (kind == "input" and name == "c") or (kind == "output" and d in whole):
                    continue  # samples: above; an input is not split by the filters its layer computes
                if parts.get(name, 1) > extent:
                    raise ConfigError(f"{where}.{name}", f"layer '{node.name}' ({node.type}): its {kind} "
                                                         f"{tuple(shape)} has {extent} along '{name}', split "
                                                         f"{parts[name]} ways: ranks would hold empty blocks",
                                      f"split '{name}' at most {extent} ways here (a per-layer entry in "
                                      f"parallel.layers, or fewer ranks per sample)")
