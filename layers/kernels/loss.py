"""Losses and metrics as local partial sums that the caller reduces over the ranks holding a batch.

Logits have the class dimension at axis 1: ``(N, K)`` for classification, ``(N, K, *spatial)`` for
segmentation; integer labels are ``(N,)`` or ``(N, *spatial)``. The mean is over the *global* number of
terms, which the caller passes as ``global_count`` (samples, or samples x pixels), so ``dlogits`` is final
and the loss is ``allreduce(partial_sum) / global_count``.
"""
from __future__ import annotations

import numpy

from lbannpy.backend import array_module

from ._geometry import KernelShapeError, per_dim


_CLASS_IDS: dict = {}


def _class_ids(xp, k, ndim):
    """``arange(k)`` shaped to broadcast along axis 1 of an ``ndim``-d array (kept: never written)."""
    key = (xp.__name__, k, ndim)
    ids = _CLASS_IDS.get(key)
    if ids is None:
        ids = _CLASS_IDS[key] = xp.arange(k).reshape((1, k) + (1,) * (ndim - 2))
    return ids


def _log_softmax(xp, logits):
    m = logits.max(axis=1, keepdims=True)
    z = logits - m
    lse = xp.log(xp.exp(z).sum(axis=1, keepdims=True))
    return z - lse


def cross_entropy(logits, labels, global_count, labels_checked=False):
    """Softmax cross-entropy over axis 1 -> ``(partial_loss_sum, dlogits)``.

    ``labels`` are class indices (one fewer dimension than ``logits``) or class probabilities (the shape of
    ``logits``). ``partial_loss_sum`` is a float64 scalar array: the sum of the local per-term losses;
    ``dlogits = (softmax - target) / global_count``. Host integer labels are checked to lie in
    ``[0, classes)`` unless the caller did (``labels_checked``).
    """
    xp = array_module(logits)
    k = logits.shape[1]
    if labels.ndim == logits.ndim:
        if tuple(labels.shape) != tuple(logits.shape):
            raise KernelShapeError(f"cross entropy: soft labels {tuple(labels.shape)} must match logits "
                                   f"{tuple(logits.shape)}")
        logp = _log_softmax(xp, logits)
        target = labels.astype(logits.dtype)
        loss = -(target * logp).sum(dtype=numpy.float64)
        dlogits = xp.exp(logp) * target.sum(axis=1, keepdims=True) - target
        dlogits /= logits.dtype.type(global_count)
        return loss, dlogits
    want = (logits.shape[0],) + tuple(logits.shape[2:])
    if tuple(labels.shape) != want:
        raise KernelShapeError(f"cross entropy: labels {tuple(labels.shape)} must be {want} for logits "
                               f"{tuple(logits.shape)}")
    if array_module(labels) is numpy and not labels_checked:  # device labels: checked before the upload
        check_label_range(labels, k)
    return _index_cross_entropy(xp, logits, labels, global_count)


def _index_cross_entropy(xp, logits, labels, global_count):
    """:func:`cross_entropy` of integer labels whose range is known: with ``z = logits - max`` the loss of a
    term is ``log(sum exp(z)) - z[label]`` and ``dlogits = exp(z) / (sum exp(z) * count)``, less
    ``1 / count`` at the label. A small batch's loss is a dozen array calls, each a few microseconds of the
    step's fixed cost, so none is spent on what the result does not need."""
    dt = logits.dtype.type
    z = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)
    onehot = labels[:, None] == _class_ids(xp, logits.shape[1], logits.ndim)
    nll = xp.log(s) - z  # -log(softmax)
    loss = xp.where(onehot, nll, dt(0)).sum(dtype=numpy.float64)
    s *= dt(global_count)
    e /= s
    inv = dt(1) / dt(global_count)
    if xp is numpy:
        numpy.subtract(e, inv, out=e, where=onehot)
    else:  # CuPy's ufuncs take no ``where``
        e -= onehot.astype(e.dtype) * inv
    return loss, e


def check_label_range(labels, num_classes):
    """Raise unless every integer label lies in ``[0, num_classes)``. Host (NumPy) labels only: on a GPU
    the same check would stall the stream for a host round trip every step, so callers check the labels
    while they are still host arrays, before upload (as :class:`lbannpy.layers.loss.Loss` does)."""
    if array_module(labels) is not numpy:
        raise TypeError("check_label_range takes host (NumPy) labels; check them before the upload")
    if labels.size and not in_class_range(labels, num_classes):
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            raise KernelShapeError(f"cross entropy: labels must lie in [0, {num_classes}), got [{lo}, {hi}]")


def in_class_range(labels, num_classes) -> bool:
    """Whether every label of a host array lies in ``[0, num_classes)``. Integer labels in one pass (a
    negative label read as unsigned is larger than any class), where ``min`` and ``max`` take two."""
    if labels.size == 0:
        return True
    if labels.dtype.kind in "iu":
        return int(labels.view(labels.dtype.str.replace("i", "u")).max()) < num_classes
    return int(labels.min()) >= 0 and int(labels.max()) < num_classes


