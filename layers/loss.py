"""Losses and metrics over distributed model outputs, reduced exactly once across ranks.

* ``cross_entropy``: logits ``(N, K)`` split by samples; labels ``(N,)`` integers.
* ``pixel_cross_entropy``: logits ``(N, K, [D,] H, W)`` split by samples and space; labels stored at the
  *input* resolution ``(N, [D,] H0, W0)`` with ``H0 = f·H``; a prediction cell is positive if any input
  pixel under it is (Dryden et al.'s mesh-tangling label reduction), done inside the loss, or once by the
  reader as it reads the labels (``HDF5Reader(label_factors=loss.factors)``, as the trainer builds it).
* ``mse``, ``l1``, ``bce_with_logits``: any output ``(N, K[, spatial...])``, split any way (channels
  included: the terms are independent); float targets of the output's shape, read blocked like it.
* ``dice``: output ``(N, K, spatial...)``; integer class labels per pixel at the output's resolution;
  MONAI's ``DiceLoss(softmax=True, to_onehot_y=True, include_background=True, smooth_nr=smooth_dr=1e-5,
  batch=False)``: the mean over (sample, class) of ``1 - (2 I + s) / (P + T + s)``, the sums ``I = sum(p t)``,
  ``P = sum(p)``, ``T = sum(t)`` over the sample's whole (split) domain.

Every loss is the global mean (dice: a function of global sums), so the gradient of every rank's block is
the exact partial of the global loss. One class per kind (:class:`Loss` builds the one ``kind`` names);
their statistics stay on the device, reduced there, and reach the host only in :meth:`Loss.metrics`.
Cross-entropy metrics are counts (correct predictions; true/false positives and false negatives per
class) summed over the block group, from which accuracy and intersection-over-union follow.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lbannpy.backend import to_numpy
from lbannpy.dist import Distribution, block_range, shape_str
from lbannpy.shuffle import ShufflePlan
from lbannpy.tensor import DistTensor

from . import kernels as K
from .base import LayerError
from .context import LayerContext
from .kernels.loss import (bce_with_logits, check_label_range, dice_grad, dice_sums, dice_terms, iou_counts,
                           l1, mse)
from .registry import LossSpec, ShapeError, register_loss


def _check_cross_entropy(model: str, last: str, out_shape: tuple) -> None:
    if len(out_shape) != 2:
        raise ShapeError(
            f"model {model!r}: loss cross_entropy needs a (N, classes) output but the last layer {last!r} "
            f"gives {shape_str(out_shape)}; end with an fc layer (or use pixel_cross_entropy for "
            f"segmentation)")


def _check_pixel_cross_entropy(model: str, last: str, out_shape: tuple) -> None:
    if len(out_shape) < 3:
        raise ShapeError(
            f"model {model!r}: loss pixel_cross_entropy needs a (N, classes, spatial...) output but the last "
            f"layer {last!r} gives {shape_str(out_shape)}; end with a conv layer")


def _check_any_output(model: str, last: str, out_shape: tuple) -> None:
    if not 2 <= len(out_shape) <= 5:
        raise ShapeError(f"model {model!r}: the last layer {last!r} gives {shape_str(out_shape)}; a loss "
                         f"needs (N, K[, spatial...])")


def _check_dice(model: str, last: str, out_shape: tuple) -> None:
    if len(out_shape) < 3:
        raise ShapeError(
            f"model {model!r}: loss dice needs a (N, classes, spatial...) output but the last layer {last!r} "
            f"gives {shape_str(out_shape)}; end with a conv layer")


register_loss(LossSpec("cross_entropy", "one label per sample", _check_cross_entropy))
register_loss(LossSpec("pixel_cross_entropy", "one label per pixel", _check_pixel_cross_entropy))
register_loss(LossSpec("mse", "mean squared error against float targets of the output's shape",
                       _check_any_output))
register_loss(LossSpec("l1", "mean absolute error against float targets of the output's shape",
                       _check_any_output))
register_loss(LossSpec("bce_with_logits", "binary cross-entropy of sigmoid(output) against targets in "
                                          "[0, 1] of the output's shape", _check_any_output))
register_loss(LossSpec("dice", "soft Dice (MONAI) of softmax(output) against one class per output pixel",
                       _check_dice))


@dataclass(frozen=True)
class LabelForm:
    """What a loss reads from the data file's ``labels`` dataset, per sample, before any model is built:
    the config's data check and ``data check`` ask it (the trainer's reader and ``predict`` take the same
    from the built loss: :attr:`Loss.label_shape`, :attr:`Loss.targets`)."""

    shape: tuple          # per-sample shape
    floating: bool        # float targets (else integer class labels)
    classes: int | None   # integer labels lie in [0, classes)
    text: str             # how messages name it
    unit_range: bool = False  # targets lie in [0, 1]


def label_form(kind: str, in_spatial, out_sample) -> LabelForm:
    """The labels loss ``kind`` reads for a model with input spatial shape ``in_spatial`` and output shape
    ``out_sample`` (one sample: ``(K, *spatial)``)."""
    return _impl(kind).form(kind, tuple(int(s) for s in in_spatial), tuple(int(s) for s in out_sample))


def _dims(shape) -> str:
    return ", ".join(map(str, shape))


_KINDS: dict[str, type] = {}


def _kinds(*names):
    def deco(cls):
        for n in names:
            _KINDS[n] = cls
        return cls
    return deco


def _impl(kind: str) -> type:
    impl = _KINDS.get(kind)
    if impl is None:
        raise LayerError(f"unknown loss '{kind}'; use one of {', '.join(_KINDS)}")
    return impl


def _channels_whole(dist: Distribution) -> Distribution:
    """``dist`` with its channel axis holding copies (a softmax over the classes needs all of them)."""
    return Distribution(tuple(dist.split), dist.ranks, (1,) if dist.split[1] > 1 else ())


class Loss:
    """The loss on the model's output: ``Loss(kind, ...)`` builds the class registered for ``kind``.
    ``forward`` returns the global loss and metrics; ``backward`` the output's gradient.

    What the trainer's reader needs comes from here: :attr:`label_dist` and :meth:`label_box` (the block of
    labels each rank reads), :attr:`factors` (per-pixel labels reduced to prediction cells as read),
    :attr:`targets` (float targets blocked like the output, channels included), :attr:`label_shape`
    (the labels' per-sample shape where it is not the reader's default) and :attr:`label_classes` (the
    range integer labels are checked against). Each kind's class lays the output out for its
    computation (``_layout``: the distribution it computes under, after checking the output's shape) and
    defines ``form`` (its :class:`LabelForm`), ``forward_stats`` and ``metrics``."""

    targets = False
    label_shape: tuple | None = None

    def __new__(cls, kind: str, *args, **kwargs):
        return super().__new__(_impl(kind) if cls is Loss else cls)

    def __init__(self, kind: str, ctx: LayerContext, logits_shape, logits_dist: Distribution,
                 label_shape=None, num_classes_metric: int | None = None):
        self.kind, self.ctx = kind, ctx
        self.logits_shape = tuple(logits_shape)
        self.src_dist = logits_dist
        self.factors = ()
        self.dist = self._layout(logits_dist, label_shape)
        self.plan = None if self.dist == logits_dist else ShufflePlan(logits_dist, self.dist,
                                                                      self.logits_shape, ctx.rank)
        self.group = ctx.block_comm(self.dist)
        self.num_classes = self.logits_shape[1]
        self._grad = None

    @property
    def label_dist(self) -> Distribution:
        """Distribution under which the reader reads labels (samples and space split like the logits)."""
        return self.dist

    @property
    def label_classes(self) -> int | None:
        """Integer labels are checked against ``[0, label_classes)``; None for float targets."""
        return None if self.targets else self.num_classes

    def label_box(self, rank=None):
        """Box of the labels this rank needs: its output block's samples and pixels."""
        box = self.dist.box(self.logits_shape, self.ctx.rank if rank is None else rank)
        return box if self.targets else (box[0],) + tuple(box[2:])

    def _gathered(self, logits: DistTensor):
        return logits.local if self.plan is None else self.plan.start(self.ctx.comm, logits.local).wait()

    def forward(self, logits: DistTensor, labels_local):
        """Collective over the loss group: ``(loss, metrics)`` as host floats. Equal to
        ``self.metrics(self.forward_stats(logits, labels_local))``: one host synchronisation."""
        return self.metrics(self.forward_stats(logits, labels_local))

    def backward(self) -> DistTensor:
        g = self._grad
        self._grad = None
        if g is None:
            raise LayerError("loss backward called before forward")
        if self.plan is not None:
            g = self.plan.reverse().start(self.ctx.comm, g).wait()
        return DistTensor(g, self.logits_shape, self.src_dist, self.ctx.rank)


@_kinds("cross_entropy", "pixel_cross_entropy")
class CrossEntropyLoss(Loss):
    """Softmax cross-entropy per sample (``cross_entropy``) or per prediction cell
    (``pixel_cross_entropy``, labels at the input's resolution reduced to the cells)."""

    @staticmethod
    def form(kind: str, in_spatial: tuple, out_sample: tuple) -> LabelForm:
        if kind == "cross_entropy":
            return LabelForm((), False, out_sample[0], "(M,) class indices")
        return LabelForm(in_spatial, False, out_sample[0],
                         f"(M, *spatial) = (M, {_dims(in_spatial)}) class indices at the input's resolution")

    def __init__(self, kind: str, ctx: LayerContext, logits_shape, logits_dist: Distribution,
                 label_shape=None, num_classes_metric: int | None = None):
        super().__init__(kind, ctx, logits_shape, logits_dist, label_shape, num_classes_metric)
        self._check_label_blocks(label_shape)
        self.count = int(np.prod([self.logits_shape[0]] + list(self.logits_shape[2:])))

    def _layout(self, logits_dist: Distribution, label_shape) -> Distribution:
        nd = len(self.logits_shape)
        if self.kind == "cross_entropy":
            if nd != 2:
                raise LayerError(f"loss cross_entropy needs (N, classes) logits, got {self.logits_shape}; "
                                 f"end the model with an fc layer or use pixel_cross_entropy")
            return Distribution((logits_dist.split[0], logits_dist.split[1]), logits_dist.ranks,
                                (1,) if logits_dist.split[1] > 1 else ())
        if nd not in (4, 5):
            raise LayerError(f"loss pixel_cross_entropy needs (N, classes, [D,] H, W) logits, got "
                             f"{self.logits_shape}")
        label_shape = tuple(label_shape)
        self.factors = tuple(int(a // b) for a, b in zip(label_shape[1:], self.logits_shape[2:]))
        if any(a != b * f for a, b, f in zip(label_shape[1:], self.logits_shape[2:], self.factors)):
            raise LayerError(f"labels of shape {label_shape} are not an integer multiple of the "
                             f"prediction's spatial shape {self.logits_shape[2:]}; choose an input size "
                             f"divisible by the model's total stride")
        return _channels_whole(logits_dist)

    def _check_label_blocks(self, label_shape):
        """Per-pixel labels are read as blocks of the input-resolution label tensor; each must be exactly
        the pixels under this rank's prediction cells. Checked for every rank (no communication)."""
        if not self.factors:
            return
        lshape = (self.logits_shape[0], 1) + tuple(label_shape[1:])
        for r in self._label_suspects(lshape):  # O(sum of split degrees), not a loop over ranks
            want = self.label_box(r)
            got = self.dist.box(lshape, r)
            got = (got[0],) + tuple(got[2:])
            if want != got:
                raise LayerError(
                    f"rank {r}: the prediction block {self.dist.box(self.logits_shape, r)} of "
                    f"{self.logits_shape} under {self.dist} covers input pixels {want}, but the label block "
                    f"read for it is {got}; choose a spatial split that divides the prediction's size "
                    f"{self.logits_shape[2:]}")

    def _label_suspects(self, lshape):
        """The first rank (in rank order) whose label block can differ from its prediction cells: blocks
        differ dimension by dimension, so per spatial dimension the first bad block coordinate, 0
        elsewhere, and the smallest such rank (none when every block matches)."""
        dist, out = self.dist, []
        for d, f in zip(range(2, len(lshape)), self.factors):
            n, m, p = self.logits_shape[d], lshape[d], dist.parts[d]
            bad = next((c for c in range(p) if tuple(f * x for x in block_range(n, p, c))
                        != block_range(m, p, c)), None)
            if bad is not None:
                out.append(dist.rank_of(tuple(bad if i == d else 0 for i in range(dist.ndim))))
        return sorted(out)[:1]

    def label_box(self, rank=None):
        """Box of the labels this rank needs: samples and (scaled) spatial block of its logits."""
        box = self.dist.box(self.logits_shape, self.ctx.rank if rank is None else rank)
        out = [box[0]]
        for (a, b), f in zip(box[2:], self.factors):
            out.append((a * f, b * f))
        return tuple(out)

    def forward_stats(self, logits: DistTensor, labels_local):
        """Collective over the loss group (every rank calls it once per batch): the loss gradient is kept
        for :meth:`backward` and the reduced statistics ``[loss sum, correct, tp[K], fp[K], fn[K]]`` are
        returned as a float64 array on the logits' device, reduced there (no host synchronisation); turn
        them into numbers with :meth:`metrics` on the steps that are logged.

        ``labels_local`` are host (NumPy) labels as the reader returns them: their range is checked here,
        before the upload, because the same check on a device array would stall every step. Per-pixel labels
        come either at the input's resolution (the block :meth:`label_box` names; reduced here, every call)
        or already reduced to this rank's prediction cells (a reader given ``label_factors=self.factors``
        reduces them once, as it reads them)."""
        xp = self.ctx.xp
        z = self._gathered(logits)
        if isinstance(labels_local, np.ndarray):
            check_label_range(labels_local, self.num_classes)
        labels = xp.asarray(labels_local)
        if self.factors and tuple(labels.shape[1:]) != tuple(z.shape[2:]):  # not yet in prediction cells
            labels = K.downsample_labels_any(labels, self.factors)
        loss_sum, self._grad = K.cross_entropy(z, labels, self.count, labels_checked=True)
        tp, fp, fn = K.iou_counts(z, labels, self.num_classes)
        k = self.num_classes
        stats = xp.empty(2 + 3 * k, dtype=np.float64)  # filled on the device: no host round trip
        stats[0] = loss_sum
        stats[1] = tp.sum()  # the correct predictions: the confusion matrix's diagonal
        stats[2:2 + k] = tp
        stats[2 + k:2 + 2 * k] = fp
        stats[2 + 2 * k:] = fn
        return self.group.allreduce(stats)

    def metrics(self, stats) -> tuple[float, dict]:
        """``(loss, metrics)`` from the reduced statistics of :meth:`forward_stats` (local: no
        communication). Brings them to the host: the one host synchronisation of a logged step."""
        tot = to_numpy(stats)
        k = self.num_classes
        tp, fp, fn = tot[2:2 + k], tot[2 + k:2 + 2 * k], tot[2 + 2 * k:]
        metrics = {"loss": float(tot[0] / self.count), "accuracy": float(tot[1] / self.count)}
        if k == 2:  # binary segmentation: IoU of the positive class
            d = tp[1] + fp[1] + fn[1]
            metrics["iou"] = float(tp[1] / d) if d > 0 else 0.0
        else:
            d = tp + fp + fn
            metrics["miou"] = float(np.mean(tp[d > 0] / d[d > 0])) if (d > 0).any() else 0.0
        return metrics["loss"], metrics


@_kinds("mse", "l1", "bce_with_logits")
class ElementwiseLoss(Loss):
    """A mean over every element of the output of a term of (output, target): squared or absolute error,
    binary cross-entropy on logits. The terms are independent, so the loss computes under the output's
    own distribution (channels split too: no redistribution) and the reader reads the targets blocked like
    the output. Statistics ``[loss sum, correct]`` (correct: ``bce_with_logits``'s predictions at 0.5)."""

    targets = True
    KERNELS = {"mse": mse, "l1": l1, "bce_with_logits": bce_with_logits}

    @staticmethod
    def form(kind: str, in_spatial: tuple, out_sample: tuple) -> LabelForm:
        what = "targets in [0, 1]" if kind == "bce_with_logits" else "targets"
        return LabelForm(out_sample, True, None,
                         f"float {what} of the output's shape (M, {_dims(out_sample)})",
                         unit_range=kind == "bce_with_logits")

    def _layout(self, logits_dist: Distribution, label_shape) -> Distribution:
        self.kernel = self.KERNELS[self.kind]
        self.count = int(np.prod(self.logits_shape))
        self.label_shape = self.logits_shape[1:]
        return logits_dist

    def forward_stats(self, logits: DistTensor, labels_local):
        """Collective over the loss group: the reduced ``[loss sum, correct]`` (float64, on the logits'
        device; no host synchronisation). ``labels_local`` are this rank's targets (:meth:`label_box`),
        host or device, any float dtype (converted to the output's)."""
        xp = self.ctx.xp
        z = self._gathered(logits)
        y = xp.asarray(labels_local)
        if tuple(y.shape) != tuple(z.shape):
            raise LayerError(f"loss {self.kind}: rank {self.ctx.rank}'s targets have shape {tuple(y.shape)} "
                             f"but its output block {tuple(z.shape)} (of {shape_str(self.logits_shape)})")
        if y.dtype != z.dtype:
            y = y.astype(z.dtype)
        out = self.kernel(z, y, self.count)
        self._grad = out[1]
        stats = xp.zeros(2, dtype=np.float64)
        stats[0] = out[0]
        if len(out) > 2:
            stats[1] = out[2]
        return self.group.allreduce(stats)

    def metrics(self, stats) -> tuple[float, dict]:
        tot = to_numpy(stats)
        metrics = {"loss": float(tot[0] / self.count)}
        if self.kind == "bce_with_logits":
            metrics["accuracy"] = float(tot[1] / self.count)
        return metrics["loss"], metrics


@_kinds("dice")
class DiceLoss(Loss):
    """Soft Dice as MONAI defines it (see the module), over the whole split domain: each block's sums per
    (sample, class) go into one buffer of the whole batch's, ``(N, K, 3)``, with the per-class
    true/false positive and false negative counts of the argmax predictions behind it; one allreduce over
    the loss group gives every rank the global sums, from which its block's exact gradient follows and
    which are the statistics :meth:`metrics` reads (loss, and the mean Dice ``2 tp / (2 tp + fp + fn)``
    of the argmax predictions over the classes present)."""

    @staticmethod
    def form(kind: str, in_spatial: tuple, out_sample: tuple) -> LabelForm:
        return LabelForm(out_sample[1:], False, out_sample[0],
                         f"(M, {_dims(out_sample[1:])}) class indices at the output's resolution")

    def _layout(self, logits_dist: Distribution, label_shape) -> Distribution:
        if len(self.logits_shape) < 3:
            raise LayerError(f"loss dice needs (N, classes, spatial...) logits, got {self.logits_shape}")
        self.label_shape = self.logits_shape[2:]
        self.count = self.logits_shape[0] * self.logits_shape[1]  # the (sample, class) terms
        return _channels_whole(logits_dist)

    def forward_stats(self, logits: DistTensor, labels_local):
        """Collective over the loss group: the reduced buffer ``[sums (N, K, 3), tp[K], fp[K], fn[K]]``
        (float64, on the logits' device; no host synchronisation). ``labels_local``: this rank's integer
        labels (:meth:`label_box`), host ones range-checked here, before the upload."""
        xp = self.ctx.xp
        z = self._gathered(logits)
        n, k = self.logits_shape[:2]
        if isinstance(labels_local, np.ndarray):
            check_label_range(labels_local, k)
        labels = xp.asarray(labels_local)
        if tuple(labels.shape) != (z.shape[0],) + tuple(z.shape[2:]):
            raise LayerError(f"loss dice: rank {self.ctx.rank}'s labels have shape {tuple(labels.shape)}; "
                             f"its output block {tuple(z.shape)} needs {(z.shape[0],) + tuple(z.shape[2:])}")
        p, onehot, sums = dice_sums(z, labels)
        tp, fp, fn = iou_counts(z, labels, k)
        buf = xp.zeros(3 * n * k + 3 * k, dtype=np.float64)
        n0, n1 = self.dist.box(self.logits_shape, self.ctx.rank)[0]
        whole = buf[:3 * n * k].reshape(n, k, 3)
        whole[n0:n1] = sums
        counts = buf[3 * n * k:].reshape(3, k)
        counts[0], counts[1], counts[2] = tp, fp, fn
        buf = self.group.allreduce(buf)
        self._grad = dice_grad(p, onehot, buf[:3 * n * k].reshape(n, k, 3)[n0:n1], self.count)
        return buf

    def metrics(self, stats) -> tuple[float, dict]:
        tot = to_numpy(stats)
        n, k = self.logits_shape[:2]
        loss = float(np.mean(1.0 - dice_terms(tot[:3 * n * k].reshape(n, k, 3))))
        tp, fp, fn = tot[3 * n * k:].reshape(3, k)
        d = 2 * tp + fp + fn
        dice = float(np.mean(2 * tp[d > 0] / d[d > 0])) if (d > 0).any() else 0.0
        return loss, {"loss": loss, "dice": dice}
