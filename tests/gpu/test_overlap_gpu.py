"""The overlap engine on GPUs, on the CUDA/CuPy/NCCL stand-in (tests/gpu_standin), rank r on device r.

Each case runs this file under ``mpiexec -n P`` with the stand-in first on ``PYTHONPATH``; the worker
(``__main__`` below) trains nothing: it plays backprop (writes each layer's gradients on the compute
stream, rank-dependent values and compute times, then ``layer_done``) for three steps and checks the
reduced gradients against the global sum computed in NumPy from the same formula, on every rank.

- overlapped equals blocking, backends ``nccl``, ``mpi`` with CUDA-aware MPI and ``host-staged`` (``mpi`` on
  an MPI that is not CUDA-aware, all ranks sharing one device), 1, 2 and 4 ranks;
- row 3: the MPI thread reduces on the rank's device; on NCCL no thread at all;
- row 4/5: gradients written on a non-default compute stream (and with per-thread default streams) are
  reduced only after they are written: the stand-in's stream-order checker raises otherwise;
- row 6: on NCCL every NCCL call comes from the main thread, in one order identical on every rank,
  interleaved with main-thread point-to-point exchanges as in a halo exchange;
- row 7: no host synchronization while a step's buckets are posted and finished on NCCL.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
STANDIN = ROOT / "tests" / "gpu_standin"
MPIEXEC = shutil.which("mpiexec")


def launch(case: str, ranks: int, backend: str, *, overlap: bool = True, env: dict | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                LBANNPY_CUDA_AWARE_MPI="1")
    full["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p])
    if backend == "host-staged":
        full.update(LBANNPY_CUDA_AWARE_MPI="0", LBANNPY_STANDIN_DEVICES="1")
    full.update(env or {})
    out = tempfile.mkdtemp(prefix=f"lbannpy-{case}-")
    full["LBANNPY_TEST_RESULTS"] = out
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE), case, backend, "1" if overlap else "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=str(ROOT))
    r.args_dir = out
    return r


def results(r: subprocess.CompletedProcess) -> list[dict]:
    """Every rank's verdict (each writes ``rank<R>.json`` into ``LBANNPY_TEST_RESULTS``)."""
    assert r.returncode == 0, f"rc {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}"
    where = Path(r.args_dir)
    rows = [json.loads(f.read_text()) for f in sorted(where.glob("rank*.json"))]
    return sorted(rows, key=lambda row: row["rank"])


def report(row: dict) -> None:
    """Worker side: this rank's verdict, for :func:`results`."""
    path = Path(os.environ["LBANNPY_TEST_RESULTS"]) / f"rank{row['rank']}.json"
    path.write_text(json.dumps(row))


needs = pytest.mark.skipif(not (STANDIN / "cupy").is_dir(), reason="the CUDA stand-in is not in this tree")


@pytest.fixture(autouse=True)
def _mpiexec():
    assert MPIEXEC, "mpiexec not found (pip install mpich)"


