"""Elementwise and merge layers: ReLU, leaky ReLU, dropout, sum (residual), concat (inception), flatten.

Their distributions are whatever the layer is given; the base class brings every input into it. Dropout
draws its mask from a counter-based generator keyed on global element indices, so a run gives the same
numbers whatever the split.
"""
from __future__ import annotations

import math

from lbannpy.config_types import Float, Int, Key
from lbannpy.dist import Distribution, shape_str

from . import kernels as K
from .base import Layer, LayerError, stable_seed
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, elementwise, register

@register(LayerSpec("relu", "rectified linear unit", (), elementwise(1), pointwise=True, order=40,
                    capturable=True))
class ReLU(Layer):
    #: set by the model when nothing else reads (or keeps) the parent's output: it is overwritten
    inplace = False
    fusable_activation = True

    def fp_compute(self, xs):
        (x,) = xs
        # the output is saved, not the input: y > 0 exactly where x > 0, and an in-place ReLU keeps no x
        y = self._y = K.relu_forward(x, out=x if self.inplace else None)
        return y

    def bp_compute(self, dy):
        y, self._y = self._y, None
        return [K.relu_backward(dy, y)]


@register(LayerSpec("leaky_relu", "leaky rectified linear unit", (
    Key("slope", Float(0.0), 0.01, "slope for negative inputs", aliases=("negative_slope",)),),
    elementwise(2), pointwise=True, order=50, capturable=True))
class LeakyReLU(Layer):
    def fp_compute(self, xs):
        (x,) = xs
        self.slope = float(self.hparams["slope"])
        self._x = x
        return K.leaky_relu_forward(x, self.slope)

    def bp_compute(self, dy):
        x, self._x = self._x, None  # the input is not kept past the backward that last needs it
        return [K.leaky_relu_backward(dy, x, self.slope)]


def _dropout_infer(lay: LayerArgs) -> Inferred:
    rate = lay.params["p"]
    if not isinstance(rate, (int, float)) or not 0 <= rate < 1:
        raise ShapeError(f"layer {lay.name!r}: dropout rate must be in [0, 1), got {rate!r}")
    return elementwise(2)(lay)


@register(LayerSpec("dropout", "inverted dropout (identity at evaluation)", (
    Key("p", Float(0.0, 1.0, hi_open=True), 0.5, "probability of dropping an element", aliases=("rate",)),),
    _dropout_infer, pointwise=True, order=60, capturable=True))
class Dropout(Layer):
    def setup(self, dist):
        super().setup(dist)
        self.p = float(self.hparams["p"])
        if not 0.0 <= self.p < 1.0:
            raise LayerError(f"layer '{self.name}' (dropout): p must be in [0, 1), got {self.p}")
        self.step = 0
        self.layer_id = stable_seed(self.name)
        xp = self.ctx.xp
        # on a GPU the mask's step is a counter in device memory, advanced by a kernel: a replayed forward
        # draws the next step's mask, as an eager one does
        self._step_dev = None if xp.__name__ == "numpy" else xp.zeros(1, dtype=xp.uint64)

    def state(self) -> dict:
        # on a GPU the device counter is the count (a replayed step advances it, not the host's)
        return {"step": self.step if self._step_dev is None else int(self._step_dev[0])}

    def load_state(self, state: dict) -> None:
        self.step = int(state["step"])
        if self._step_dev is not None:
            self._step_dev[...] = self.step

    def fp_compute(self, xs):
        (x,) = xs
        if not self.train or self.p == 0.0:
            self._scale = None
            return x
        box = self.local_box("in")
        step = self.step if self._step_dev is None else self._step_dev
        self._scale = K.dropout_mask(self.ctx.seed, step, self.layer_id, box, self.p,
                                     xp=self.ctx.xp, dtype=x.dtype)
        self.step += 1
        if self._step_dev is not None:
            self._step_dev += 1
        return K.dropout_forward(x, self._scale)

    def bp_compute(self, dy):
        return [dy if self._scale is None else K.dropout_backward(dy, self._scale)]


def _sum_infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    for par, s in zip(lay.parents, lay.in_shapes):
        if s != x:
            raise ShapeError(
                f"layer {lay.name!r} (sum): input {par!r} has shape {shape_str(s)} but {lay.parents[0]!r} "
                f"has {shape_str(x)}; all inputs of a sum need one shape (add a 1x1 conv with a stride to "
                f"the shortcut, or fix the filters/stride of one branch)")
    return Inferred(x, (len(lay.in_shapes) - 1) * math.prod(x))


