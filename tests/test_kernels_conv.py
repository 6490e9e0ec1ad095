"""Local convolution kernels against PyTorch CPU (float64 to 1e-10; float32 to its own precision).

Every check runs on both CPU paths: the compiled kernels (``_cconv``, where the extension is built) and the
NumPy im2col path (the fallback of an install without a C compiler)."""
from __future__ import annotations

import itertools
import os
import platform
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernel_util import assert_close, require_built
from lbannpy.layers.kernels import conv as kconv
from lbannpy.layers.kernels import (KernelShapeError, conv_backward_bias, conv_backward_data,
                                    conv_backward_filter, conv_forward, crop_spatial, pad_spatial)

SPATIAL = {2: (17, 23), 3: (7, 9, 11)}
BATCH, CHANNELS = 3, 5


@dataclass(frozen=True)
class ConvCase:
    nsp: int
    kernel: int
    stride: int | tuple
    dilation: int
    pads: tuple  # ((lo, hi), ...) per spatial dimension
    groups: int = 1
    filters: int = 7
    bias: bool = True

    @property
    def id(self) -> str:
        p = "x".join(f"{lo}-{hi}" for lo, hi in self.pads)
        return (f"{self.nsp}d-k{self.kernel}-s{self.stride}-d{self.dilation}-p{p}-g{self.groups}"
                f"{'' if self.bias else '-nobias'}")