@needs
@pytest.mark.parametrize("backend", ["nccl", "mpi", "host-staged"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_overlapped_equals_blocking(ranks, backend):
    got = {}
    for overlap in (True, False):
        rows = results(launch("sums", ranks, backend, overlap=overlap))
        assert len(rows) == ranks
        for row in rows:
            assert row["device"] == row["rank"] % row["devices"], row  # rank r on device r (or shared)
            assert row["ok"], row
            assert row["host_staged"] == (backend == "host-staged" and ranks > 1), row
        got[overlap] = [row["digest"] for row in rows]
    assert got[True] == got[False]


@needs
@pytest.mark.parametrize("backend", ["nccl", "mpi", "host-staged"])
def test_the_engine_works_on_the_ranks_device(backend):
    """Row 3: every CUDA call of the engine happens on the rank's GPU; the MPI thread selects it first."""
    for row in results(launch("devices", 2, backend)):
        assert row["ok"], row
        assert set(row["comm_devices"]) == {row["rank"] % row["devices"]}, row
        if backend == "nccl":
            assert row["threads"] == 0, row  # no gradient thread on NCCL (row 6)


@needs
@pytest.mark.parametrize("backend", ["nccl", "mpi", "host-staged"])
@pytest.mark.parametrize("how", ["side_stream", "per_thread_default"])
def test_gradients_are_reduced_after_backward_wrote_them(backend, how):
    """Rows 4 and 5: backward on a stream other than the legacy default stream."""
    env = {"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"} if how == "per_thread_default" else {}
    case = "side_stream" if how == "side_stream" else "sums"
    for row in results(launch(case, 2, backend, env=env)):
        assert row["ok"], row


@needs
def test_nccl_calls_come_from_one_thread_in_one_order():
    """Row 6: buckets and the main thread's exchanges are issued by the main thread, in the same order on
    every rank."""
    rows = results(launch("order", 4, "nccl"))
    for row in rows:
        assert row["ok"], row
        assert row["nccl_threads"] == ["MainThread"], row
    assert all(row["calls"] == rows[0]["calls"] for row in rows), [row["calls"][:12] for row in rows]
    assert any(c.startswith("allReduce") for c in rows[0]["calls"]) and \
        any(c.startswith("send") for c in rows[0]["calls"])


@needs
def test_no_host_synchronization_in_a_nccl_step():
    """Row 7: posting and finishing a step's buckets on NCCL never blocks the host."""
    for row in results(launch("syncs", 2, "nccl")):
        assert row["ok"], row
        assert row["host_syncs"] == 0, row
        assert row["timed_events"] == 0, row


# -------------------------------------------------------------------------------------------------------
# the worker, run by mpiexec


def count_host_syncs(cupy) -> list:
    """Wrap every CuPy call that blocks the host on the device (event, stream, device synchronize; device
    to host copies); returns the list each call appends its name to. Works on real CuPy too."""
    calls: list = []

    def wrap(owner, name):
        orig = getattr(owner, name)

        def counted(*a, **k):
            calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return orig(*a, **k)

        setattr(owner, name, counted)

    wrap(cupy.cuda.Event, "synchronize")
    wrap(cupy.cuda.Stream, "synchronize")
    wrap(cupy.cuda.Device, "synchronize")
    wrap(cupy.cuda.runtime, "deviceSynchronize")
    wrap(cupy, "asnumpy")
    wrap(cupy.ndarray, "get")
    return calls


def count_timed_events(cupy) -> list:
    """Record every timed event made from now on (``Event()`` or ``Stream.record()`` without one)."""
    timed: list = []
    real_event, real_record = cupy.cuda.Event, cupy.cuda.Stream.record

    def event(*a, **k):
        if not k.get("disable_timing", a[1] if len(a) > 1 else False):
            timed.append("Event()")
        return real_event(*a, **k)

    def record(self, ev=None):
        if ev is None:  # CuPy then makes a plain, timed event
            timed.append("Stream.record()")
        return real_record(self, ev)

    cupy.cuda.Event = event
    cupy.cuda.Stream.record = record
    return timed


def _worker(case: str, backend: str, overlap: bool) -> None:  # pragma: no cover - runs under mpiexec
    import hashlib
    import threading
    import time

    import cupy
    import numpy as np

    from lbannpy.comm import Runtime
    from lbannpy.comm.overlap import OverlapEngine


    class P:
        def __init__(self, name, n):
            self.name = name
            self.grad = cupy.zeros(n, dtype=np.float64)

    class Spy:
        """Wraps a bucket communicator: records the current device of the thread that reduces."""

        def __init__(self, comm, devices):
            self._c, self._devices = comm, devices

        def __getattr__(self, name):
            return getattr(self._c, name)

        def dup(self):
            return Spy(self._c.dup(), self._devices)

        def allreduce(self, *a, **k):
            self._devices.add(cupy.cuda.Device().id)
            return self._c.allreduce(*a, **k)

        def iallreduce(self, *a, **k):
            self._devices.add(cupy.cuda.Device().id)
            return self._c.iallreduce(*a, **k)

        def free(self):
            self._c.free()

    staged = backend == "host-staged"
    with Runtime(backend="mpi" if staged else backend, device="gpu", share_gpu=staged) as rt:
        world, rank, size = rt.world, rt.world.rank, rt.world.size
        out = {"rank": rank, "device": cupy.cuda.Device().id, "ok": False,
               "devices": cupy.cuda.runtime.getDeviceCount(), "host_staged": rt.host_staged}
        layers = [f"l{i}" for i in range(6)]
        # the compute stream is current from the start, as in a trainer: parameters and the engine's buffers
        # are made (and zeroed) on it, so backward on that stream is ordered after them
        side = cupy.cuda.Stream(non_blocking=True) if case == "side_stream" else None
        with side if side is not None else _Null():
            params = [P(f"{lay}.{k}", n) for i, lay in enumerate(layers)
                      for k, n in (("w", 900 + 150 * i), ("b", 5))]
        devices: set = set()
        comms = [Spy(world, devices)] * len(params) if case == "devices" else [world] * len(params)
        calls, callers = [], set()
        if case == "order":
            nccl_comm_cls = cupy.cuda.nccl.NcclCommunicator
            for name in ("allReduce", "send", "recv"):
                orig = getattr(nccl_comm_cls, name)

                def wrapped(self, *a, _orig=orig, _name=name, **k):
                    count = a[1] if _name in ("send", "recv") else a[2]
                    calls.append(f"{_name}:{count}")
                    callers.add(threading.current_thread().name)
                    return _orig(self, *a, **k)

                setattr(nccl_comm_cls, name, wrapped)
        with side if side is not None else _Null():
            eng = OverlapEngine(params, comms, bucket_bytes=16_000, first_bucket_bytes=4_000, overlap=overlap,
                                thread_multiple=rt.thread_multiple, xp=rt.xp)
        rng = np.random.default_rng(rank)
        ok = True
        digest = hashlib.sha256()
        syncs: list = []
        timed: list = []
        try:
            for step in range(3):
                if case == "syncs" and step == 2:
                    syncs = count_host_syncs(cupy)
                    timed = count_timed_events(cupy)
                ctx = side if side is not None else _Null()
                with ctx:
                    eng.start_step()
                    for j, layer in enumerate(reversed(layers)):
                        i = len(layers) - 1 - j
                        for k, p in enumerate(params[2 * i:2 * i + 2]):
                            # backward "computes" this layer's gradients on the current (compute) stream
                            p.grad[...] = cupy.arange(p.grad.size, dtype=np.float64) * 0 + \
                                (rank + 1) * (step + 2 * i + k)
                        if case != "syncs":
                            time.sleep(float(rng.uniform(0, 0.003)))
                        if case == "order" and size > 1:  # a main-thread exchange, as a halo would be
                            a = cupy.full(4, float(rank))
                            b = cupy.empty(4)
                            hs = [world.isend(a, (rank + 1) % size, tag=j),
                                  world.irecv(b, (rank - 1) % size, tag=j)]
                            world.flush()
                            for h in hs:
                                h.wait()
                        eng.layer_done(layer)
                    eng.finish()
                    if case == "syncs" and step == 2:
                        syncs, timed = list(syncs), list(timed)  # the checks below sync: stop counting
                    want = sum(r + 1 for r in range(size))
                    for i, p in enumerate(params):
                        host = cupy.asnumpy(p.grad)
                        digest.update(host.tobytes())
                        ok &= bool(np.all(host == want * (step + i)))
        finally:
            eng.close()
        order = [b for b, *_ in eng.records]
        ok &= order == list(range(len(eng.buckets))) * 3
        out.update(ok=bool(ok), digest=digest.hexdigest(), comm_devices=sorted(devices),
                   threads=int(eng._thread is not None), nccl_threads=sorted(callers), calls=calls,
                   host_syncs=len(syncs), sync_calls=sorted(set(syncs)), timed_events=len(timed))
        report(out)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    _worker(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
