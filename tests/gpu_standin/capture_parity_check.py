"""Stream capture as CUDA does it: the same checks on the CuPy stand-in (PYTHONPATH starting with
tests/gpu_standin, from tests/test_gpu_standin_graph.py) and on a real GPU with the installed CuPy, which
is what the stand-in's capture model is held to:

    python -m pytest -q -s -p no:cacheprovider --import-mode=importlib \
        tests/gpu_standin/capture_parity_check.py

Each check prints one ``PARITY`` line with what happened. A refusal is compared by the error's name (CUDA's)
or CuPy's words, and by whether ``end_capture`` then raises (CUDA invalidated the capture) or ends it
(CuPy refused before calling CUDA); the stand-in's messages add the call site.
"""
import re

import numpy as np
import pytest

import cupy

BACKEND = "stand-in" if "gpu_standin" in cupy.__file__.replace("\\", "/") else f"CuPy {cupy.__version__}"
RNG = np.random.default_rng(7)
affine = cupy.ElementwiseKernel("T x, T w", "T y", "y = x * w - 0.5;", "parity_affine")
sumsq = cupy.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "parity_sumsq")


def side_stream(blocking=False):
    s = cupy.cuda.Stream(non_blocking=not blocking)
    s.wait_event(cupy.cuda.get_current_stream().record())
    return s


def pinned_empty(shape):
    n = int(np.prod(shape)) * 8
    alloc = getattr(cupy.cuda, "alloc_pinned_memory", None)
    if alloc is not None:
        return np.frombuffer(alloc(n), np.float64, int(np.prod(shape))).reshape(shape)
    import ctypes  # the stand-in without pinned memory: a buffer it treats as page-locked
    buf = type("PinnedBuffer", (ctypes.Array,), {"_type_": ctypes.c_uint8, "_length_": n,
                                                  "_standin_pinned": True})()
    return np.ndarray(shape, np.float64, buffer=buf)


def report(case, outcome):
    print(f"PARITY {BACKEND} | {case} | {outcome}", flush=True)


def test_replay_on_new_data():
    pool, x, wh = cupy.cuda.MemoryPool(), cupy.zeros((4, 8)), RNG.standard_normal((4, 8))
    w, acc, host = cupy.asarray(wh), cupy.zeros(4), pinned_empty((4, 8))
    s = side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = cupy.maximum(affine(x, w), 0.0)
        t = sumsq(y, axis=1)
        acc += t
        total = y.sum()
        g = s.end_capture()
    want_acc = np.zeros(4)
    for _ in range(3):
        host[...] = RNG.standard_normal((4, 8))
        x.set(host, stream=s)                 # the static input, filled before each launch
        g.launch(s)
        s.synchronize()
        ref = np.maximum(host * wh - 0.5, 0.0)
        want_acc += (ref ** 2).sum(axis=1)
        np.testing.assert_allclose(y.get(), ref, rtol=1e-13)
        np.testing.assert_allclose(t.get(), (ref ** 2).sum(axis=1), rtol=1e-13)
        np.testing.assert_allclose(float(total), ref.sum(), rtol=1e-13)
        np.testing.assert_allclose(acc.get(), want_acc, rtol=1e-13)
    report("replay on new data", "equal to NumPy, 3 launches")


def test_joined_stream():
    pool, x = cupy.cuda.MemoryPool(), cupy.zeros(16)
    s, s2 = side_stream(), cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        a = x * 2.0
        s2.wait_event(s.record())
        with s2:
            b = a + 1.0
        s.wait_event(s2.record())
        c = b * x
        g = s.end_capture()
    for _ in range(2):
        h = RNG.standard_normal(16)
        x.set(h, stream=s)
        g.launch(s)
        s.synchronize()
        np.testing.assert_allclose(c.get(), (2 * h + 1) * h, rtol=1e-14)
    report("joined stream", "equal to NumPy, 2 launches")


def _outcome(op, blocking=False):
    """(what ``op`` raised during a capture or None, what end_capture raised or 'ended')."""
    pool, x = cupy.cuda.MemoryPool(), cupy.arange(8.0)
    s = side_stream(blocking)
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x * 2.0
        try:
            op(s, x, y)
            raised = None
        except Exception as e:  # noqa: BLE001  (the parity report names whatever was raised)
            raised = f"{type(e).__name__}: {e}"
        try:
            s.end_capture()
            ended = "ended"
        except Exception as e:  # noqa: BLE001
            ended = f"{type(e).__name__}: {e}"
    cupy.cuda.Device().synchronize()
    return raised, ended


