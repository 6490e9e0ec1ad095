"""Smooth and parametric activations, softmax over channels, identity and the product of inputs.

Every type here is pointwise along the dimensions it splits: any split of the input is the layer's own, and
no halo or collective is needed, except PReLU's weight gradient, a partial sum over this rank's block that
the trainer reduces over the dimensions the weight is not cut along (as batch norm's). Softmax normalises
over the channels, so it does not split them.

What a layer keeps from its forward for its backward is what its kernel needs and no more: the output
(sigmoid, tanh, ELU, softmax), the input (PReLU, the inputs of a product), or, for SiLU and GELU, the
derivative the NumPy kernel computes in the forward's pass (the input on a GPU); nothing is kept when the
layer is evaluated (``train`` false), and everything is let go by the backward that used it.
"""
from __future__ import annotations

import math

import numpy as np

from lbannpy.config_types import Float, Int, Key, Str
from lbannpy.dist import shape_str

from .base import Layer, LayerError
from .kernels import activation as K
from .registry import ALL_DIMS, Inferred, LayerArgs, LayerSpec, ShapeError, elementwise, register

#: FLOPs counted for one exp, expm1, tanh or erf: the polynomial and range reduction of a vectorised libm
#: call, about ten multiply-or-add operations (the cost model prices these layers by their element count)
TRANSCENDENTAL = 10


class _Pointwise(Layer):
    """One input, the output of its shape and distribution; ``_forward(x)`` returns ``(y, saved)``, saved
    only while training, and ``_backward(dy, saved)`` the input gradient."""

    def fp_compute(self, xs):
        (x,) = xs
        y, saved = self._forward(x)
        self._saved = saved if self.train else None
        return y

    def bp_compute(self, dy):
        saved, self._saved = self._saved, None
        return [self._backward(dy, saved)]


@register(LayerSpec("sigmoid", "logistic sigmoid 1 / (1 + exp(-x))", (),
                    elementwise(3 + TRANSCENDENTAL), pointwise=True, order=51, capturable=True))
class Sigmoid(_Pointwise):
    def _forward(self, x):
        y = K.sigmoid_forward(x)
        return y, y

    def _backward(self, dy, y):
        return K.sigmoid_backward(dy, y)


@register(LayerSpec("tanh", "hyperbolic tangent", (), elementwise(TRANSCENDENTAL), pointwise=True, order=52,
                    capturable=True))
class Tanh(_Pointwise):
    def _forward(self, x):
        y = K.tanh_forward(x)
        return y, y

    def _backward(self, dy, y):
        return K.tanh_backward(dy, y)


@register(LayerSpec("gelu", "Gaussian error linear unit x * Phi(x) (PyTorch's F.gelu)", (
    Key("approximate", Str(("none", "tanh")), "none",
        "none: the exact normal CDF; tanh: PyTorch's tanh approximation"),),
    elementwise(6 + TRANSCENDENTAL), pointwise=True, order=53, capturable=True))
class GELU(_Pointwise):
    output_kept = False  # the backward reads the derivative (or the input), never the output

    def setup(self, dist):
        super().setup(dist)
        self.approximate = str(self.hparams["approximate"])
        if self.approximate not in ("none", "tanh"):
            raise LayerError(f"layer '{self.name}' (gelu): approximate must be none or tanh, got "
                             f"{self.approximate!r}")

    def _forward(self, x):
        return K.gelu_forward(x, self.approximate, grad=self.train)

    def _backward(self, dy, saved):
        return K.gelu_backward(dy, saved, self.approximate)


@register(LayerSpec("silu", "sigmoid-weighted linear unit x * sigmoid(x) (swish)", (),
                    elementwise(3 + TRANSCENDENTAL), pointwise=True, order=54, capturable=True))
class SiLU(_Pointwise):
    output_kept = False

    def _forward(self, x):
        return K.silu_forward(x, grad=self.train)

    def _backward(self, dy, saved):
        return K.silu_backward(dy, saved)


@register(LayerSpec("elu", "exponential linear unit: x above 0, alpha * (exp(x) - 1) else", (
    Key("alpha", Float(0.0), 1.0, "the negative saturation value (>= 0: the output's sign is the input's, "
        "so the backward reads the output)"),),
    elementwise(3 + TRANSCENDENTAL), pointwise=True, order=55, capturable=True))
class ELU(_Pointwise):
    def setup(self, dist):
        super().setup(dist)
        self.alpha = float(self.hparams["alpha"])
        if not self.alpha >= 0.0:
            raise LayerError(f"layer '{self.name}' (elu): alpha must be >= 0, got {self.alpha}")

    def _forward(self, x):
        y = K.elu_forward(x, self.alpha)
        return y, y

    def _backward(self, dy, y):
        return K.elu_backward(dy, y, self.alpha)