def _cases():
    out = []
    for k, s, d in itertools.product(range(1, 8), (1, 2), (1, 2)):
        total = d * (k - 1)
        half = total // 2
        for lo, hi in ((0, 0), (half, total - half), (half + 1, max(total - half - 1, 0))):
            out.append(ConvCase(2, k, s, d, ((lo, hi), (hi, lo))))
    for k, s, d in itertools.product((1, 2, 3, 5), (1, 2), (1, 2)):
        total = d * (k - 1)
        out.append(ConvCase(3, k, s, d, ((total // 2, total - total // 2),) * 3))
    out.append(ConvCase(3, 3, 1, 1, ((0, 2), (1, 0), (2, 1))))
    out.append(ConvCase(3, 7, 2, 1, ((3, 3),) * 3))
    out += [ConvCase(2, 3, 1, 1, ((1, 1),) * 2, groups=5, filters=10),
            ConvCase(2, 3, 2, 2, ((2, 2),) * 2, groups=5, filters=5, bias=False),
            ConvCase(3, 3, 1, 1, ((1, 1),) * 3, groups=5, filters=10),
            ConvCase(2, 4, 2, 1, ((1, 2),) * 2, bias=False)]
    return list(dict.fromkeys(out))  # small kernels repeat a padding choice


CASES = _cases()


def _torch_pad(pads):
    out = []
    for lo, hi in reversed(pads):  # F.pad lists the last dimension first
        out += [lo, hi]
    return out


def _reference(case: ConvCase, x, w, b, dy_seed):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[case.nsp]
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if b is not None else None
    yt = conv(F.pad(xt, _torch_pad(case.pads)), wt, bt, case.stride, 0, case.dilation, case.groups)
    dy = np.random.default_rng(dy_seed).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(dy))
    return (yt.detach().numpy(), dy, xt.grad.numpy(), wt.grad.numpy(),
            None if bt is None else bt.grad.numpy())


def _inputs(case: ConvCase, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, CHANNELS) + SPATIAL[case.nsp])
    w = rng.standard_normal((case.filters, CHANNELS // case.groups) + (case.kernel,) * case.nsp)
    b = rng.standard_normal(case.filters) if case.bias else None
    return x, w, b


def _check(case: ConvCase, x, w, b, rtol, ref=None):
    if ref is None:
        ref = _reference(case, x.astype(np.float64), w.astype(np.float64),
                         None if b is None else b.astype(np.float64), 1)
    y_ref, dy, dx_ref, dw_ref, db_ref = ref
    dt = x.dtype
    xw = pad_spatial(x, case.pads)
    y = conv_forward(xw, w, b, case.stride, case.dilation)
    assert y.dtype == dt
    assert_close(y, y_ref, rtol)
    dxw = conv_backward_data(dy.astype(dt), w, xw.shape, case.stride, case.dilation)
    assert dxw.shape == xw.shape and dxw.dtype == dt
    assert_close(crop_spatial(dxw, case.pads), dx_ref, rtol)
    # into caller buffers (the layers' reused window workspace) filled with garbage: the same numbers
    y_out, dxw_out = np.full_like(y, np.nan), np.full_like(dxw, np.nan)
    assert conv_forward(xw, w, b, case.stride, case.dilation, out=y_out) is y_out
    assert conv_backward_data(dy.astype(dt), w, xw.shape, case.stride, case.dilation, out=dxw_out) is dxw_out
    np.testing.assert_array_equal(y_out, y)
    np.testing.assert_array_equal(dxw_out, dxw)
    # into a block of a larger output (the layer's interior and boundary pieces), rows strided or not
    for big in (np.full(y.shape[:-1] + (y.shape[-1] + 3,), np.nan, dt),
                np.full(y.shape[:-1] + (2 * y.shape[-1],), np.nan, dt)):
        view = big[..., :y.shape[-1]] if big.shape[-1] != 2 * y.shape[-1] else big[..., ::2]
        conv_forward(xw, w, b, case.stride, case.dilation, out=view)
        np.testing.assert_array_equal(view, y)
    dw = conv_backward_filter(xw, dy.astype(dt), w.shape, case.stride, case.dilation)
    assert dw.shape == w.shape and dw.dtype == dt
    assert_close(dw, dw_ref, rtol)
    if db_ref is not None:
        assert_close(conv_backward_bias(dy.astype(dt)), db_ref, rtol)


def _require_compiled() -> None:
    require_built(kconv._cconv, "_cconv")


@pytest.fixture(params=["compiled", "numpy"])
def kernel_path(request, monkeypatch):
    """Run the test on one CPU path: the compiled kernels or the NumPy fallback."""
    if request.param == "compiled":
        _require_compiled()
        monkeypatch.setattr(kconv, "USE_COMPILED", True)
        # every shape on the compiled kernels, not only those where they are the faster path (and on CPUs
        # without AVX-512, where they are never the faster one)
        monkeypatch.setattr(kconv, "DIRECT_FAST", True)
        monkeypatch.setattr(kconv, "COMPILED_MAX_CHANNELS", 1 << 30)
        monkeypatch.setattr(kconv, "COMPILED_MIN_ROW", 0)
    else:
        monkeypatch.setattr(kconv, "USE_COMPILED", False)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_conv_float64_matches_torch(case, kernel_path, monkeypatch):
    x, w, b = _inputs(case)
    ref = _reference(case, x, w, b, 1)
    # data gradient through the flipped convolution (per stride phase) wherever it applies, and one output
    # row per gathered block: the blocking that large images take
    monkeypatch.setattr(kconv, "GATHER_DATA_GRAD_MAX_RATIO", float("inf"))
    monkeypatch.setattr(kconv, "COL2IM_MIN_CHANNELS", float("inf"))
    monkeypatch.setattr(kconv, "CPU_COLUMN_BYTES", 1)
    _check(case, x, w, b, 1e-10, ref)
    # data gradient through GEMM + col2im scatter (NumPy path), default blocks
    monkeypatch.setattr(kconv, "CPU_COLUMN_BYTES", 8 * 1024 * 1024)
    monkeypatch.setattr(kconv, "GATHER_DATA_GRAD_MAX_RATIO", 0.0)
    _check(case, x, w, b, 1e-10, ref)


# wide enough for the compiled kernels' vector blocks (32 float32 / 16 float64 outputs per row block, the
# last block of a row overlapping the one before; 16 / 8 per filter-gradient vector plus a scalar tail),
# filter counts that split into several register blocks (26 -> 9 + 9 + 8, 64) or none (1)
WIDE_SPATIAL = {1: (83,), 2: (9, 77), 3: (4, 5, 45)}
WIDE_CASES = [
    ConvCase(2, 3, 1, 1, ((1, 1),) * 2, filters=26),
    ConvCase(2, 3, 2, 1, ((1, 1),) * 2, filters=16),
    ConvCase(2, 3, 1, 2, ((2, 2),) * 2, filters=1),
    ConvCase(2, 5, 2, 2, ((4, 4),) * 2, filters=7, bias=False),
    ConvCase(2, 4, 3, 1, ((1, 2),) * 2, filters=64),
    ConvCase(2, 3, 1, 1, ((1, 1),) * 2, groups=5, filters=10),
    ConvCase(1, 3, 1, 1, ((1, 1),), filters=16),
    ConvCase(1, 5, 2, 1, ((2, 2),), filters=13),
    ConvCase(3, 3, 1, 1, ((1, 1),) * 3, filters=16),
    ConvCase(3, 3, 2, 1, ((1, 1),) * 3, filters=9),
    # strides differing per dimension: rows strided through the row pitch, columns read in place (1, 2)
    # or from a phase-split copy (3)
    ConvCase(2, 3, (2, 1), 1, ((1, 1),) * 2, filters=16),
    ConvCase(2, 3, (1, 2), 1, ((1, 1),) * 2, filters=16),
    ConvCase(2, 5, (3, 2), 1, ((2, 2),) * 2, filters=12),
    ConvCase(2, 3, (2, 3), 1, ((1, 1),) * 2, filters=5),
    ConvCase(3, 3, (1, 2, 3), 1, ((1, 1),) * 3, filters=6),
    ConvCase(3, 3, (2, 1, 2), 1, ((1, 1),) * 3, filters=6),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", WIDE_CASES, ids=lambda c: c.id)
def test_conv_wide_rows_match_torch(case, dtype, kernel_path, monkeypatch):
    monkeypatch.setitem(SPATIAL, case.nsp, WIDE_SPATIAL[case.nsp])
    x, w, b = _inputs(case, seed=5)
    ref = _reference(case, x, w, b, 4)
    rtol = 1e-10 if dtype == np.float64 else 3e-5
    _check(case, x.astype(dtype), w.astype(dtype), None if b is None else b.astype(dtype), rtol, ref)


def test_conv_compiled_and_numpy_paths_agree(monkeypatch):
    """The two CPU paths on a mesh-model-like float32 layer (18 -> 16 channels, stride 1 and 2)."""
    _require_compiled()
    monkeypatch.setattr(kconv, "COMPILED_MIN_ROW", 0)  # the stride-2 rows here are 35 outputs wide
    monkeypatch.setattr(kconv, "DIRECT_FAST", True)  # also without AVX-512
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 18, 21, 70)).astype(np.float32)
    w = (rng.standard_normal((16, 18, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    xw = pad_spatial(x, 1)
    for stride in (1, 2):
        got = {}
        for compiled in (True, False):
            monkeypatch.setattr(kconv, "USE_COMPILED", compiled)
            y = conv_forward(xw, w, b, stride)
            dy = np.random.default_rng(8).standard_normal(y.shape).astype(np.float32)
            got[compiled] = (y, conv_backward_data(dy, w, xw.shape, stride),
                             conv_backward_filter(xw, dy, w.shape, stride))
        for a, r in zip(got[True], got[False]):
            assert_close(a, r.astype(np.float64), 2e-5)


def test_compiled_kernels_only_where_they_are_the_faster_path(monkeypatch):
    """Few channels on wide rows (the mesh model's first layers) take the direct kernel; narrow rows and
    many channels take the GEMM path, where the direct kernel is many times slower."""
    _require_compiled()
    monkeypatch.setattr(kconv, "USE_COMPILED", True)
    monkeypatch.setattr(kconv, "DIRECT_FAST", True)
    a = np.zeros(1, dtype=np.float32)
    assert kconv._compiled(a, channels=18, row=1024) and kconv._compiled(a, channels=64, row=48)
    assert not kconv._compiled(a, channels=18, row=16)      # narrow rows
    assert not kconv._compiled(a, channels=768, row=1024)   # many channels
    assert not kconv._compiled(a.astype(np.int32), channels=18, row=1024)
    calls = []
    monkeypatch.setattr(kconv, "_forward_compiled", lambda *a, **k: calls.append(a) or np.zeros(0))
    deep = np.zeros((1, 128, 18, 18), np.float32)
    conv_forward(deep, np.zeros((128, 128, 3, 3), np.float32))
    assert not calls, "a 128-channel layer on 16-wide rows must not take the direct kernel"


def test_direct_kernels_only_with_avx512(monkeypatch):
    """The direct kernel's register blocks fit AVX-512's registers only: without it (``wide_vectors()`` is
    False) even the mesh model's first layers take the GEMM path; the flag is what the CPU says."""
    _require_compiled()
    cpu = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() == "x86_64" and "flags" in cpu:
        assert kconv._cconv.wide_vectors() == (" avx512f" in cpu)
    assert kconv.DIRECT_FAST == bool(kconv._cconv.wide_vectors())
    monkeypatch.setattr(kconv, "USE_COMPILED", True)
    a = np.zeros(1, dtype=np.float32)
    monkeypatch.setattr(kconv, "DIRECT_FAST", False)
    assert not kconv._compiled(a, channels=18, row=1024)
    calls = []
    monkeypatch.setattr(kconv, "_forward_compiled", lambda *a, **k: calls.append(a) or np.zeros(0))
    x = np.random.default_rng(0).standard_normal((1, 18, 6, 66)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((16, 18, 3, 3)).astype(np.float32)
    y = conv_forward(x, w)
    assert not calls and y.shape == (1, 16, 4, 64)
    monkeypatch.setattr(kconv, "DIRECT_FAST", True)  # the control: the same layer takes the direct kernel
    conv_forward(x, w)
    assert len(calls) == 1


F32_CASES = [c for c in CASES if c.pads[0] == (c.dilation * (c.kernel - 1) // 2,) * 2 or c.groups > 1][:12]


@pytest.mark.parametrize("case", F32_CASES, ids=lambda c: c.id)
def test_conv_float32_matches_torch(case, kernel_path):
    x, w, b = _inputs(case)
    f32 = np.float32
    _check(case, x.astype(f32), w.astype(f32), None if b is None else b.astype(f32), 2e-5)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_conv_results_do_not_alias_scratch(stride, kernel_path):
    """Results stay valid after later calls: the compiled path reuses scratch buffers for its temporaries
    (phase splits, padded dy) but never returns one."""
    rng = np.random.default_rng(11)
    xw = rng.standard_normal((2, 4, 13, 70))
    w = rng.standard_normal((6, 4, 3, 3))
    y1 = conv_forward(xw, w, None, stride)
    dy1 = rng.standard_normal(y1.shape)
    dx1 = conv_backward_data(dy1, w, xw.shape, stride)
    dw1 = conv_backward_filter(xw, dy1, w.shape, stride)
    keep = [a.copy() for a in (y1, dx1, dw1)]
    y2 = conv_forward(2 * xw, w, None, stride)
    dx2 = conv_backward_data(2 * dy1, w, xw.shape, stride)
    conv_backward_filter(2 * xw, 2 * dy1, w.shape, stride)
    for a, b in zip((y1, dx1, dw1), keep):
        np.testing.assert_array_equal(a, b)
    assert not np.shares_memory(y1, y2) and not np.shares_memory(dx1, dx2)
    assert_close(dx2, 2 * keep[1])


def test_conv_refuses_an_unfit_output_buffer():
    xw = np.zeros((1, 2, 6, 6))
    w = np.zeros((3, 2, 3, 3))
    for bad in (np.zeros((1, 3, 4, 5)), np.zeros((1, 3, 4, 4), np.float32)):
        with pytest.raises(KernelShapeError, match="output buffer"):
            conv_forward(xw, w, out=bad)
    with pytest.raises(KernelShapeError, match="window gradient buffer.*shape \\(1, 2, 6, 6\\)"):
        conv_backward_data(np.zeros((1, 3, 4, 4)), w, xw.shape, out=np.zeros((1, 2, 6, 5)))
    with pytest.raises(KernelShapeError, match="C-contiguous"):
        conv_backward_data(np.zeros((1, 3, 4, 4)), w, xw.shape, out=np.zeros((1, 2, 6, 12))[..., ::2])


def test_padding_lost_window_gradient_is_adjoint():
    """<conv(pad(x)), dy> == <x, crop(conv_backward_data(dy))>: the data gradient is the exact adjoint."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 11, 13))
    w = rng.standard_normal((6, 4, 3, 5))
    pads = ((1, 2), (2, 2))
    y = conv_forward(pad_spatial(x, pads), w, None, 2, 1)
    dy = rng.standard_normal(y.shape)
    dx = crop_spatial(conv_backward_data(dy, w, pad_spatial(x, pads).shape, 2, 1), pads)
    assert abs(np.vdot(y, dy) - np.vdot(x, dx)) <= 1e-10 * abs(np.vdot(y, dy))


def test_pad_value_and_crop_roundtrip():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    xw = pad_spatial(x, ((1, 2), (0, 3)), value=-np.inf)
    assert xw.shape == (2, 3, 7, 8)
    assert np.isneginf(xw[:, :, 0]).all() and np.isneginf(xw[:, :, :, 5:]).all()
    np.testing.assert_array_equal(crop_spatial(xw, ((1, 2), (0, 3))), x)


@pytest.mark.parametrize("bad", ["window-too-small", "channels", "dy-shape", "dtype"])
def test_conv_refuses_bad_shapes(bad):
    x = np.zeros((1, 4, 5, 5))
    w = np.zeros((2, 4, 3, 3))
    with pytest.raises(KernelShapeError):
        if bad == "window-too-small":
            conv_forward(x[:, :, :2], w)
        elif bad == "channels":
            conv_forward(x, np.zeros((2, 3, 3, 3)))
        elif bad == "dy-shape":
            conv_backward_filter(x, np.zeros((1, 2, 4, 4)), w.shape)
        else:
            conv_forward(x.astype(np.float32), w)


def test_conv_cupy_matches_numpy():
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver or no device
        pytest.skip(f"no usable GPU: {exc}")
    for case in CASES[::7]:
        x, w, b = _inputs(case)
        xw = pad_spatial(x, case.pads)
        y = conv_forward(xw, w, b, case.stride, case.dilation)
        dy = np.random.default_rng(2).standard_normal(y.shape)
        got = [conv_forward(cp.asarray(xw), cp.asarray(w), None if b is None else cp.asarray(b),
                            case.stride, case.dilation),
               conv_backward_data(cp.asarray(dy), cp.asarray(w), xw.shape, case.stride, case.dilation),
               conv_backward_filter(cp.asarray(xw), cp.asarray(dy), w.shape, case.stride, case.dilation)]
        want = [y, conv_backward_data(dy, w, xw.shape, case.stride, case.dilation),
                conv_backward_filter(xw, dy, w.shape, case.stride, case.dilation)]
        for g, r in zip(got, want):
            assert_close(cp.asnumpy(g), r, 1e-10)


def test_conv_sample_chunks_match_one_chunk(monkeypatch):
    """The GEMM path with chunks of 2 samples (the last one short) and with one chunk of all 5 agree."""
    monkeypatch.setattr(kconv, "USE_COMPILED", False)
    rng = np.random.default_rng(5)
    xw = rng.standard_normal((5, 6, 11, 9))
    w = rng.standard_normal((8, 6, 3, 3))
    b = rng.standard_normal(8)
    dy = rng.standard_normal((5, 8, 5, 4))
    got = {}
    per_sample = 6 * 9 * 5 * 4 * 8  # columns of one sample, float64 bytes
    for budget in (2 * per_sample, 1 << 30):
        monkeypatch.setattr(kconv, "CPU_COLUMN_BYTES", budget)
        monkeypatch.setattr(kconv, "GATHER_DATA_GRAD_MAX_RATIO", 0.0)  # col2im data gradient
        got[budget] = (conv_forward(xw, w, b, 2), conv_backward_data(dy, w, xw.shape, 2),
                       conv_backward_filter(xw, dy, w.shape, 2))
    for a, c in zip(*got.values()):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)
