"""The model graph: layers built from the config's ``model`` tree, each with its distribution.

Layers are configured in topological order on every rank (so group communicators are created in the
same order everywhere). Where a layer's input distribution differs from its parent's output distribution,
the layer's base class redistributes (and reverses that in backprop). Gradients of a tensor consumed by
several layers are summed in the parent's output distribution.
"""
from __future__ import annotations

from typing import Any

from lbannpy.dist import DIM_NAMES, Distribution, DistributionError
from lbannpy.layers.base import Layer, LayerError
from lbannpy.layers.context import LayerContext
from lbannpy.layers.registry import ALL_DIMS, INPUT_NAMES, activation_sharing, layer_classes
from lbannpy.tensor import DistTensor


class ModelError(ValueError):
    """A model that cannot be built: names the layer and the fix."""


def effective_default(default: dict, ranks: int, batch_size: int) -> tuple[dict, str]:
    """``parallel.default`` with the ranks it leaves free given to the sample dimension (as DDP and LBANN
    do) when the batch divides, and a one-line note for the user ('' when nothing was left free). Ranks
    stay replicas only where written: ``r`` (replicas) counts as used. Pure."""
    default = {k: int(v) for k, v in (default or {}).items()}
    replicas = default.pop("r", 1)
    used = replicas
    for v in default.values():
        used *= v
    free = ranks // used if used and ranks % used == 0 else 1
    if free <= 1:
        return default, ""
    n = default.get("n", 1) * free
    if batch_size % n == 0:
        return dict(default, n=n), (f"{free} rank(s) left free by parallel.default split the samples: n={n} "
                                    f"(parallel.default.r={free * replicas} keeps them as replicas)")
    return default, (f"{free} rank(s) left free by parallel.default hold replicas: the batch {batch_size} "
                     f"does not divide by n={n}; choose a batch size that does to split the samples")


def layer_dist(layer_type: str, splittable, ndim: int, ranks: int, default: dict, override: dict | None):
    """The distribution of a layer's output: the per-layer override as given (unsupported dims are refused
    by the layer), else the default restricted to what this layer type can split and its tensor has."""
    names = DIM_NAMES[ndim]
    if override is not None:
        degrees = {k: int(v) for k, v in override.items() if k in ALL_DIMS}
        extra = [k for k, v in degrees.items() if k not in names and v > 1]
        if extra:
            raise ModelError(f"a {layer_type} layer has a rank-{ndim} output {names}; it cannot split "
                             f"{extra}")
        degrees = {k: v for k, v in degrees.items() if k in names}
    else:
        degrees = {k: int(v) for k, v in (default or {}).items() if k in names and k in splittable}
    return Distribution.make(ndim, ranks, **degrees)


