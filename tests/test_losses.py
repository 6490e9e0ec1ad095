"""The losses of ``model.loss`` beyond cross-entropy (mse, l1, bce_with_logits, dice) against PyTorch in
float64 (1e-10 relative): the kernels summed over blocks as over ranks, and the Loss class on one process
(forward, gradient, metrics); their checks and the labels each reads (:func:`label_form`)."""
from __future__ import annotations

import numpy as np
import pytest

from kernel_util import assert_close
from loss_refs import KINDS, draw, torch_loss
from lbannpy.comm import SingleCommunicator
from lbannpy.dist import Distribution
from lbannpy.layers.base import LayerError
from lbannpy.layers.context import LayerContext
from lbannpy.layers.kernels import loss as KL
from lbannpy.layers.loss import Loss, label_form
from lbannpy.layers.registry import ShapeError, loss_specs
from lbannpy.tensor import DistTensor

SHAPES = [(6, 3), (3, 4, 7, 9), (2, 3, 5, 4, 6), (4, 2, 11)]


def _one_rank(kind, out, labels):
    ctx = LayerContext(SingleCommunicator(), np, "float64", seed=0)
    dist = Distribution.whole(out.ndim, 1)
    loss = Loss(kind, ctx, out.shape, dist)
    value, metrics = loss.forward(DistTensor(out, out.shape, dist, 0), labels)
    return loss, value, metrics, loss.backward().local


@pytest.mark.parametrize("kind,shape", [(k, s) for k in KINDS for s in SHAPES if k != "dice" or len(s) > 2],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_loss_matches_torch(kind, shape):
    out, labels = draw(kind, shape)
    want, grad = torch_loss(kind, out, labels)
    loss, value, metrics, got = _one_rank(kind, out, labels)
    assert type(loss).__name__ == ("DiceLoss" if kind == "dice" else "ElementwiseLoss")
    assert_close(value, want)
    assert_close(got, grad)
    assert metrics["loss"] == value


@pytest.mark.parametrize("kind", ["mse", "l1", "bce_with_logits"])
def test_elementwise_kernels_sum_over_blocks(kind):
    """Blocks of any dimension (as ranks hold them): partial sums add up to the global sum and each
    block's gradient is its part of the global one."""
    out, y = draw(kind, (4, 3, 6, 5), seed=1)
    want, grad = torch_loss(kind, out, y)
    fn = getattr(KL, kind)
    total, g = 0.0, np.empty_like(out)
    for sl in [np.s_[:1], np.s_[1:, :2, :4], np.s_[1:, :2, 4:], np.s_[1:, 2:]]:
        res = fn(out[sl], y[sl], out.size)
        total += float(res[0])
        g[sl] = res[1]
    assert_close(total / out.size, want)
    assert_close(g, grad)


def test_dice_kernels_from_global_sums():
    """Per-block sums added over a spatial split give the global ones; each block's gradient from them is
    its part of MONAI's."""
    out, y = draw("dice", (3, 4, 8, 6), seed=2)
    want, grad = torch_loss("dice", out, y)
    blocks = [np.s_[:, :, :3], np.s_[:, :, 3:]]
    parts = [KL.dice_sums(out[sl], y[(sl[0],) + sl[2:]]) for sl in blocks]
    sums = sum(p[2] for p in parts)
    assert_close(np.mean(1 - KL.dice_terms(sums)), want)
    g = np.empty_like(out)
    for sl, (p, onehot, _) in zip(blocks, parts):
        g[sl] = KL.dice_grad(p, onehot, sums, 3 * 4)
    assert_close(g, grad)


def test_bce_is_stable_and_counts_predictions_at_one_half():
    x = np.array([[800.0, -800.0, 0.3, -0.2]])
    y = np.array([[1.0, 0.0, 0.0, 0.6]])
    loss, g, correct = KL.bce_with_logits(x, y, 4)
    want, grad = torch_loss("bce_with_logits", x, y)
    assert np.isfinite(float(loss)) and np.isfinite(g).all()
    assert_close(float(loss) / 4, want)
    assert_close(g, grad)
    assert int(correct) == 2
    _, _, metrics, _ = _one_rank("bce_with_logits", x, y)
    assert metrics["accuracy"] == 0.5


def test_dice_metrics_of_a_perfect_prediction():
    y = np.random.default_rng(3).integers(0, 3, (2, 5, 5))
    out = 40.0 * (np.eye(3)[y].transpose(0, 3, 1, 2) - 0.5)
    _, value, metrics, _ = _one_rank("dice", out, y)
    assert metrics["dice"] == 1.0 and value < 1e-9
    assert set(metrics) == {"loss", "dice"}


def test_metrics_per_kind():
    for kind, keys in (("mse", {"loss"}), ("l1", {"loss"}), ("bce_with_logits", {"loss", "accuracy"})):
        out, y = draw(kind, (4, 2, 3))
        assert set(_one_rank(kind, out, y)[2]) == keys


def test_wrong_targets_and_labels_are_refused():
    out, y = draw("mse", (4, 2, 3, 3))
    with pytest.raises(LayerError, match=r"targets have shape \(4, 2, 3\)"):
        _one_rank("mse", out, y[..., 0])
    with pytest.raises(LayerError, match="labels have shape"):
        _one_rank("dice", out, np.zeros((4, 3), np.int64))
    with pytest.raises(Exception, match=r"labels must lie in \[0, 2\)"):
        _one_rank("dice", out, np.full((4, 3, 3), 2))
    with pytest.raises(LayerError, match="unknown loss 'huber'; use one of cross_entropy"):
        Loss("huber", None, (1, 1), Distribution.whole(2, 1))


def test_loss_specs_check_the_output_and_say_what_labels_they_read():
    specs = loss_specs()
    assert {"mse", "l1", "bce_with_logits", "dice"} <= set(specs)
    for kind in ("mse", "l1", "bce_with_logits"):
        specs[kind].check("m", "last", (4, 3))
        specs[kind].check("m", "last", (4, 3, 8, 8))
    with pytest.raises(ShapeError, match="loss dice needs a \\(N, classes, spatial...\\) output"):
        specs["dice"].check("m", "last", (4, 3))
    f = label_form("mse", (16, 16), (2, 8, 8))
    assert f.shape == (2, 8, 8) and f.floating and f.classes is None and not f.unit_range
    assert label_form("bce_with_logits", (8,), (1, 8)).unit_range
    f = label_form("dice", (16, 16), (3, 8, 8))
    assert f.shape == (8, 8) and not f.floating and f.classes == 3
    assert label_form("pixel_cross_entropy", (16, 16), (3, 8, 8)).shape == (16, 16)
    assert label_form("cross_entropy", (16, 16), (3,)).shape == ()
