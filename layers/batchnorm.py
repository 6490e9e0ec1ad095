"""Distributed batch normalisation: per-block partial sums, one allreduce per pass.

``sync: group`` (default) aggregates statistics over the spatial group of each sample block: the ranks
that share the same samples and channels but hold different parts of space (exactly a single-GPU BN of
that sample block — the default of Dryden et al. when a sample is split). ``sync: global`` aggregates over
all ranks holding the batch (synchronised BN: identical to single-rank BN of the whole mini-batch).
Channels may be split (statistics are per channel). Evaluation uses running statistics. A GPU run whose
kernel set is cuDNN Frontend's (``runtime.kernels``) computes with its batch-norm plans
(:mod:`lbannpy.layers.kernels.cudnn_bn`: fused where the statistics are one rank's block).
"""
from __future__ import annotations

import math

import numpy as np

from lbannpy.config_types import Float, Key, Str
from lbannpy.dist import Distribution, shape_str

from . import kernels as K
from .kernels import cudnn_bn
from .base import Layer, LayerError
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, register
from .state import StateTensor, is_writer


def _infer(lay: LayerArgs) -> Inferred:
    x = lay.x
    if len(x) < 2:
        raise ShapeError(f"layer {lay.name!r}: batchnorm needs (N, C, ...) input, got {shape_str(x)}")
    # statistics (2), normalise (2), scale-shift (1) per element; a scale and a shift per channel
    return Inferred(x, 5 * math.prod(x), 2 * x[1])


SPEC = LayerSpec("batchnorm", "batch normalization over samples and spatial dimensions, per channel", (
    Key("eps", Float(0.0, lo_open=True), 1e-5, "added to the variance"),
    Key("momentum", Float(0.0, 1.0), 0.1, "weight of the new batch in the running statistics"),
    Key("sync", Str(("group", "global")), "group",
        "statistics over the ranks holding one sample (group) or over all ranks (global)")),
    _infer, weights_split=True, spatial_statistics=True, pointwise=True, order=30,
    capturable=True)


