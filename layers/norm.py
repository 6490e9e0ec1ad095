"""Instance, group and layer normalisation: statistics per sample over the whole split spatial domain.

Each statistic covers one sample's values of a group of channels (instance norm: one channel; group norm:
``C / groups`` channels; layer norm: all of them) over every spatial position, wherever the split put them.
A rank takes per (sample, group) partial sums of its block, and one allreduce per pass over the ranks holding
the rest of its samples (the spatial grid axes, plus ``c`` for layer norm, whose statistic spans the split
channels) makes them whole; the backward likewise. The counts come from the shapes, so nothing is read
back to the host. Instance norm with ``track_running_stats`` keeps PyTorch's running statistics (the
average over the batch of each sample's mean and unbiased variance), as layer state; its allreduce then
also spans the sample split, each rank's samples in their own rows, so every rank sees the whole batch's
statistics in that same one allreduce.

Group norm splits channels where every channel block holds whole groups (uneven blocks of whole groups
included: with one channel per group any split does): a rank's statistics are then its own groups', whole
over its channels, and the allreduce spans space only as without the split. A split that would cut a group
is refused by ``validate``, dropped by the planner and refused by the layer (:func:`group_split_check`).
Instance norm and layer norm split every dimension.
"""
from __future__ import annotations

import math

import numpy as np

from lbannpy.config_types import REQUIRED, Bool, Float, Int, Key
from lbannpy.dist import Distribution, block_starts, box_shape, shape_str

from .base import Layer, LayerError
from .kernels import norm as K
from .registry import (Inferred, LayerArgs, LayerSpec, ShapeError, Statistics, needs_image, register,
                       split_refusal)
from .state import StateTensor, is_writer

_EPS = Key("eps", Float(0.0, lo_open=True), 1e-5, "added to the variance")


def _flops(x) -> int:
    # statistics (sum and sum of squares: 3), normalise with the folded scale and shift (2) per element
    return 5 * math.prod(x)


def _infer_instance(lay: LayerArgs) -> Inferred:
    needs_image(lay, "instance norm normalises each channel of each sample over space")
    return Inferred(lay.x, _flops(lay.x), 2 * lay.x[1] if lay.params.get("affine") else 0)


def _infer_group(lay: LayerArgs) -> Inferred:
    needs_image(lay, "group norm normalises groups of channels of each sample over space")
    g, c = lay.params.get("groups"), lay.x[1]
    if not isinstance(g, int) or isinstance(g, bool) or g < 1 or c % g:
        raise ShapeError(f"layer {lay.name!r} (groupnorm): groups={g!r} must be a positive divisor of the "
                         f"{c} channels of its input {shape_str(lay.x)}")
    return Inferred(lay.x, _flops(lay.x), 2 * c if lay.params.get("affine", True) else 0)


def _infer_layer(lay: LayerArgs) -> Inferred:
    needs_image(lay, "layer norm normalises each sample over (C, spatial...)")
    per_sample = math.prod(lay.x[1:])
    # the element-wise scale and shift are a multiply and an add more per element
    affine = lay.params.get("affine", True)
    return Inferred(lay.x, _flops(lay.x) + (2 * math.prod(lay.x) if affine else 0),
                    2 * per_sample if affine else 0)


def _whole_groups(channels: int, group_size: int, parts: int) -> bool:
    """Every block of ``channels`` split ``parts`` ways starts and ends on a group boundary."""
    return all(b % group_size == 0 for b in block_starts(channels, parts))


def group_split_check(params, in_shape, dist: Distribution):
    """``("c", why, fix)`` where a channel split of group norm would cut a group (the statistic of a group
    cut in two would need the other rank's channels), else None; the fix names the degrees that work."""
    c, parts = in_shape[1], dist.parts_of("c")
    g = params.get("groups")
    if parts == 1 or not isinstance(g, int) or isinstance(g, bool) or g < 1 or c % g:
        return None  # nothing split, or groups that shape inference refuses on its own
    size = c // g
    if _whole_groups(c, size, parts):
        return None
    blocks = sorted({b - a for a, b in zip(block_starts(c, parts), block_starts(c, parts)[1:])})
    ok = [str(p) for p in range(1, c + 1) if _whole_groups(c, size, p)]
    return ("c", f"a channel split of {parts} cuts its {g} groups of {size} channels (blocks of "
                 f"{'/'.join(map(str, blocks))} channels)",
            f"split c so that each block holds whole groups: c in {{{', '.join(ok)}}}")


