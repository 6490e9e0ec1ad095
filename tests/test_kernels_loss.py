"""Losses and metric partial counts against PyTorch / direct loops (float64 to 1e-10)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.layers.kernels import (KernelShapeError, accuracy_counts, cross_entropy, downsample_labels_any,
                                    iou, iou_counts, pixel_cross_entropy, softmax_cross_entropy)


@dataclass(frozen=True)
class CECase:
    logits_shape: tuple
    pieces: int  # the batch split into this many sample blocks, as over sample-parallel ranks
    soft: bool = False

    @property
    def id(self) -> str:
        return f"{'x'.join(map(str, self.logits_shape))}-split{self.pieces}{'-soft' if self.soft else ''}"


@pytest.mark.parametrize("case", [CECase((6, 10), 1), CECase((6, 10), 3), CECase((3, 4, 17, 23), 3),
                                  CECase((2, 3, 7, 9, 11), 2), CECase((5, 7), 1, soft=True)],
                         ids=lambda c: c.id)
def test_cross_entropy_matches_torch(case):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(case.logits_shape) * 3.0
    k = case.logits_shape[1]
    if case.soft:
        labels = rng.random(case.logits_shape)
        labels /= labels.sum(axis=1, keepdims=True)
        lt = torch.tensor(labels)
    else:
        labels = rng.integers(0, k, (case.logits_shape[0],) + case.logits_shape[2:])
        lt = torch.tensor(labels)
    xt = torch.tensor(logits, requires_grad=True)
    loss_t = F.cross_entropy(xt, lt)
    loss_t.backward()
    count = labels.size // (k if case.soft else 1)
    fn = softmax_cross_entropy if logits.ndim == 2 else pixel_cross_entropy
    blocks = zip(np.array_split(logits, case.pieces), np.array_split(labels, case.pieces))
    parts = [fn(lb, lab, count) for lb, lab in blocks]
    loss = sum(p[0] for p in parts) / count
    assert_close(loss, loss_t.detach().numpy())
    assert_close(np.concatenate([p[1] for p in parts]), xt.grad.numpy())


def test_cross_entropy_is_stable_for_large_logits_and_checks_labels():
    logits = np.array([[1000.0, 0.0, -1000.0]])
    loss, d = cross_entropy(logits, np.array([1]), 1)
    assert np.isfinite(loss) and abs(float(loss) - 1000.0) < 1e-9
    assert np.isfinite(d).all()
    with pytest.raises(KernelShapeError):
        cross_entropy(logits, np.array([3]), 1)
    with pytest.raises(KernelShapeError):
        cross_entropy(logits, np.array([0, 1]), 1)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.int8, np.bool_])
def test_float32_cross_entropy_with_any_integer_labels_matches_torch(dtype):
    """Labels as a reader hands them (any integer width, signed or not, or a 0/1 mask): the same float32 loss
    and gradient as PyTorch's, and out-of-range labels refused."""
    rng = np.random.default_rng(4)
    k = 2 if dtype is np.bool_ else 5
    logits = (rng.standard_normal((4, k, 6, 7)) * 4.0).astype(np.float32)
    labels = rng.integers(0, k, (4, 6, 7)).astype(dtype)
    xt = torch.tensor(logits, requires_grad=True)
    loss_t = F.cross_entropy(xt, torch.tensor(labels.astype(np.int64)), reduction="sum")
    loss_t.backward()
    loss, d = pixel_cross_entropy(logits, labels, 1)
    assert loss.dtype == np.float64 and d.dtype == np.float32
    np.testing.assert_allclose(float(loss), loss_t.item(), rtol=1e-6)
    np.testing.assert_allclose(d, xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    if dtype is not np.bool_:
        bad = labels.copy()
        bad[1, 2, 3] = k
        with pytest.raises(KernelShapeError, match=rf"\[0, {k}\), got \[0, {k}\]"):
            pixel_cross_entropy(logits, bad, 1)
    if np.issubdtype(dtype, np.signedinteger):
        bad = labels.copy()
        bad[0, 0, 0] = -1
        with pytest.raises(KernelShapeError, match=r"got \[-1, "):
            pixel_cross_entropy(logits, bad, 1)


def test_in_class_range_reads_negative_labels_as_out_of_range():
    from lbannpy.layers.kernels.loss import in_class_range

    for dtype in (np.int64, np.int16, np.uint16, np.float32):
        a = np.arange(12, dtype=dtype).reshape(3, 4)[:, ::2]  # not contiguous
        assert in_class_range(a, 11) and not in_class_range(a, 10)
        if dtype != np.uint16:
            a[1, 1] = -1
            assert not in_class_range(a, 11)
    assert in_class_range(np.zeros((0,), np.int64), 1)
    assert in_class_range(np.array([True, False]), 2) and not in_class_range(np.array([True]), 1)
    assert not in_class_range(np.array([np.iinfo(np.int64).min]), 2)


def _downsample_loop(labels, f):
    n = labels.shape[0]
    out_shape = tuple(-(-s // fi) for s, fi in zip(labels.shape[1:], f))
    out = np.zeros((n,) + out_shape, dtype=labels.dtype)
    for idx in np.ndindex(*out.shape):
        sl = (idx[0],) + tuple(slice(o * fi, (o + 1) * fi) for o, fi in zip(idx[1:], f))
        out[idx] = labels[sl].max()
    return out


@dataclass(frozen=True)
class DownCase:
    shape: tuple
    factor: tuple
    classes: int

    @property
    def id(self) -> str:
        return f"{'x'.join(map(str, self.shape))}-f{'x'.join(map(str, self.factor))}-k{self.classes}"


@pytest.mark.parametrize("case", [DownCase((3, 17, 23), (2, 2), 2), DownCase((2, 16, 16), (4, 4), 2),
                                  DownCase((3, 17, 23), (3, 5), 4), DownCase((2, 7, 9, 11), (2, 2, 2), 2),
                                  DownCase((2, 64, 64), (8, 8), 2), DownCase((2, 8, 12, 10), (1, 4, 5), 3),
                                  DownCase((2, 12, 10), (3, 1), 4)],
                         ids=lambda c: c.id)
def test_downsample_labels_any(case):
    labels = (np.random.default_rng(1).random(case.shape) < 0.1 * case.classes).astype(np.int64)
    if case.classes > 2:
        labels *= np.random.default_rng(2).integers(1, case.classes, case.shape)
    got = downsample_labels_any(labels, case.factor)
    np.testing.assert_array_equal(got, _downsample_loop(labels, case.factor))
    if case.classes == 2:  # "a cell is positive if any input pixel under it is"
        t = torch.tensor(labels[:, None].astype(np.float64))
        pool = F.max_pool2d if len(case.factor) == 2 else F.max_pool3d
        ref = pool(t, case.factor, case.factor, ceil_mode=True)[:, 0].numpy().astype(np.int64)
        np.testing.assert_array_equal(got, ref)


def test_accuracy_and_iou_counts():
    rng = np.random.default_rng(3)
    k = 4
    logits = rng.standard_normal((3, k, 17, 23))
    logits[0, :, 0, 0] = 1.0  # a tie: argmax takes the first class
    labels = rng.integers(0, k, (3, 17, 23))
    pred = torch.tensor(logits).argmax(dim=1).numpy()
    assert pred[0, 0, 0] == 0
    parts = [iou_counts(lg, lb) for lg, lb in zip(np.array_split(logits, 3), np.array_split(labels, 3))]
    tp, fp, fn = (sum(p[i] for p in parts) for i in range(3))
    for c in range(k):
        assert tp[c] == np.sum((pred == c) & (labels == c))
        assert fp[c] == np.sum((pred == c) & (labels != c))
        assert fn[c] == np.sum((pred != c) & (labels == c))
    assert_close(iou(tp, fp, fn), tp / (tp + fp + fn))
    correct, total = accuracy_counts(logits, labels)
    assert (correct, total) == (int((pred == labels).sum()), labels.size)
    assert np.isnan(iou(np.array([0]), np.array([0]), np.array([0])))[0]
