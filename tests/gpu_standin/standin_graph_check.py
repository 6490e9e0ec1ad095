"""Stream capture in the CuPy stand-in (``Stream.begin_capture`` / ``end_capture`` / ``cupy.cuda.Graph``):
replay on new data against NumPy on the host, and each refusal CUDA makes during a capture. Run by
tests/test_gpu_standin_graph.py in a subprocess whose PYTHONPATH starts with tests/gpu_standin."""
import ctypes
import gc

import numpy as np
import pytest

import cupy
from cupy import _standin
from cupy.cuda import runtime

CUDAError = runtime.CUDARuntimeError
RNG = np.random.default_rng(34)
relu = cupy.ElementwiseKernel("T x", "T y", "y = x > 0 ? x : 0;", "graph_relu")
sumsq = cupy.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "graph_sumsq")


def side_stream():
    """A non-blocking stream ordered after the work issued so far on the current stream."""
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    return s


def sites(fn):
    """The ``file:line`` strings of ``fn``'s lines: a refusal of a call made in ``fn`` names one of them."""
    return {f"{__file__}:{line}" for _, _, line in fn.__code__.co_lines() if line}


def pinned(shape, dtype=np.float64):
    """A host array over memory the stand-in treats as page-locked (``_standin.is_pinned``): a buffer
    object marked as such, as an array over CuPy's ``PinnedMemoryPointer`` has that object as its base."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = type("PinnedBuffer", (ctypes.Array,), {"_type_": ctypes.c_uint8, "_length_": nbytes,
                                                  "_standin_pinned": True})()
    return np.ndarray(shape, dtype, buffer=buf)


# ---------------------------------------------------------------- capture and replay
def test_replay_computes_kernels_reductions_and_copies_on_new_data():
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    wh = RNG.standard_normal((3, 4))
    x = cupy.zeros((3, 4))                    # the static input the graph reads
    w = cupy.asarray(wh)
    acc = cupy.zeros(3)                       # made before the capture, accumulated by every launch
    copy = cupy.zeros(3)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        assert s.is_capturing() and runtime.streamIsCapturing(s.ptr)
        y = x * w - 0.5                       # NumPy-protocol operations
        z = relu(y)                           # ElementwiseKernel
        t = sumsq(z, axis=1)                  # ReductionKernel
        m = z.sum()                           # a reduction to a 0-d device array
        acc += t                              # in place on a buffer from before the capture
        cupy.copyto(copy, t)                  # a device-to-device copy
        col = z[:, 1].copy()                  # a view, then a copy of it
        g = s.end_capture()
    assert isinstance(g, cupy.cuda.Graph) and not s.is_capturing()
    # nothing ran: buffers made in the capture hold garbage, older ones their old contents
    assert np.isnan(z.get()).all() and np.isnan(m.get())
    np.testing.assert_array_equal(acc.get(), np.zeros(3))
    np.testing.assert_array_equal(copy.get(), np.zeros(3))
    total = np.zeros(3)
    for k in range(3):
        h = RNG.standard_normal((3, 4))
        x.set(h, stream=s)
        _standin.reset_launches()
        _standin.reset_host_syncs()
        g.launch(stream=s)
        assert _standin.host_syncs() == {} and _standin.graph_launches() == 1
        s.synchronize()
        ref = np.maximum(h * wh - 0.5, 0)
        total += (ref ** 2).sum(axis=1)
        np.testing.assert_allclose(z.get(), ref, rtol=1e-15)
        np.testing.assert_allclose(t.get(), (ref ** 2).sum(axis=1), rtol=1e-14)
        np.testing.assert_allclose(float(m), ref.sum(), rtol=1e-14)
        np.testing.assert_allclose(acc.get(), total, rtol=1e-14)
        np.testing.assert_allclose(copy.get(), (ref ** 2).sum(axis=1), rtol=1e-14)
        np.testing.assert_array_equal(col.get(), ref[:, 1])


def test_launch_counts_equal_the_eager_run():
    """The graph's launches are the eager step's kernels, one each, and a launch makes no host sync."""
    def step(x, w, acc):
        y = relu(x * w)
        acc += sumsq(y, axis=0)
        return y

    xh, wh = RNG.standard_normal((2, 5)), RNG.standard_normal((2, 5))
    x, w, acc = cupy.asarray(xh), cupy.asarray(wh), cupy.zeros(5)
    cupy.cuda.get_current_stream().synchronize()
    _standin.reset_launches()
    step(x, w, acc)
    eager = _standin.launches()
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        step(x, w, acc)
        g = s.end_capture()
    _standin.reset_launches()
    _standin.reset_host_syncs()
    g.launch(s)
    g.launch(s)
    assert _standin.launches() == {k: 2 * v for k, v in eager.items()}
    assert _standin.graph_launches() == 2 and _standin.host_syncs() == {}
    s.synchronize()
    ref = (np.maximum(xh * wh, 0) ** 2).sum(axis=0)
    np.testing.assert_allclose(acc.get(), 3 * ref, rtol=1e-14)


def test_a_stream_joined_by_events_is_captured_and_replayed():
    pool, s, s2 = cupy.cuda.MemoryPool(), side_stream(), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(5)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        a = x * 2.0
        s2.wait_event(s.record())             # s2 joins the capture
        assert s2.is_capturing()
        with s2:
            b = a + 1.0                       # recorded on s2
            c = x * 10.0
        s.wait_event(s2.record())             # joined back
        d = b * c
        g = s.end_capture()
    assert not s2.is_capturing()
    for _ in range(2):
        h = RNG.standard_normal(5)
        x.set(h, stream=s)
        g.launch(s)
        s.synchronize()
        np.testing.assert_allclose(d.get(), (2 * h + 1) * (10 * h), rtol=1e-15)


def test_end_capture_refuses_a_stream_not_joined_back():
    pool, s, s2 = cupy.cuda.MemoryPool(), side_stream(), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(5)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        s2.wait_event(s.record())
        with s2:
            x * 2.0
        with pytest.raises(CUDAError, match="cudaErrorStreamCaptureUnjoined"):
            s.end_capture()
    assert not s.is_capturing() and not s2.is_capturing()


def test_order_inside_the_capture_is_checked():
    """A joined stream reading what the origin wrote after the fork, with no event, races in the graph."""
    pool, s, s2 = cupy.cuda.MemoryPool(), side_stream(), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(5)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        s2.wait_event(s.record())
        a = x * 2.0                           # after the fork: not ordered before s2's work
        with s2:
            with pytest.raises(_standin.RaceError, match="no event ordering them inside the capture"):
                a + 1.0
        with pytest.raises(CUDAError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()


def test_replay_is_ordered_against_work_outside_the_graph():
    pool, s, other = cupy.cuda.MemoryPool(), side_stream(), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x + 1.0
        g = s.end_capture()
    other.wait_event(cupy.cuda.get_current_stream().record())
    x.set(np.ones(4), stream=other)           # the graph's input, written on another stream
    with pytest.raises(_standin.RaceError, match="touches buffer"):
        g.launch(s)
    s.wait_event(other.record())
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(y.get(), np.full(4, 2.0))


def test_a_graph_launched_inside_a_capture_is_a_child_node():
    x = cupy.zeros(3)
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x + 1.0
        inner = s.end_capture()
        s.begin_capture()
        inner.launch(s)
        z = y * 2.0
        outer = s.end_capture()
    h = RNG.standard_normal(3)
    x.set(h, stream=s)
    outer.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(z.get(), (h + 1) * 2)


def test_capture_api_as_cupy():
    with pytest.raises(RuntimeError, match="cannot capture on the default"):
        cupy.cuda.Stream.null.begin_capture()
    with pytest.raises(NotImplementedError):
        cupy.cuda.Graph()
    s = cupy.cuda.Stream(non_blocking=True)
    assert s.is_capturing() is False and runtime.streamIsCapturing(s.ptr) is False
    with pytest.raises(CUDAError, match="not capturing"):
        s.end_capture()
    assert (runtime.streamCaptureModeGlobal, runtime.streamCaptureModeThreadLocal,
            runtime.streamCaptureModeRelaxed) == (0, 1, 2)


def test_what_a_capture_allows_outside_it():
    """Work, syncs and plain allocations on streams outside the capture, on buffers it does not write."""
    pool, other = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(3)
    s = side_stream()
    other.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x + 1.0
        with other:
            u = cupy.arange(3.0) * 2          # another stream: not in the capture
            v = x * 5.0                       # reads what the capture only reads
            other.synchronize()
        g = s.end_capture()
    np.testing.assert_array_equal(u.get(), [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(v.get(), np.zeros(3))
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(y.get(), np.ones(3))


# ---------------------------------------------------------------- refusals, each with the call site
def _refused(op, match, exc=CUDAError, pool=True, invalidates=True):
    """``op(s, x, y)`` during a capture on ``s`` (``y`` already captured) raises ``exc`` naming the call
    site; CUDA's refusals invalidate the capture, CuPy's (a RuntimeError before CUDA is called) do not."""
    mp, s = cupy.cuda.MemoryPool(), side_stream()
    x = cupy.arange(6.0)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(mp.malloc if pool else None), s:
        s.begin_capture()
        y = x * 2.0 if pool else None
        with pytest.raises(exc, match=match) as err:
            op(s, x, y)
        assert any(site in str(err.value) for site in sites(op)), str(err.value)
        if not invalidates:
            assert s.is_capturing()
            assert isinstance(s.end_capture(), cupy.cuda.Graph)
            return
        with pytest.raises(RuntimeError, match="invalidated"):
            s.is_capturing()
        with pytest.raises(CUDAError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    assert not s.is_capturing()


CUDA_SYNCS = {  # refused by CUDA, which invalidates the capture
    "Stream.synchronize": lambda s, x, y: s.synchronize(),
    "Device.synchronize": lambda s, x, y: cupy.cuda.Device().synchronize(),
    "runtime.deviceSynchronize": lambda s, x, y: runtime.deviceSynchronize(),
    "Event.synchronize": lambda s, x, y: s.record().synchronize(),
    "Event.done": lambda s, x, y: s.record().done,
    "Stream.done": lambda s, x, y: s.done,
}
READS = {  # device-to-host reads on the capturing stream, refused by CuPy before CUDA sees them
    "ndarray.get": lambda s, x, y: y.get(),
    "cupy.asnumpy": lambda s, x, y: cupy.asnumpy(y),
    "ndarray.item": lambda s, x, y: y.sum().item(),
    "float": lambda s, x, y: float(y[0]),
    "bool": lambda s, x, y: bool(y[0]),
    "int": lambda s, x, y: int(y[0]),
    "ndarray.tolist": lambda s, x, y: y.tolist(),
    "cupy.bincount": lambda s, x, y: cupy.bincount(cupy.arange(3)),
}


@pytest.mark.parametrize("name", list(CUDA_SYNCS))
def test_a_host_sync_is_refused_and_invalidates_the_capture(name):
    _refused(CUDA_SYNCS[name], "cudaErrorStreamCaptureUnsupported|cudaErrorCapturedEvent")


@pytest.mark.parametrize("name", list(READS))
def test_a_device_to_host_read_is_refused(name):
    _refused(READS[name], "the current stream is capturing, so D2H transfers are disallowed",
             exc=RuntimeError, invalidates=False)


def test_an_elapsed_time_of_a_captured_event_is_refused():
    _refused(lambda s, x, y: cupy.cuda.get_elapsed_time(s.record(), s.record()), "cudaErrorCapturedEvent",
             invalidates=False)


def test_a_read_refusal_names_the_kind():
    _refused(lambda s, x, y: y.get(), r"\(ndarray.get during the capture begun on", exc=RuntimeError,
             invalidates=False)


@pytest.mark.parametrize("source", ["pageable", "pinned"])
def test_a_host_to_device_copy_into_the_capture_is_refused(source):
    host = np.ones(6) if source == "pageable" else pinned((6,))
    _refused(lambda s, x, y: x.set(host, stream=s), "H2D transfers are disallowed .ndarray.set",
             exc=RuntimeError, invalidates=False)


def test_an_upload_into_the_capture_is_refused():
    _refused(lambda s, x, y: cupy.asarray(np.ones(3)), "H2D transfers are disallowed .cupy.asarray",
             exc=RuntimeError, invalidates=False)


def test_a_copy_on_a_stream_outside_the_capture_is_allowed():
    """The graph's static input is filled outside the graph, on another stream, while it is captured."""
    x = cupy.zeros(6)
    pool, s, other = cupy.cuda.MemoryPool(), side_stream(), cupy.cuda.Stream(non_blocking=True)
    other.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x * 2.0
        x.set(np.full(6, 3.0), stream=other)
        g = s.end_capture()
    s.wait_event(other.record())
    g.launch(s)
    s.synchronize()
    np.testing.assert_array_equal(y.get(), np.full(6, 6.0))


