"""The layer registry: the one place every other package learns what a layer type is.

Each layer family declares, beside its implementation (its module in this package), a :class:`LayerSpec`:
its spec keys with their defaults (the config schema's ``Key`` objects), how many parents it takes, the
tensor dimensions it may split, its pure shape inference (input shapes -> output shape, FLOPs, parameter
count, stencil) and the few facts the cost model prices it by. ``@register(spec)`` on the layer class records
both. The config schema, the model builder, the strategy graph, the planner and the cost model read the
registry; none of them names a layer type.

This module is light on purpose (the standard library and :mod:`lbannpy.dist` only): the config and strategy
packages import it at start-up. The families themselves are imported on the first query of the registry,
by walking this package (every module but this one, ``base`` and the ``kernels`` package), so a new layer
type is a new module here (plus its kernel) and nothing else.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from lbannpy.dist import Distribution, DistributionError, shape_str
from lbannpy.stencil import Stencil
from lbannpy.config_types import REQUIRED, UNSET

#: names a layer's ``parents`` use for the model input; no layer may take one of them as its name
INPUT_NAMES = ("x", "input")
#: every tensor dimension a layer may split, in the order of :data:`lbannpy.dist.DIM_NAMES` of a 3-D image
ALL_DIMS = ("n", "c", "d", "h", "w")


class ShapeError(ValueError):
    """A spec whose shapes do not fit together. The message names the layer, the shapes and the fix."""


@dataclass(frozen=True)
class LayerArgs:
    """What shape inference sees of one layer: its parameters (defaults filled), parents and their shapes."""

    name: str
    type: str
    params: Mapping[str, Any]
    parents: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]

    @property
    def x(self) -> tuple[int, ...]:
        return self.in_shapes[0]


#: how a stencil layer's halo moves (:attr:`Inferred.halo`), priced by :func:`lbannpy.strategy.cost.halo_time`
HALO_MODES = ("window", "periodic", "adjoint")


@dataclass(frozen=True)
class Inferred:
    """The result of shape inference: output shape, forward FLOPs of the whole mini-batch (a multiply-add
    is two), learnable parameters, and the window geometry on the input (None for pointwise layers).

    ``halo`` says how the stencil's halo moves when space is split, which the stencil alone cannot say:

    * ``"window"``: each rank fetches the input rows its output block reads beyond its own block; padding
      is made locally (zeros, reflect, replicate);
    * ``"periodic"``: the same, but the padding wraps around (circular): the ranks at either end of a split
      dimension fetch it from the other end of the process grid, so it is exchanged like a halo;
    * ``"adjoint"``: the layer is the data gradient of a window layer (transposed convolution, upsampling)
      and ``stencil`` is that window layer's geometry *on this layer's output* (its output size is this
      layer's input size): the forward sends the ghost contributions of each output block to their owners
      and the backward fetches the same rows of dL/dy, on output-shaped blocks.
    """

    out_shape: tuple[int, ...]
    flops: int
    n_params: int = 0
    stencil: Stencil | None = None
    halo: str = "window"

    def __post_init__(self):
        if self.halo not in HALO_MODES:
            raise ValueError(f"Inferred.halo must be one of {HALO_MODES}, got {self.halo!r}")


@dataclass(frozen=True)
class Statistics:
    """Numbers a normalisation or global reduction sums (or maximises) across ranks: ``forward`` and
    ``backward`` numbers per element of the output's local extents along ``per`` (``("n", "c")``: per
    sample and channel), reduced over the ranks that split ``over``. ``groups`` names the parameter that
    counts channel groups when the numbers are per group rather than per channel (group norm: ``per``
    holds ``"c"``, and a block of ``c_local`` channels holds ``groups·c_local/C`` groups). Priced by
    :func:`lbannpy.strategy.cost.internal_comm_time` as one allreduce per pass that has numbers."""

    over: tuple[str, ...] = ("d", "h", "w")
    per: tuple[str, ...] = ("c",)
    forward: int = 2
    backward: int = 2
    groups: str | None = None


def reduced_dims(spec: "LayerSpec", in_shape, out_shape, dist: Distribution) -> tuple[int, ...]:
    """Dimensions a layer reduces whole (a global pool's space: extent 1 in its output, more in its input)
    that ``dist`` splits: there the split cuts the layer's input, and every rank of it holds the same output
    block (its :class:`Statistics` completes the reduction). The planner's and ``validate``'s block checks
    read the input along them."""
    st = spec.statistics
    if st is None or len(in_shape) != len(out_shape):
        return ()
    return tuple(i for i, name in enumerate(dist.dim_names) if name in st.over and dist.parts[i] > 1
                 and out_shape[i] == 1 < in_shape[i])


def split_refusal(spec: "LayerSpec", params: Mapping[str, Any], in_shape, dist: Distribution
                  ) -> tuple[str, str, str] | None:
    """``(dimension, why, what to do)`` where a layer of ``spec`` with ``params`` on an input of
    ``in_shape`` cannot compute its output in ``dist`` although its type splits those dimensions
    (:attr:`LayerSpec.split_check`); None where it can."""
    if spec.split_check is None:
        return None
    return spec.split_check(spec.resolve(params), tuple(int(n) for n in in_shape), dist)


def _same_split(dist: Distribution, ndim_in: int) -> Distribution:
    return dist


@dataclass(frozen=True)
class LayerSpec:
    """One layer type. ``params`` are :class:`lbannpy.config_types.Key` objects (name, type, default, doc,
    aliases); ``max_parents`` None means any number. The cost facts:

    * ``input_dist(dist, ndim_in)``: the distribution the layer needs its input in, given its output's;
    * ``weights_split``: its weights are cut along the output channels like its output;
    * ``weights_spatial``: its weights have the output's shape less the samples (layer norm's
      ``(C, spatial...)``) and are cut like the output along channels and space: only ranks holding other
      samples of the same block hold copies to synchronise;
    * ``reduces_channels``: each output sums over all input channels (its backward costs two forwards, its
      weights are read by the kernel, and a channel split leaves dL/dx as partial sums to allreduce);
    * ``spatial_statistics``: a spatial split needs an allreduce of 2 numbers per channel each way;
    * ``statistics``: what a layer reduces across ranks, when it is not the above (:class:`Statistics`:
      instance, group and layer norm, global pooling); where set, it replaces ``spatial_statistics``;
    * ``pointwise``: the planner lets it follow its parent's split instead of enumerating its own;
    * ``no_kernel``: a view (no arithmetic, no memory traffic);
    * ``dense``: where the "one weird trick" baseline turns model-parallel;
    * ``flat_output``: the output is (n, features) whatever the input's rank;
    * ``split_check(params, in_shape, dist)``: for a split the type allows in general but these parameters
      and shapes do not (a channel block cutting a group of channels), ``(dimension, why, what to do)``;
      None where ``dist`` works. The planner drops such a split, ``validate`` and the layer refuse it.

    And one fact the step graph reads (:mod:`lbannpy.training.graphstep`):

    * ``capturable``: the layer's forward and backward on a GPU can be captured into a CUDA graph and
      replayed: no host synchronisation, no host value that changes from step to step passed to a kernel,
      and no persistent buffer rebound to a new array (a replay keeps writing the one captured). A type
      that is not says why in ``capture_note`` (one clause, printed when a run falls back to eager steps).
    """

    name: str
    doc: str
    params: tuple = ()
    infer: Callable[[LayerArgs], Inferred] | None = None
    min_parents: int = 1
    max_parents: int | None = 1
    split_dims: tuple[str, ...] = ALL_DIMS
    input_dist: Callable[[Distribution, int], Distribution] = _same_split
    weights_split: bool = False
    reduces_channels: bool = False
    spatial_statistics: bool = False
    statistics: Statistics | None = None
    weights_spatial: bool = False
    pointwise: bool = False
    no_kernel: bool = False
    dense: bool = False
    flat_output: bool = False
    capturable: bool = False
    capture_note: str = "it does not declare itself capturable"
    split_check: Callable[[Mapping[str, Any], tuple, Distribution], tuple[str, str, str] | None] | None = None
    #: where the type is listed (schema text, error messages): ascending, then in registration order
    order: int = 1000

    def resolve(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with aliases renamed and every unset key that has a default filled in (the schema's
        defaults, also for specs that did not pass through the schema, e.g. built in a test)."""
        out = dict(params)
        for k in self.params:
            for a in k.aliases:
                if a in out and out.get(k.name) is None:
                    out[k.name] = out.pop(a)
        for k in self.params:
            if out.get(k.name) is None and k.default_from is None and k.default not in (REQUIRED, UNSET):
                out[k.name] = k.default
        for k in self.params:
            if out.get(k.name) is None and k.default_from is not None and out.get(k.default_from) is not None:
                out[k.name] = out[k.default_from]
        return out

    def accepts(self) -> tuple[str, ...]:
        """Every key a layer of this type takes (names and aliases)."""
        return tuple(k.name for k in self.params) + tuple(a for k in self.params for a in k.aliases)


