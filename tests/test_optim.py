"""Optimizers against torch.optim (float64) and the learning-rate schedules against their formulas."""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lbannpy.dist import Distribution
from lbannpy.layers.param import Param
from lbannpy.config import ConfigError
from lbannpy.optim import learning_rate, make_optimizer


@dataclass(frozen=True)
class OptCase:
    name: str
    cfg: tuple  # (key, value) pairs of the optimizer config

    def config(self) -> dict:
        return dict(self.cfg)


CASES = [
    OptCase("sgd", (("type", "sgd"), ("lr", 0.1))),
    OptCase("sgd-momentum-wd", (("type", "sgd"), ("lr", 0.05), ("momentum", 0.9), ("weight_decay", 1e-2))),
    OptCase("sgd-nesterov", (("type", "sgd"), ("lr", 0.05), ("momentum", 0.8), ("nesterov", True))),
    OptCase("adam", (("type", "adam"), ("lr", 1e-2))),
    OptCase("adam-wd", (("type", "adam"), ("lr", 3e-3), ("betas", [0.8, 0.99]), ("eps", 1e-6),
                        ("weight_decay", 1e-3))),
]


def _torch_optimizer(cfg, params):
    if cfg["type"] == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], momentum=cfg.get("momentum", 0.0),
                               nesterov=cfg.get("nesterov", False), weight_decay=cfg.get("weight_decay", 0.0))
    return torch.optim.Adam(params, lr=cfg["lr"], betas=cfg.get("betas", (0.9, 0.999)),
                            eps=cfg.get("eps", 1e-8), weight_decay=cfg.get("weight_decay", 0.0))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_optimizer_matches_torch(case):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((4, 3))
    d = Distribution.whole(2, 1)
    p = Param("w", w0.shape, ((0, 4), (0, 3)), w0.copy(), np.zeros_like(w0), d, ())
    opt = make_optimizer(case.config(), [p], total_steps=10)
    tw = torch.tensor(w0.copy(), requires_grad=True)
    topt = _torch_optimizer(case.config(), [tw])
    for step in range(6):
        g = rng.standard_normal(w0.shape)
        opt.zero_grad()
        p.grad += g
        opt.step()
        topt.zero_grad()
        tw.grad = torch.tensor(g)
        topt.step()
        np.testing.assert_allclose(p.value, tw.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_state_is_created_at_set_up_and_updated_in_place(case):
    """A step never binds a new state buffer (a captured step would keep updating the old one)."""
    rng = np.random.default_rng(3)
    p = Param("w", (4, 3), ((0, 4), (0, 3)), rng.standard_normal((4, 3)), np.zeros((4, 3)),
              Distribution.whole(2, 1), ())
    opt = make_optimizer(case.config(), [p], total_steps=10)
    assert sorted(opt.state["w"]) == opt.slot_names()
    before = dict(opt.state["w"])
    assert all(not a.any() for a in before.values())
    for _ in range(3):
        p.grad[...] = rng.standard_normal((4, 3))
        opt.step()
    assert opt.state["w"].keys() == before.keys()
    assert all(opt.state["w"][k] is a and a.any() for k, a in before.items())


@pytest.mark.parametrize("case", CASES[:3], ids=[c.name for c in CASES[:3]])
def test_large_parameters_are_updated_in_pieces_bit_for_bit(case, monkeypatch):
    # a parameter larger than a piece (plus a ragged end): the same float32 bits as one whole-array update
    import lbannpy.optim as optim

    rng = np.random.default_rng(1)
    shape = (3, optim.PIECE // 2 + 7)
    w0 = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    d = Distribution.whole(2, 1)
    out = []
    for piece in (optim.PIECE, 10**12):  # in pieces, then whole
        monkeypatch.setattr(optim, "PIECE", piece)
        p = Param("w", shape, tuple((0, n) for n in shape), w0.copy(), np.zeros_like(w0), d, ())
        opt = make_optimizer(case.config(), [p], total_steps=10)
        for g in grads:
            opt.zero_grad()
            p.grad += g
            opt.step()
        out.append(p.value)
    assert out[0].dtype == np.float32 and np.array_equal(out[0], out[1])


def test_device_sum_of_squares_in_float64_groups():
    """The device path's Σ g² over every gradient: groups concatenated up to the group size (an array
    larger than a group stands alone), float64 throughout, one element; against a float64 sum."""
    from lbannpy.training.gradsync import device_sum_squares

    rng = np.random.default_rng(2)
    grads = [(rng.standard_normal(n) * 1e3).astype(np.float32).reshape(-1, 1) for n in (5, 70, 3, 200, 9, 1)]
    want = sum(float(np.dot(g.ravel().astype(np.float64), g.ravel().astype(np.float64))) for g in grads)
    for group in (1, 8, 75, 100, 1000):
        got = device_sum_squares(np, grads, group=group)
        assert got.shape == (1,) and got.dtype == np.float64
        assert float(got[0]) == pytest.approx(want, rel=1e-14)
    concat = []
    def concatenate(arrays):
        concat.append(len(arrays))
        return np.concatenate(arrays)

    xp = types.SimpleNamespace(zeros=np.zeros, float64=np.float64, dot=np.dot, concatenate=concatenate)
    assert float(device_sum_squares(xp, grads, group=80)[0]) == pytest.approx(want, rel=1e-14)
    assert concat == [3, 2]  # 5+70+3 | 200 alone, not concatenated | 9+1


def test_defaults_are_the_schema_s_and_adam_s_learning_rate_is_torch_s():
    """One place states a default (the schema); Adam's learning rate defaults to PyTorch's 1e-3, SGD's to
    0.01, as a validated spec's do."""
    from lbannpy.config import validate

    p = Param("w", (3, 1), ((0, 3), (0, 1)), np.zeros((3, 1)), np.zeros((3, 1)), Distribution.whole(2, 1), ())
    adam = make_optimizer({"type": "adam"}, [p], 10)
    assert adam.base_lr == torch.optim.Adam([torch.zeros(1, requires_grad=True)]).defaults["lr"] == 1e-3
    assert make_optimizer({"type": "sgd"}, [p], 10).base_lr == 0.01
    spec = {"model": {"input": {"channels": 1, "spatial": [4]}, "layers": [{"name": "f", "type": "fc",
                                                                           "units": 2}]},
            "data": {"train": {"path": "x.h5"}}, "optimizer": {"type": "adam"}}
    assert validate(spec, data=False, memory=False)["optimizer"]["lr"] == 1e-3


def test_schedules():
    assert learning_rate(0.1, 5, 100, None) == 0.1
    warm = {"type": "none", "warmup_steps": 4}
    got = [learning_rate(0.1, s, 100, warm) for s in range(5)]
    assert got == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])
    step = {"type": "step", "step_size": 3, "gamma": 0.5}
    assert [learning_rate(1.0, s, 100, step) for s in range(7)] == pytest.approx([1, 1, 1, .5, .5, .5, .25])
    cos = {"type": "cosine", "warmup_steps": 2}
    total = 12
    got = [learning_rate(1.0, s, total, cos) for s in range(total)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 10)) for s in range(2, total)]
    assert got == pytest.approx(want)
    with pytest.raises(ConfigError, match="unknown value 'exp'"):  # checked by the schema, as a spec's
        learning_rate(1.0, 0, 10, {"type": "exp"})


