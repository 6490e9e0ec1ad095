"""GPU arrays over an MPI that is not CUDA-aware (comm/hoststaged.py), and ranks sharing a GPU, on the
CUDA/CuPy stand-in (tests/gpu_standin). The stand-in's asynchronous copies to pinned memory land only when
the host observes them, so a staged path that posted MPI before its copy finished sends stale bytes and
gets a wrong result, not only a checker's report.

- every Communicator method on CuPy arrays, host-staged, equals the MPI backend on NumPy arrays (exact),
  at 2, 3 and 4 ranks sharing one device (the same check as the NCCL backend's in test_comm_gpu.py);
- the copy stream waits for the producer's event: a buffer written on a side stream is staged right with
  ``after=`` and is a race the stand-in reports without it;
- pinned buffers are pooled: a step's operations allocate no pinned memory once warm; the main thread
  makes no host synchronisation;
- more ranks on a node than GPUs: refused by default in one line (ranks per node, GPUs seen, the key);
  ``runtime.share_gpu: true`` allows it; NCCL on a shared device is refused naming the host-staged backend.
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

# the end-to-end tier's helpers and fixtures (``work``: its data sets; ``train``: an mpiexec run)
from test_train_gpu import spec, train, work  # noqa: F401

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
STANDIN = ROOT / "tests" / "gpu_standin"
MPIEXEC = shutil.which("mpiexec")
STAGED = {"LBANNPY_CUDA_AWARE_MPI": "0", "LBANNPY_STANDIN_DEVICES": "1", "LBANNPY_TEST_BACKEND": "mpi",
          "LBANNPY_TEST_SHARE_GPU": "1"}

pytestmark = pytest.mark.skipif(os.environ.get("LBANNPY_GPU", "") == "real",
                                reason="stand-in checks (its copies land only when the host observes them)")


def launch(script: Path, case: str, ranks: int, *extra: str, env: dict | None = None, timeout: float = 180):
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    full = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    full["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p])
    full.update(STAGED)
    full.update(env or {})
    out = tempfile.mkdtemp(prefix=f"lbannpy-staged-{case}-")
    full["LBANNPY_TEST_RESULTS"] = out
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(script), case, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=str(ROOT))
    r.args_dir = out
    return r


def results(r: subprocess.CompletedProcess, ranks: int) -> list[dict]:
    assert r.returncode == 0, f"rc {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}"
    rows = [json.loads(f.read_text()) for f in sorted(Path(r.args_dir).glob("rank*.json"))]
    assert len(rows) == ranks, (rows, r.stderr[-3000:])
    return sorted(rows, key=lambda row: row["rank"])


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_method_host_staged_equals_the_mpi_backend(ranks):
    rows = results(launch(HERE.parent / "test_comm_gpu.py", "methods", ranks), ranks)
    for row in rows:
        assert row["failed"] == [], row
        assert row["checked"] >= 12, row


def test_the_copy_stream_waits_for_the_producer():
    for row in results(launch(HERE, "producer", 2), 2):
        assert row["with_event"] == 2 * 63.0 + 1.0, row  # sum over 2 ranks of (rank + 63)
        assert "RaceError" in row["without_event"] and "ndarray.get" in row["without_event"], row


def test_pinned_buffers_are_reused_and_the_main_thread_never_syncs():
    for row in results(launch(HERE, "steady", 2), 2):
        assert row["ok"], row
        assert row["host_staged"] is True, row
        assert row["device"] == 0, row  # both ranks share the one device
        assert row["warm_pinned_allocs"] == 0, row
        assert row["host_syncs"] == 0, row
        assert row["staging_waits"] > 0, row  # the staging thread waited on the copy events instead
        assert row["other_waits"] == [], row
        assert row["staging_thread_joined"], row


def _refused(p) -> str:
    """A configuration problem: exit 2 with one line on stderr (``lbannpy.train: error: ...``, naming the
    key to change), checked before MPI starts, so no rank fails and nothing goes to a failure log."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert "Traceback" not in p.stderr and "failed" not in p.stderr and len(lines) == 1, p.stderr
    return lines[0]


def test_ranks_sharing_a_gpu_are_refused_by_default(work, train):  # noqa: F811  (fixtures)
    p = train(2, spec(work, "cls", "share-refused", steps=1), "--set", "runtime.device=gpu", "--set",
              "runtime.backend=mpi", env={"LBANNPY_STANDIN_DEVICES": "1", "LBANNPY_CUDA_AWARE_MPI": "0"},
              check=False)
    ln = _refused(p)
    assert "2 ranks on this node but 1 GPU(s) visible" in ln and "runtime.share_gpu: true" in ln, ln


def test_share_gpu_allows_ranks_on_one_gpu_over_host_staged_mpi():
    r = launch(HERE, "runtime", 2, "mpi", "1")
    rows = results(r, 2)
    for row in rows:
        assert row["device"] == 0 and row["host_staged"] and row["sum"] == 1.0, row
    said = [ln for ln in r.stderr.splitlines() if "host-staged" in ln]
    assert len(said) == 1 and "ranks share GPUs" in said[0], r.stderr  # rank 0 says it, once


