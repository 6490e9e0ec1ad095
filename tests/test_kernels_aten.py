"""The ATen kernel set (PyTorch's convolutions through DLPack) against lbannpy's own: kernel by kernel over
many shapes, zero-copy and ``out=`` buffers, and whole training runs with ``runtime.kernels: own`` against
``aten`` (float64 to 1e-10, float32 to round-off), on one rank and split over two. Needs torch (the test
dependency); without it the ATen set cannot exist and these tests are skipped."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from lbannpy.layers.kernels import conv as own
from lbannpy.layers.kernels.select import KernelChoiceError, conv_kernels
from train_util import ENV, PY, assert_same_weights, build_config, final_params, make_data, model_spec, sh

torch = pytest.importorskip("torch")
aten = pytest.importorskip("lbannpy.layers.kernels.aten")
MPIEXEC = shutil.which("mpiexec")

# (batch, channels, spatial, filters, kernel, stride, dilation)
SHAPES = [(1, 1, (9,), 2, 3, 1, 1), (2, 5, (17,), 3, 5, 2, 1), (3, 2, (20,), 4, 3, 3, 2),
          (2, 3, (17, 17), 5, 3, 1, 1), (3, 7, (20, 19), 4, 5, 2, 1), (1, 4, (19, 21), 6, 3, 3, 2),
          (4, 70, (9, 9), 8, 3, 1, 1), (2, 16, (12, 12), 70, 1, 1, 1), (1, 2, (11, 11), 3, 5, 1, 2),
          (2, 3, (6, 7, 8), 3, 3, 1, 1), (1, 2, (9, 8, 7), 2, 3, 2, 1), (2, 1, (7, 7, 7), 2, 1, 1, 1)]


def _case(shape, dtype, seed=0):
    n, c, sp, f, k, s, d = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, *sp)).astype(dtype)
    w = rng.standard_normal((f, c) + (k,) * len(sp)).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    return x, w, b, s, d


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{len(s[2])}d-{i}" for i, s in enumerate(SHAPES)])
def test_aten_equals_own_in_float64(shape):
    x, w, b, s, d = _case(shape, np.float64)
    y = own.conv_forward(x, w, b, s, d)
    assert np.abs(aten.conv_forward(x, w, b, s, d) - y).max() <= 1e-10 * max(np.abs(y).max(), 1)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx = own.conv_backward_data(dy, w, x.shape, s, d)
    got = aten.conv_backward_data(dy, w, x.shape, s, d)
    assert got.shape == x.shape and np.abs(got - dx).max() <= 1e-10 * max(np.abs(dx).max(), 1)
    dw = own.conv_backward_filter(x, dy, w.shape, s, d)
    got = aten.conv_backward_filter(x, dy, w.shape, s, d)
    assert got.shape == w.shape and np.abs(got - dw).max() <= 1e-10 * max(np.abs(dw).max(), 1)


@pytest.mark.parametrize("shape", SHAPES[:6] + SHAPES[9:11], ids=lambda s: f"{len(s[2])}d-{s[4]}k{s[5]}s")
def test_aten_padding_equals_own_on_the_padded_window(shape):
    from lbannpy.layers.kernels import crop_spatial, pad_spatial

    x, w, b, s, d = _case(shape, np.float64, seed=2)
    p = (shape[4] // 2) * d
    pads = [(p, p)] * (x.ndim - 2)
    win = pad_spatial(x, pads)
    y = own.conv_forward(win, w, b, s, d)
    got = aten.conv_forward(x, w, b, s, d, padding=p)
    assert got.shape == y.shape and np.abs(got - y).max() <= 1e-10 * max(np.abs(y).max(), 1)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    dx = crop_spatial(own.conv_backward_data(dy, w, win.shape, s, d), pads)
    got = aten.conv_backward_data(dy, w, x.shape, s, d, padding=p)
    assert got.shape == x.shape and np.abs(got - dx).max() <= 1e-10 * max(np.abs(dx).max(), 1)
    dw = own.conv_backward_filter(win, dy, w.shape, s, d)
    got = aten.conv_backward_filter(x, dy, w.shape, s, d, padding=p)
    assert np.abs(got - dw).max() <= 1e-10 * max(np.abs(dw).max(), 1)


@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[6:10],
                         ids=lambda s: f"{len(s[2])}d-{s[3]}f{s[4]}k{s[5]}s")
@pytest.mark.parametrize("bias", [True, False])
def test_filter_and_bias_gradients_in_one_call_equal_own_and_pytorch(shape, bias):
    """Each set's ``conv_backward_params`` (what the layer calls, filter in hand): ATen's one operator call
    against lbannpy's filter gradient and bias sum, and both against PyTorch's autograd, padded or not."""
    x, w, b, s, d = _case(shape, np.float64, seed=4)
    p = (shape[4] // 2) * d
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d)[x.ndim - 3]
    yt = conv(xt, wt, bt, s, p, d)
    dy = np.random.default_rng(5).standard_normal(tuple(yt.shape))
    dw_ref, db_ref = (g.numpy() for g in torch.autograd.grad(yt, (wt, bt), torch.from_numpy(dy)))
    for ks in (conv_kernels("own"), conv_kernels("aten")):
        dw, db = ks.conv_backward_params(x, dy, w, bias, s, d, padding=p)
        tol = 1e-10 * max(np.abs(dw_ref).max(), 1)
        assert dw.shape == w.shape and np.abs(dw - dw_ref).max() <= tol, ks.name
        if bias:
            assert db.shape == b.shape and np.abs(db - db_ref).max() <= 1e-10 * max(np.abs(db_ref).max(), 1)
        else:
            assert db is None


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize("case", [(32, 1, (32, 32), 6, 5, 1, 1, 0), (4, 1, (12, 13), 6, 3, 2, 1, 1),
                                  (2, 1, (11, 11), 3, 3, 1, 2, 2)], ids=["lenet-conv1", "s2p1", "d2p2"])
def test_one_input_channel_filter_gradient_runs_channels_last_and_equals_pytorch(case, dtype, rtol,
                                                                                 monkeypatch):
    """A 2-D convolution of one input channel hands oneDNN its filter gradient's operands channels-last
    (the faster layout there): the same gradients as PyTorch's NCHW autograd, for a contiguous input and for
    a block of a larger array."""
    n, c, sp, f, k, s, d, p = case
    rng = np.random.default_rng(9)
    big = rng.standard_normal((n, c, sp[0] + 3, sp[1] + 2)).astype(dtype)
    w, b = (rng.standard_normal(shape).astype(dtype) for shape in ((f, c, k, k), (f,)))
    calls = []
    real = aten._one_channel_nhwc
    monkeypatch.setattr(aten, "_one_channel_nhwc", lambda *a: calls.append(1) or real(*a))
    for x in (np.ascontiguousarray(big[:, :, 1:sp[0] + 1, 2:]), big[:, :, 1:sp[0] + 1, 2:]):
        xt, wt, bt = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (x, w, b))
        yt = torch.nn.functional.conv2d(xt, wt, bt, s, p, d)
        dy = rng.standard_normal(tuple(yt.shape)).astype(dtype)
        grads = torch.autograd.grad(yt, (wt, bt), torch.from_numpy(dy.astype(np.float64)))
        dw_ref, db_ref = (g.numpy() for g in grads)
        dw, db = conv_kernels("aten").conv_backward_params(x, dy, w, True, s, d, padding=p)
        assert dw.shape == w.shape and dw.dtype == dtype and db.dtype == dtype
        assert np.abs(dw - dw_ref).max() <= rtol * max(np.abs(dw_ref).max(), 1)
        assert np.abs(db - db_ref).max() <= rtol * max(np.abs(db_ref).max(), 1)
        own_dw, own_db = conv_kernels("own").conv_backward_params(x, dy, w, True, s, d, padding=p)
        assert np.abs(dw - own_dw).max() <= rtol * max(np.abs(own_dw).max(), 1)
    assert len(calls) == 2


def test_float32_zero_copy_and_out_buffers():
    x, w, b, s, d = _case((2, 3, (13, 13), 4, 3, 1, 1), np.float32)
    assert aten._t(x).data_ptr() == x.ctypes.data  # the input is wrapped, not copied
    y = own.conv_forward(x, w, b, s, d)
    out = np.empty_like(y)
    assert aten.conv_forward(x, w, b, s, d, out=out) is out
    assert np.abs(out - y).max() <= 1e-5 * np.abs(y).max() and out.dtype == np.float32
    dy = np.ones_like(y)
    dx_out = np.empty_like(x)
    assert aten.conv_backward_data(dy, w, x.shape, s, d, out=dx_out) is dx_out
    assert np.abs(dx_out - own.conv_backward_data(dy, w, x.shape, s, d)).max() <= 1e-4


def test_choice_rules(monkeypatch):
    assert conv_kernels("own").name == "own" and conv_kernels("aten").name == "aten"
    assert conv_kernels("auto").name == "aten"  # torch is here
    with pytest.raises(KernelChoiceError, match="not one of"):
        conv_kernels("fast")
    monkeypatch.setattr(aten, "available", lambda device="cpu": False)
    assert conv_kernels("auto").name == "own"
    with pytest.raises(KernelChoiceError, match="aten needs PyTorch"):
        conv_kernels("aten")


def test_trainer_refuses_aten_without_torch_in_one_line(tmp_path):
    """A torch that cannot be imported (blocked on the import path): runtime.kernels aten is one line."""
    work = make_data(tmp_path, blobs_size=8, blobs_samples=8, mesh_size=16, mesh_samples=2)
    model, data = model_spec(work, "cls", [{"name": "c1", "type": "conv", "filters": 2, "kernel": 3},
                                           {"name": "f1", "type": "fc", "units": 4}], 8)
    cfg = build_config(work, "noaten", {"model": model, "data": data,
                                        "trainer": {"batch_size": 4, "steps": 1},
                                        "runtime": {"kernels": "aten"}, "output": {"dir": str(work / "o")}})
    block = ("import sys\nclass B:\n    def find_spec(self, name, *a):\n        if name == 'torch' or "
             "name.startswith('torch.'):\n            raise ImportError('no torch')\n"
             "sys.meta_path.insert(0, B())\n"
             "from lbannpy.train import main\nraise SystemExit(main([sys.argv[1], '--quiet']))")
    p = subprocess.run([sys.executable, "-c", block, str(cfg)], capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "runtime.kernels: aten needs PyTorch" in p.stderr


LAYERS = [
    {"name": "c1", "type": "conv", "filters": 6, "kernel": 3, "padding": 1, "bias": False},
    {"name": "b1", "type": "batchnorm", "sync": "global"},
    {"name": "r1", "type": "relu"},
    {"name": "c2", "type": "conv", "filters": 6, "kernel": 3, "stride": 2, "padding": 1, "dilation": 1},
    {"name": "r2", "type": "relu"},
    {"name": "c3", "type": "conv", "filters": 4, "kernel": 3, "padding": 2, "dilation": 2},
    {"name": "f1", "type": "fc", "units": 4},
]


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_training_with_own_and_aten_kernels_agrees(tmp_path):
    work = make_data(tmp_path, blobs_size=12, blobs_samples=32, mesh_size=16, mesh_samples=2)
    model, data = model_spec(work, "cls", LAYERS, 12)

    def run(tag, kernels, dtype, ranks=1, parallel=None):
        cfg = {"model": model, "data": data,
               "trainer": {"batch_size": 8, "steps": 3, "seed": 3, "dtype": dtype},
               "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
               "parallel": parallel or {}, "runtime": {"kernels": kernels},
               "checkpoint": {"dir": str(work / tag / "ckpt")}, "output": {"dir": str(work / tag / "out")}}
        sh([MPIEXEC, "-n", str(ranks), PY, "-m", "lbannpy.train", build_config(work, tag, cfg), "--quiet"])
        return final_params(work / tag / "ckpt")

    own64 = run("own64", "own", "float64")
    assert_same_weights(run("aten64", "aten", "float64"), own64, 1e-10, "aten vs own, float64")
    assert_same_weights(run("aten64-h2", "aten", "float64", 2, {"default": {"h": 2}}), own64, 1e-10,
                        "aten split over height on 2 ranks vs own on 1, float64")
    # samples or filters split: nothing to exchange, so the layers hand ATen their blocks unpadded (it pads);
    # filters split also sums the partial input gradients of the filter groups
    for split in ({"n": 2}, {"c": 2}):
        tag = "aten64-" + "".join(f"{k}{v}" for k, v in split.items())
        assert_same_weights(run(tag, "aten", "float64", 2, {"default": split}), own64, 1e-10,
                            f"aten on 2 ranks split {split} vs own on 1, float64")
    assert_same_weights(run("aten32", "aten", "float32"), run("own32", "own", "float32"), 1e-4,
                        "aten vs own, float32")


def test_unsplit_layers_hand_their_blocks_to_kernels_that_pad(monkeypatch):
    """ATen pads every unsplit layer's convolution; lbannpy's own kernels those small enough for their
    one-call path (``_conv_small.MAX_MACS``), and no other."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels import _conv_small
    from lbannpy.layers.kernels.select import conv_kernels
    from lbannpy.model import Model

    spec = {"name": "m", "input": {"channels": 3, "spatial": [12, 12]}, "layers": LAYERS,
            "loss": "cross_entropy"}
    every = {"c1": (1, 1), "c2": (1, 1), "c3": (2, 2)}
    for choice, most, want in (("aten", None, every), ("own", 0, {}), ("own", 1 << 40, every)):
        if most is not None:
            monkeypatch.setattr(_conv_small, "MAX_MACS", most)
        ctx = LayerContext(SingleCommunicator(), np, "float64", seed=0)
        ctx.conv_kernels = conv_kernels(choice)
        model = Model(spec, 4, ctx, {})
        got = {lay.name: lay.kernel_pads for lay in model.layers if hasattr(lay, "kernel_pads")}
        assert {k: v for k, v in got.items() if v is not None} == want, got