class Model:
    def __init__(self, model_spec: dict, batch_size: int, ctx: LayerContext, parallel: dict | None = None):
        parallel = parallel or {}
        self.ctx = ctx
        self.spec = model_spec
        inp = model_spec["input"]
        spatial = tuple(int(s) for s in inp["spatial"])
        self.input_shape = (int(batch_size), int(inp["channels"])) + spatial
        ranks = ctx.size
        default, self.rank_note = effective_default(parallel.get("default") or {}, ranks, int(batch_size))
        overrides = parallel.get("layers") or {}
        in_override = next((overrides[n] for n in INPUT_NAMES if n in overrides), None)
        self.input_dist = layer_dist("input", ALL_DIMS, len(self.input_shape), ranks,
                                     default, in_override)
        classes = layer_classes()
        self.layers: list[Layer] = []
        self.parents: dict[str, list[str]] = {}
        shapes = {n: self.input_shape for n in INPUT_NAMES}
        dists = {n: self.input_dist for n in INPUT_NAMES}
        prev = INPUT_NAMES[0]
        for i, spec in enumerate(model_spec["layers"]):
            spec = dict(spec)
            name = spec.pop("name")
            ltype = spec.pop("type")
            parents = spec.pop("parents", None) or [prev]
            if isinstance(parents, str):
                parents = [parents]
            if ltype not in classes:
                raise ModelError(f"model.layers[{i}] '{name}': unknown layer type '{ltype}'")
            for p in parents:
                if p not in shapes:
                    raise ModelError(f"model.layers[{i}] '{name}': parent '{p}' is not an earlier layer")
            layer = classes[ltype](name, **spec)
            in_shapes = [shapes[p] for p in parents]
            ndim = 2 if layer.spec.flat_output else len(in_shapes[0])
            try:
                dist = layer_dist(ltype, layer.splittable, ndim, ranks, default, overrides.get(name))
                layer.configure(ctx, in_shapes, [dists[p] for p in parents], dist)
            except (DistributionError, ModelError) as exc:
                raise LayerError(f"layer '{name}' ({ltype}): {exc}") from exc
            layer.keeps_window = all(p in INPUT_NAMES for p in parents)
            self.layers.append(layer)
            self.parents[name] = list(parents)
            shapes[name] = layer.out_shape
            dists[name] = layer.out_dist
            prev = name
        self.output = self.layers[-1]
        self.consumers: dict[str, int] = {}
        for ps in self.parents.values():
            for p in ps:
                self.consumers[p] = self.consumers.get(p, 0) + 1
        self._plan_steps()

    def _plan_steps(self) -> None:
        """Fuse and order once what every step repeats: a ReLU whose only parent is a batch-norm that
        nothing else reads runs inside the batch-norm (one pass forward, one backward; the ReLU layer is
        skipped), and a ReLU whose parent's output nothing else reads (nor keeps for its own backward)
        overwrites it. ``ctx.fuse = False`` keeps every layer on its own."""
        by_name = {layer.name: layer for layer in self.layers}
        self._fused: set[str] = set()
        sharing = activation_sharing(((layer.name, layer, self.parents[layer.name], layer.out_dist)
                                      for layer in self.layers), fuse=self.ctx.fuse)
        for name, how in sharing.items():
            if how == "fused":
                by_name[self.parents[name][0]].fuse_relu = True
                self._fused.add(name)
            else:
                by_name[name].inplace = True
        # (layer, parent names, the layer's parent when fused into it else None)
        self._steps = [(layer, self.parents[layer.name],
                        self.parents[layer.name][0] if layer.name in self._fused else None)
                       for layer in self.layers]
        self._input_grad_for = None
        # the sum of a multi-consumer tensor's gradients, one buffer per (tensor, shape, dtype) planned at its
        # first use and written every step after (a captured step keeps writing the same one)
        self._grad_sums: dict = {}

    def _grad_sum(self, key: str, a, b):
        """``a + b`` into the planned buffer of tensor ``key``'s gradient (``a`` may be that buffer)."""
        buf = self._grad_sums.get((key, a.shape, a.dtype.str))
        if buf is None:
            buf = self._grad_sums[(key, a.shape, a.dtype.str)] = self.ctx.xp.empty_like(a)
        if a is buf:
            buf += b
        else:
            self.ctx.xp.add(a, b, out=buf)
        return buf

    @property
    def params(self):
        return [p for layer in self.layers for p in layer.params]

    def set_train(self, train: bool) -> None:
        for layer in self.layers:
            layer.train = train

    def forward(self, x: DistTensor, before_layer=None) -> DistTensor:
        """Forward pass; ``before_layer(layer)`` is called just before each layer's forward (the trainer
        applies a layer's late, replicated gradient update there)."""
        # the last pass's activations (an evaluation pass keeps them, as backward never comes) go first, so
        # they are not alive beside this pass's
        self._acts = None
        acts: dict[str, Any] = {n: x for n in INPUT_NAMES}
        for layer, parents, fused_into in self._steps:
            if before_layer is not None:
                before_layer(layer)
            if fused_into is not None:  # computed by its batch-norm parent
                acts[layer.name] = acts[fused_into]
            elif len(parents) == 1:
                acts[layer.name] = layer.forward([acts[parents[0]]])
            else:
                acts[layer.name] = layer.forward([acts[p] for p in parents])
        self._acts = acts
        return acts[self.output.name]

    def activations(self) -> dict:
        """The outputs of the last forward pass by layer name, until backward consumes them (a copy of the
        mapping; the arrays are the pass's own); empty when none are held. The health checks read them to
        say where values first went non-finite."""
        return dict(self._acts or {})

    def _set_input_grad(self, input_grad: bool) -> None:
        if self._input_grad_for is input_grad:
            return
        for layer in self.layers:
            layer.needs_input_grad = input_grad or not all(p in INPUT_NAMES for p in self.parents[layer.name])
        self._input_grad_for = input_grad

    def backward(self, dy: DistTensor, on_layer=None, input_grad: bool = True) -> DistTensor | None:
        """Backprop from the loss gradient ``dy``; ``on_layer(name)`` is called after each layer's backward
        (its weight gradients are then final on this rank: the overlap engine posts their bucket). Returns
        the gradient w.r.t. the model input; with ``input_grad=False`` (training) layers that read only
        the model input skip computing it where they can (conv, fc: no data gradient, no partial-sum
        reduction, no halo accumulation) and None may be returned."""
        grads: dict[str, DistTensor] = {self.output.name: dy}
        self._set_input_grad(input_grad)
        first = INPUT_NAMES[0]
        # a layer's output is read by later layers only, which have all been back-propagated when its own
        # turn comes: from then on only the layer itself may need it (and keeps its own reference), so the
        # forward's reference goes, and each activation is freed as soon as its last user is done
        acts = self._acts or {}
        for layer, parents, fused_into in reversed(self._steps):
            acts.pop(layer.name, None)
            g = grads.pop(layer.name, None)
            if g is None:
                raise ModelError(f"layer '{layer.name}' does not reach the loss; remove it or connect it")
            dxs = (g,) if fused_into is not None else layer.backward(g)
            if on_layer is not None:
                on_layer(layer.name)
            for p, dx in zip(parents, dxs):
                if dx is None:
                    continue
                key = first if p in INPUT_NAMES else p
                have = grads.get(key)
                if have is not None:
                    # the model input's gradient is returned to the caller, who may keep it: a new array
                    total = have.local + dx.local if key == first else self._grad_sum(key, have.local,
                                                                                      dx.local)
                    grads[key] = DistTensor.trusted(total, dx.global_shape, dx.dist, dx.rank,
                                                    have.local.shape)
                else:
                    grads[key] = dx
        self._acts = None
        return grads.get(first)
