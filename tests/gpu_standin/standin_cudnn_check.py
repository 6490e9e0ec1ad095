"""The cuDNN Frontend stand-in (``tests/gpu_standin/cudnn``): its convolutions and batch-norm nodes against
PyTorch, ``execute`` as a checked launch that a stream capture records and replays, and each refusal, with
the refusal switched off (``cudnn._bind.RULES``) to show the bad call would otherwise go through. Run by
tests/test_gpu_standin_cudnn.py in a subprocess whose PYTHONPATH starts with tests/gpu_standin."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cudnn
import cupy
from cudnn import _bind
from cupy import _standin
from cupy.cuda import runtime

RNG = np.random.default_rng(43)
DT = {np.float64: cudnn.data_type.DOUBLE, np.float32: cudnn.data_type.FLOAT}
# (image [N, C, *S], filter [K, C / groups, *R], pre, post, stride, dilation)
GEOMETRIES = {
    "1d-groups-stride-asym": ((2, 6, 11), (4, 3, 3), [1], [2], [2], [1]),
    "2d-groups-dilation-asym": ((2, 4, 9, 8), (6, 2, 3, 2), [1, 0], [2, 1], [2, 1], [1, 2]),
    "2d-depthwise": ((2, 4, 7, 7), (4, 1, 3, 3), [1, 1], [1, 1], [1, 1], [1, 1]),
    "2d-1x1": ((3, 3, 5, 6), (5, 3, 1, 1), [0, 0], [0, 0], [1, 1], [1, 1]),
    "3d-all": ((1, 4, 6, 7, 5), (4, 2, 2, 3, 1), [0, 1, 2], [1, 1, 0], [1, 2, 1], [2, 1, 1]),
}


def row_major(shape):
    return [int(s) for s in np.cumprod([1] + list(shape)[:0:-1])[::-1]]


def _torch(x, w, pre, post, stride, dil):
    sp = x.ndim - 2
    pad = [p for i in reversed(range(sp)) for p in (pre[i], post[i])]
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    y = [F.conv1d, F.conv2d, F.conv3d][sp - 1](F.pad(xt, pad), wt, stride=stride, dilation=dil,
                                               groups=x.shape[1] // w.shape[1])
    return xt, wt, y


def torch_conv(x, w, dy, pre, post, stride, dil):
    """PyTorch's convolution (float64) and its two gradients for the upstream gradient ``dy`` (or a random
    one when ``dy`` is None): (y, dy, dx, dw)."""
    xt, wt, y = _torch(x, w, pre, post, stride, dil)
    dy = RNG.standard_normal(tuple(y.shape)) if dy is None else dy
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), dy, xt.grad.numpy(), wt.grad.numpy()


class Conv:
    """One convolution node in its own graph, planned on handle ``h`` (the ops as lbannpy calls them)."""

    def __init__(self, op, h, x_shape, w_shape, y_shape, geometry, dtype=np.float64, build=True):
        pre, post, stride, dil = geometry
        t = DT[dtype]
        self.g = cudnn.pygraph(io_data_type=t, intermediate_data_type=t, compute_data_type=t, handle=h)
        shapes = {"conv_fprop": (x_shape, w_shape, y_shape), "conv_dgrad": (y_shape, w_shape, x_shape),
                  "conv_wgrad": (x_shape, y_shape, w_shape)}[op]
        self.a = self.g.tensor(name="a", dim=list(shapes[0]), stride=row_major(shapes[0]), data_type=t)
        self.b = self.g.tensor(name="b", dim=list(shapes[1]), stride=row_major(shapes[1]), data_type=t)
        ports = {"conv_fprop": ("image", "weight"), "conv_dgrad": ("loss", "filter"),
                 "conv_wgrad": ("image", "loss")}[op]
        self.out = getattr(self.g, op)(**dict(zip(ports, (self.a, self.b))), pre_padding=pre,
                                       post_padding=post, stride=stride, dilation=dil, compute_data_type=t,
                                       name=op)
        self.out.set_output(True).set_dim(list(shapes[2])).set_stride(row_major(shapes[2])).set_data_type(t)
        self.shapes, self.dtype = shapes, dtype
        if build:
            self.build()

    def build(self):
        self.g.validate()
        self.g.build_operation_graph()
        self.g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        self.g.check_support()
        self.g.build_plans()

    def buffers(self, a, b):
        """Device arrays for the two inputs (uploaded) and the output, and a workspace of the plan's size."""
        self.A, self.B = cupy.asarray(a.astype(self.dtype)), cupy.asarray(b.astype(self.dtype))
        self.O = cupy.zeros(self.shapes[2], dtype=self.dtype)
        self.ws = cupy.empty(self.g.get_workspace_size(), dtype=np.uint8)
        return self

    def execute(self, h, **over):
        pack = {self.a: over.get("a", self.A), self.b: over.get("b", self.B),
                self.out: over.get("out", self.O)}
        self.g.execute(pack, over.get("ws", self.ws), handle=h)
        return self.O