def _channels_last(a):
    out = aten.channels_last_view(np.empty(aten.channels_last_shape(a.shape), a.dtype), a.ndim)
    out[...] = a
    return out


@pytest.mark.parametrize("shape", [(2, 3, (13, 12), 5, 3, 1, 1), (1, 18, (20, 21), 16, 3, 2, 1),
                                   (2, 4, (7, 8, 9), 3, 3, 1, 2)], ids=["2d", "2d-stride", "3d-dilation"])
def test_channels_last_operands_give_the_nchw_results(shape):
    """A window and an output gradient laid out channels-last (what a layer hands over where its calibrated
    row names that layout) give the NCHW operands' forward and gradients (float64 to 1e-10); the output and
    the filter gradient come back C-contiguous."""
    x, w, b, s, d = _case(shape, np.float64)
    xc = _channels_last(x)
    assert not xc.flags.c_contiguous and aten._is_channels_last(aten._t(xc))
    y = aten.conv_forward(x, w, b, s, d)
    yc = aten.conv_forward(xc, w, b, s, d)
    assert yc.flags.c_contiguous and np.abs(yc - y).max() <= 1e-10 * np.abs(y).max()
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dyc = _channels_last(dy)
    dx, dxc = aten.conv_backward_input(dy, w, x, s, d), aten.conv_backward_input(dyc, w, xc, s, d)
    assert dx.flags.c_contiguous  # dxc: in whichever layout oneDNN computed it (never copied to NCHW)
    assert np.abs(dxc - dx).max() <= 1e-10 * np.abs(dx).max()
    (dw, db), (dwc, dbc) = (aten.conv_backward_params(x, dy, w, True, s, d),
                            aten.conv_backward_params(xc, dyc, w, True, s, d))
    assert dwc.flags.c_contiguous and np.abs(dwc - dw).max() <= 1e-10 * np.abs(dw).max()
    assert np.abs(dbc - db).max() <= 1e-10 * np.abs(db).max()