@register(SPEC)
class BatchNorm(Layer):
    #: set by the model when the only reader of this layer's output is a ReLU: the layer then outputs
    #: ``relu(bn(x))`` and back-propagates through both (one pass each way)
    fuse_relu = False
    fuses_relu = True
    output_kept = False  # the backward reads the input (and the fused output, kept by the layer itself)

    def setup(self, dist: Distribution) -> None:
        super().setup(dist)
        (in_shape,) = self.in_shapes
        hp = self.hparams
        self.eps = float(hp["eps"])
        self.momentum = float(hp["momentum"])
        self.sync = hp["sync"]
        if self.sync not in ("group", "global"):
            raise LayerError(f"layer '{self.name}' (batchnorm): sync must be 'group' or 'global', "
                             f"got {self.sync!r}")
        spatial = [n for n in dist.dim_names if n not in ("n", "c")]
        self.stat_dims = spatial + (["n"] if self.sync == "global" else [])
        self.stats_comm = self.ctx.block_comm(dist, self.stat_dims)
        c = in_shape[1]
        cbox = dist.box(in_shape, self.ctx.rank)[1]
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        self.gamma = self.new_param("scale", (c,), np.ones(c), (cbox,), dist, reduce_dims)
        self.beta = self.new_param("bias", (c,), None, (cbox,), dist, reduce_dims)
        xp = self.ctx.xp
        self.cbox = cbox
        # the number of values each channel's statistics cover, from shapes alone (the stats group's blocks
        # tile the stat dimensions; the other dimensions are this rank's block), so no count travels in the
        # allreduce and none is read back to the host
        box = dist.box(in_shape, self.ctx.rank)
        self.local_block = tuple(hi - lo for lo, hi in box)
        self.stat_count = float(math.prod(n if name in self.stat_dims else hi - lo
                                    for name, n, (lo, hi) in zip(dist.dim_names, in_shape, box)
                                    if name != "c"))
        self.running_mean = xp.zeros(cbox[1] - cbox[0])
        self.running_var = xp.ones(cbox[1] - cbox[0])
        # cuDNN Frontend's batch-norm plans where the run's kernel set is cuDNN's (a GPU run: select.py)
        cudnn_set = getattr(self.ctx.conv_kernels, "name", None) == "cudnn" and xp.__name__ != "numpy"
        self.cudnn = cudnn_bn.LayerPlans(self.eps, self.momentum) if cudnn_set else None

    @property
    def kernel_set(self) -> str | None:
        """The kernels this layer computes with where they are not the family's own (``summary.json``):
        ``cudnn`` while every pass it ran was cuDNN Frontend's."""
        return None if self.cudnn is None else self.cudnn.name

    def state(self) -> dict:
        """Not collective: the running statistics as tensors of shape (groups, C), one row per group of
        ranks that share them (a sample block of the ``n`` split under ``sync: group``, one row under
        ``sync: global``); replica 0 of the first rank of each (group, channel block) writes it."""
        dist, rank = self.out_dist, self.ctx.rank
        groups = dist.parts_of("n") if self.sync == "group" else 1
        g = dist.coords(rank)[0] if self.sync == "group" else 0
        shape = (groups, self.in_shapes[0][1])
        box = ((g, g + 1), self.cbox)
        writer = is_writer(dist, self.stat_dims, rank)
        return {k: StateTensor(shape, box, getattr(self, k).reshape(1, -1), writer)
                for k in ("running_mean", "running_var")}

    def load_state(self, state: dict) -> None:
        """Each sample group gets its own statistics back when the checkpoint has as many groups as this
        run; when the number of groups changed (another ``n`` split or ``sync``) every rank gets the
        average over the written groups (of the means and of the variances), its channel block only."""
        groups = self.out_dist.parts_of("n") if self.sync == "group" else 1
        g = self.out_dist.coords(self.ctx.rank)[0] if self.sync == "group" else 0
        for k in ("running_mean", "running_var"):
            rd = state[k]
            written, c = rd.global_shape
            if c != self.in_shapes[0][1]:
                raise LayerError(f"layer '{self.name}' (batchnorm): checkpoint {k} has {c} channels, the "
                                 f"model {self.in_shapes[0][1]}")
            if written == groups:
                vals = rd.read(((g, g + 1), self.cbox))[0]
            else:
                vals = rd.read(((0, written), self.cbox)).mean(axis=0)
            getattr(self, k)[...] = self.ctx.xp.asarray(np.ascontiguousarray(vals), dtype=np.float64)

    def fp_compute(self, xs):
        (x,) = xs
        relu = self.fuse_relu
        bn = self.cudnn if x.size else None
        gamma, beta = self.gamma.value, self.beta.value
        if not self.train:
            self._saved = None
            y = None if bn is None else bn.forward_eval(x, self.running_mean, self.running_var, gamma, beta,
                                                        relu)
            return y if y is not None else K.bn_forward(x, self.running_mean, self.running_var, gamma, beta,
                                                        self.eps, relu=relu)
        if x.shape != self.local_block:
            raise LayerError(f"layer '{self.name}' (batchnorm) on rank {self.ctx.rank}: input block "
                             f"{tuple(x.shape)} is not the block {self.local_block} of {self.in_shapes[0]} "
                             f"under {self.in_dists[0]}; batches must have the configured batch size")
        count = self.stat_count
        # the running statistics are written in place: the buffers stay those of set-up (capture-safe)
        if bn is not None and self.stats_comm.size == 1 and count > 1:  # cuDNN's fused pass (cudnn_bn)
            done = bn.forward_local(x, gamma, beta, count, self.running_mean, self.running_var, relu)
            if done is not None:
                self._saved = (x, None, None, count, done[0] if relu else None, done[1])
                return done[0]
        tot = K.bn_local_sums(x)
        if self.stats_comm.size > 1:
            tot = self.stats_comm.allreduce(tot)
        done = None if bn is None else bn.forward_reduced(x, tot, count, gamma, beta, self.running_mean,
                                                          self.running_var, relu)
        if done is None:
            done = K.bn_train_forward(x, tot, count, gamma, beta, self.eps, self.momentum, self.running_mean,
                                      self.running_var, relu=relu, in_place=True)
        y, mean, var = done[:3]
        self._saved = (x, mean, var, count, y if relu else None, None)
        return y

    def bp_compute(self, dy):
        x, mean, var, count, y, planned = self._saved
        gamma = self.gamma.value
        if planned is not None:  # the forward was cuDNN's fused pass: so is the backward
            self._saved = None
            return [self.cudnn.backward_local(dy, planned, gamma, self.gamma.grad, self.beta.grad, y)]
        tot = K.bn_backward_sums(dy, x, mean, var, self.eps, y=y)
        # gradients of scale/shift are partial sums over this block; the grad sync sums them
        K.bn_add_param_grads(tot, self.gamma.grad, self.beta.grad)
        if self.stats_comm.size > 1:
            tot = self.stats_comm.allreduce(tot)
        dx = K.bn_backward_data_summed(dy, x, mean, var, gamma, self.eps, tot, count, y=y)
        self._saved = None
        return [dx]