@pytest.fixture
def h():
    """A handle on device 0 whose stream is a non-blocking stream made current for the test."""
    handle = cudnn.create_handle()
    s = cupy.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=s.ptr)
    with s:
        yield handle
    cudnn.destroy_handle(handle)


def case(name, dtype=np.float64):
    """Inputs of a geometry (values of ``dtype``, held in float64) and PyTorch's float64 results."""
    xs, ws, pre, post, stride, dil = GEOMETRIES[name]

    def rnd(a):
        return a.astype(dtype).astype(np.float64)
    x, w = rnd(RNG.standard_normal(xs)), rnd(RNG.standard_normal(ws))
    dy = rnd(torch_conv(x, w, None, pre, post, stride, dil)[1])
    y, dy, dx, dw = torch_conv(x, w, dy, pre, post, stride, dil)
    return x, w, y, dy, dx, dw, (pre, post, stride, dil)


# ---------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_fprop_dgrad_wgrad_equal_torch_in_float64(h, name):
    x, w, y, dy, dx, dw, geo = case(name)
    got_y = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo).buffers(x, w).execute(h)
    got_dx = Conv("conv_dgrad", h, x.shape, w.shape, y.shape, geo).buffers(dy, w).execute(h)
    got_dw = Conv("conv_wgrad", h, x.shape, w.shape, y.shape, geo).buffers(x, dy).execute(h)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref in ((got_y, y), (got_dx, dx), (got_dw, dw)):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got.get(), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["2d-groups-dilation-asym", "3d-all"])
def test_float32_is_float64_arithmetic_rounded_once(h, name):
    x, w, y, dy, dx, dw, geo = case(name, np.float32)
    for op, a, b, ref in (("conv_fprop", x, w, y), ("conv_dgrad", dy, w, dx), ("conv_wgrad", x, dy, dw)):
        got = Conv(op, h, x.shape, w.shape, y.shape, geo, np.float32).buffers(a, b).execute(h).get()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, ref.astype(np.float32), rtol=2e-7, atol=1e-6)


def test_output_dims_are_inferred_by_the_builder_as_the_real_one_does(h):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, handle=h)
    x = g.tensor(name="x", dim=[2, 4, 9, 8], stride=row_major([2, 4, 9, 8]))
    w = g.tensor(name="w", dim=[6, 2, 3, 3], stride=row_major([6, 2, 3, 3]))
    y = g.conv_fprop(image=x, weight=w, padding=[1, 1], stride=[2, 1], dilation=[1, 1])
    assert y.get_dim() == [2, 6, 5, 8] and y.get_stride() == row_major([2, 6, 5, 8]) and y.get_is_virtual()
    dx = g.conv_dgrad(loss=y, filter=w, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    assert dx.get_dim() == [2, 2, 5, 8]
    dw = g.conv_wgrad(image=x, loss=y, padding=[1, 1], stride=[2, 1], dilation=[1, 1])
    assert dw.get_dim() == []  # a filter gradient's dims are the caller's to set


def test_channels_last_strides_and_raw_pointers(h):
    """Explicit strides describe the caller's layout (an NHWC array bound as NCHW), and a raw device
    pointer borrows the declared layout."""
    x, w, y, dy, dx, dw, geo = case("2d-groups-dilation-asym")
    t = cudnn.data_type.DOUBLE
    g = cudnn.pygraph(io_data_type=t, compute_data_type=t, handle=h)
    n, c, hh, ww = x.shape
    tx = g.tensor(name="x", dim=list(x.shape), stride=[hh * ww * c, 1, ww * c, c], data_type=t)
    tw = g.tensor(name="w", dim=list(w.shape), stride=row_major(w.shape), data_type=t)
    ty = g.conv_fprop(image=tx, weight=tw, pre_padding=geo[0], post_padding=geo[1], stride=geo[2],
                      dilation=geo[3])
    ty.set_output(True)
    g.build([cudnn.heur_mode.A])
    nhwc = cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
    W, Y = cupy.asarray(w), cupy.zeros(y.shape)
    ws = cupy.empty(g.get_workspace_size(), dtype=np.uint8)
    g.execute({tx: nhwc.transpose(0, 3, 1, 2), "w": W.data.ptr, ty.get_uid(): Y}, ws.data.ptr, handle=h)
    np.testing.assert_allclose(Y.get(), y, rtol=1e-12, atol=1e-12)


def test_a_dense_buffer_of_other_dims_is_taken_as_declared(h):
    x, w, y, dy, dx, dw, geo = case("1d-groups-stride-asym")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo).buffers(x, w)
    flat = cupy.asarray(x.ravel())
    np.testing.assert_allclose(c.execute(h, a=flat).get(), y, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- launches, streams, capture
def test_execute_is_one_launch_on_the_handle_stream_checked_for_order(h):
    x, w, y, dy, dx, dw, geo = case("2d-depthwise")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo).buffers(x, w)
    _standin.reset_launches()
    c.execute(h)
    assert _standin.launches() == {"cudnn.execute": 1}
    other = cupy.cuda.Stream(non_blocking=True)
    with other, pytest.raises(_standin.RaceError, match="last written on"):
        c.O * 2  # the output read on another stream with no event after the execute


