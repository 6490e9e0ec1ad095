"""Losses and metrics over distributed logits, reduced exactly once across ranks.

* ``cross_entropy``: logits ``(N, K)`` split by samples; labels ``(N,)`` integers.
* ``pixel_cross_entropy``: logits ``(N, K, [D,] H, W)`` split by samples and space; labels stored at the
  *input* resolution ``(N, [D,] H0, W0)`` with ``H0 = f·H``; a prediction cell is positive if any input
  pixel under it is (Dryden et al.'s mesh-tangling label reduction), done inside the loss, or once by the
  reader as it reads the labels (``HDF5Reader(label_factors=loss.factors)``, as the trainer builds it).

Both are means over the global number of predictions, so the gradient of every rank's block is a partial
of the global loss and sums of partials over ranks are exact. Metrics are counts (correct predictions;
true/false positives and false negatives per class) summed over the block group, from which accuracy and
intersection-over-union follow.
"""
from __future__ import annotations

import numpy as np

from lbannpy.backend import to_numpy
from lbannpy.dist import Distribution, block_range, shape_str
from lbannpy.shuffle import ShufflePlan
from lbannpy.tensor import DistTensor

from . import kernels as K
from .base import LayerError
from .context import LayerContext
from .kernels.loss import check_label_range
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


register_loss(LossSpec("cross_entropy", "one label per sample", _check_cross_entropy))
register_loss(LossSpec("pixel_cross_entropy", "one label per pixel", _check_pixel_cross_entropy))


class Loss:
    """The loss on the model's output. ``forward`` returns the global loss; ``backward`` the logits grad."""

    def __init__(self, kind: str, ctx: LayerContext, logits_shape, logits_dist: Distribution,
                 label_shape=None, num_classes_metric: int | None = None):
        self.kind, self.ctx = kind, ctx
        self.logits_shape = tuple(logits_shape)
        self.src_dist = logits_dist
        nd = len(self.logits_shape)
        if kind == "cross_entropy":
            if nd != 2:
                raise LayerError(f"loss cross_entropy needs (N, classes) logits, got {self.logits_shape}; "
                                 f"end the model with an fc layer or use pixel_cross_entropy")
            self.dist = Distribution((logits_dist.split[0], logits_dist.split[1]), logits_dist.ranks,
                                     (1,) if logits_dist.split[1] > 1 else ())
            self.factors = ()
        elif kind == "pixel_cross_entropy":
            if nd not in (4, 5):
                raise LayerError(f"loss pixel_cross_entropy needs (N, classes, [D,] H, W) logits, got "
                                 f"{self.logits_shape}")
            split = list(logits_dist.split)
            rep = (1,) if split[1] > 1 else ()
            self.dist = Distribution(tuple(split), logits_dist.ranks, rep)
            label_shape = tuple(label_shape)
            self.factors = tuple(int(a // b) for a, b in zip(label_shape[1:], self.logits_shape[2:]))
            if any(a != b * f for a, b, f in zip(label_shape[1:], self.logits_shape[2:], self.factors)):
                raise LayerError(f"labels of shape {label_shape} are not an integer multiple of the "
                                 f"prediction's spatial shape {self.logits_shape[2:]}; choose an input size "
                                 f"divisible by the model's total stride")
        else:
            raise LayerError(f"unknown loss '{kind}'; use cross_entropy or pixel_cross_entropy")
        self.plan = None if self.dist == logits_dist else ShufflePlan(logits_dist, self.dist,
                                                                      self.logits_shape, ctx.rank)
        self.group = ctx.block_comm(self.dist)
        self._check_label_blocks(label_shape)
        self.count = int(np.prod([self.logits_shape[0]] + list(self.logits_shape[2:])))
        self.num_classes = self.logits_shape[1]

    @property
    def label_dist(self) -> Distribution:
        """Distribution under which the reader reads labels (samples and space split like the logits)."""
        return self.dist

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

    def forward(self, logits: DistTensor, labels_local):
        """Collective over the loss group: ``(loss, metrics)`` as host floats. Equal to
        ``self.metrics(self.forward_stats(logits, labels_local))``: one host synchronisation."""
        return self.metrics(self.forward_stats(logits, labels_local))

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
        ctx, xp = self.ctx, self.ctx.xp
        z = logits.local if self.plan is None else self.plan.start(ctx.comm, logits.local).wait()
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

    def backward(self) -> DistTensor:
        g = self._grad
        self._grad = None
        if g is None:
            raise LayerError("loss backward called before forward")
        if self.plan is not None:
            g = self.plan.reverse().start(self.ctx.comm, g).wait()
        return DistTensor(g, self.logits_shape, self.src_dist, self.ctx.rank)
