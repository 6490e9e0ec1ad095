"""The model graph of a spec: layers in topological order with shapes, FLOPs and parameter counts.

Each layer's shapes come from its type's own declaration in :mod:`lbannpy.layers.registry` (pure: no arrays,
no MPI): the config loader calls this to validate a spec, the strategy selector to cost it.

Shapes are global and include the sample dimension: ``(N, C)`` after a fully-connected layer, ``(N, C, H, W)``
for 2-D images, ``(N, C, D, H, W)`` for 3-D volumes. FLOPs count a multiply-add as two floating-point
operations and are for the forward pass of the whole mini-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from lbannpy.layers.registry import INPUT_NAMES, LayerArgs, ShapeError, layer_spec, layer_specs, loss_specs

from ..dist import shape_str
from ..stencil import Stencil

__all__ = ["INPUT_NAMES", "ShapeError", "Node", "ModelGraph", "build_graph"]


@dataclass(frozen=True)
class Node:
    """One layer of the model graph, shapes resolved."""

    name: str
    type: str
    params: Mapping[str, Any]
    parents: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    flops_fwd: int  # floating-point operations of the forward pass over the whole mini-batch
    n_params: int  # learnable parameters (weights + biases; BN scale + shift)
    stencil: Stencil | None = None  # conv / pool geometry on the input tensor, None for pointwise layers
    halo: str = "window"  # how the stencil's halo moves (registry.Inferred.halo): window, periodic, adjoint

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.in_shapes[0]

    def __str__(self) -> str:
        ins = ", ".join(shape_str(s) for s in self.in_shapes)
        return f"{self.name} ({self.type}): {ins} -> {shape_str(self.out_shape)}"


@dataclass(frozen=True)
class ModelGraph:
    """Layers in topological order (each after its parents). ``input_shape`` includes the batch size."""

    name: str
    input_shape: tuple[int, ...]
    nodes: tuple[Node, ...]
    loss: str | None = None
    index: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.index:
            object.__setattr__(self, "index", {n.name: i for i, n in enumerate(self.nodes)})

    def __getitem__(self, name: str) -> Node:
        try:
            return self.nodes[self.index[name]]
        except KeyError:
            raise KeyError(f"model {self.name!r} has no layer {name!r}; layers: {list(self.index)}") from None

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def batch_size(self) -> int:
        return self.input_shape[0]

    def children(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for p in n.parents:
                if p not in INPUT_NAMES:
                    out[p].append(n.name)
        return out

    @property
    def outputs(self) -> list[str]:
        """Layers no other layer reads (the model's outputs)."""
        return [k for k, v in self.children().items() if not v]

    @property
    def total_flops_fwd(self) -> int:
        return sum(n.flops_fwd for n in self.nodes)

    @property
    def total_params(self) -> int:
        return sum(n.n_params for n in self.nodes)

    def summary(self) -> str:
        lines = [f"model {self.name}: input {shape_str(self.input_shape)}, {len(self.nodes)} layers, "
                 f"{self.total_params:,} parameters, {self.total_flops_fwd / 1e9:.3f} GFLOP forward"]
        for n in self.nodes:
            lines.append(f"  {n}  params={n.n_params:,} flops={n.flops_fwd:,}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------


def build_graph(model_spec: Mapping[str, Any], batch_size: int) -> ModelGraph:
    """Resolve the ``model:`` tree of a spec into a :class:`ModelGraph` for mini-batches of ``batch_size``.

    Raises :class:`ShapeError` (a ``ValueError``) naming the layer, the shapes and the fix when the spec is
    malformed or its shapes do not fit together.
    """
    if not isinstance(model_spec, Mapping):
        raise ShapeError(f"model spec must be a mapping with 'input' and 'layers', got "
                         f"{type(model_spec).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ShapeError(f"batch_size must be a positive integer, got {batch_size!r}")
    name = str(model_spec.get("name", "model"))
    input_shape = _input_shape(model_spec, batch_size)
    raw_layers = model_spec.get("layers")
    if not isinstance(raw_layers, Sequence) or isinstance(raw_layers, (str, bytes)) or not raw_layers:
        raise ShapeError(f"model {name!r}: 'layers' must be a non-empty list of layer mappings")

    layers = _normalise_layers(name, raw_layers)
    order = _topological(name, layers)
    shapes: dict[str, tuple[int, ...]] = {n: input_shape for n in INPUT_NAMES}
    nodes = []
    for lay in order:
        in_shapes = tuple(shapes[p] for p in lay["parents"])
        node = _infer(lay, in_shapes)
        shapes[node.name] = node.out_shape
        nodes.append(node)

    loss = model_spec.get("loss")
    if loss is not None:
        loss = _check_loss(name, str(loss), nodes)
    return ModelGraph(name, input_shape, tuple(nodes), loss)


def _input_shape(spec: Mapping[str, Any], batch: int) -> tuple[int, ...]:
    inp = spec.get("input")
    if not isinstance(inp, Mapping) or "channels" not in inp or "spatial" not in inp:
        raise ShapeError("model 'input' must be a mapping {channels: C, spatial: [H, W]} (or [D, H, W])")
    ch, sp = inp["channels"], inp["spatial"]
    if isinstance(sp, int):
        sp = [sp, sp]
    if not isinstance(ch, int) or ch < 1:
        raise ShapeError(f"input channels must be a positive integer, got {ch!r}")
    if not isinstance(sp, Sequence) or not 1 <= len(sp) <= 3 \
            or not all(isinstance(s, int) and s >= 1 for s in sp):
        raise ShapeError(f"input spatial must be 1 to 3 positive integers ([W], [H, W] or [D, H, W]), got "
                         f"{sp!r}")
    return (batch, ch) + tuple(int(s) for s in sp)


def _normalise_layers(model: str, raw: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    seen: set[str] = set()
    prev = "x"
    for i, lay in enumerate(raw):
        if not isinstance(lay, Mapping):
            raise ShapeError(f"model {model!r}: layer #{i} must be a mapping, got {lay!r}")
        lname = lay.get("name")
        if not isinstance(lname, str) or not lname:
            raise ShapeError(f"model {model!r}: layer #{i} needs a 'name' (a non-empty string)")
        if lname in INPUT_NAMES:
            raise ShapeError(f"layer #{i}: the name {lname!r} is reserved for the model input; rename the "
                             f"layer")
        if lname in seen:
            raise ShapeError(f"model {model!r}: two layers are named {lname!r}; layer names must be unique")
        seen.add(lname)
        ltype = lay.get("type")
        specs = layer_specs()
        if ltype not in specs:
            raise ShapeError(f"layer {lname!r}: unknown type {ltype!r}; use one of {sorted(specs)}")
        params = dict(lay.get("params") or {})
        params.update({k: v for k, v in lay.items() if k not in ("name", "type", "parents", "params")})
        accepts = specs[ltype].accepts()
        unknown = set(params) - set(accepts)
        if unknown:
            raise ShapeError(f"layer {lname!r} ({ltype}): unknown parameter(s) {sorted(unknown)}; "
                             f"a {ltype} layer takes {list(accepts) or 'no parameters'}")
        parents = lay.get("parents") or [prev]
        if isinstance(parents, str):
            parents = [parents]
        if not isinstance(parents, Sequence) or not parents or not all(isinstance(p, str) for p in parents):
            raise ShapeError(f"layer {lname!r}: 'parents' must be a layer name or a non-empty list of names")
        out.append({"name": lname, "type": ltype, "params": params, "parents": tuple(parents), "pos": i})
        prev = lname
    names = {lay["name"] for lay in out}
    for lay in out:
        for p in lay["parents"]:
            if p not in names and p not in INPUT_NAMES:
                raise ShapeError(f"layer {lay['name']!r}: parent {p!r} is not a layer of model {model!r} "
                                 f"(use 'x' or 'input' for the model input)")
        n_in = len(lay["parents"])
        spec = layer_spec(lay["type"])
        if n_in < spec.min_parents:
            least = {2: "two", 3: "three"}.get(spec.min_parents, spec.min_parents)
            raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) needs at least {least} parents, "
                             f"got {list(lay['parents'])}")
        if spec.max_parents is not None and n_in > spec.max_parents:
            joins = sorted(n for n, s in layer_specs().items() if s.max_parents is None)
            exactly = {1: "one parent"}.get(spec.max_parents, f"{spec.max_parents} parents")
            raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) takes exactly {exactly}, "
                             f"got {list(lay['parents'])}; join branches with a {' or '.join(joins)} layer")
    return out


