"""Global average or max pooling: ``(N, C, *spatial)`` -> ``(N, C, 1, ..., 1)`` (PyTorch's
``F.adaptive_avg_pool2d(x, 1)`` and ``x.amax(spatial, keepdim=True)``), the classifier head of ResNets.

The input may be split along samples, channels and space. Each rank reduces its block over its spatial
extent, then one allreduce (sum or max) over the ranks that split space completes the reduction; the
output's spatial dimensions are whole, so those ranks all hold the same output block: the output
distribution replicates the spatial grid axes. Under the framework's replicated semantics
(:mod:`lbannpy.shuffle`) every replica of an output block receives the whole, identical output gradient,
so the backward needs no reduction for the average: each rank spreads ``dy / S`` over its block. The max
sends ``dy`` to the maximal elements, split evenly among ties as PyTorch's ``amax`` does (a tie may span
ranks: the count of maximal elements is summed over the spatial group, one allreduce in the backward).
"""
from __future__ import annotations

import math

from lbannpy.config_types import Key, Str
from lbannpy.dist import Distribution

from .base import Layer, LayerError
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, Statistics, register

MODES = ("avg", "max")


def _infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    if not 3 <= len(x) <= 5:
        raise ShapeError(f"layer {lay.name!r} (global_pool) needs an (N, C, spatial...) input with 1 to 3 "
                         f"spatial dimensions, got {x} from {lay.parents[0]!r}")
    if lay.params["mode"] not in MODES:
        raise ShapeError(f"layer {lay.name!r}: global_pool mode must be avg or max, got "
                         f"{lay.params['mode']!r}")
    return Inferred(tuple(x[:2]) + (1,) * (len(x) - 2), math.prod(x))


SPEC = LayerSpec(
    "global_pool", "average or max over the whole spatial extent: (N, C, spatial) -> (N, C, 1, ...)", (
        Key("mode", Str(MODES), "avg", "avg or max"),),
    # one allreduce over the ranks splitting space, of one number per sample and channel each way (the
    # max's backward sums its tie counts; the average's needs none, priced as the max's)
    _infer, order=21, capturable=True,
    statistics=Statistics(over=("d", "h", "w"), per=("n", "c"), forward=1, backward=1))


@register(SPEC)
class GlobalPool(Layer):
    output_kept = False

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        if not 3 <= len(in_shape) <= 5:
            raise LayerError(f"layer '{self.name}' (global_pool) needs an (n, c, spatial...) input, got "
                             f"{in_shape}")
        self.mode = self.hparams["mode"]
        if self.mode not in MODES:
            raise LayerError(f"layer '{self.name}' (global_pool): mode must be avg or max, got {self.mode!r}")
        nd = len(in_shape)
        self.size = math.prod(in_shape[2:])
        self.in_dists = [dist]
        self.out_shape = tuple(in_shape[:2]) + (1,) * (nd - 2)
        split_space = [i for i in range(2, nd) if dist.parts[i] > 1]
        # the output's spatial extent is 1: the ranks that split space hold copies of one output block
        self.out_dist = Distribution(dist.split, dist.ranks, tuple(dist.replicate) + tuple(split_space))
        names = [dist.dim_names[i] for i in split_space]
        self.space = self.ctx.grid_comm(dist, names) if names else None
        self.axes = tuple(range(2, nd))

    def fp_compute(self, xs):
        (x,) = xs
        n, c = x.shape[:2]
        flat = x.reshape(n, c, -1)
        if self.mode == "avg":
            y = flat.sum(axis=2)
            if self.space is not None:
                y = self.space.allreduce(y)
            y *= 1.0 / self.size
        else:
            y = flat.max(axis=2)
            if self.space is not None:
                y = self.space.allreduce(y, op="max")
            self._x, self._max = x, y.copy()  # a copy: a reader may overwrite the output in place
        self._shape = x.shape
        return y.reshape(self._shape[:2] + (1,) * len(self.axes))

    def bp_compute(self, dy):
        xp = self.ctx.xp
        shape = self._shape
        if self.mode == "avg":
            dx = xp.empty(shape, dtype=dy.dtype)
            dx[...] = dy * (1.0 / self.size)
            return [dx]
        x, m = self._x, self._max
        self._x = self._max = None
        hit = x == m.reshape(shape[:2] + (1,) * len(self.axes))
        count = hit.reshape(shape[0], shape[1], -1).sum(axis=2).astype(dy.dtype)
        if self.space is not None:
            count = self.space.allreduce(count)
        scale = dy.reshape(shape[:2]) / count
        return [hit * scale.reshape(shape[:2] + (1,) * len(self.axes))]