@dataclass(frozen=True)
class LossSpec:
    """A loss on the model output. ``check(model, last_layer_name, out_shape)`` raises :class:`ShapeError`
    when the model's output cannot feed it."""

    name: str
    doc: str
    check: Callable[[str, str, tuple], None]


_LAYERS: dict[str, LayerSpec] = {}
_CLASSES: dict[str, type] = {}
_LOSSES: dict[str, LossSpec] = {}
_lock = threading.RLock()
_discovered = False
_SKIP = ("base", "registry")


def register(spec: LayerSpec):
    """Class decorator: record ``spec`` and its layer class (which gets ``spec``, ``type``, ``splittable``
    and ``arity`` from it). Registering a second type under a taken name is an error."""

    def deco(cls):
        with _lock:
            old = _CLASSES.get(spec.name)
            if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"layer type {spec.name!r} is registered twice: by {old.__module__}."
                                 f"{old.__qualname__} and {cls.__module__}.{cls.__qualname__}; rename one")
            cls.spec = spec
            cls.type = spec.name
            cls.splittable = spec.split_dims
            cls.arity = spec.max_parents if spec.max_parents == spec.min_parents else None
            _LAYERS[spec.name] = spec
            _CLASSES[spec.name] = cls
        return cls

    return deco


def register_loss(spec: LossSpec) -> LossSpec:
    with _lock:
        _LOSSES[spec.name] = spec
    return spec


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    with _lock:
        if _discovered:
            return
        # the package this module is part of: complete once layers are looked up
        import lbannpy.layers as pkg

        for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if not mod.ispkg and mod.name not in _SKIP and not mod.name.startswith("_"):
                importlib.import_module(f"{pkg.__name__}.{mod.name}")
        _discovered = True