def test_an_allocation_without_a_capture_pool_is_refused():
    _refused(lambda s, x, y: x * 3.0, "outside the capture's memory pool|default allocator", pool=False)


def test_an_allocation_from_another_pool_is_refused():
    other = cupy.cuda.MemoryPool()

    def op(s, x, y):
        with cupy.cuda.using_allocator(other.malloc):
            return x * 3.0
    _refused(op, "from another pool")


def test_work_on_a_stream_outside_the_capture_on_its_buffers_is_refused():
    other = cupy.cuda.Stream(non_blocking=True)

    def op(s, x, y):
        with other:
            return y + 1.0
    _refused(op, "did not join", exc=_standin.RaceError)


def test_the_legacy_stream_beside_a_blocking_capturing_stream_is_refused():
    x = cupy.zeros(4)
    pool, s = cupy.cuda.MemoryPool(), cupy.cuda.Stream()  # a blocking stream
    s.wait_event(cupy.cuda.get_current_stream().record())
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        with cupy.cuda.Stream.null:
            with pytest.raises(CUDAError, match="cudaErrorStreamCaptureImplicit") as err:
                x + 1.0
        assert f"{__file__}:" in str(err.value)
        with pytest.raises(CUDAError, match="cudaErrorStreamCaptureInvalidated"):
            s.end_capture()
    s2 = side_stream()                                    # a non-blocking one does not sync with it
    with cupy.cuda.using_allocator(pool.malloc), s2:
        s2.begin_capture()
        with cupy.cuda.Stream.null:
            y = x + 1.0
        s2.end_capture()
    np.testing.assert_array_equal(y.get(), np.ones(4))