def softmax_cross_entropy(logits, labels, global_count):
    """Classification: ``logits`` ``(N, K)``, ``labels`` ``(N,)``; see :func:`cross_entropy`."""
    return cross_entropy(logits, labels, global_count)


def pixel_cross_entropy(logits, labels, global_count):
    """Segmentation: ``logits`` ``(N, K, *S)``, ``labels`` ``(N, *S)``; ``global_count`` is the number
    of labelled pixels in the global batch. See :func:`cross_entropy`."""
    return cross_entropy(logits, labels, global_count)


def downsample_labels_any(labels, factor):
    """Labels ``(N, *S)`` at input resolution -> ``(N, *ceil(S/factor))``: each cell takes the largest label
    of the input pixels under it, so for 0/1 masks a cell is positive if any pixel under it is. Cells that
    stick out past the end see only the pixels that exist. A distributed caller must hand in blocks whose
    starts are multiples of ``factor``."""
    xp = array_module(labels)
    nsp = labels.ndim - 1
    f = per_dim(factor, nsp, "factor")
    out = tuple(-(-n // fi) for n, fi in zip(labels.shape[1:], f))
    if any(o * fi != n for o, fi, n in zip(out, f, labels.shape[1:])):
        if labels.dtype == numpy.bool_:
            low = False
        elif numpy.issubdtype(labels.dtype, numpy.integer):
            low = numpy.iinfo(labels.dtype).min
        else:
            low = -numpy.inf
        padded = xp.full((labels.shape[0],) + tuple(o * fi for o, fi in zip(out, f)), low,
                         dtype=labels.dtype)
        padded[(slice(None),) + tuple(slice(0, n) for n in labels.shape[1:])] = labels
        labels = padded
    # one dimension at a time, first to last: the early reductions combine whole contiguous rows (fast),
    # and the last one, over a short innermost axis, runs on an array already f times smaller than one
    # reduction over both axes would read
    for i, fi in enumerate(f):
        if fi > 1:
            sh = labels.shape
            labels = labels.reshape(sh[:1 + i] + (out[i], fi) + sh[2 + i:]).max(axis=2 + i)
    return labels


def predictions(logits):
    """Predicted class per term (first maximum on ties, like ``torch.argmax``)."""
    return logits.argmax(axis=1)


def correct_count(logits, labels):
    """Number of argmax predictions equal to integer labels, as a 0-d int64 array of the logits' array
    module (no host synchronisation on a GPU)."""
    xp = array_module(logits)
    return (predictions(logits) == labels).sum(dtype=xp.int64)


def accuracy_counts(logits, labels):
    """``(correct, total)`` local counts (ints) of argmax predictions equal to integer labels. Converts to
    host ints (a host synchronisation on a GPU): a training step reads them off the diagonal of
    :func:`iou_counts`, on the device."""
    return int(correct_count(logits, labels)), int(labels.size)


def iou_counts(logits, labels, num_classes=None):
    """Per-class ``(tp, fp, fn)`` int64 arrays ``(K,)`` of argmax predictions against integer labels, to be
    summed over ranks; IoU of class k is ``tp / (tp + fp + fn)``."""
    xp = array_module(logits)
    k = logits.shape[1] if num_classes is None else int(num_classes)
    idx = labels.astype(xp.int64).ravel()  # a copy (the caller's labels stay as they are)
    idx *= k
    idx += predictions(logits).ravel()
    conf = _counts(xp, idx, k * k).reshape(k, k)  # rows: label, columns: prediction
    tp = xp.diagonal(conf).copy()
    return tp, conf.sum(axis=0) - tp, conf.sum(axis=1) - tp


def _counts(xp, idx, size: int):
    """``bincount(idx, minlength=size)`` of indices known to lie in ``[0, size)``. CuPy's bincount reads the
    indices' range on the host (a wait for the device every step, seen on a real GPU); on the device the
    counts are an atomic scatter-add instead (``uint64``: a type CUDA's atomicAdd takes)."""
    if xp is numpy:
        return numpy.bincount(idx, minlength=size)
    counts = xp.zeros(size, dtype=xp.uint64)
    xp.add.at(counts, idx, xp.ones(idx.shape, dtype=xp.uint64))
    return counts.astype(xp.int64)


def iou(tp, fp, fn):
    """Per-class intersection over union from reduced counts (NaN where a class never occurs)."""
    xp = array_module(tp)
    denom = (tp + fp + fn).astype(xp.float64)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        return xp.where(denom > 0, tp / xp.where(denom > 0, denom, 1.0), xp.nan)


# -- regression, binary and overlap losses (model.loss mse, l1, bce_with_logits, dice) ----------------------
# Each returns this block's partial sum and the block's exact share of the gradient of the *global* mean,
# like :func:`cross_entropy`: the caller reduces the partial sums over the ranks of a batch.


def mse(outputs, targets, global_count):
    """Squared error -> ``(partial_sum, doutputs)``: ``sum((x - y)^2)`` of this block (float64, 0-d) and
    ``2 (x - y) / global_count``; ``targets`` have the outputs' shape and dtype."""
    d = outputs - targets
    loss = (d * d).sum(dtype=numpy.float64)
    d *= outputs.dtype.type(2) / outputs.dtype.type(global_count)
    return loss, d


def l1(outputs, targets, global_count):
    """Absolute error -> ``(partial_sum, doutputs)``: ``sum(|x - y|)`` and ``sign(x - y) / global_count``
    (0 where ``x == y``, as PyTorch's ``l1_loss`` differentiates)."""
    xp = array_module(outputs)
    d = outputs - targets
    loss = xp.abs(d).sum(dtype=numpy.float64)
    g = xp.sign(d)
    g /= outputs.dtype.type(global_count)
    return loss, g


def bce_with_logits(logits, targets, global_count):
    """Binary cross-entropy on logits -> ``(partial_sum, dlogits, correct)``. Per term
    ``max(x, 0) - x y + log(1 + exp(-|x|))`` (no overflow for any ``x``); ``dlogits = (sigmoid(x) - y) /
    global_count``; ``correct`` counts ``x > 0`` agreeing with ``y > 0.5`` (accuracy at probability 0.5), a
    0-d int64 array of the logits' module."""
    xp = array_module(logits)
    dt = logits.dtype.type
    e = xp.exp(-xp.abs(logits))
    loss = (xp.maximum(logits, dt(0)) - logits * targets + xp.log1p(e)).sum(dtype=numpy.float64)
    pos = logits >= 0
    sig = xp.where(pos, dt(1), e) / (dt(1) + e)
    sig -= targets
    sig /= dt(global_count)
    correct = ((logits > 0) == (targets > dt(0.5))).sum(dtype=xp.int64)
    return loss, sig, correct


DICE_SMOOTH = 1e-5  # MONAI DiceLoss's smooth_nr and smooth_dr defaults


def softmax(logits):
    """Softmax over axis 1 (the classes)."""
    xp = array_module(logits)
    e = xp.exp(logits - logits.max(axis=1, keepdims=True))
    e /= e.sum(axis=1, keepdims=True)
    return e


def dice_sums(logits, labels):
    """Soft Dice's statistics of a block: ``(probabilities, onehot, sums)`` with ``sums`` float64
    ``(n, K, 3)``: per sample and class the block's ``sum(p t)``, ``sum(p)`` and ``sum(t)`` over its pixels
    (``p`` the softmax over classes, ``t`` the one-hot integer labels ``(n, *spatial)``). Sums over the
    pixels of the whole domain are these summed over the ranks that split the space."""
    xp = array_module(logits)
    p = softmax(logits)
    onehot = labels[:, None] == _class_ids(xp, logits.shape[1], logits.ndim)
    axes = tuple(range(2, logits.ndim))
    sums = xp.empty(tuple(logits.shape[:2]) + (3,), dtype=numpy.float64)
    sums[..., 0] = xp.where(onehot, p, p.dtype.type(0)).sum(axis=axes, dtype=numpy.float64)
    sums[..., 1] = p.sum(axis=axes, dtype=numpy.float64)
    sums[..., 2] = onehot.sum(axis=axes, dtype=numpy.float64)
    return p, onehot, sums


def dice_terms(sums, smooth=DICE_SMOOTH):
    """Per (sample, class) Dice coefficients ``(2 I + s) / (P + T + s)`` from *global* sums ``(..., 3)``."""
    return (2 * sums[..., 0] + smooth) / (sums[..., 1] + sums[..., 2] + smooth)


def dice_grad(p, onehot, sums, terms: int, smooth=DICE_SMOOTH):
    """d/dlogits of ``mean(1 - dice_terms)`` over ``terms`` (sample, class) pairs for the block whose
    probabilities and one-hot labels are ``p``, ``onehot``, given the *global* sums ``(n, K, 3)`` of its
    samples: with ``D = P + T + s``, ``dL/dp = ((2 I + s) / D^2 - 2 t / D) / terms``, then through the
    softmax, ``p (g - sum_k p g)``."""
    bcast = (slice(None), slice(None)) + (None,) * (p.ndim - 2)
    den = sums[..., 1] + sums[..., 2] + smooth
    a = (2.0 / (den * terms)).astype(p.dtype)[bcast]
    b = ((2 * sums[..., 0] + smooth) / (den * den * terms)).astype(p.dtype)[bcast]
    g = b - a * onehot.astype(p.dtype)
    g -= (p * g).sum(axis=1, keepdims=True)
    g *= p
    return g
