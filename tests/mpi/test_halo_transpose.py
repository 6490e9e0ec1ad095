"""The halo patterns of the transposed convolution and of upsampling, each on its own, by the dot-product
test at any rank count (float64): the distributed forward ``F`` and backward ``F*`` of the layer satisfy
``<F x, y> = <x, F* y>`` under every split of the samples and spatial dimensions whose degrees divide the
rank count (leftover ranks replicate), uneven blocks included. A transposed convolution's forward sends
its ghost output rows back to their owners (the accumulation of a convolution's halo) and its backward
fetches those rows of ``dL/dY``; upsampling fetches input rows forward and sends their gradients back.
Both directions are checked against each other, not against a reference, so a wrong piece of either (a
dropped corner, a ghost overwritten instead of added, an off-by-one window) shows as a gap.

The transposed convolution is also bilinear in its filter: ``<w, dL/dw> = <F_w x, y>`` checks the filter
gradient's partial sums over the split (each rank's piece of the window) the same way.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lbannpy.backend import to_numpy
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.tensor import DistTensor
from mpi_util import assert_all
from tensor_util import adjoint_gap

GAP = 1e-12

CONV_TRANSPOSE = [
    dict(kernel=3, stride=1, padding=1),
    dict(kernel=3, stride=2, padding=1, output_padding=1),
    dict(kernel=2, stride=2),
    dict(kernel=5, stride=3, padding=2, dilation=1, output_padding=2),
    dict(kernel=3, stride=2, dilation=2, groups=2),
]
UPSAMPLE = [
    dict(mode="nearest", scale=2),
    dict(mode="nearest", scale=3),
    dict(mode="linear", scale=2),
    dict(mode="linear", scale=3),
    dict(mode="linear", scale=2, align_corners=True),
    dict(mode="linear", scale=[3, 2], align_corners=True),
]
IMAGE = (3, 4, 7, 10)  # 3 samples: n degrees of 2 and 4 leave uneven or replicated blocks
VOLUME = (2, 2, 5, 4, 6)


def grids(ndim: int, size: int, dims=None) -> list[dict]:
    """Every split of the sample and spatial dimensions whose degrees multiply to a divisor of ``size``."""
    names = dims or (("n", "d", "h", "w") if ndim == 5 else ("n", "h", "w"))
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    out = []
    for degrees in itertools.product(divisors, repeat=len(names)):
        if size % math.prod(degrees) == 0:
            out.append({n: d for n, d in zip(names, degrees) if d > 1})
    return out


def _gaps(comm, xp, layer: dict, shape: tuple, par: dict) -> tuple[float, float]:
    """``(gap of <F x, y> = <x, F* y>, gap of <w, dL/dw> = <F x, y> or 0)`` of one layer under ``par``."""
    ctx = LayerContext(comm, xp, "float64", seed=3)
    spec = {"input": {"channels": shape[1], "spatial": list(shape[2:])}, "layers": [dict(layer)]}
    model = Model(spec, shape[0], ctx, {"default": par})
    lay = model.layers[0]
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape)
    y = rng.standard_normal(lay.out_shape)
    xt = DistTensor.scatter(xp.asarray(x), model.input_dist, comm)
    fx = model.forward(xt)
    yt = DistTensor.scatter(xp.asarray(y), fx.dist, comm)
    aty = model.backward(yt, input_grad=True)
    counted_out = fx.dist.copy_index(comm.rank) == 0
    counted_in = aty.dist.copy_index(comm.rank) == 0
    gap = adjoint_gap(comm, fx.local, yt.local, xt.local, aty.local, counted_out, counted_in)
    wgap = 0.0
    for p in lay.params:  # the filter (bias False): partial sums of dL/dw over the ranks of one replica
        p.settle()
        mine = float(np.vdot(to_numpy(p.value).ravel(), to_numpy(p.grad).ravel()))
        lhs = float(np.vdot(to_numpy(fx.local).ravel(), to_numpy(yt.local).ravel()))
        first = lay.out_dist.copy_index(comm.rank) == 0
        tot = comm.allreduce(np.array([mine if first else 0.0, lhs if counted_out else 0.0]))
        wgap = abs(tot[0] - tot[1]) / max(abs(tot[0]), abs(tot[1]), 1e-300)
    return gap, wgap


def _check(comm, xp, layers, shape, dims=None):
    bad, tried = [], 0
    for layer in layers:
        for par in grids(len(shape), comm.size, dims):
            if any(shape[{"n": 0, "c": 1, "d": 2, "h": -2, "w": -1}[d]] < k for d, k in par.items()):
                continue
            tried += 1
            gap, wgap = _gaps(comm, xp, layer, shape, par)
            if not (gap <= GAP and wgap <= GAP):
                bad.append(f"{layer} under {par or 'no split'}: <Fx,y> against <x,F*y> {gap:.2e}, "
                           f"<w,dw> against <Fx,y> {wgap:.2e}")
    assert_all(comm, tried > 0 and not bad, f"{tried} splits tried; " + "; ".join(bad[:6]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [IMAGE, VOLUME], ids=["2d", "3d"])
def test_conv_transpose_forward_and_backward_are_adjoint(comm, xp, shape):
    layers = [{"name": "t", "type": "conv_transpose", "filters": 4, "bias": False, **kw}
              for kw in CONV_TRANSPOSE]
    if len(shape) == 5:
        layers = layers[:3]
    _check(comm, xp, layers, shape)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [IMAGE, VOLUME], ids=["2d", "3d"])
def test_upsample_forward_and_backward_are_adjoint(comm, xp, shape):
    layers = [{"name": "u", "type": "upsample", **kw} for kw in UPSAMPLE]
    if len(shape) == 5:
        layers = [dict(lay, scale=2) for lay in layers[::2]]
    _check(comm, xp, layers, shape)
    if comm.size > 1:  # channels split beside space
        _check(comm, xp, layers[2:3], shape, ("c", "h"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [None, "channels_last"], ids=["calibrated", "channels-last"])
def test_conv_transpose_on_aten_kernels_matches_pytorch(comm, monkeypatch, layout):
    """Under ``runtime.kernels: aten`` the layer runs PyTorch's transposed convolution itself where space is
    whole (on channels-last copies of its operands where that layout is the one taken; as one matrix
    product each way where the stride is the kernel and the operands are NCHW), and ATen's convolutions on
    its windows where it is split: every case of the family equals PyTorch as with lbannpy's kernels."""
    pytest.importorskip("torch")
    from case_sets.transpose import cases
    from layer_cases import compare

    from lbannpy.layers.kernels import aten

    monkeypatch.setattr(aten, "LAYOUT", layout)
    tiled = []  # the stride-equals-kernel path (one matrix product each way), where NCHW operands take it
    for name in ("_tiles_forward", "_tiles_backward"):
        monkeypatch.setattr(aten, name, lambda *a, f=getattr(aten, name), **k: tiled.append(1) or f(*a, **k))
    bad, native, cl = [], 0, 0
    for case in cases(comm.size):
        if not case.name.startswith("convT"):
            continue
        models = []
        bad += compare(case, comm, kernels="aten", out=models)
        native += sum(bool(getattr(lay, "native", False)) for lay in models[0].layers)
        cl += sum(bool(getattr(lay, "native", False) and lay.channels_last) for lay in models[0].layers)
    ran = native > 0 and (layout is None) == (cl == 0) and (layout is not None or len(tiled) > 0)
    assert_all(comm, not bad and ran, "\n".join(bad) or f"{native} layer(s) ran ATen's transposed "
                                                         f"convolution, {cl} of them channels-last")


