"""A layer type added through the registry alone (imported by test_layer_registry's subprocesses only, so the
registry of the test process itself keeps the shipped types).

``toy_scale`` multiplies each channel by a learnable scale: one parameter per channel, elementwise, so any
split works; its weight gradient is a partial sum over every dimension but the channels.
"""
from __future__ import annotations

import math

import numpy as np

from lbannpy.config_types import Float, Key
from lbannpy.layers.base import Layer
from lbannpy.layers.registry import Inferred, LayerArgs, LayerSpec, register


def _infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    return Inferred(x, math.prod(x), x[1])


@register(LayerSpec("toy_scale", "per-channel learnable scale", (
    Key("init", Float(0.0, lo_open=True), 1.0, "initial scale of every channel"),), _infer,
    weights_split=True, pointwise=True))
class ToyScale(Layer):
    def setup(self, dist):
        super().setup(dist)
        c = self.in_shapes[0][1]
        cbox = dist.box(self.out_shape, self.ctx.rank)[1]
        self.g = self.new_param("scale", (c,), np.full(c, float(self.hparams["init"])), (cbox,), dist,
                                [d for d in dist.dim_names if d != "c"])

    def _bcast(self, ndim: int):
        return self.g.value.reshape((1, -1) + (1,) * (ndim - 2))

    def fp_compute(self, xs):
        (x,) = xs
        self._x = x
        return x * self._bcast(x.ndim)

    def bp_compute(self, dy):
        self.g.grad += (dy * self._x).sum(axis=(0,) + tuple(range(2, dy.ndim)))
        self._x = None
        return [dy * self._bcast(dy.ndim)]