def test_the_layout_is_the_calibrated_rows_and_can_be_forced(monkeypatch):
    """A convolution goes channels-last where its calibrated row says so (and it has that layout), NCHW
    where the row says nchw or there is none; ``LAYOUT`` forces either."""
    assert aten.takes_channels_last((1, 18, 34, 34), (16, 18, 3, 3), "channels_last")
    assert aten.takes_channels_last((1, 5, 9, 9, 9), (2, 5, 3, 3, 3), "channels_last")
    assert not aten.takes_channels_last((1, 18, 34, 34), (16, 18, 3, 3), "nchw")
    assert not aten.takes_channels_last((1, 18, 34, 34), (16, 18, 3, 3))  # no calibrated row: NCHW
    assert not aten.takes_channels_last((1, 1, 34, 34), (16, 1, 3, 3), "channels_last")  # nothing to lay out
    assert not aten.takes_channels_last((1, 4, 34), (4, 4, 3), "channels_last")  # 1-D: no such format
    monkeypatch.setattr(aten, "LAYOUT", "nchw")
    assert not aten.takes_channels_last((1, 18, 34, 34), (16, 18, 3, 3), "channels_last")
    monkeypatch.setattr(aten, "LAYOUT", "channels_last")
    assert aten.takes_channels_last((1, 5, 9, 9, 9), (2, 5, 3, 3, 3))