@pytest.mark.timeout(240)
def test_overlap_off_gives_identical_numbers(comm):
    """The interior computed while the halo messages travel, or after them: the same arithmetic in the same
    order, so the same bits (forward, input gradient, filter gradient), under every spatial split."""
    from layer_cases import Case, run_lbannpy

    layers = [{"name": "t", "type": "conv_transpose", "filters": 3, "kernel": 3, "stride": 2, "padding": 1,
               "output_padding": 1},
              {"name": "u", "type": "upsample", "mode": "linear"},
              {"name": "u", "type": "upsample", "mode": "linear", "align_corners": True, "scale": 3}]
    bad = []
    for layer in layers:
        for par in grids(4, comm.size, ("h", "w")):
            case = Case("overlap", (layer,), (2, 3, 12, 10), {"default": par})
            on, off = run_lbannpy(case, comm, overlap=True), run_lbannpy(case, comm, overlap=False)
            same = np.array_equal(on[0], off[0]) and np.array_equal(on[1], off[1]) and all(
                np.array_equal(on[2][k], off[2][k]) for k in on[2])
            if not same:
                bad.append(f"{layer['type']} under {par}")
    assert_all(comm, not bad, "overlap on and off differ: " + "; ".join(bad))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layer,phase", [
    ({"name": "u", "type": "upsample", "mode": "linear"}, "forward"),
    ({"name": "t", "type": "conv_transpose", "filters": 3, "kernel": 3, "padding": 1}, "backward")],
    ids=["upsample-forward", "conv_transpose-backward"])
def test_interior_runs_while_the_halo_exchange_is_in_flight(comm, layer, phase):
    """The pass that fetches rows (upsampling's forward, the transposed convolution's backward, which
    fetches dL/dY): rank 1 holds its halo back (does not enter the pass) until rank 0 has computed a piece of
    its result, which it can only do from owned rows, so only if it computes its interior while the exchange
    is in flight; a layer that waits first never sends the go, and rank 1 gives up after a bound (a guard
    against a hang, not a measurement)."""
    if comm.size != 2:
        pytest.skip("the held-back halo is written for 2 ranks (decided by comm.size on every rank)")
    from test_layers import _GO_BOUND, _arrives_within

    ctx = LayerContext(comm, np, "float64", seed=1)
    spec = {"input": {"channels": 3, "spatial": [64, 16]}, "layers": [dict(layer)]}
    model = Model(spec, 2, ctx, {"default": {"h": 2}})
    lay = model.layers[0]
    rng = np.random.default_rng(0)
    xt = DistTensor.scatter(rng.standard_normal((2, 3, 64, 16)), model.input_dist, comm)
    dyt = DistTensor.scatter(rng.standard_normal(lay.out_shape), lay.out_dist, comm)
    if phase == "backward":
        model.forward(xt)
    go = comm.dup()
    sent, ok = [], True
    if comm.rank == 0:
        def hooked(fn):
            def run(*a, **kw):
                out = fn(*a, **kw)
                sent or sent.append(go.isend(np.ones(1), 1, 1))
                return out
            return run
        if phase == "forward":
            lay._interior[1].forward = hooked(lay._interior[1].forward)
        else:
            lay._gather = hooked(lay._gather)
        model.forward(xt) if phase == "forward" else model.backward(dyt, input_grad=True)
        ok = bool(sent)
        if not sent:
            sent.append(go.isend(np.ones(1), 1, 1))
        sent[0].wait()
    else:
        got = go.irecv(np.zeros(1), 0, 1)
        ok = _arrives_within(got, _GO_BOUND)
        model.forward(xt) if phase == "forward" else model.backward(dyt, input_grad=True)
        if not ok:
            got.wait()
    go.free()
    assert_all(comm, ok, f"rank 0 computed nothing of its {phase} before the halo arrived")