def test_workspace_is_written_so_sharing_it_across_streams_races(h):
    x, w, y, dy, dx, dw, geo = case("2d-depthwise")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo).buffers(x, w)
    c.execute(h)
    s2 = cupy.cuda.Stream(non_blocking=True)
    s2.wait_event(cupy.cuda.get_current_stream().record())
    h2 = cudnn.create_handle()
    cudnn.set_stream(handle=h2, stream=s2.ptr)
    with s2:
        out2 = cupy.zeros(y.shape)
    c.execute(h)  # the workspace is written again on the first stream, after s2 waited
    with s2, pytest.raises(_standin.RaceError):
        c.g.execute({c.a: c.A, c.b: c.B, c.out: out2}, c.ws, handle=h2)


def test_capture_records_execute_and_a_replay_recomputes_on_new_data(h):
    x, w, y, dy, dx, dw, geo = case("2d-groups-dilation-asym")
    convs = [Conv(op, h, x.shape, w.shape, y.shape, geo) for op in ("conv_fprop", "conv_dgrad", "conv_wgrad")]
    X, W, DY = cupy.zeros(x.shape), cupy.zeros(w.shape), cupy.zeros(y.shape)
    outs = [cupy.zeros(c.shapes[2]) for c in convs]
    wss = [cupy.empty(c.g.get_workspace_size(), dtype=np.uint8) for c in convs]
    ins = [(X, W), (DY, W), (X, DY)]
    s, pool = cupy.cuda.get_current_stream(), cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        s.begin_capture()
        for c, (a, b), o, ws in zip(convs, ins, outs, wss):
            c.g.execute({c.a: a, c.b: b, c.out: o}, ws, handle=h)
        graph = s.end_capture()
    np.testing.assert_array_equal(outs[0].get(), 0)  # nothing ran until the graph is launched
    for _ in range(2):
        x, w = RNG.standard_normal(x.shape), RNG.standard_normal(w.shape)
        ry, rdy, rdx, rdw = torch_conv(x, w, None, *geo)
        X.set(x, stream=s), W.set(w, stream=s), DY.set(rdy, stream=s)
        _standin.reset_launches()
        _standin.reset_host_syncs()
        graph.launch(stream=s)
        assert _standin.launches() == {"cudnn.execute": 3} and _standin.host_syncs() == {}
        s.synchronize()
        for got, ref in zip(outs, (ry, rdx, rdw)):
            np.testing.assert_allclose(got.get(), ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- refusals
@pytest.fixture
def rule(monkeypatch):
    """``rule("name")`` switches one refusal off for the rest of the test."""
    return lambda name: monkeypatch.setitem(_bind.RULES, name, False)


@pytest.fixture
def conv(h):
    x, w, y, dy, dx, dw, geo = case("2d-groups-dilation-asym")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo).buffers(x, w)
    assert c.g.get_workspace_size() > 0
    return c


