"""The model graph of a spec: layers in topological order with shapes, FLOPs and parameter counts.

This is the project's one shape-inference function. It is pure (no arrays, no MPI): the config loader calls
it to validate a spec, the strategy selector to cost it, the runtime to size its tensors.

Shapes are global and include the sample dimension: ``(N, C)`` after a fully-connected layer, ``(N, C, H, W)``
for 2-D images, ``(N, C, D, H, W)`` for 3-D volumes. FLOPs count a multiply-add as two floating-point
operations and are for the forward pass of the whole mini-batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..dist import DistributionError, Stencil, shape_str

INPUT_NAMES = ("x", "input")

# type -> parameters it accepts (besides name, type, parents); unknown keys are refused so that typos surface
LAYER_PARAMS: dict[str, tuple[str, ...]] = {
    "conv": ("filters", "kernel", "stride", "padding", "dilation", "groups", "bias"),
    "batchnorm": ("eps", "momentum", "sync"),
    "relu": (),
    "leaky_relu": ("slope", "negative_slope"),
    "pool": ("mode", "kernel", "stride", "padding", "global"),
    "sum": (),
    "concat": ("axis",),
    "fc": ("units", "bias"),
    "dropout": ("rate", "p"),
    "flatten": (),
}
LOSSES = ("cross_entropy", "pixel_cross_entropy", "mse")
WEIGHTED_TYPES = ("conv", "fc", "batchnorm")


class ShapeError(ValueError):
    """A spec whose shapes do not fit together. The message names the layer, the shapes and the fix."""


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

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.in_shapes[0]

    @property
    def spatial_dims(self) -> int:
        return len(self.out_shape) - 2

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
        raise ShapeError(f"model spec must be a mapping with 'input' and 'layers', got {type(model_spec).__name__}")
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
    if not isinstance(sp, Sequence) or not 1 <= len(sp) <= 3 or not all(isinstance(s, int) and s >= 1 for s in sp):
        raise ShapeError(f"input spatial must be 1 to 3 positive integers ([W], [H, W] or [D, H, W]), got {sp!r}")
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
            raise ShapeError(f"layer #{i}: the name {lname!r} is reserved for the model input; rename the layer")
        if lname in seen:
            raise ShapeError(f"model {model!r}: two layers are named {lname!r}; layer names must be unique")
        seen.add(lname)
        ltype = lay.get("type")
        if ltype not in LAYER_PARAMS:
            raise ShapeError(f"layer {lname!r}: unknown type {ltype!r}; use one of {sorted(LAYER_PARAMS)}")
        params = dict(lay.get("params") or {})
        params.update({k: v for k, v in lay.items() if k not in ("name", "type", "parents", "params")})
        unknown = set(params) - set(LAYER_PARAMS[ltype])
        if unknown:
            raise ShapeError(f"layer {lname!r} ({ltype}): unknown parameter(s) {sorted(unknown)}; "
                             f"a {ltype} layer takes {list(LAYER_PARAMS[ltype]) or 'no parameters'}")
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
        if lay["type"] in ("sum", "concat") and n_in < 2:
            raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) needs at least two parents, got "
                             f"{list(lay['parents'])}")
        if lay["type"] not in ("sum", "concat") and n_in != 1:
            raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) takes exactly one parent, got "
                             f"{list(lay['parents'])}; join branches with a 'sum' or 'concat' layer")
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
        raise ShapeError(f"model {model!r}: layers {cyc} form a cycle through their 'parents'; a model must be "
                         f"acyclic")
    return out


def _int_param(lay: Mapping[str, Any], key: str, default=None, minimum: int = 1):
    v = lay["params"].get(key, default)
    if v is None:
        raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) needs '{key}'")
    vals = v if isinstance(v, (list, tuple)) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in vals):
        raise ShapeError(f"layer {lay['name']!r}: '{key}' must be an integer >= {minimum} (or one per spatial "
                         f"dimension), got {v!r}")
    return list(v) if isinstance(v, (list, tuple)) else v


def _stencil(lay: Mapping[str, Any], in_shape: tuple[int, ...], kernel, stride, padding, dilation) -> Stencil:
    try:
        st = Stencil.conv(len(in_shape), kernel, stride, padding, dilation)
    except (DistributionError, TypeError, ValueError) as exc:
        raise ShapeError(f"layer {lay['name']!r} ({lay['type']}) on input {shape_str(in_shape)}: {exc}") from None
    for i, (w, n) in enumerate(zip(st.dims[2:], in_shape[2:])):
        if w.output_size(n) < 1:
            raise ShapeError(
                f"layer {lay['name']!r} ({lay['type']}): input {shape_str(in_shape)} is too small along spatial "
                f"dimension {i} (size {n}, padded {n + w.pad_lo + w.pad_hi}) for a window of reach {w.reach}; "
                f"use a larger input, more padding or a smaller kernel/stride")
    return st


def _infer(lay: dict[str, Any], in_shapes: tuple[tuple[int, ...], ...]) -> Node:
    name, typ, p = lay["name"], lay["type"], lay["params"]
    x = in_shapes[0]
    n = x[0]
    numel_in = math.prod(x)
    stencil = None
    n_params = 0

    def spatial_only(what: str):
        if len(x) < 3:
            raise ShapeError(f"layer {name!r} ({typ}) needs an image input (N, C, spatial...), got "
                             f"{shape_str(x)} from {lay['parents'][0]!r}; {what}")

    if typ == "conv":
        spatial_only("move the layer before the fully-connected layers")
        filters = _int_param(lay, "filters")
        groups = _int_param(lay, "groups", 1)
        kernel = _int_param(lay, "kernel", 3)
        stride = _int_param(lay, "stride", 1)
        dilation = _int_param(lay, "dilation", 1)
        padding = p.get("padding", 0)
        c = x[1]
        if c % groups or filters % groups:
            raise ShapeError(f"layer {name!r}: groups={groups} must divide input channels {c} and filters {filters}")
        stencil = _stencil(lay, x, kernel, stride, padding, dilation)
        out = (n, filters) + stencil.output_shape(x)[2:]
        ksize = math.prod(w.kernel for w in stencil.dims[2:])
        bias = bool(p.get("bias", True))
        n_params = filters * (c // groups) * ksize + (filters if bias else 0)
        flops = 2 * math.prod(out) * (c // groups) * ksize
    elif typ == "pool":
        spatial_only("pool before flattening")
        mode = p.get("mode", "max")
        if mode not in ("max", "avg"):
            raise ShapeError(f"layer {name!r}: pool mode must be 'max' or 'avg', got {mode!r}")
        if p.get("global", False):
            kernel, stride, padding = list(x[2:]), 1, 0
        else:
            kernel = _int_param(lay, "kernel", 2)
            stride = p.get("stride") if p.get("stride") is not None else kernel
            stride = _int_param({**lay, "params": {"stride": stride}}, "stride")
            padding = p.get("padding", 0)
        stencil = _stencil(lay, x, kernel, stride, padding, 1)
        out = stencil.output_shape(x)
        flops = math.prod(out) * math.prod(w.kernel for w in stencil.dims[2:])
    elif typ == "batchnorm":
        if len(x) < 2:
            raise ShapeError(f"layer {name!r}: batchnorm needs (N, C, ...) input, got {shape_str(x)}")
        out = x
        n_params = 2 * x[1]
        flops = 5 * numel_in  # statistics (2), normalise (2), scale-shift (1) per element
    elif typ in ("relu", "dropout"):
        out = x
        flops = numel_in if typ == "relu" else 2 * numel_in
        if typ == "dropout":
            rate = p.get("rate", p.get("p", 0.5))
            if not isinstance(rate, (int, float)) or not 0 <= rate < 1:
                raise ShapeError(f"layer {name!r}: dropout rate must be in [0, 1), got {rate!r}")
    elif typ == "leaky_relu":
        out = x
        flops = 2 * numel_in
    elif typ == "flatten":
        out = (n, math.prod(x[1:]))
        flops = 0
    elif typ == "fc":
        units = _int_param(lay, "units")
        d_in = math.prod(x[1:])
        out = (n, units)
        bias = bool(p.get("bias", True))
        n_params = d_in * units + (units if bias else 0)
        flops = 2 * n * d_in * units
    elif typ == "sum":
        for par, s in zip(lay["parents"], in_shapes):
            if s != x:
                raise ShapeError(
                    f"layer {name!r} (sum): input {par!r} has shape {shape_str(s)} but {lay['parents'][0]!r} has "
                    f"{shape_str(x)}; all inputs of a sum need one shape (add a 1x1 conv with a stride to the "
                    f"shortcut, or fix the filters/stride of one branch)")
        out = x
        flops = (len(in_shapes) - 1) * numel_in
    elif typ == "concat":
        axis = p.get("axis", 1)
        if axis not in (1, "c", "channels"):
            raise ShapeError(f"layer {name!r}: concat joins along channels (axis 1) only, got axis={axis!r}")
        for par, s in zip(lay["parents"], in_shapes):
            if len(s) != len(x) or s[0] != x[0] or s[2:] != x[2:]:
                raise ShapeError(
                    f"layer {name!r} (concat): input {par!r} has shape {shape_str(s)} but {lay['parents'][0]!r} "
                    f"has {shape_str(x)}; inputs of a channel concat must agree in all but the channel "
                    f"dimension (match strides/padding of the branches)")
        out = (n, sum(s[1] for s in in_shapes)) + x[2:]
        flops = 0
    else:  # pragma: no cover - LAYER_PARAMS and this chain list the same types
        raise ShapeError(f"layer {name!r}: unknown type {typ!r}")
    return Node(name, typ, dict(p), lay["parents"], in_shapes, tuple(int(s) for s in out), int(flops),
                int(n_params), stencil)


def _check_loss(model: str, loss: str, nodes: list[Node]) -> str:
    if loss not in LOSSES:
        raise ShapeError(f"model {model!r}: unknown loss {loss!r}; use one of {list(LOSSES)}")
    last = nodes[-1]
    if loss == "cross_entropy" and len(last.out_shape) != 2:
        raise ShapeError(
            f"model {model!r}: loss cross_entropy needs a (N, classes) output but the last layer {last.name!r} "
            f"gives {shape_str(last.out_shape)}; end with an fc layer (or use pixel_cross_entropy for "
            f"segmentation)")
    if loss == "pixel_cross_entropy" and len(last.out_shape) < 3:
        raise ShapeError(
            f"model {model!r}: loss pixel_cross_entropy needs a (N, classes, spatial...) output but the last "
            f"layer {last.name!r} gives {shape_str(last.out_shape)}; end with a conv layer")
    return loss