def _reflect_layer(ctx, shape=(2, 18, 14, 14)):
    from lbannpy.dist import Distribution
    from lbannpy.layers.registry import layer_classes

    layer = layer_classes()["conv"]("c", filters=16, kernel=3, padding=1, padding_mode="reflect")
    dist = Distribution.make(4, 1)
    layer.configure(ctx, [shape], [dist], dist)
    return layer


def _ctx(choice="aten", table=None):
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext

    ctx = LayerContext(SingleCommunicator(), np, np.float64, seed=0)
    ctx.conv_kernels = conv_kernels(choice)
    ctx.conv_kernel_table = table or {}
    return ctx


def test_a_runs_conv_layout_does_not_follow_timing(monkeypatch):
    """With channels-last made to time ten times faster (every clock a layout choice could read), a conv
    layer with no calibrated row still takes NCHW: the layouts round differently, and a run's numbers must
    not follow a timing (nor differ between ranks)."""
    import time

    state = {"calls": 0, "now": 0.0}

    def clock():  # calls alternate start/stop of NCHW, then of channels-last: 10 s against 1 s
        state["now"] += {1: 10.0, 3: 1.0}.get(state["calls"] % 4, 0.0)
        state["calls"] += 1
        return state["now"]
    monkeypatch.setattr(time, "process_time", clock)
    monkeypatch.setattr(time, "perf_counter", clock)
    for choice in ("aten", "auto"):
        for phase in range(4):  # whichever clock reads come first, one phase lines the pattern up
            layer = _reflect_layer(_ctx(choice), (2, 18, 14 + phase, 14))
            for dtype in ("float64", "float32"):
                state["calls"] = phase
                assert layer.kern.name == "aten" and layer._channels_last(np.dtype(dtype)) is False


