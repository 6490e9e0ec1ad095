"""Checks of the CuPy stand-in, run by tests/test_gpu_standin.py in a subprocess whose PYTHONPATH starts
with tests/gpu_standin (so the normal test process never imports the stand-in as ``cupy``)."""
import threading

import numpy as np
import pytest

import cupy
from cupy import _standin
from cupy.cuda import runtime


def test_is_the_standin():
    assert cupy.__file__.replace("\\", "/").endswith("tests/gpu_standin/cupy/__init__.py")


def test_no_implicit_host_conversion():
    x = cupy.arange(4, dtype=np.float32)
    assert not isinstance(x, np.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cupy.add(x, np.ones(4, np.float32))
    with pytest.raises(TypeError):
        x + np.ones(4, np.float32)


def test_reductions_are_device_scalars_and_syncs_are_counted():
    _standin.reset_host_syncs()
    x = cupy.arange(6, dtype=np.float64).reshape(2, 3)
    s = x.sum()
    assert isinstance(s, cupy.ndarray) and s.shape == ()
    assert _standin.host_syncs() == {}
    assert float(s) == 15.0
    assert x.argmax().item() == 5
    np.testing.assert_array_equal(cupy.asnumpy(x), np.arange(6.0).reshape(2, 3))
    syncs = _standin.host_syncs()
    assert sum(syncs.values()) == 3
    assert all(site.startswith(__file__) for _, site in syncs)  # call sites are outside the stand-in


def test_numpy_api_used_by_lbannpy():
    h = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x = cupy.asarray(h)
    np.testing.assert_allclose(cupy.matmul(x, x.T).get(), h @ h.T, rtol=1e-5)
    np.testing.assert_allclose(cupy.einsum("ij,kj->ik", x, x).get(), h @ h.T, rtol=1e-5)
    np.testing.assert_array_equal(cupy.where(x > 0, x, 0).get(), np.where(h > 0, h, 0))
    np.testing.assert_array_equal(cupy.concatenate([x, x]).get(), np.concatenate([h, h]))
    np.testing.assert_array_equal(cupy.bincount(cupy.asarray(np.array([0, 2, 2]))).get(), [1, 0, 2])
    np.testing.assert_allclose(cupy.exp(x).get(), np.exp(h), rtol=1e-6)
    assert cupy.ascontiguousarray(x.T).flags.c_contiguous
    assert x.astype(cupy.float64).dtype == np.float64
    assert cupy.get_array_module(x) is cupy and cupy.get_array_module(h) is np
    st = cupy.lib.stride_tricks.as_strided(x, (2, 2), (x.strides[0], x.strides[1]))
    np.testing.assert_array_equal(st.get(), h[:2, :2])


def test_views_share_memory_and_inplace():
    x = cupy.zeros((2, 3), dtype=np.float32)
    v = x[1]
    v += 5
    x.reshape(6)[0] = 7
    np.testing.assert_array_equal(x.get(), [[7, 0, 0], [5, 5, 5]])
    assert v.data.ptr == x.data.ptr + 3 * 4
    cupy.copyto(x[0], v)
    np.testing.assert_array_equal(x.get()[0], [5, 5, 5])
    # out=None is no out (CuPy allocates the result), out=x writes x and returns it
    y = cupy.maximum(x - 6, np.float32(0.5), out=None)
    np.testing.assert_array_equal(y.get(), [[0.5] * 3] * 2)
    assert cupy.maximum(x, np.float32(6), out=x) is x


def test_devices_are_per_thread():
    assert runtime.getDeviceCount() == 4
    with cupy.cuda.Device(2):
        a = cupy.ones(3)
        assert a.device.id == 2
        seen = []
        t = threading.Thread(target=lambda: seen.append(cupy.cuda.Device().id))
        t.start()
        t.join()
        assert seen == [0]
    with pytest.raises(ValueError, match="device"):
        a + 1  # device 0 is current, the array lives on device 2
    with pytest.raises(runtime.CUDARuntimeError):
        cupy.cuda.Device(4)


def test_cross_device_event_is_refused():
    with cupy.cuda.Device(1):
        e = cupy.cuda.Event()
    s = cupy.cuda.Stream(non_blocking=True)
    with pytest.raises(runtime.CUDARuntimeError, match="device"):
        s.wait_event(e)
    with pytest.raises(runtime.CUDARuntimeError, match="device"):
        e.record(s)


def test_race_without_event_raises_and_event_orders():
    a = cupy.ones(8, dtype=np.float32)
    side = cupy.cuda.Stream(non_blocking=True)
    with pytest.raises(_standin.RaceError, match="buffer"):
        with side:
            a *= 2                  # `a` was written on the null stream: `side` must wait for it first
    side.wait_event(cupy.cuda.get_current_stream().record())
    with side:
        a *= 2                      # written on `side`
    with pytest.raises(_standin.RaceError, match="last written on <Stream"):
        a.sum()                     # read on the null stream without ordering
    cupy.cuda.get_current_stream().wait_event(side.record())
    assert float(a.sum()) == 16.0
    with side:
        a += 1
    side.synchronize()              # a host sync also orders later launches
    assert float(a.sum()) == 24.0


def test_streams_and_events():
    s = cupy.cuda.Stream(non_blocking=True)
    assert isinstance(s.ptr, int) and s.ptr != 0 and cupy.cuda.Stream.null.ptr == 0
    with s:
        assert cupy.cuda.get_current_stream() is s
    assert cupy.cuda.get_current_stream() is not s
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(s)
    e1.record(s)
    e1.synchronize()
    assert e1.done and cupy.cuda.get_elapsed_time(e0, e1) >= 0
    with pytest.raises(runtime.CUDARuntimeError, match="disable_timing"):
        cupy.cuda.get_elapsed_time(cupy.cuda.Event(disable_timing=True), e1)


def test_nccl_pointer_checks_single_rank():
    from cupy.cuda import nccl
    uid = nccl.get_unique_id()
    assert isinstance(uid, tuple) and len(uid) == 128
    c = nccl.NcclCommunicator(1, uid, 0)
    x = cupy.arange(4, dtype=np.float32)
    y = cupy.empty(4, np.float32)
    s = cupy.cuda.get_current_stream().ptr
    c.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    np.testing.assert_array_equal(y.get(), [0, 1, 2, 3])
    with pytest.raises(ValueError, match="past the end"):
        c.allReduce(x.data.ptr, y.data.ptr, 5, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    with pytest.raises(ValueError, match="not a live allocation"):
        c.allReduce(12345, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    with cupy.cuda.Device(1):
        z = cupy.empty(4, np.float32)
    with pytest.raises(nccl.NcclError, match="device 1"):
        c.allReduce(x.data.ptr, z.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s)
    side = cupy.cuda.Stream(non_blocking=True)
    x += 1  # written on the null stream after the last host sync
    with pytest.raises(_standin.RaceError):  # collective on `side` not ordered after that write
        c.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    c.destroy()


def test_unique_id_as_bytes(monkeypatch):
    from cupy.cuda import nccl
    monkeypatch.setenv("LBANNPY_STANDIN_NCCL_UID", "bytes")
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    c = nccl.NcclCommunicator(1, uid, 0)
    assert (c.rank_id(), c.size(), c.device_id()) == (0, 1, 0)
    c.destroy()
    with pytest.raises(nccl.NcclError):
        nccl.NcclCommunicator(1, b"short", 0)


def test_numpy_index_and_assigned_value_are_uploaded_like_cupy():
    x = cupy.zeros(4, dtype=np.float32)
    x[np.array([1, 3])] = np.array([5.0, 6.0], np.float32)
    np.testing.assert_array_equal(x[np.array([3, 1])].get(), [6, 5])