def _unjoined(s, x, y):
    s2 = cupy.cuda.Stream(non_blocking=True)
    s2.wait_event(s.record())
    with s2:
        y + 1.0


def _legacy(s, x, y):
    with cupy.cuda.Stream.null:
        x + 1.0


def _outside_event(s, x, y):
    s.wait_event(cupy.cuda.Stream(non_blocking=True).record())  # an event recorded outside the capture


INVALID = "cudaErrorStreamCaptureInvalidated"
D2H, H2D = "the current stream is capturing, so D2H", "the current stream is capturing, so H2D"
CASES = {  # name: (operation, capture on a blocking stream, what it raises (None: nothing), end_capture)
    "Stream.synchronize": (lambda s, x, y: s.synchronize(), 0, "cudaErrorStreamCaptureUnsupported", INVALID),
    "Device.synchronize": (lambda s, x, y: cupy.cuda.Device().synchronize(), 0,
                           "cudaErrorStreamCaptureUnsupported", INVALID),
    "Event.synchronize": (lambda s, x, y: s.record().synchronize(), 0, "cudaErrorCapturedEvent", INVALID),
    "Event.done": (lambda s, x, y: s.record().done, 0, "", INVALID),  # CuPy returns; the stand-in raises
    "Stream.done": (lambda s, x, y: s.done, 0, "", INVALID),
    "get_elapsed_time": (lambda s, x, y: cupy.cuda.get_elapsed_time(s.record(), s.record()), 0,
                         "cudaErrorCapturedEvent", "ended"),
    "ndarray.get": (lambda s, x, y: y.get(), 0, D2H, "ended"),
    "float(ndarray)": (lambda s, x, y: float(y[1]), 0, D2H, "ended"),
    "cupy.bincount": (lambda s, x, y: cupy.bincount(cupy.arange(3)), 0, D2H, "ended"),
    "cupy.asarray(host)": (lambda s, x, y: cupy.asarray(np.ones(8)), 0, H2D, "ended"),
    "ndarray.set(pageable)": (lambda s, x, y: x.set(np.ones(8), stream=s), 0, H2D, "ended"),
    "ndarray.set(pinned)": (lambda s, x, y: x.set(pinned_empty((8,)), stream=s), 0, H2D, "ended"),
    "wait on an event from outside": (_outside_event, 0, "cudaErrorStreamCaptureIsolation", INVALID),
    "legacy stream beside a blocking capture": (_legacy, 1, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", INVALID),
    "stream not joined back": (_unjoined, 0, None, "cudaErrorStreamCaptureUnjoined"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refusal(case):
    op, blocking, raises, ends = CASES[case]
    raised, ended = _outcome(op, blocking)
    report(case, f"raised={raised!s:.150} | end_capture: {ended!s:.100}")
    if raises is None:
        assert raised is None, raised
    elif raises:
        assert raised is not None and re.search(re.escape(raises), raised), raised
    assert ends in ended, ended


def test_nccl_allreduce_in_a_graph():
    """One rank: allReduce captured and replayed (NCCL >= 2.9 supports graphs)."""
    try:
        from cupy.cuda import nccl
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    except Exception as e:  # noqa: BLE001  (a CuPy without NCCL)
        pytest.skip(f"no NCCL: {e}")
    pool, x = cupy.cuda.MemoryPool(), cupy.zeros(32)
    s = side_stream()
    with cupy.cuda.using_allocator(pool.malloc), s:
        s.begin_capture()
        y = x * 3.0
        z = cupy.empty_like(y)
        comm.allReduce(y.data.ptr, z.data.ptr, 32, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
        out = z + 1.0
        g = s.end_capture()
    for _ in range(2):
        h = RNG.standard_normal(32)
        x.set(h, stream=s)
        g.launch(s)
        s.synchronize()
        np.testing.assert_allclose(out.get(), 3 * h + 1, rtol=1e-14)
    comm.destroy()
    report("nccl allReduce in a graph", "equal to NumPy, 2 launches")