def test_the_calibrated_row_chooses_the_layers_layout():
    """``layout: channels_last`` in the row of the layer's shape (``runtime.kernels`` auto or aten) gives
    the layer that layout; ``nchw`` or no row, NCHW; a run of ``own`` kernels never."""
    from lbannpy.layers.kernels.select import kernel_table
    from lbannpy.machine import load_machine, machine_from_dict

    def machine(layout):
        tree = load_machine("lassen").to_dict()
        row = {"type": "conv", "in": [2, 18, 14, 14], "out": [2, 16, 14, 14], "fwd_s": 1e-3, "kernel": "aten"}
        tree["compute"]["measured"] = [{**row, **({"layout": layout} if layout else {})}]
        return machine_from_dict(tree)

    f64 = np.dtype("float64")
    for choice in ("auto", "aten"):
        table = kernel_table(choice, "cpu", machine("channels_last"))
        assert _reflect_layer(_ctx(choice, table))._channels_last(f64)
        assert not _reflect_layer(_ctx(choice, table), (2, 18, 12, 14))._channels_last(f64)  # no row there
        for layout in ("nchw", None):
            layer = _reflect_layer(_ctx(choice, kernel_table(choice, "cpu", machine(layout))))
            assert not layer._channels_last(f64)
    assert kernel_table("own", "cpu", machine("channels_last")) == {}