def layer_specs() -> dict[str, LayerSpec]:
    """Every registered layer type, by name (a copy), in listing order."""
    _discover()
    return dict(sorted(_LAYERS.items(), key=lambda kv: kv[1].order))


def layer_spec(name: str) -> LayerSpec:
    """The spec of a layer type; KeyError naming the known types for an unknown one."""
    _discover()
    try:
        return _LAYERS[name]
    except KeyError:
        raise KeyError(f"unknown layer type {name!r}; known: {sorted(_LAYERS)}") from None


def layer_classes() -> dict[str, type]:
    """Layer type name -> class, in listing order."""
    return {name: _CLASSES[name] for name in layer_specs()}


def loss_specs() -> dict[str, LossSpec]:
    _discover()
    return dict(_LOSSES)


class RegistryView(Mapping):
    """A read-only live view of the registry (new registrations show), for module-level constants such as
    the schema's ``LAYER_TYPES`` that must not import the families when their module is imported."""

    def __init__(self, source: Callable[[], dict]):
        self._source = source

    def __getitem__(self, key):
        return self._source()[key]

    def __iter__(self):
        return iter(self._source())

    def __len__(self) -> int:
        return len(self._source())

    def __repr__(self) -> str:
        return f"RegistryView({list(self)})"


# --------------------------------------------------------------------------------------------------------
# helpers for the families' shape inference (pure)


