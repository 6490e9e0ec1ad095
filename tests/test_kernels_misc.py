"""Element-wise kernels (ReLU, leaky ReLU, dropout) and fully-connected GEMMs against PyTorch (float64)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close
from lbannpy.layers.kernels import (dropout_backward, dropout_forward, dropout_mask, fc_backward_bias,
                                    fc_backward_data, fc_backward_filter, fc_forward, leaky_relu_backward,
                                    leaky_relu_forward, relu_backward, relu_forward)


@dataclass(frozen=True)
class ActCase:
    name: str
    slope: float = 0.0

    @property
    def id(self) -> str:
        return self.name + (f"-{self.slope:g}" if self.slope else "")


@pytest.mark.parametrize("case", [ActCase("relu"), ActCase("leaky", 0.01), ActCase("leaky", 0.2)],
                         ids=lambda c: c.id)
def test_activation_matches_torch(case):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 17, 23))
    x[0, 0, 0, :4] = 0.0  # the kink: PyTorch's subgradient at 0
    dy = rng.standard_normal(x.shape)
    xt = torch.tensor(x, requires_grad=True)
    yt = F.relu(xt) if case.name == "relu" else F.leaky_relu(xt, case.slope)
    yt.backward(torch.tensor(dy))
    if case.name == "relu":
        y, dx = relu_forward(x), relu_backward(dy, x)
    else:
        y, dx = leaky_relu_forward(x, case.slope), leaky_relu_backward(dy, x, case.slope)
    assert_close(y, yt.detach().numpy())
    assert_close(dx, xt.grad.numpy())


def test_activations_on_non_finite_values_match_torch():
    x = np.array([-np.inf, np.inf, np.nan, -0.0, 0.0, -2.0])
    np.testing.assert_array_equal(relu_forward(x), F.relu(torch.tensor(x)).numpy())
    np.testing.assert_array_equal(leaky_relu_forward(x, 0.1), F.leaky_relu(torch.tensor(x), 0.1).numpy())


@dataclass(frozen=True)
class FCCase:
    batch: int
    n_in: int
    n_out: int
    bias: bool

    @property
    def id(self) -> str:
        return f"{self.batch}x{self.n_in}->{self.n_out}{'' if self.bias else '-nobias'}"


@pytest.mark.parametrize("case", [FCCase(3, 17, 5, True), FCCase(1, 23, 7, False), FCCase(8, 5, 11, True)],
                         ids=lambda c: c.id)
def test_fc_matches_torch(case):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((case.batch, case.n_in)), rng.standard_normal((case.n_out, case.n_in))
    b = rng.standard_normal(case.n_out) if case.bias else None
    dy = rng.standard_normal((case.batch, case.n_out))
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if case.bias else None
    yt = F.linear(xt, wt, bt)
    yt.backward(torch.tensor(dy))
    assert_close(fc_forward(x, w, b), yt.detach().numpy())
    assert_close(fc_backward_data(dy, w), xt.grad.numpy())
    assert_close(fc_backward_filter(x, dy), wt.grad.numpy())
    if case.bias:
        assert_close(fc_backward_bias(dy), bt.grad.numpy())


@dataclass(frozen=True)
class DropoutCase:
    shape: tuple
    split_axis: int
    pieces: int
    p: float

    @property
    def id(self) -> str:
        return f"{'x'.join(map(str, self.shape))}-axis{self.split_axis}-{self.pieces}-p{self.p:g}"


@pytest.mark.parametrize("case", [DropoutCase((3, 5, 17, 23), 2, 3, 0.5),
                                  DropoutCase((3, 5, 17, 23), 0, 3, 0.1),
                                  DropoutCase((2, 4, 7, 9, 11), 4, 2, 0.3), DropoutCase((6, 33), 1, 4, 0.5)],
                         ids=lambda c: c.id)
def test_dropout_mask_does_not_depend_on_the_split(case):
    full_box = tuple((0, n) for n in case.shape)
    full = dropout_mask(7, 11, 3, full_box, case.p, dtype=np.float64)
    edges = np.linspace(0, case.shape[case.split_axis], case.pieces + 1).astype(int)
    blocks = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        box = list(full_box)
        box[case.split_axis] = (int(lo), int(hi))
        blocks.append(dropout_mask(7, 11, 3, tuple(box), case.p, dtype=np.float64))
    np.testing.assert_array_equal(np.concatenate(blocks, case.split_axis), full)
    np.testing.assert_array_equal(np.unique(full), [0.0, 1.0 / (1.0 - case.p)])


def test_dropout_mask_statistics_and_keys():
    box = ((0, 8), (0, 16), (0, 64), (0, 64))
    m = dropout_mask(1, 0, 0, box, 0.3)
    n = m.size
    keep = float((m > 0).mean())
    assert abs(keep - 0.7) < 5 * np.sqrt(0.21 / n), keep  # five standard deviations
    assert m.dtype == np.float32 and abs(float(m.mean(dtype=np.float64)) - 1.0) < 0.01
    # neighbouring elements are uncorrelated
    k = (m > 0).astype(np.float64).ravel()
    corr = np.corrcoef(k[:-1], k[1:])[0, 1]
    assert abs(corr) < 5 / np.sqrt(n), corr
    # every key changes the mask
    others = [dropout_mask(*keys, box, 0.3) for keys in ((2, 0, 0), (1, 1, 0), (1, 0, 1))]
    for other in others:
        assert 0.35 < float(((other > 0) != (m > 0)).mean()) < 0.49  # 2 * 0.7 * 0.3 = 0.42 expected
    assert not dropout_mask(1, 0, 0, box, 1.0).any()
    assert (dropout_mask(1, 0, 0, box, 0.0) == 1).all()


def test_dropout_forward_backward():
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((3, 5, 17, 23)), rng.standard_normal((3, 5, 17, 23))
    m = dropout_mask(3, 4, 5, tuple((0, n) for n in x.shape), 0.25, dtype=np.float64)
    np.testing.assert_array_equal(dropout_forward(x, m), np.where(m > 0, x * (1 / 0.75), 0.0))
    np.testing.assert_array_equal(dropout_backward(dy, m), np.where(m > 0, dy * (1 / 0.75), 0.0))
    with pytest.raises(ValueError):
        dropout_mask(1, 0, 0, ((0, 4),), 1.5)
