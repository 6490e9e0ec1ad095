"""The upsampling kernels (layers/kernels/upsample.py) on one process: against ``F.interpolate`` and its
gradient (float64 to 1e-12, float32 to float32 round-off), on whole tensors and on any box of the output
computed from an input array that covers only the box's source (what a split layer hands them), 1-D to 3-D,
nearest and linear with ``align_corners`` either way, scales 1 to 3 and per dimension; host float arrays on
the compiled kernels (``_cupsample``) and on the NumPy path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_util import require_built

from lbannpy.layers.kernels import upsample as U
from lbannpy.layers.kernels._geometry import KernelShapeError

MODES = [("nearest", False), ("linear", False), ("linear", True)]
SHAPES = [(2, 3, 7), (2, 3, 5, 6), (1, 2, 3, 4, 5), (1, 1, 1, 2)]


def _torch(x, scale, mode, corners, dy=None):
    nsp = x.ndim - 2
    sf = tuple(float(s) for s in (scale if isinstance(scale, (list, tuple)) else [scale] * nsp))
    xt = torch.tensor(x, requires_grad=True)
    if mode == "nearest":
        y = F.interpolate(xt, scale_factor=sf, mode="nearest")
    else:
        y = F.interpolate(xt, scale_factor=sf, mode=("linear", "bilinear", "trilinear")[nsp - 1],
                          align_corners=corners)
    if dy is None:
        return y.detach().numpy()
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy()


def _scales(shape):
    nsp = len(shape) - 2
    return [1, 2, 3, [3, 1, 2][:nsp] if nsp > 1 else 2]


@pytest.mark.parametrize("mode,corners", MODES, ids=["nearest", "linear", "linear-corners"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_whole_tensor_matches_interpolate_and_its_gradient(shape, mode, corners):
    rng = np.random.default_rng(1)
    for scale in _scales(shape):
        x = rng.standard_normal(shape)
        y = U.upsample(x, scale, mode, corners)
        dy = rng.standard_normal(y.shape)
        ty, tdx = _torch(x, scale, mode, corners, dy)
        dx = U.upsample_backward(dy, shape, scale, mode, corners)
        assert np.abs(y - ty).max() <= 1e-12 * np.abs(ty).max(), scale
        assert np.abs(dx - tdx).max() <= 1e-12 * np.abs(tdx).max(), scale
        assert dx is not dy and dx.shape == shape


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("mode,corners", MODES, ids=["nearest", "linear", "linear-corners"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_any_box_from_its_source_alone(monkeypatch, shape, mode, corners, compiled):
    """A box of the output from an input array holding only the box's source (at its global origin), and
    the box's gradient, added into the whole input, equal to the whole tensor's (both host paths)."""
    monkeypatch.setattr(U, "USE_COMPILED", compiled and U.USE_COMPILED)
    rng = np.random.default_rng(2)
    for scale in _scales(shape)[1:]:
        x = rng.standard_normal(shape)
        full = _torch(x, scale, mode, corners)
        axes = U._axes(shape, scale, mode, corners)
        for _ in range(6):
            box = []
            for a in axes:
                o0 = int(rng.integers(0, a.out))
                box.append((o0, int(rng.integers(o0 + 1, a.out + 1))))
            probe = U.Plan(axes, box, (0,) * len(axes))
            src = x[probe.source_slices]
            plan = U.Plan(axes, box, [lo for lo, _ in probe.source])
            sl = (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box)
            out = np.full(full.shape, np.nan)
            plan.forward(src, out=out[sl])
            assert np.abs(out[sl] - full[sl]).max() <= 1e-12
            g = rng.standard_normal(out[sl].shape)
            gx = np.zeros(shape)
            gx[probe.source_slices] += plan.backward(g)
            big = np.zeros(full.shape)
            big[sl] = g
            assert np.abs(gx - U.upsample_backward(big, shape, scale, mode, corners)).max() <= 1e-12


@pytest.mark.parametrize("mode,corners", MODES, ids=["nearest", "linear", "linear-corners"])
def test_float32(mode, corners):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    y = U.upsample(x, 2, mode, corners)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    ty, tdx = _torch(x, 2, mode, corners, dy)
    dx = U.upsample_backward(dy, x.shape, 2, mode, corners)
    assert y.dtype == dx.dtype == np.float32
    assert np.abs(y - ty).max() <= 1e-5 and np.abs(dx - tdx).max() <= 1e-5


@pytest.mark.parametrize("mode,corners", MODES, ids=["nearest", "linear", "linear-corners"])
def test_channel_blocks_thin_boxes_and_strided_outputs(monkeypatch, mode, corners):
    """The host paths: channel blocks run one at a time (a tiny ``BLOCK_BYTES``: one channel each), a box one
    output wide along the last dimension with the others whole (their x2 passes over flattened arrays), a
    box written into a strided part of a larger array, float32 (nearest: a wider integer per pair)."""
    monkeypatch.setattr(U, "BLOCK_BYTES", 64)
    rng = np.random.default_rng(4)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        shape = (2, 3, 4, 5, 6)
        x = rng.standard_normal(shape).astype(dtype)
        dy = rng.standard_normal((2, 3, 8, 10, 12)).astype(dtype)
        full, tdx = _torch(x, 2, mode, corners, dy)
        assert np.abs(U.upsample(x, 2, mode, corners) - full).max() <= tol
        assert np.abs(U.upsample_backward(dy, shape, 2, mode, corners) - tdx).max() <= tol
        axes = U._axes(shape, 2, mode, corners)
        for box in ([(0, 8), (0, 10), (5, 6)], [(0, 8), (2, 8), (0, 12)], [(0, 8), (0, 10), (2, 10)]):
            probe = U.Plan(axes, box, (0, 0, 0))
            plan = U.Plan(axes, box, [lo for lo, _ in probe.source], np, dtype)
            sl = (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box)
            out = np.full((2, 6) + full.shape[2:], np.nan, dtype=dtype)[:, ::2]
            plan.forward(x[probe.source_slices], out=out[sl])
            assert np.abs(out[sl] - full[sl]).max() <= tol, box
            gx = np.zeros(shape, dtype)
            gx[probe.source_slices] += plan.backward(dy[sl])
            big = np.zeros_like(dy)
            big[sl] = dy[sl]
            assert np.abs(gx - U.upsample_backward(big, shape, 2, mode, corners)).max() <= tol, box


def test_source_ranges_are_monotone_and_cover_every_tap():
    for mode, corners in MODES:
        for n, s in ((1, 2), (5, 2), (7, 3), (4, 1)):
            ax = U.Axis(n, s, mode, corners)
            last = (0, 0)
            for o in range(ax.out):
                lo, hi = ax.source(o, o + 1)
                i0, i1, lam = ax.taps(o)
                assert lo <= i0 <= i1 < hi <= n and 0.0 <= lam < 1.0
                assert lo >= last[0] and hi >= last[1]
                last = (lo, hi)


def test_refusals():
    with pytest.raises(KernelShapeError, match="mode"):
        U.Axis(4, 2, "cubic")
    axes = U._axes((1, 1, 8), 2, "linear", False)
    plan = U.Plan(axes, [(4, 10)], (0,))
    with pytest.raises(KernelShapeError, match="does not cover"):
        plan.forward(np.zeros((1, 1, 3)))
    with pytest.raises(KernelShapeError, match="outside"):
        U.Plan(axes, [(0, 17)], (0,))
    with pytest.raises(KernelShapeError, match="per spatial dimension"):
        U.upsample(np.zeros((1, 1, 2, 2)), [2, 2, 2])


@pytest.mark.parametrize("mode,corners", MODES, ids=["nearest", "linear", "linear-corners"])
def test_compiled_kernels_match_the_numpy_path_and_interpolate(monkeypatch, mode, corners):
    """The compiled one-pass kernels (host float32/float64 plans) against the NumPy path and PyTorch: whole
    tensors 1-D to 3-D at scales 2, 3 and per dimension (float64 to 1e-12, float32 to its round-off), boxes
    from their source alone written into strided parts of larger arrays, and the adjoint."""
    require_built(getattr(U, "_cupsample", None), "_cupsample")
    rng = np.random.default_rng(5)
    for shape in SHAPES[:3] + [(1, 3, 33, 20)]:
        for scale in _scales(shape)[1:]:
            for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-6)):
                x = rng.standard_normal(shape).astype(dtype)
                axes = U._axes(shape, scale, mode, corners)
                whole = [(0, a.out) for a in axes]
                plan = U.Plan(axes, whole, (0,) * len(axes), np, dtype)
                assert plan.compiled is not None
                y = plan.forward(x)
                dy = rng.standard_normal(y.shape).astype(dtype)
                dx = plan.backward(dy)
                ty, tdx = _torch(x, scale, mode, corners, dy)
                assert y.dtype == dx.dtype == dtype
                assert np.abs(y - ty).max() <= tol * np.abs(ty).max(), (shape, scale, dtype)
                assert np.abs(dx - tdx).max() <= tol * 4 * np.abs(tdx).max(), (shape, scale, dtype)
                monkeypatch.setattr(U, "USE_COMPILED", False)
                ref = U.Plan(axes, whole, (0,) * len(axes), np, dtype)
                monkeypatch.setattr(U, "USE_COMPILED", True)
                assert ref.compiled is None
                assert np.abs(y - ref.forward(x)).max() <= tol * np.abs(ty).max()
                assert np.abs(dx - ref.backward(dy)).max() <= tol * 4 * np.abs(tdx).max()
                for _ in range(3):
                    box = []
                    for a in axes:
                        o0 = int(rng.integers(0, a.out))
                        box.append((o0, int(rng.integers(o0 + 1, a.out + 1))))
                    probe = U.Plan(axes, box, (0,) * len(axes))
                    part = U.Plan(axes, box, [lo for lo, _ in probe.source], np, dtype)
                    sl = (slice(None), slice(None)) + tuple(slice(a, b) for a, b in box)
                    out = np.full((shape[0], 2 * shape[1]) + y.shape[2:], np.nan, dtype=dtype)[:, ::2]
                    part.forward(x[probe.source_slices], out=out[sl])
                    assert np.abs(out[sl] - ty[sl]).max() <= tol * np.abs(ty).max(), box
                    gx = np.zeros(shape, dtype)
                    gx[probe.source_slices] += part.backward(np.ascontiguousarray(dy[sl]))
                    big = np.zeros_like(dy)
                    big[sl] = dy[sl]
                    assert np.abs(gx - ref.backward(big)).max() <= tol * 4 * np.abs(tdx).max(), box


def test_compiled_kernels_refuse_arrays_that_do_not_fit_their_tables():
    require_built(getattr(U, "_cupsample", None), "_cupsample")
    axes = U._axes((1, 2, 4, 5), 2, "linear", False)
    plan = U.Plan(axes, [(0, 8), (0, 10)], (0, 0), np, np.float32)
    with pytest.raises(ValueError, match="tables for"):
        plan.compiled(U._cupsample.forward, np.zeros((1, 2, 4, 6), np.float32), np.zeros((1, 2, 8, 10),
                                                                                          np.float32))
    with pytest.raises(ValueError, match="table ftab"):  # float64 arrays, float32 tables
        plan.compiled(U._cupsample.forward, np.zeros((1, 2, 4, 5)), np.zeros((1, 2, 8, 10)))
    with pytest.raises(ValueError, match="5-d array of float32"):
        plan.compiled(U._cupsample.forward, np.zeros((1, 2, 4, 5), np.float32), np.zeros((1, 2, 8, 10)))
    assert not plan.compiled.takes(np.zeros(1))


@pytest.mark.parametrize("shape", [(2, 3, 4, 37), (1, 2, 3, 4, 37), (1, 2, 5, 16)],
                         ids=["2d", "3d", "2d-one-vector"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_nearest_scale_two_takes_one_pass_with_the_numpy_paths_numbers(monkeypatch, shape, dtype):
    """Nearest at scale 2 in H and W (and D or not) runs a one-pass kernel each way (whole vectors and a
    remainder on rows of 37): the forward is the input repeated, bit for bit, and the gradient is the NumPy
    path's bit for bit (the same order of additions) and PyTorch's to round-off."""
    require_built(getattr(U, "_cupsample", None), "_cupsample")
    rng = np.random.default_rng(11)
    x = rng.standard_normal(shape).astype(dtype)
    axes = U._axes(shape, 2, "nearest", False)
    whole = [(0, a.out) for a in axes]
    plan = U.Plan(axes, whole, (0,) * len(axes), np, dtype)
    assert plan.compiled is not None
    y = plan.forward(x)
    rep = x
    for d in range(2, x.ndim):
        rep = np.repeat(rep, 2, axis=d)
    assert np.array_equal(y, rep)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx = plan.backward(dy)
    monkeypatch.setattr(U, "USE_COMPILED", False)
    ref = U.Plan(axes, whole, (0,) * len(axes), np, dtype)
    assert ref.compiled is None
    assert np.array_equal(dx, ref.backward(dy))
    _, tdx = _torch(x.astype(np.float64), 2, "nearest", False, dy.astype(np.float64))
    tol = 1e-12 if dtype == np.float64 else 1e-6
    assert np.abs(dx - tdx).max() <= tol * np.abs(tdx).max()