def test_a_workspace_smaller_than_the_plan_asks_is_refused(h, conv, rule):
    need = conv.g.get_workspace_size()
    short = cupy.empty(need - 1, dtype=np.uint8)
    with pytest.raises(ValueError, match=f"workspace has {need - 1} bytes but the plan needs {need}"):
        conv.execute(h, ws=short)
    with pytest.raises(ValueError, match=f"needs a workspace of {need} bytes"):
        conv.execute(h, ws=None)
    with pytest.raises(ValueError, match="runs past the end"):
        conv.execute(h, ws=short.data.ptr)
    rule("workspace")
    conv.execute(h, ws=short)


def test_planning_during_a_capture_is_refused_and_invalidates_it(h, rule):
    x, w, y, dy, dx, dw, geo = case("1d-groups-stride-asym")
    s = cupy.cuda.get_current_stream()
    for step in ("build_operation_graph", "create_execution_plans", "check_support", "build_plans", "build"):
        c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo, build=False)
        c.g.validate()
        if step in ("check_support",):
            c.g.create_execution_plans()
        s.begin_capture()
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnsupported.*before the capture"):
            getattr(c.g, step)()
        with pytest.raises(runtime.CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    rule("capture")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo, build=False)
    s.begin_capture()
    c.build()
    s.end_capture()


def test_a_pointer_that_is_not_a_live_allocation_is_refused(h, conv, rule):
    with pytest.raises(ValueError, match="is not a live allocation"):
        conv.execute(h, a=0x1234)
    gone = cupy.zeros(conv.shapes[0])
    ptr = gone.data.ptr
    del gone
    with pytest.raises(ValueError, match="'a'.*is not a live allocation"):
        conv.execute(h, a=ptr)
    with pytest.raises(TypeError, match="host numpy.ndarray"):
        conv.execute(h, a=np.zeros(conv.shapes[0]))
    rule("pointer")
    conv.execute(h, a=ptr)


def test_a_buffer_of_the_wrong_extent_or_type_is_refused(h, conv, rule):
    big = cupy.zeros((conv.shapes[0][0] + 1,) + tuple(conv.shapes[0][1:]))
    with pytest.raises(ValueError, match="has shape .* but the graph declares dim"):
        conv.execute(h, a=big[1:, :, :-1])
    with pytest.raises(ValueError, match="is float32 but the graph declares"):
        conv.execute(h, a=conv.A.astype(np.float32))
    small = cupy.zeros(int(np.prod(conv.shapes[0])) - 1)
    with pytest.raises(ValueError, match="runs past the end"):
        conv.execute(h, a=small.data.ptr)
    rule("extent")
    conv.execute(h, a=big[1:, :, :-1])


def test_execute_on_another_stream_than_the_handle_s_is_refused(h, conv, rule):
    other = cupy.cuda.Stream(non_blocking=True)
    other.wait_event(cupy.cuda.get_current_stream().record())
    with other, pytest.raises(_standin.RaceError, match="handle's stream is .* but the current CuPy stream"):
        conv.execute(h)
    fresh = cudnn.create_handle()  # never set: stream 0, the legacy stream
    with pytest.raises(_standin.RaceError, match="handle's stream is 0x0"):
        conv.execute(fresh)
    rule("stream")
    cupy.cuda.get_current_stream().synchronize()
    with other:
        conv.execute(h)


def test_execute_before_build_plans_is_refused(h, rule):
    x, w, y, dy, dx, dw, geo = case("1d-groups-stride-asym")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo, build=False)
    c.g.validate()
    c.g.create_execution_plans()
    with pytest.raises(RuntimeError, match="Call build\\(\\) first"):
        c.g.get_workspace_size()
    pack = {c.a: cupy.asarray(x), c.b: cupy.asarray(w), c.out: cupy.zeros(y.shape)}
    with pytest.raises(RuntimeError, match="before build_plans"):
        c.g.execute(pack, cupy.empty(1 << 16, dtype=np.uint8), handle=h)
    rule("built")
    c.g.execute(pack, cupy.empty(1 << 16, dtype=np.uint8), handle=h)
    np.testing.assert_allclose(pack[c.out].get(), y, rtol=1e-12, atol=1e-12)