def test_a_lazy_gradient_is_overwritten_by_the_first_contribution_and_zeroed_when_none_comes():
    """``zero_grad`` marks a lazy parameter's gradient stale instead of writing zeros; the step's first
    contribution overwrites it (``accumulate`` or ``grad_into``), later ones add; a step with none reads
    zeros (the optimizer settles it). An eager parameter is zeroed as before."""
    d = Distribution.whole(2, 1)
    lazy = Param("lazy", (2, 3), ((0, 2), (0, 3)), np.ones((2, 3)), np.full((2, 3), 7.0), d, (), lazy=True)
    eager = Param("eager", (2, 3), ((0, 2), (0, 3)), np.ones((2, 3)), np.full((2, 3), 7.0), d, ())
    opt = make_optimizer({"type": "sgd", "lr": 0.5}, [lazy, eager], total_steps=10)
    g1, g2 = np.full((2, 3), 2.0), np.arange(6.0).reshape(2, 3)
    opt.zero_grad()
    assert lazy.stale and np.all(lazy.grad == 7.0), "no pass over a lazy gradient"
    assert not eager.stale and np.all(eager.grad == 0.0)
    lazy.accumulate(g1)
    lazy.accumulate(g2)
    np.testing.assert_array_equal(lazy.grad, g1 + g2)
    opt.zero_grad()
    into = lazy.grad_into()
    assert into is lazy.grad and not lazy.stale and lazy.grad_into() is None
    into[...] = g2
    lazy.accumulate(g1)
    np.testing.assert_array_equal(lazy.grad, g1 + g2)
    opt.zero_grad()  # no contribution this step: the update reads zeros, the value stays
    opt.step()
    np.testing.assert_array_equal(lazy.grad, np.zeros((2, 3)))
    np.testing.assert_array_equal(lazy.value, np.ones((2, 3)))


def test_the_overlap_engine_zeroes_a_stale_gradient_before_reducing_it():
    """A lazy parameter whose layer made no contribution this step reaches the reduction as zeros, not as
    last step's values."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.comm.overlap import OverlapEngine

    d = Distribution.whole(2, 1)
    ps = [Param(f"l{i}.w", (2, 2), ((0, 2), (0, 2)), np.ones((2, 2)), np.full((2, 2), 5.0), d, (), lazy=True)
          for i in range(2)]
    eng = OverlapEngine(ps, [SingleCommunicator()] * 2, bucket_bytes=16, first_bucket_bytes=16, overlap=False)
    try:
        eng.start_step()
        for p in ps:
            p.stale = True
        ps[1].accumulate(np.full((2, 2), 3.0))
        seen = []
        eng.finish(on_bucket=lambda params: seen.extend((p.name, p.grad.copy()) for p in params))
        got = dict(seen)
        np.testing.assert_array_equal(got["l0.w"], np.zeros((2, 2)))
        np.testing.assert_array_equal(got["l1.w"], np.full((2, 2), 3.0))
    finally:
        eng.close()


@pytest.mark.parametrize("sizes", [[10], [7, 3 * 2**16 + 5, 1, 2**16, 2**16 - 7, 123456]])
def test_packed_gradient_sum_of_squares_over_many_arrays(sizes):
    """The logged step's gradient norm packs every gradient into one float64 buffer: across buffer edges,
    for arrays smaller and larger than the buffer, it is the float64 sum of squares."""
    from lbannpy.training.gradsync import packed_sum_squares

    rng = np.random.default_rng(3)
    arrays = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32) for n in sizes]
    arrays[-1] = arrays[-1].reshape(-1, 2) if arrays[-1].size % 2 == 0 else arrays[-1]
    want = sum(float(np.dot(a.ravel().astype(np.float64), a.ravel().astype(np.float64))) for a in arrays)
    buf = np.full(2**16, np.nan)
    assert packed_sum_squares(arrays, buf) == pytest.approx(want, rel=1e-13)
    assert packed_sum_squares([], buf) == 0.0