def test_a_wait_on_an_event_from_outside_the_capture_is_refused():
    outside = cupy.cuda.Stream(non_blocking=True).record()
    _refused(lambda s, x, y: s.wait_event(outside), "cudaErrorStreamCaptureIsolation")


def test_a_freed_block_of_a_live_graph_is_not_handed_out_again():
    x = cupy.zeros(8)
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        tmp = x + 1.0                         # a temporary of the graph: written by every launch
        out = tmp * 2.0
        g = s.end_capture()
        del tmp                               # its block goes back to the pool, the graph still writes it
        gc.collect()
        assert pool.n_free_blocks() == 1
        with pytest.raises(_standin.RaceError, match="used by a live CUDA graph") as err:
            cupy.empty(8)
        assert f"{__file__}:" in str(err.value)
        g.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(out.get(), np.full(8, 2.0))
        del g                                 # the graph is gone: the block may be reused
        gc.collect()
        reused = cupy.empty(8)
        assert pool.n_free_blocks() == 0 and reused.size == 8


def test_a_freed_block_is_reused_inside_one_capture():
    """Within a capture a pool block freed and handed out again is ordered by the capture's own stream."""
    x = cupy.zeros(8)
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        tmp = x + 1.0
        first = tmp.data.ptr
        acc = tmp * 2.0
        del tmp
        tmp2 = x + 3.0                        # the same block, later on the same stream
        assert tmp2.data.ptr == first
        acc += tmp2
        g = s.end_capture()
    h = RNG.standard_normal(8)
    x.set(h, stream=s)
    g.launch(s)
    s.synchronize()
    np.testing.assert_allclose(acc.get(), (h + 1) * 2 + (h + 3), rtol=1e-15)