class _SampleNorm(Layer):
    """What the three types share: statistics per (sample, group) from partial sums and one allreduce per
    pass. A subclass sets ``_groups`` (global groups; channels per group divide each channel block) and
    whether the statistic spans the channel split (``_spans_channels``)."""

    _spans_channels = False
    tracks = False
    # the backward reads the input and the statistics, never the output: a ReLU that alone reads it may
    # overwrite it in place
    output_kept = False

    def _groups(self, channels: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def setup(self, dist: Distribution) -> None:
        super().setup(dist)
        (in_shape,) = self.in_shapes
        if len(in_shape) < 3:
            raise LayerError(f"layer '{self.name}' ({self.type}) needs an image input (N, C, spatial...), "
                             f"got {shape_str(in_shape)}")
        hp = self.hparams
        self.eps = float(hp["eps"])
        self.affine = bool(hp["affine"])
        rank = self.ctx.rank
        n, c = in_shape[:2]
        names = dist.dim_names
        box = dist.box(in_shape, rank)
        self.local_block = box_shape(box)
        self.nbox, self.cbox = box[0], box[1]
        groups = self._groups(c)
        self.group_size = c // groups
        self.count = float(self.group_size * math.prod(in_shape[2:]))
        # the channel block's groups (a layer norm's one group: every channel of the block)
        self.local_groups = 1 if self._spans_channels else (self.cbox[1] - self.cbox[0]) // self.group_size
        self.stat_dims = list(names[2:]) + (["c"] if self._spans_channels else [])
        if self.tracks and dist.parts_of("n") > 1:
            # the running statistics average over the whole batch: each rank's samples in their own rows
            self.stat_dims.append("n")
            self.batch_rows = (n, self.nbox)
        else:
            self.batch_rows = None
        self.stats_comm = self.ctx.block_comm(dist, self.stat_dims)
        # the backward's sums are per sample: never over the sample split
        self.grad_comm = self.ctx.block_comm(dist, [d for d in self.stat_dims if d != "n"])
        self._saved = None

    def _check_block(self, x) -> None:
        if tuple(x.shape) != self.local_block:
            raise LayerError(f"layer '{self.name}' ({self.type}) on rank {self.ctx.rank}: input block "
                             f"{tuple(x.shape)} is not the block {self.local_block} of {self.in_shapes[0]} "
                             f"under {self.in_dists[0]}; batches must have the configured batch size")

    def _statistics(self, x):
        """The mean and biased variance ``(N, G)`` of this block's samples and groups, over the whole
        statistic (one allreduce where other ranks hold part of it); also the whole batch's when tracked."""
        tot = K.group_totals(x, self.local_groups)
        if self.batch_rows is not None:
            n, (lo, hi) = self.batch_rows
            full = self.ctx.xp.zeros((2, n, self.local_groups), dtype=np.float64)
            full[:, lo:hi] = tot
            tot = full
        if self.stats_comm.size > 1:
            tot = self.stats_comm.allreduce(tot)
        mean, var = K.moments(tot, self.count)
        if self.tracks and self.train:
            K.running_update(mean, var, self.count, self.momentum, self.running_mean, self.running_var)
        if self.batch_rows is not None:
            lo, hi = self.batch_rows[1]
            mean, var = mean[lo:hi], var[lo:hi]
        return mean, var


@register(LayerSpec("instancenorm", "instance normalization: each channel of each sample over space", (
    _EPS,
    Key("affine", Bool(), False, "learn a scale and a shift per channel"),
    Key("track_running_stats", Bool(), False,
        "keep running statistics (used in evaluation), as torch.nn.InstanceNorm does"),
    Key("momentum", Float(0.0, 1.0), 0.1, "weight of the new batch in the running statistics")),
    _infer_instance, weights_split=True, spatial_statistics=True, statistics=Statistics(per=("n", "c")),
    pointwise=True, order=31, capturable=True))
class InstanceNorm(_SampleNorm):
    def _groups(self, channels: int) -> int:
        return channels

    def setup(self, dist: Distribution) -> None:
        self.tracks = bool(self.hparams["track_running_stats"])
        self.momentum = float(self.hparams["momentum"])
        super().setup(dist)
        c = self.in_shapes[0][1]
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        self.gamma = self.beta = None
        if self.affine:
            self.gamma = self.new_param("scale", (c,), np.ones(c), (self.cbox,), dist, reduce_dims)
            self.beta = self.new_param("bias", (c,), None, (self.cbox,), dist, reduce_dims)
        if self.tracks:
            xp, cl = self.ctx.xp, self.cbox[1] - self.cbox[0]
            self.running_mean = xp.zeros(cl)
            self.running_var = xp.ones(cl)

    def state(self) -> dict:
        """Not collective: the running statistics ``(C,)`` (the whole batch's: the same on every rank of a
        channel block), written by the first rank of each channel block."""
        if not self.tracks:
            return {}
        dist, rank = self.out_dist, self.ctx.rank
        writer = is_writer(dist, [d for d in dist.dim_names if d != "c"], rank)
        c = self.in_shapes[0][1]
        return {k: StateTensor((c,), (self.cbox,), getattr(self, k), writer)
                for k in ("running_mean", "running_var")}

    def load_state(self, state: dict) -> None:
        """The channel block's running statistics, whatever distribution wrote them. New arrays are
        assigned (the dry run on a shallow copy leaves the live layer as it was); a run resumes before its
        steps are captured, so no captured graph holds the old ones."""
        if not self.tracks:
            return
        c = self.in_shapes[0][1]
        for k in ("running_mean", "running_var"):
            if k not in state or tuple(state[k].global_shape) != (c,):
                got = None if k not in state else tuple(state[k].global_shape)
                raise LayerError(f"layer '{self.name}' (instancenorm): checkpoint {k} has shape {got}, the "
                                 f"model ({c},)")
        vals = {k: state[k].read((self.cbox,)) for k in ("running_mean", "running_var")}
        for k, v in vals.items():
            setattr(self, k, self.ctx.xp.asarray(np.ascontiguousarray(v), dtype=np.float64))

    def _params(self):
        return (None, None) if not self.affine else (self.gamma.value, self.beta.value)

    def fp_compute(self, xs):
        (x,) = xs
        gamma, beta = self._params()
        if self.tracks and not self.train:  # evaluation with the running statistics, per channel
            n = x.shape[0]
            xp = self.ctx.xp
            mean = xp.broadcast_to(self.running_mean.reshape(1, -1), (n, x.shape[1]))
            var = xp.broadcast_to(self.running_var.reshape(1, -1), (n, x.shape[1]))
            self._saved = (x, mean, var, None)
            return K.group_forward(x, mean, var, gamma, beta, self.eps)
        self._check_block(x)
        mean, var = self._statistics(x)
        self._saved = (x, mean, var, self.count)
        return K.group_forward(x, mean, var, gamma, beta, self.eps)

    def bp_compute(self, dy):
        x, mean, var, count = self._saved
        self._saved = None
        gamma = None if not self.affine else self.gamma.value
        sums = K.group_backward_sums(dy, x, mean, var, self.eps)
        if self.affine:
            K.add_param_grads(sums, self.gamma.grad, self.beta.grad)
        if count is None:  # the running statistics are constants: dx = gamma / sigma * dy
            return [K.group_forward(dy, mean * 0.0, var, gamma, None, self.eps)]
        tot = K.group_backward_totals(sums, gamma, self.local_groups)
        if self.grad_comm.size > 1:
            tot = self.grad_comm.allreduce(tot)
        return [K.group_backward_data(dy, x, mean, var, gamma, self.eps, tot, count)]


@register(LayerSpec("groupnorm", "group normalization: groups of channels of each sample over space", (
    Key("groups", Int(1), REQUIRED, "number of channel groups (divides the channels)",
        aliases=("num_groups",)),
    _EPS,
    Key("affine", Bool(), True, "learn a scale and a shift per channel")),
    _infer_group, weights_split=True, spatial_statistics=True,
    statistics=Statistics(per=("n", "c"), groups="groups"), pointwise=True, order=32, capturable=True,
    split_check=group_split_check))
class GroupNorm(_SampleNorm):
    def _groups(self, channels: int) -> int:
        g = self.hparams.get("groups")
        if not isinstance(g, int) or g < 1 or channels % g:
            raise LayerError(f"layer '{self.name}' (groupnorm): groups={g!r} must be a positive divisor of "
                             f"its {channels} channels")
        return g

    def setup(self, dist: Distribution) -> None:
        cut = split_refusal(self.spec, self.hparams, self.in_shapes[0], dist)
        if cut is not None:
            raise LayerError(f"layer '{self.name}' (groupnorm) under {dist}: {cut[1]}; {cut[2]}")
        super().setup(dist)
        c = self.in_shapes[0][1]
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        self.gamma = self.beta = None
        if self.affine:
            self.gamma = self.new_param("scale", (c,), np.ones(c), (self.cbox,), dist, reduce_dims)
            self.beta = self.new_param("bias", (c,), None, (self.cbox,), dist, reduce_dims)

    def fp_compute(self, xs):
        (x,) = xs
        self._check_block(x)
        mean, var = self._statistics(x)
        self._saved = (x, mean, var)
        gamma, beta = (None, None) if not self.affine else (self.gamma.value, self.beta.value)
        return K.group_forward(x, mean, var, gamma, beta, self.eps)

    def bp_compute(self, dy):
        x, mean, var = self._saved
        self._saved = None
        gamma = None if not self.affine else self.gamma.value
        sums = K.group_backward_sums(dy, x, mean, var, self.eps)
        if self.affine:
            K.add_param_grads(sums, self.gamma.grad, self.beta.grad)
        tot = K.group_backward_totals(sums, gamma, self.local_groups)
        if self.grad_comm.size > 1:
            tot = self.grad_comm.allreduce(tot)
        return [K.group_backward_data(dy, x, mean, var, gamma, self.eps, tot, self.count)]


@register(LayerSpec("layernorm", "layer normalization: each sample over (C, spatial...), element-wise affine",
                    (
    _EPS,
    Key("affine", Bool(), True, "learn a scale and a shift per element of (C, spatial...)")),
    _infer_layer, weights_split=True, weights_spatial=True, spatial_statistics=True,
    statistics=Statistics(("c", "d", "h", "w"), ("n",)), pointwise=True, order=33, capturable=True))
class LayerNorm(_SampleNorm):
    """Over (C, spatial...) of each sample; the scale and shift have the shape (C, *spatial) and are split
    like the activation's block (their gradients: partial sums over the sample split only)."""

    _spans_channels = True

    def _groups(self, channels: int) -> int:
        return 1

    def setup(self, dist: Distribution) -> None:
        super().setup(dist)
        (in_shape,) = self.in_shapes
        box = dist.box(in_shape, self.ctx.rank)[1:]
        self.gamma = self.beta = None
        if self.affine:
            shape = tuple(in_shape[1:])
            self.gamma = self.new_param("scale", shape, np.ones(shape), box, dist, ["n"])
            self.beta = self.new_param("bias", shape, None, box, dist, ["n"])

    def fp_compute(self, xs):
        (x,) = xs
        self._check_block(x)
        mean, var = self._statistics(x)
        gamma, beta = (None, None) if not self.affine else (self.gamma.value, self.beta.value)
        self._saved = (x, mean, var)
        return K.layer_forward(x, mean, var, gamma, beta, self.eps)

    def bp_compute(self, dy):
        x, mean, var = self._saved
        self._saved = None
        gamma = None if not self.affine else self.gamma.value
        grads = (None, None) if not self.affine else (self.gamma.grad, self.beta.grad)
        tot, work = K.layer_backward(dy, x, mean, var, self.eps, gamma, *grads)
        if self.grad_comm.size > 1:
            tot = self.grad_comm.allreduce(tot)
        return [K.layer_backward_data(dy, x, mean, var, self.eps, gamma, tot, self.count, work)]