@register(LayerSpec("sum", "elementwise sum of its parents (residual connections)", (), _sum_infer, 2, None,
                    order=70, capturable=True))
class Sum(Layer):
    """Elementwise sum of inputs of one shape (residual connections)."""

    output_kept = False

    def setup(self, dist):
        shapes = set(self.in_shapes)
        if len(shapes) != 1:
            raise LayerError(f"layer '{self.name}' (sum) needs inputs of one shape, got "
                             f"{', '.join(map(str, self.in_shapes))}; add a 1x1 conv to match channels")
        super().setup(dist)

    def fp_compute(self, xs):
        y = xs[0].copy()
        for x in xs[1:]:
            y += x
        return y

    def bp_compute(self, dy):
        return [dy] * len(self.in_shapes)


def _flatten_input(dist: Distribution, ndim_in: int) -> Distribution:
    return Distribution((dist.split[0],) + (1,) * (ndim_in - 1), dist.ranks)


@register(LayerSpec("flatten", "reshape (n, c, spatial...) to (n, c*prod(spatial))", (),
                    lambda lay: Inferred((lay.x[0], math.prod(lay.x[1:])), 0), split_dims=("n",),
                    input_dist=_flatten_input, no_kernel=True, flat_output=True, order=100,
                    capturable=True))
class Flatten(Layer):
    """``(n, c, *spatial)`` -> ``(n, c·prod(spatial))``; samples may be split, nothing else."""

    def setup(self, dist: Distribution):
        (in_shape,) = self.in_shapes
        nin = len(in_shape)
        pn = dist.split[0]
        self.out_shape = (in_shape[0], int(math.prod(in_shape[1:])))
        self.out_dist = Distribution((pn, 1), dist.ranks)
        self.in_dists = [Distribution((pn,) + (1,) * (nin - 1), dist.ranks)]

    def fp_compute(self, xs):
        (x,) = xs
        self._shape = x.shape
        return x.reshape(x.shape[0], -1)

    def bp_compute(self, dy):
        return [dy.reshape(self._shape)]


def _concat_infer(lay: LayerArgs) -> Inferred:
    x, axis = lay.x, lay.params["axis"]
    if axis not in (1, "c", "channels"):
        raise ShapeError(f"layer {lay.name!r}: concat joins along channels (axis 1) only, got axis={axis!r}")
    for par, s in zip(lay.parents, lay.in_shapes):
        if len(s) != len(x) or s[0] != x[0] or s[2:] != x[2:]:
            raise ShapeError(
                f"layer {lay.name!r} (concat): input {par!r} has shape {shape_str(s)} but {lay.parents[0]!r} "
                f"has {shape_str(x)}; inputs of a channel concat must agree in all but the channel "
                f"dimension (match strides/padding of the branches)")
    return Inferred((x[0], sum(s[1] for s in lay.in_shapes)) + x[2:], 0)


@register(LayerSpec("concat", "concatenation of its parents along one dimension", (
    Key("axis", Int(1), 1, "tensor dimension to concatenate along (1: channels)"),), _concat_infer, 2, None,
    split_dims=("n", "d", "h", "w"), order=80, capturable=True))
class Concat(Layer):
    """Concatenation along channels (inception); channels are not split in this layer."""

    def setup(self, dist: Distribution):
        if int(self.hparams["axis"]) != 1:
            raise LayerError(f"layer '{self.name}' (concat): only axis 1 (channels) is supported, got "
                             f"axis {self.hparams.get('axis')}")
        first = self.in_shapes[0]
        for s in self.in_shapes[1:]:
            if len(s) != len(first) or s[0] != first[0] or s[2:] != first[2:]:
                raise LayerError(f"layer '{self.name}' (concat) joins inputs along channels; all other "
                                 f"dimensions must agree, got {', '.join(map(str, self.in_shapes))}")
        self.in_dists = [dist] * len(self.in_shapes)
        self.out_shape = (first[0], sum(s[1] for s in self.in_shapes)) + tuple(first[2:])
        self.out_dist = dist
        self._sizes = [s[1] for s in self.in_shapes]

    def fp_compute(self, xs):
        return self.ctx.xp.concatenate(xs, axis=1)

    def bp_compute(self, dy):
        out, start = [], 0
        for c in self._sizes:
            out.append(dy[:, start:start + c])
            start += c
        return out
