"""The PyTorch float64 references of the losses (``model.loss``) and the random outputs and labels the loss
tests draw: shared by the serial tests (tests/test_losses.py) and the MPI tier (tests/mpi/test_losses.py).
Dice is MONAI's ``DiceLoss(softmax=True, to_onehot_y=True, include_background=True, smooth_nr=1e-5,
smooth_dr=1e-5, batch=False)`` written out in torch: MONAI is not a dependency of the tests."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

KINDS = ("mse", "l1", "bce_with_logits", "dice")
SMOOTH = 1e-5


def monai_dice(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """MONAI's soft Dice loss of logits ``x`` ``(N, K, *S)`` against integer labels ``(N, *S)``."""
    p = torch.softmax(x, dim=1)
    t = F.one_hot(labels, x.shape[1]).movedim(-1, 1).to(x.dtype)
    axes = tuple(range(2, x.ndim))
    inter = (p * t).sum(axes)
    den = p.sum(axes) + t.sum(axes)
    return (1.0 - (2.0 * inter + SMOOTH) / (den + SMOOTH)).mean()


def torch_loss(kind: str, out: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """``(loss, d loss / d out)`` of PyTorch in float64."""
    x = torch.tensor(out, dtype=torch.float64, requires_grad=True)
    y = torch.tensor(labels)
    if kind == "mse":
        loss = F.mse_loss(x, y.double())
    elif kind == "l1":
        loss = F.l1_loss(x, y.double())
    elif kind == "bce_with_logits":
        loss = F.binary_cross_entropy_with_logits(x, y.double())
    elif kind == "dice":
        loss = monai_dice(x, y.long())
    else:
        loss = F.cross_entropy(x, y.long())
    loss.backward()
    return float(loss.detach()), x.grad.numpy()


def draw(kind: str, shape: tuple, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random outputs of ``shape`` and labels for loss ``kind``: float targets of the same shape (in
    [0, 1] with exact 0s and 1s for bce), integer classes ``(N, *S)`` for dice and cross-entropy."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal(shape) * 2.0
    if kind in ("mse", "l1"):
        return out, rng.standard_normal(shape)
    if kind == "bce_with_logits":
        y = rng.random(shape)
        y.reshape(-1)[::7] = 0.0
        y.reshape(-1)[3::7] = 1.0
        return out, y
    return out, rng.integers(0, shape[1], (shape[0],) + tuple(shape[2:]))