def int_param(lay: LayerArgs, key: str, default=None, minimum: int = 1):
    """An integer parameter (or one per spatial dimension) of at least ``minimum``; ShapeError otherwise."""
    v = lay.params.get(key, default)
    if v is None:
        raise ShapeError(f"layer {lay.name!r} ({lay.type}) needs '{key}'")
    vals = v if isinstance(v, (list, tuple)) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= minimum for x in vals):
        raise ShapeError(f"layer {lay.name!r}: '{key}' must be an integer >= {minimum} (or one per spatial "
                         f"dimension), got {v!r}")
    return list(v) if isinstance(v, (list, tuple)) else v


def window_stencil(lay: LayerArgs, in_shape: Sequence[int], kernel, stride, padding, dilation) -> Stencil:
    """The sliding-window geometry of a conv-like layer; ShapeError when the window does not fit."""
    in_shape = tuple(in_shape)
    try:
        st = Stencil.conv(len(in_shape), kernel, stride, padding, dilation)
    except (DistributionError, TypeError, ValueError) as exc:
        raise ShapeError(f"layer {lay.name!r} ({lay.type}) on input {shape_str(in_shape)}: {exc}") from None
    for i, (w, n) in enumerate(zip(st.dims[2:], in_shape[2:])):
        if w.output_size(n) < 1:
            raise ShapeError(
                f"layer {lay.name!r} ({lay.type}): input {shape_str(in_shape)} is too small along spatial "
                f"dimension {i} (size {n}, padded {n + w.pad_lo + w.pad_hi}) for a window of reach "
                f"{w.reach}; "
                f"use a larger input, more padding or a smaller kernel/stride")
    return st


def needs_image(lay: LayerArgs, what: str) -> None:
    """ShapeError unless the (first) input is an image (N, C, spatial...)."""
    if len(lay.x) < 3:
        raise ShapeError(f"layer {lay.name!r} ({lay.type}) needs an image input (N, C, spatial...), got "
                         f"{shape_str(lay.x)} from {lay.parents[0]!r}; {what}")


def elementwise(flops_per_element: int = 1) -> Callable[[LayerArgs], Inferred]:
    """Shape inference of a one-input elementwise layer: same shape, ``flops_per_element`` per element."""

    def infer(lay: LayerArgs) -> Inferred:
        return Inferred(lay.x, flops_per_element * math.prod(lay.x))

    return infer


def activation_sharing(nodes, fuse: bool = True) -> dict[str, str]:
    """The one rule for a pointwise activation (``fusable_activation``) and its parent's output, applied by
    the model at set-up and counted by the strategy's memory estimate: ``"fused"`` when the parent
    ``fuses_relu`` (the parent applies it; the activation layer is skipped), ``"inplace"`` when the parent
    does not keep its output (``output_kept``), which the activation then overwrites. Either needs one
    parent, a layer (not the model input) that nothing else reads and that is not the model's output, in
    the same distribution. ``nodes``: ``(name, layer or layer class, parent names, distribution)`` in model
    order, the last the output; ``fuse=False``: every layer on its own."""
    nodes = list(nodes)
    if not fuse or not nodes:
        return {}
    consumers: dict[str, int] = {}
    for _, _, parents, _ in nodes:
        for p in parents:
            consumers[p] = consumers.get(p, 0) + 1
    by_name = {node[0]: node for node in nodes}
    last = nodes[-1][0]
    out = {}
    for name, kind, parents, dist in nodes:
        if not kind.fusable_activation or len(parents) != 1 or parents[0] not in by_name:
            continue
        parent, pkind, _, pdist = by_name[parents[0]]
        if consumers[parent] != 1 or parent == last or pdist != dist:
            continue
        if pkind.fuses_relu:
            out[name] = "fused"
        elif not pkind.output_kept:
            out[name] = "inplace"
    return out