def _topological(model: str, layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kahn's algorithm, ties broken by position in the spec (so a spec in order stays in order)."""
    import heapq

    by_name = {lay["name"]: lay for lay in layers}
    indeg = {lay["name"]: sum(1 for p in lay["parents"] if p not in INPUT_NAMES) for lay in layers}
    kids: dict[str, list[str]] = {lay["name"]: [] for lay in layers}
    for lay in layers:
        for p in lay["parents"]:
            if p not in INPUT_NAMES:
                kids[p].append(lay["name"])
    ready = [(lay["pos"], lay["name"]) for lay in layers if indeg[lay["name"]] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(by_name[n])
        for k in kids[n]:
            indeg[k] -= 1
            if indeg[k] == 0:
                heapq.heappush(ready, (by_name[k]["pos"], k))
    if len(out) != len(layers):
        cyc = sorted(n for n, d in indeg.items() if d > 0)
        raise ShapeError(f"model {model!r}: layers {cyc} form a cycle through their 'parents'; a model "
                         f"must be acyclic")
    return out


def _infer(lay: dict[str, Any], in_shapes: tuple[tuple[int, ...], ...]) -> Node:
    """Shape inference by the layer type's own declaration (:mod:`lbannpy.layers.registry`)."""
    spec = layer_spec(lay["type"])
    args = LayerArgs(lay["name"], lay["type"], spec.resolve(lay["params"]), lay["parents"], in_shapes)
    r = spec.infer(args)
    return Node(lay["name"], lay["type"], dict(lay["params"]), lay["parents"], in_shapes,
                tuple(int(s) for s in r.out_shape), int(r.flops), int(r.n_params), r.stencil, r.halo)


def _check_loss(model: str, loss: str, nodes: list[Node]) -> str:
    losses = loss_specs()
    if loss not in losses:
        raise ShapeError(f"model {model!r}: unknown loss {loss!r}; use one of {list(losses)}")
    losses[loss].check(model, nodes[-1].name, nodes[-1].out_shape)
    return loss