def _prelu_infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    k = lay.params.get("num_parameters", 1)
    if len(x) < 2 or k not in (1, x[1]):
        raise ShapeError(f"layer {lay.name!r} (prelu): num_parameters must be 1 or the input's channels "
                         f"({x[1] if len(x) > 1 else '?'}, input {shape_str(x)} from {lay.parents[0]!r}), "
                         f"got {k!r}")
    return Inferred(x, 2 * math.prod(x), k)


@register(LayerSpec("prelu", "parametric ReLU: x above 0, weight * x else (one weight, or one per channel)", (
    Key("num_parameters", Int(1), 1, "1 (one weight) or the input's channels (one per channel)"),
    Key("init", Float(), 0.25, "initial value of every weight"),),
    _prelu_infer, weights_split=True, pointwise=True, order=56, capturable=True))
class PReLU(_Pointwise):
    output_kept = False

    def setup(self, dist):
        super().setup(dist)
        c = self.in_shapes[0][1]
        k = int(self.hparams["num_parameters"])
        if k not in (1, c):
            raise LayerError(f"layer '{self.name}' (prelu): num_parameters must be 1 or the input's {c} "
                             f"channels, got {k}")
        init = np.full(k, float(self.hparams["init"]))
        if k == 1:  # one weight on every rank: its gradient is a partial sum over every split dimension
            self.w = self.new_param("weight", (1,), init, None, dist, dist.dim_names)
        else:       # cut along the channels like the input; partial sums over the other dimensions
            cbox = dist.box(self.out_shape, self.ctx.rank)[1]
            self.w = self.new_param("weight", (c,), init, (cbox,), dist,
                                    [d for d in dist.dim_names if d != "c"])

    def _forward(self, x):
        return K.prelu_forward(x, self.w.value), x

    def _backward(self, dy, x):
        return K.prelu_backward(dy, x, self.w.value, self.w.grad)


def _softmax_infer(lay: LayerArgs) -> Inferred:
    if len(lay.x) < 2:
        raise ShapeError(f"layer {lay.name!r} (softmax) normalises over the channels (dimension 1); its "
                         f"input {shape_str(lay.x)} from {lay.parents[0]!r} has none")
    return Inferred(lay.x, (4 + TRANSCENDENTAL) * math.prod(lay.x))


@register(LayerSpec("softmax", "softmax over the channels (dimension 1)", (), _softmax_infer,
                    split_dims=tuple(d for d in ALL_DIMS if d != "c"), pointwise=True, order=57,
                    capturable=True))
class Softmax(_Pointwise):
    def _forward(self, x):
        y = K.softmax_forward(x)
        return y, y

    def _backward(self, dy, y):
        return K.softmax_backward(dy, y)


@register(LayerSpec("identity", "the input unchanged (no copy)", (), elementwise(0), pointwise=True,
                    no_kernel=True, order=58, capturable=True))
class Identity(Layer):
    """Hands its input on as its output (the same array), and the gradient back the same way. The output
    is the parent's array, so ``output_kept`` stays true: no reader may overwrite it in place."""

    def fp_compute(self, xs):
        return xs[0]

    def bp_compute(self, dy):
        return [dy]


def _mul_infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    for par, s in zip(lay.parents, lay.in_shapes):
        if s != x:
            raise ShapeError(
                f"layer {lay.name!r} (mul): input {par!r} has shape {shape_str(s)} but {lay.parents[0]!r} "
                f"has {shape_str(x)}; all inputs of a product need one shape (no broadcasting)")
    return Inferred(x, (len(lay.in_shapes) - 1) * math.prod(x))


@register(LayerSpec("mul", "elementwise product of its parents (gates, attention maps)", (), _mul_infer, 2,
                    None, order=71, capturable=True))
class Mul(Layer):
    """Elementwise product of inputs of one shape; the backward reads the inputs, not the output."""

    output_kept = False

    def setup(self, dist):
        if len(set(self.in_shapes)) != 1:
            raise LayerError(f"layer '{self.name}' (mul) needs inputs of one shape, got "
                             f"{', '.join(map(str, self.in_shapes))}")
        super().setup(dist)

    def fp_compute(self, xs):
        self._xs = list(xs) if self.train else None
        return K.mul_forward(xs)

    def bp_compute(self, dy):
        xs, self._xs = self._xs, None
        return K.mul_backward(dy, xs)