def test_lbannpy_batchnorm_and_pooling_kernels_replay_as_the_host_kernels():
    """lbannpy's GPU kernels of a batch-norm + ReLU + max-pool forward and backward, captured once and
    replayed on new batches, give its host kernels' numbers on each batch."""
    from lbannpy.layers.kernels import batchnorm as K
    from lbannpy.layers.kernels import pool as P

    shape, c = (2, 3, 6, 4), 3

    def step(x, d, g, b, rm, rv, gg, gb):
        count = float(np.prod(shape) // c)
        tot = K.bn_local_sums(x)
        y, mean, var, rm2, rv2 = K.bn_train_forward(x, tot, count, g, b, 1e-5, 0.1, rm, rv, relu=True)
        t2 = K.bn_backward_sums(d, x, mean, var, 1e-5, y=y)
        K.bn_add_param_grads(t2, gg, gb)                  # accumulates into gg, gb
        dx = K.bn_backward_data_summed(d, x, mean, var, g, 1e-5, t2, count, y=y)
        py, arg = P.max_pool_forward(y, (2, 2), (2, 2), 1)
        pdx = P.max_pool_backward(py, arg, shape, (2, 2), (2, 2), 1)
        return [y, mean, var, rm2, rv2, dx, py, pdx, gg, gb]

    def params(xp):
        return [xp.asarray(np.linspace(0.5, 1.5, c)), xp.asarray(np.linspace(-0.2, 0.3, c)),
                xp.asarray(np.full(c, 0.1)), xp.asarray(np.full(c, 0.9)), xp.zeros(c), xp.zeros(c)]

    x, d, dev, host = cupy.zeros(shape), cupy.zeros(shape), params(cupy), params(np)
    pool, s = cupy.cuda.MemoryPool(), side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        outs = step(x, d, *dev)
        g = s.end_capture()
    for _ in range(3):
        h, dy = RNG.standard_normal(shape) * 3 + 5, RNG.standard_normal(shape)
        x.set(h, stream=s)
        d.set(dy, stream=s)
        g.launch(s)
        s.synchronize()
        for got, want in zip(outs, step(h, dy, *host)):
            np.testing.assert_allclose(got.get(), want, rtol=1e-12, atol=1e-12)