def test_a_handle_or_buffer_of_another_device_is_refused(h, conv, rule):
    with cupy.cuda.Device(1):
        s1 = cupy.cuda.Stream(non_blocking=True)
        other_dev = cupy.zeros(conv.shapes[0])
        cupy.cuda.Device(1).synchronize()
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH"):
        cudnn.set_stream(handle=h, stream=s1.ptr)
    with pytest.raises(ValueError, match="is on device 1"):
        conv.execute(h, a=other_dev)
    with cupy.cuda.Device(1), s1, pytest.raises(RuntimeError, match="created on device 0 but device 1"):
        conv.execute(h)
    rule("device")
    conv.execute(h, a=other_dev)


def test_what_no_engine_supports_raises_cudnn_graph_not_supported(h):
    x, w, y, dy, dx, dw, geo = case("1d-groups-stride-asym")
    t, f = cudnn.data_type.DOUBLE, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=t, compute_data_type=f, handle=h)
    tx = g.tensor(name="x", dim=list(x.shape), stride=row_major(x.shape))
    tw = g.tensor(name="w", dim=list(w.shape), stride=row_major(w.shape))
    g.conv_fprop(image=tx, weight=tw, padding=[1], stride=[1], dilation=[1]).set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="compute in"):
        g.build([cudnn.heur_mode.A])
    g = cudnn.pygraph(io_data_type=t, compute_data_type=t, handle=h)
    tx = g.tensor(name="x", dim=list(x.shape), stride=row_major(x.shape))
    tw = g.tensor(name="w", dim=list(w.shape), stride=row_major(w.shape))
    g.conv_fprop(image=tx, weight=tw, padding=[1], stride=[1], dilation=[1])  # never set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="virtual"):
        g.build([cudnn.heur_mode.A])


def test_graph_state_errors_are_the_real_frontend_s(h):
    x, w, y, dy, dx, dw, geo = case("1d-groups-stride-asym")
    c = Conv("conv_fprop", h, x.shape, w.shape, y.shape, geo)
    with pytest.raises(RuntimeError, match="planning is one-shot"):
        c.g.create_execution_plans()
    with pytest.raises(RuntimeError, match="the graph is frozen"):
        c.out.set_dim([1, 1, 1])
    g = cudnn.pygraph(io_data_type=cudnn.data_type.DOUBLE, handle=h)
    tx = g.tensor(name="x", dim=list(x.shape), stride=row_major(x.shape))
    tw = g.tensor(name="w", dim=list(w.shape), stride=row_major(w.shape))
    g.conv_fprop(image=tx, weight=tw, padding=[1], dilation=[1]).set_output(True)
    with pytest.raises(RuntimeError, match="Conv strides not set"):
        g.validate()
    with pytest.raises(RuntimeError, match="not the convolution's"):
        Conv("conv_dgrad", h, x.shape, w.shape, (2, 4, 3), geo)


# ---------------------------------------------------------------- batch-norm nodes
class Norm:
    """One batch-norm node in its own graph (as lbannpy's cudnn_bn builds them), planned on handle ``h``."""

    def __init__(self, op, h, image, dtype=np.float64, eps=1e-5):
        t = DT[dtype]
        chan = [1, image[1]] + [1] * (len(image) - 2)
        self.g = cudnn.pygraph(io_data_type=t, intermediate_data_type=t, compute_data_type=t, handle=h)

        def tensor(name, shape):
            return self.g.tensor(name=name, dim=list(shape), stride=row_major(shape), data_type=t)
        if op == "batchnorm":
            self.ins = {"x": tensor("x", image), "scale": tensor("scale", chan), "bias": tensor("bias", chan)}
            self.eps = self.g.tensor_scalar(eps, t, name="eps")
            outs = self.g.batchnorm(self.ins["x"], self.ins["scale"], self.ins["bias"], epsilon=self.eps,
                                    name="bn")
            assert outs[3:] == [None, None]
            names = ("y", "mean", "inv")
        elif op == "batchnorm_inference":
            self.ins = {k: tensor(k, image if k == "x" else chan)
                        for k in ("x", "mean", "inv", "scale", "bias")}
            outs = [self.g.batchnorm_inference(self.ins["x"], self.ins["mean"], self.ins["inv"],
                                               self.ins["scale"], self.ins["bias"])]
            names = ("y",)
        else:
            self.ins = {k: tensor(k, image if k in ("dy", "x") else chan)
                        for k in ("dy", "x", "scale", "mean", "inv")}
            outs = self.g.batchnorm_backward(*self.ins.values())
            names = ("dx", "dscale", "dbias")
        self.outs = dict(zip(names, outs[:len(names)]))
        for o in self.outs.values():
            o.set_output(True).set_data_type(t)
        self.g.build([cudnn.heur_mode.A])
        self.dtype, self.image, self.chan = dtype, image, chan

    def execute(self, h, arrays, ws=None):
        outs = {k: cupy.zeros(self.image if k in ("y", "dx") else self.chan, dtype=self.dtype)
                for k in self.outs}
        pack = {t: cupy.asarray(np.asarray(arrays[k], self.dtype)) for k, t in self.ins.items()}
        pack.update({t: outs[k] for k, t in self.outs.items()})
        need = self.g.get_workspace_size()
        self.g.execute(pack, cupy.empty(max(need, 1), dtype=np.uint8) if ws is None else ws, handle=h)
        return {k: v.get() for k, v in outs.items()}


