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

Replicated gradients (Lee et al., §III-C, the trainer's ``comm.replicate_fc``): instead of a partial ``dW``
that the gradient sync allreduces over the ``Pc`` sample groups (``units/Pr × features`` numbers), the
layer allgathers its input rows in the forward and its error rows ``dy`` in the backward over those groups
(``(features + units/Pr) × batch`` numbers) and every rank computes ``dW`` and ``db`` for the whole
mini-batch. Both gathers are posted non-blocking; :meth:`FullyConnected.replicated_grads` waits for them
and sets the gradients, which the trainer applies just before the layer's next forward, so the gather of
the errors overlaps the end of this step and the start of the next.
"""
from __future__ import annotations

import math

from lbannpy.config_types import REQUIRED, Bool, Int, Key
from lbannpy.dist import Distribution

from . import kernels as K
from .base import Layer, LayerError
from .registry import Inferred, LayerArgs, LayerSpec, int_param, register


def _infer(lay: LayerArgs) -> Inferred:
    x, units = lay.x, int_param(lay, "units")
    d_in = math.prod(x[1:])
    n_params = d_in * units + (units if lay.params["bias"] else 0)
    return Inferred((x[0], units), 2 * x[0] * d_in * units, n_params)


def _input_dist(dist: Distribution, ndim_in: int) -> Distribution:
    # features flattened from (c, spatial...): samples split like the output, the c grid axis replicated
    pn, pc = dist.split[0], dist.split[1]
    return Distribution((pn, pc) + (1,) * (ndim_in - 2), dist.ranks, (1,) if pc > 1 else ())


@register(LayerSpec("fc", "fully connected (flattens a spatial input)", (
    Key("units", Int(1), REQUIRED, "output features"),
    Key("bias", Bool(), True, "learn an additive bias")), _infer, split_dims=("n", "c"),
    input_dist=_input_dist,
    weights_split=True, reduces_channels=True, dense=True, flat_output=True, order=90,
    capturable=True))
class FullyConnected(Layer):

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
        self.use_bias = bool(self.hparams["bias"])
        w0 = self.rng("weight").standard_normal((units, self.features)) * math.sqrt(2.0 / self.features)
        cbox = dist.box(self.out_shape, self.ctx.rank)[1]
        self.w = self.new_param("weight", (units, self.features), w0, (cbox, (0, self.features)), dist,
                                ("n",), lazy=True)
        self.b = (self.new_param("bias", (units,), None, (cbox,), dist, ("n",), lazy=True) if self.use_bias
                  else None)
        self.row = self.ctx.grid_comm(self.in_dists[0], ["c"]) if pr > 1 else None
        self.gather = None  # the sample-group communicator, once replicated gradients are enabled
        self._gx = self._gdy = None

    # -- replicated gradients --------------------------------------------------------------------------
    def replicate_gradients(self) -> None:
        """Compute ``dW``/``db`` for the whole mini-batch on every rank of the sample group from gathered
        inputs and errors (collective over the world: it may create the group's communicator)."""
        dist = self.out_dist
        group = sorted(dist.block_group(self.ctx.rank, ("n",)))  # the ranks that hold copies of W[cb]
        self.gather = self.ctx.block_comm(dist, ("n",))
        # rows each member contributes, in the communicator's rank order (split keyed by world rank)
        self._rows = [dist.local_shape(self.out_shape, r)[0] for r in group]

    @property
    def replicated(self) -> bool:
        return self.gather is not None

    def _post_gather(self, a):
        a = self.ctx.xp.ascontiguousarray(a)
        return self.gather.iallgatherv(a, [r * a.shape[1] for r in self._rows]), a.shape[1]

    def replicated_grads(self) -> list:
        """Wait for the gathers of the last training step and set this layer's gradients from the whole
        mini-batch; returns the parameters to update (none when no step is pending)."""
        if self._gx is None or self._gdy is None:
            return []
        (hx, nx), (hdy, ndy) = self._gx, self._gdy
        self._gx = self._gdy = None
        x = hx.wait().reshape(-1, nx)
        dy = hdy.wait().reshape(-1, ndy)
        K.fc_backward_filter(x, dy, out=self.w.grad)
        self.w.stale = False
        if self.b is not None:
            self.b.grad[...] = K.fc_backward_bias(dy)
            self.b.stale = False
        return self.params

    @property
    def pending(self) -> bool:
        return self._gdy is not None

    def fp_compute(self, xs):
        (x,) = xs
        self._xshape = x.shape
        x2 = x.reshape(x.shape[0], -1)
        if self.replicated and self.train:
            if self.pending:
                raise LayerError(f"layer '{self.name}' (fc): the replicated gradients of the previous step "
                                 f"were not applied before this forward")
            self._gx = self._post_gather(x2)
        self._x = x2
        return K.fc_forward(x2, self.w.value, None if self.b is None else self.b.value)

    def bp_compute(self, dy):
        dx = None
        if self.needs_input_grad:
            dx = K.fc_backward_data(dy, self.w.value)
            if self.row is not None:
                dx = self.row.allreduce(dx)
        if self.replicated:
            self._gdy = self._post_gather(dy)  # dW for the whole batch in replicated_grads()
        else:
            into = self.w.grad_into()
            if into is not None:  # the step's first contribution: the product straight into the gradient
                K.fc_backward_filter(self._x, dy, out=into)
            else:  # added through a reused workspace (a weight-sized temporary is fresh pages every step)
                space = self.ctx.workspace("fc filter gradient", self.w.grad.shape, dy.dtype)
                self.w.grad += K.fc_backward_filter(self._x, dy, out=space)
            if self.b is not None:
                self.b.accumulate(K.fc_backward_bias(dy))
        self._x = None
        return [None if dx is None else dx.reshape(self._xshape)]