@pytest.mark.parametrize("mode", ["reflect", "circular", "zeros"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_conv_layer_on_either_layout_equals_pytorch(monkeypatch, mode, layout):
    """The conv layer (one rank, ATen kernels, a window built for its padding mode) with its window and
    output gradient channels-last or NCHW: forward, input, filter and bias gradients equal PyTorch's
    (float64 to 1e-10), twice in a row (the window workspace reused)."""
    import torch.nn.functional as F

    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.registry import layer_classes
    from lbannpy.tensor import DistTensor

    monkeypatch.setattr(aten, "LAYOUT", layout)
    shape = (2, 5, 11, 12)
    ctx = LayerContext(SingleCommunicator(), np, np.float64, seed=0)
    ctx.conv_kernels = conv_kernels("aten")
    layer = layer_classes()["conv"]("c", filters=4, kernel=3, padding=1, padding_mode=mode)
    dist = Distribution.make(4, 1)
    layer.configure(ctx, [shape], [dist], dist)
    if mode == "zeros":  # unsplit zero padding: the kernels pad the block, no window
        assert layer.kernel_pads is not None and not layer._channels_last(np.dtype("float64"))
    else:
        assert layer._channels_last(np.dtype("float64")) == (layout == "channels_last")
    rng = np.random.default_rng(3)
    for _ in range(2):
        x = rng.standard_normal(shape)
        dy = rng.standard_normal(layer.out_shape)
        y = layer.forward([DistTensor(x, shape, dist, 0)])
        dx = layer.backward(DistTensor(dy, layer.out_shape, dist, 0))
        xt = torch.tensor(x, requires_grad=True)
        wt = torch.tensor(layer.w.value, requires_grad=True)
        bt = torch.tensor(layer.b.value, requires_grad=True)
        pad = xt if mode == "zeros" else F.pad(xt, (1, 1, 1, 1), mode=mode)
        yt = F.conv2d(pad, wt, bt, padding=1 if mode == "zeros" else 0)
        yt.backward(torch.tensor(dy))
        for ours, ref in ((y, yt), (dx[0], xt.grad), (layer.w.grad, wt.grad), (layer.b.grad, bt.grad)):
            ours = getattr(ours, "local", ours)
            ref = ref.detach().numpy()
            assert np.abs(np.asarray(ours) - ref).max() <= 1e-10 * np.abs(ref).max()
        layer.w.grad[...] = 0
        layer.b.grad[...] = 0


def _assert_transposed_autograd(ours, x, w, b, dy, stride, pad, opad, dil):
    """``ours`` = (output, dL/dx, dL/dw, dL/db) of a transposed convolution equal PyTorch's autograd in
    float64 (to 1e-12 for float64 arrays, to float32 round-off for float32 ones), in their dtype."""
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    fn = (None, torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
          torch.nn.functional.conv_transpose3d)[x.ndim - 2]
    ty = fn(tx, tw, tb, stride, pad, opad, 1, dil)
    ty.backward(torch.tensor(dy, dtype=torch.float64))
    tol = 1e-12 if x.dtype == np.float64 else 2e-6
    for got, ref in zip(ours, (ty.detach(), tx.grad, tw.grad, tb.grad)):
        ref = ref.numpy()
        assert got.dtype == x.dtype and got.shape == ref.shape
        assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.parametrize("case", [((2, 3, 9, 50), 5, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1)),
                                  ((1, 4, 60), 3, (4,), (2,), (1,), (0,), (1,)),
                                  ((1, 2, 3, 4, 49), 3, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 0, 0),
                                   (1, 1, 1)),
                                  ((2, 3, 5, 50), 4, (3, 3), (1, 1), (1, 1), (0, 0), (2, 2)),
                                  ((1, 65, 4, 50), 2, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1))],
                         ids=["2d-k3s2", "1d-k4s2", "3d", "2d-dilated", "2d-65-channels"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_a_transposed_convolution_of_few_channels_runs_forward_compiled(monkeypatch, case, dtype):
    """A host transposed convolution of up to ``aten.DIRECT_MAX_CHANNELS`` input channels that is not the
    stride-is-kernel case computes its forward as a convolution's input gradient on lbannpy's compiled
    kernels (where they run with AVX-512), its gradients on ATen's operator: all equal PyTorch's autograd
    (float64 to 1e-12, float32 to round-off) with output padding, dilation and a bias; 65 channels, or a
    CPU without AVX-512, take ATen's forward."""
    shape, f, k, stride, pad, opad, dil = case
    taken = []
    real = aten._direct_forward
    monkeypatch.setattr(aten, "_direct_forward", lambda *a: taken.append(1) or real(*a))
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal(shape).astype(dtype), rng.standard_normal((shape[1], f) + k).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    assert not aten.tiles(x.shape, w.shape, stride, pad, opad, dil, 1)
    y = aten.conv_transpose_forward(x, w, b, stride, pad, opad, dil, 1)
    assert bool(taken) == (own.DIRECT_FAST and own.USE_COMPILED and shape[1] <= aten.DIRECT_MAX_CHANNELS)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx, dw, db = aten.conv_transpose_backward(dy, x, w, True, True, stride, pad, opad, dil, 1)
    _assert_transposed_autograd((y, dx, dw, db), x, w, b, dy, stride, pad, opad, dil)


@pytest.mark.parametrize("shape,k", [((2, 3, 50), (2,)), ((2, 4, 3, 50), (3, 2)),
                                     ((2, 3, 2, 3, 49), (2, 3, 2)), ((2, 6, 2, 3, 48), (2, 2, 2)),
                                     ((1, 5, 4, 24), (2, 2))],
                         ids=["1d", "2d-k3x2", "3d-k2x3x2", "3d", "2d-narrow"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_transposed_convolution_with_a_last_kernel_extent_of_two_runs_compiled(monkeypatch, shape, k, dtype):
    """Where the stride is the kernel and its last extent 2 (a U-Net's 2x2 or 2x2x2 up-convolution), the
    host path interleaves in compiled calls (:mod:`lbannpy.layers.kernels._conv_tiles`): the forward writes
    both column phases of a row at once (output rows of 48+), both gradients read ``dy``'s columns two
    apart (input rows of 48+; the 24-wide case splits ``dy``'s blocks out in one pass for two matrix
    products); all equal PyTorch's autograd (float64 to 1e-12, float32 to round-off) with a random bias,
    and on a CPU without AVX-512 the general path computes them instead."""
    from lbannpy.layers.kernels import _conv_tiles

    taken = {}
    for name in ("forward", "backward_data", "backward_filter", "split"):
        fn = getattr(_conv_tiles, name)

        def spy(*a, fn=fn, name=name):
            got = fn(*a)
            taken[name] = got is not None and got is not False
            return got
        monkeypatch.setattr(_conv_tiles, name, spy)
    rng = np.random.default_rng(3)
    f = 5
    x, w = rng.standard_normal(shape).astype(dtype), rng.standard_normal((shape[1], f) + k).astype(dtype)
    b = rng.standard_normal(f).astype(dtype)
    y = aten.conv_transpose_forward(x, w, b, k, 0, 0, 1, 1)
    dy = rng.standard_normal(y.shape).astype(dtype)
    dx, dw, db = aten.conv_transpose_backward(dy, x, w, True, True, k, 0, 0, 1, 1)
    fast = own.DIRECT_FAST and own.USE_COMPILED
    direct = fast and shape[-1] >= 48
    assert taken == {"forward": fast, "backward_data": direct,
                     **({"backward_filter": True} if direct else {"split": own.USE_COMPILED})}
    _assert_transposed_autograd((y, dx, dw, db), x, w, b, dy, k, 0, 0, 1)


@pytest.mark.parametrize("shape,k", [((2, 3, 7), (2,)), ((2, 4, 5, 6), (2, 2)), ((1, 3, 4, 3, 5), (2, 3, 2)),
                                     ((3, 2, 4, 5), (3, 1))], ids=["1d", "2d", "3d", "2d-k3x1"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_transposed_convolution_whose_stride_is_its_kernel_is_one_product_each_way(shape, k, bias):
    """A host transposed convolution with stride = kernel (no padding, no dilation, one group: a U-Net's
    up-convolution) goes through one matrix product each way (:func:`aten.tiles`): output, input, filter and
    bias gradients equal PyTorch's autograd in float64, a random bias included; other geometries do not take
    it."""
    torch = pytest.importorskip("torch")
    from lbannpy.layers.kernels import aten

    rng = np.random.default_rng(7)
    f = 5
    x, w = rng.standard_normal(shape), rng.standard_normal((shape[1], f) + k)
    b = rng.standard_normal(f) if bias else None
    assert aten.tiles(x.shape, w.shape, k, 0, 0, 1, 1)
    assert not aten.tiles(x.shape, w.shape, k, 1, 0, 1, 1) and not aten.tiles(x.shape, w.shape, 1, 0, 0, 1, 1)
    y = aten.conv_transpose_forward(x, w, b, k, 0, 0, 1, 1)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = aten.conv_transpose_backward(dy, x, w, bias, True, k, 0, 0, 1, 1)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True) if bias else None
    fn = (None, torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
          torch.nn.functional.conv_transpose3d)[len(k)]
    ty = fn(tx, tw, tb, stride=k)
    ty.backward(torch.tensor(dy))
    for ours, ref in ((y, ty.detach()), (dx, tx.grad), (dw, tw.grad)) + (((db, tb.grad),) if bias else ()):
        ref = ref.numpy()
        assert ours.shape == ref.shape and np.abs(ours - ref).max() <= 1e-12 * np.abs(ref).max()
    if not bias:
        assert db is None