def _torch_bn(x, scale, bias, dy, eps=1e-5):
    xt = torch.tensor(x, requires_grad=True)
    st, bt = torch.tensor(scale.ravel(), requires_grad=True), torch.tensor(bias.ravel(), requires_grad=True)
    y = F.batch_norm(xt, None, None, st, bt, training=True, eps=eps)
    y.backward(torch.tensor(dy))
    return y.detach().numpy(), xt.grad.numpy(), st.grad.numpy(), bt.grad.numpy()


@pytest.mark.parametrize("image", [(3, 4, 5, 6), (2, 3, 4, 3, 5)])
def test_batchnorm_passes_equal_torch_in_float64(h, image):
    chan = [1, image[1]] + [1] * (len(image) - 2)
    x, dy = RNG.standard_normal(image) * 3 + 1, RNG.standard_normal(image)
    scale, bias = RNG.standard_normal(chan), RNG.standard_normal(chan)
    y, dx, ds, db = _torch_bn(x, scale, bias, dy)
    got = Norm("batchnorm", h, image).execute(h, {"x": x, "scale": scale, "bias": bias})
    np.testing.assert_allclose(got["y"], y, rtol=1e-12, atol=1e-12)
    axes = (0,) + tuple(range(2, x.ndim))
    np.testing.assert_allclose(got["mean"], x.mean(axis=axes, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(got["inv"], 1 / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5), rtol=1e-13)
    back = Norm("batchnorm_backward", h, image).execute(
        h, {"dy": dy, "x": x, "scale": scale, "mean": got["mean"], "inv": got["inv"]})
    np.testing.assert_allclose(back["dx"], dx, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(back["dscale"].ravel(), ds, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(back["dbias"].ravel(), db, rtol=1e-12, atol=1e-12)
    inf = Norm("batchnorm_inference", h, image).execute(
        h, {"x": x, "mean": got["mean"], "inv": got["inv"], "scale": scale, "bias": bias})
    np.testing.assert_allclose(inf["y"], y, rtol=1e-12, atol=1e-12)


def test_batchnorm_float32_is_float64_arithmetic_rounded_once(h):
    image = (3, 4, 5, 6)
    chan = [1, 4, 1, 1]
    x = RNG.standard_normal(image).astype(np.float32).astype(np.float64)
    scale, bias = np.ones(chan), np.zeros(chan)
    got = Norm("batchnorm", h, image, np.float32).execute(h, {"x": x, "scale": scale, "bias": bias})
    y = _torch_bn(x, scale, bias, np.zeros(image))[0]
    assert got["y"].dtype == np.float32 and got["inv"].dtype == np.float32
    np.testing.assert_allclose(got["y"], y.astype(np.float32), rtol=2e-7, atol=1e-6)


def test_batchnorm_training_passes_ask_for_a_workspace_and_a_short_one_is_refused(h, rule):
    n = Norm("batchnorm", h, (2, 3, 4, 4))
    need = n.g.get_workspace_size()
    assert need > 0 and Norm("batchnorm_inference", h, (2, 3, 4, 4)).g.get_workspace_size() == 0
    arrays = {"x": RNG.standard_normal((2, 3, 4, 4)), "scale": np.ones((1, 3, 1, 1)),
              "bias": np.zeros((1, 3, 1, 1))}
    with pytest.raises(ValueError, match="the plan needs"):
        n.execute(h, arrays, ws=cupy.empty(need - 1, dtype=np.uint8))
    rule("workspace")
    n.execute(h, arrays, ws=cupy.empty(need - 1, dtype=np.uint8))


def test_batchnorm_capture_records_execute_and_replays_on_new_data(h):
    image = (2, 3, 4, 5)
    n = Norm("batchnorm", h, image)
    X, S, B = cupy.zeros(image), cupy.ones((1, 3, 1, 1)), cupy.zeros((1, 3, 1, 1))
    Y, M, V = cupy.zeros(image), cupy.zeros((1, 3, 1, 1)), cupy.zeros((1, 3, 1, 1))
    ws = cupy.empty(n.g.get_workspace_size(), dtype=np.uint8)
    s = cupy.cuda.get_current_stream()
    with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):
        s.begin_capture()
        n.g.execute({n.ins["x"]: X, n.ins["scale"]: S, n.ins["bias"]: B, n.outs["y"]: Y, n.outs["mean"]: M,
                     n.outs["inv"]: V}, ws, handle=h)
        graph = s.end_capture()
    for _ in range(2):
        x = RNG.standard_normal(image)
        X.set(x, stream=s)
        _standin.reset_host_syncs()
        graph.launch(stream=s)
        assert _standin.host_syncs() == {}
        s.synchronize()
        np.testing.assert_allclose(Y.get(), _torch_bn(x, np.ones(3), np.zeros(3), np.zeros(image))[0],
                                   rtol=1e-12, atol=1e-12)


def test_batchnorm_ports_the_standin_does_not_model_are_refused(h):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.DOUBLE, handle=h)
    x, c = g.tensor(dim=[2, 3, 4, 4]), g.tensor(dim=[1, 3, 1, 1])
    eps = g.tensor_scalar(1e-5, cudnn.data_type.DOUBLE)
    with pytest.raises(TypeError, match="running statistics"):
        g.batchnorm(x, c, c, in_running_mean=c, in_running_var=c, epsilon=eps,
                    momentum=g.tensor_scalar(0.1, cudnn.data_type.DOUBLE))
    with pytest.raises(TypeError, match="peer_stats"):
        g.batchnorm(x, c, c, epsilon=eps, peer_stats=[c])
    with pytest.raises(TypeError, match="missing tensor argument"):
        g.batchnorm(x, c, c)


def test_a_pass_by_value_scalar_is_not_a_buffer(h):
    n = Norm("batchnorm", h, (2, 3, 4, 4))
    eps = n.eps
    assert eps.is_pass_by_value and eps.pass_by_value == 1e-5
    pack = {n.ins["x"]: cupy.zeros((2, 3, 4, 4)), n.ins["scale"]: cupy.ones((1, 3, 1, 1)),
            n.ins["bias"]: cupy.zeros((1, 3, 1, 1)), n.outs["y"]: cupy.zeros((2, 3, 4, 4)),
            n.outs["mean"]: cupy.zeros((1, 3, 1, 1)), n.outs["inv"]: cupy.zeros((1, 3, 1, 1)),
            eps: cupy.zeros((1, 1, 1, 1))}
    with pytest.raises(ValueError, match="pass-by-value scalar"):
        n.g.execute(pack, cupy.empty(n.g.get_workspace_size(), dtype=np.uint8), handle=h)


def test_what_no_norm_engine_supports_raises_cudnn_graph_not_supported(h):
    d, f = cudnn.data_type.DOUBLE, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=d, compute_data_type=d, handle=h)
    x, c = g.tensor(dim=[2, 3, 4, 4]), g.tensor(dim=[1, 3, 1, 1], data_type=f)
    for o in g.batchnorm(x, c, c, epsilon=g.tensor_scalar(1e-5, d))[:3]:
        o.set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="per-channel tensors"):
        g.build([cudnn.heur_mode.A])
    g = cudnn.pygraph(io_data_type=d, compute_data_type=d, handle=h)
    x, c = g.tensor(dim=[2, 3, 4, 4]), g.tensor(dim=[1, 3, 1, 1])
    y = g.batchnorm_inference(x, c, c, c, c)
    g.conv_fprop(image=y, weight=g.tensor(dim=[3, 3, 1, 1]), padding=[0, 0], stride=[1, 1],
                 dilation=[1, 1]).set_output(True)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="alone|one norm node"):
        g.build([cudnn.heur_mode.A])
    g = cudnn.pygraph(io_data_type=d, compute_data_type=d, handle=h)
    x, c = g.tensor(dim=[2, 3, 4, 4]), g.tensor(dim=[1, 4, 1, 1])
    g.batchnorm_inference(x, c, c, c, c).set_output(True)
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_BAD_PARAM"):
        g.validate()
