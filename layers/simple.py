"""Elementwise and merge layers: ReLU, leaky ReLU, dropout, sum (residual), concat (inception), flatten.

Their distributions are whatever the layer is given; the base class brings every input into it. Dropout
draws its mask from a counter-based generator keyed on global element indices, so a run gives the same
numbers whatever the split.
"""
from __future__ import annotations

import math

from lbannpy.dist import Distribution

from . import kernels as K
from .base import Layer, LayerError, stable_seed


class ReLU(Layer):
    type = "relu"

    def fp_compute(self, xs):
        (x,) = xs
        self._x = x
        return K.relu_forward(x)

    def bp_compute(self, dy):
        return [K.relu_backward(dy, self._x)]


class LeakyReLU(Layer):
    type = "leaky_relu"

    def fp_compute(self, xs):
        (x,) = xs
        self.slope = float(self.hparams.get("slope", 0.01))
        self._x = x
        return K.leaky_relu_forward(x, self.slope)

    def bp_compute(self, dy):
        return [K.leaky_relu_backward(dy, self._x, self.slope)]


class Dropout(Layer):
    type = "dropout"

    def setup(self, dist):
        super().setup(dist)
        self.p = float(self.hparams.get("p", 0.5))
        if not 0.0 <= self.p < 1.0:
            raise LayerError(f"layer '{self.name}' (dropout): p must be in [0, 1), got {self.p}")
        self.step = 0
        self.layer_id = stable_seed(self.name)

    def state(self) -> dict:
        return {"step": self.step}

    def load_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def fp_compute(self, xs):
        (x,) = xs
        if not self.train or self.p == 0.0:
            self._scale = None
            return x
        box = self.local_box("in")
        self._scale = K.dropout_mask(self.ctx.seed, self.step, self.layer_id, box, self.p,
                                     xp=self.ctx.xp, dtype=x.dtype)
        self.step += 1
        return K.dropout_forward(x, self._scale)

    def bp_compute(self, dy):
        return [dy if self._scale is None else K.dropout_backward(dy, self._scale)]


class Sum(Layer):
    """Elementwise sum of inputs of one shape (residual connections)."""

    type = "sum"
    arity = None

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


class Flatten(Layer):
    """``(n, c, *spatial)`` -> ``(n, c·prod(spatial))``; samples may be split, nothing else."""

    type = "flatten"
    splittable = ("n",)

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


class Concat(Layer):
    """Concatenation along channels (inception); channels are not split in this layer."""

    type = "concat"
    arity = None
    splittable = ("n", "d", "h", "w")

    def setup(self, dist: Distribution):
        if int(self.hparams.get("axis", 1)) != 1:
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
