"""Fully-connected layer: sample-parallel, model-parallel, and the 1.5D Pr × Pc algorithm in one.

The layer's distribution is ``n = Pc, c = Pr`` over a 2-D ``(samples, units)`` output (Gholami et al.,
§2.4): weights are split by output unit over the ``Pr`` ranks of a row and replicated over the ``Pc``
sample groups; the batch is split ``Pc`` ways. ``Pr = 1`` is sample (data) parallelism, ``Pc = 1`` is
model parallelism. The input (flattened if it comes from a convolution) is brought by the base class into
``n = Pc`` with the ``c`` grid axis replicated, laid on the same ranks as the output, so every rank of a row
holds its samples' whole feature vectors.

forward   y[nb, cb]  = x[nb, :] · W[cb, :]ᵀ + b[cb]                     (local GEMM)
backward  dx[nb, :]  = Σ_cb dy[nb, cb] · W[cb, :]                        (allreduce over the row, Pr ranks)
          dW[cb, :]  = Σ_nb dy[nb, cb]ᵀ · x[nb, :]                       (partial; summed over n by grad sync)
"""
from __future__ import annotations

import math

from lbannpy.dist import Distribution

from . import kernels as K
from .base import Layer, LayerError


class FullyConnected(Layer):
    type = "fc"
    splittable = ("n", "c")

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        units = int(self.hparams["units"])
        if dist.ndim != 2:
            spatial = [n for n, p in zip(dist.dim_names, dist.parts) if p > 1 and n not in ("n", "c")]
            if spatial:
                raise LayerError(f"layer '{self.name}' (fc) cannot split the spatial dimension(s) {spatial} "
                                 f"(distribution {dist}, input {in_shape}); use n and c only")
            dist = Distribution((dist.split[0], dist.split[1]), dist.ranks)
        pc, pr = dist.split
        nin = len(in_shape)
        self.features = int(math.prod(in_shape[1:]))
        self.out_shape = (in_shape[0], units)
        self.out_dist = dist
        # the input keeps its own rank (4-D from a conv): n split Pc ways, c grid axis (Pr) replicated
        self.in_dists = [Distribution((pc, pr) + (1,) * (nin - 2), dist.ranks, (1,) if pr > 1 else ())]
        self.use_bias = bool(self.hparams.get("bias", True))
        w0 = self.rng("weight").standard_normal((units, self.features)) * math.sqrt(2.0 / self.features)
        cbox = dist.box(self.out_shape, self.ctx.rank)[1]
        self.w = self.new_param("weight", (units, self.features), w0, (cbox, (0, self.features)), dist, ("n",))
        self.b = self.new_param("bias", (units,), None, (cbox,), dist, ("n",)) if self.use_bias else None
        self.row = self.ctx.grid_comm(self.in_dists[0], ["c"]) if pr > 1 else None

    def fp_compute(self, xs):
        (x,) = xs
        self._xshape = x.shape
        x2 = x.reshape(x.shape[0], -1)
        self._x = x2
        return K.fc_forward(x2, self.w.value, None if self.b is None else self.b.value)

    def bp_compute(self, dy):
        dx = K.fc_backward_data(dy, self.w.value)
        if self.row is not None:
            dx = self.row.allreduce(dx)
        self.w.grad += K.fc_backward_filter(self._x, dy)
        if self.b is not None:
            self.b.grad += K.fc_backward_bias(dy)
        self._x = None
        return [dx.reshape(self._xshape)]