def test_nccl_on_a_shared_gpu_is_refused_naming_the_host_staged_backend(work, train):  # noqa: F811
    p = train(2, spec(work, "cls", "share-nccl", steps=1), "--set", "runtime.device=gpu", "--set",
              "runtime.backend=nccl", "--set", "runtime.share_gpu=true", env={"LBANNPY_STANDIN_DEVICES": "1"},
              check=False)
    ln = _refused(p)
    assert "NCCL cannot run two ranks on one GPU" in ln, ln
    assert "runtime.backend: mpi" in ln and "through host memory" in ln, ln


# -------------------------------------------------------------------------------------------------------
# the worker, run by mpiexec


def report(row: dict) -> None:
    path = Path(os.environ["LBANNPY_TEST_RESULTS"]) / f"rank{row['rank']}.json"
    path.write_text(json.dumps(row))


def _producer(out: dict) -> None:  # pragma: no cover - runs under mpiexec
    import cupy
    from mpi4py import MPI

    from lbannpy.comm.mpi import MPICommunicator

    c = MPICommunicator(MPI.COMM_WORLD.Dup(), owned=True)
    me = c.rank
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.arange(64, dtype=cupy.float64) + me
        ev = side.record(cupy.cuda.Event(disable_timing=True))
    out["with_event"] = float(cupy.asnumpy(c.allreduce(x, after=ev))[-1])
    with side:
        y = cupy.arange(64, dtype=cupy.float64) + me  # a new write on the side stream, not waited for
    try:
        c.allreduce(y)  # the copy stream is ordered after this thread's current stream only: a race
        out["without_event"] = "no error"
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        out["without_event"] = f"{type(exc).__name__}: {exc}"
    out["ok"] = True


def _steady(out: dict) -> None:  # pragma: no cover - runs under mpiexec
    import threading

    import cupy
    import numpy as np

    from cupy import _standin as probe  # the stand-in's host-sync counter (asynchronous copies are not)

    from lbannpy.comm import Runtime, hoststaged

    allocs = []
    real_alloc = cupy.cuda.alloc_pinned_memory

    def counted_alloc(n):
        allocs.append(n)
        return real_alloc(n)

    cupy.cuda.alloc_pinned_memory = counted_alloc
    with Runtime(backend="mpi", device="gpu", share_gpu=True) as rt:
        c, me, p = rt.world, rt.rank, rt.size
        grads = cupy.full(1000, float(me + 1))
        halo_out, halo_in = cupy.full(16, float(me)), cupy.empty(16)

        def step():
            c.allreduce(grads, out=grads)
            grads[...] = float(me + 1)
            hs = [c.irecv(halo_in, (me - 1) % p, tag=3), c.isend(halo_out, (me + 1) % p, tag=3)]
            for h in hs:
                h.wait()
            return c.allgather(halo_in[:4])

        step()
        probe.reset_host_syncs()
        del allocs[:]
        for _ in range(5):
            g = step()
        # host_syncs: the threads that submit GPU work (this one); the staging thread, which submits
        # nothing, sleeps on each copy event (Event.synchronize in hoststaged), counted apart
        syncs = probe.host_syncs()
        waits = probe.waiter_syncs()
        out["staging_waits"] = sum(n for (kind, where), n in waits.items()
                                   if kind == "Event.synchronize" and where.startswith(hoststaged.__file__))
        out["other_waits"] = sorted(f"{k} {w}" for (k, w) in waits if not w.startswith(hoststaged.__file__))
        out["host_syncs"] = int(sum(syncs.values()))
        out["warm_pinned_allocs"] = len(allocs)
        want = np.array([[(r - 1) % p] * 4 for r in range(p)], dtype=np.float64)
        ok = bool(np.array_equal(cupy.asnumpy(g), want))
        ok &= float(cupy.asnumpy(c.allreduce(grads))[0]) == float(sum(range(1, p + 1)))
        out.update(ok=ok, host_staged=rt.host_staged, device=int(cupy.cuda.Device().id),
                   sync_calls=sorted(f"{k} {w}" for k, w in syncs))
        staging = [t for t in threading.enumerate() if t.name == "lbannpy-host-staging"]
    # the Runtime's teardown stopped and joined the staging thread
    out["staging_thread_joined"] = len(staging) == 1 and not staging[0].is_alive()


def _runtime(out: dict, backend: str, share: str) -> None:  # pragma: no cover - runs under mpiexec
    import cupy

    from lbannpy.comm import Runtime

    with Runtime(backend=backend, device="gpu", share_gpu=share == "1") as rt:
        x = cupy.full(3, float(rt.rank))
        out.update(device=int(cupy.cuda.Device().id), host_staged=rt.host_staged,
                   sum=float(cupy.asnumpy(rt.world.allreduce(x))[0]))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from mpi4py import MPI

    result = {"rank": MPI.COMM_WORLD.Get_rank(), "ok": False}
    {"producer": _producer, "steady": _steady, "runtime": _runtime}[sys.argv[1]](result, *sys.argv[2:])
    report(result)
