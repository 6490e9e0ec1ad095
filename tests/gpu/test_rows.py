"""Issue #13 rows with no home in the other GPU tiers, on the CUDA stand-in (``tests/gpu/revert_rows.py``
undoes each row's fix and checks that its test fails):

- row 9 (gradient buckets): on a GPU with NCCL the bucket times, ``comm_time_s`` and
  ``hidden_comm_fraction`` come from CUDA events on the communicator's stream, and ``summary.json``'s
  ``clock`` says so; the CPU run keeps host times;
- row 4: CUDA-aware MPI waits for a buffer's writer on the buffer's device, from any thread;
- a ``CommError`` while the Runtime starts is one line per rank on stderr, no traceback, exit non-zero.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

# the end-to-end tier's helpers and fixtures (``work``: its data sets; ``train``: an mpiexec run)
from test_train_gpu import GPU, PY, spec, summary, train, work  # noqa: F401
from train_util import metrics

HERE = Path(__file__).resolve()


@pytest.mark.nccl_only  # the bucket times are events on the NCCL communicator's stream
def test_bucket_times_are_cuda_events_on_a_gpu(work, train):  # noqa: F811  (fixtures)
    cfg = {"bucket_mb": 0.001, "first_bucket_mb": 0.0005}  # several buckets
    train(2, spec(work, "cls", "rows-cpu", {"default": {"n": 2}}, cfg, steps=4))
    s = summary(work, "rows-cpu")
    assert s["clock"] == {"layers": "host", "step": "host", "buckets": "host", "io_wait": "host"}, s["clock"]
    for overlap in (True, False):
        tag = f"rows-gpu-{overlap}"
        # eager steps: a replayed CUDA graph has no per-bucket events (runtime.cuda_graph)
        train(2, spec(work, "cls", tag, {"default": {"n": 2}}, {**cfg, "overlap": overlap}, steps=4), *GPU,
              "--set", "output.log_every=2", "--set", "runtime.cuda_graph=off")
        s = summary(work, tag)
        assert s["clock"]["buckets"] == "cuda-events", (overlap, s["clock"])
        assert len(s["buckets"]) > 1 and all(b["median_s"] is not None and b["median_s"] > 0
                                             for b in s["buckets"]), s["buckets"]
        rows = metrics(work / tag / "out")
        assert [int(r["step"]) for r in rows] == [2, 4], rows
        comm = [float(r["comm_time_s"]) for r in rows]
        hidden = [float(r["hidden_comm_s"]) for r in rows]
        assert all(c > 0 for c in comm), rows  # logged steps: the step's events, read once its marks settle
        for r, h, c in zip(rows, hidden, comm):
            assert h == pytest.approx(float(r["hidden_comm_fraction"]) * c, rel=1e-12, abs=1e-15), r
        # the run's fraction is its hidden time over its communication time, from the rows' parts
        assert s["comm_time_s"] > 0, s
        assert s["hidden_comm_fraction"] == pytest.approx(sum(hidden) / sum(comm), rel=1e-12, abs=1e-15), s


def test_a_backend_the_device_cannot_run_is_one_line_before_mpi(work, train):  # noqa: F811
    """``backend nccl`` on ``device cpu``: refused before MPI starts (every rank finds it alike from the
    config): exit 2 and one line from the launcher's rank 0 naming the key and what to set, no traceback,
    no failure log (nothing failed: a configuration the machine cannot run)."""
    cfg = spec(work, "cls", "rows-error", steps=1)
    p = train(2, cfg, "--set", "runtime.backend=nccl", check=False)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("lbannpy.train: error: ") and "runtime.backend: nccl" in lines[0], lines
    assert "runtime.backend: mpi" in lines[0], lines
    assert not list((work / "rows-error").rglob("failure-rank*.log"))


@pytest.mark.skipif(os.environ.get("LBANNPY_GPU", "") == "real",
                    reason="reads the CUDA stand-in's stream-order clocks (real CuPy has none) and needs a "
                           "second device")
def test_cuda_aware_mpi_waits_for_the_buffers_device(gpu_run):
    """Row 4: before CUDA-aware MPI reads a device buffer, the host waits for the writer on the *buffer's*
    device (or for the producer's event), not on the calling thread's current device: the gradient thread
    starts on device 0 while rank 1's gradients live on device 1. The stand-in's stream-order clocks say
    whether the host observed the buffer's last write."""
    p = gpu_run([PY, HERE, "row4"], env={"LBANNPY_CUDA_AWARE_MPI": "1"}, timeout=120)
    got = [json.loads(ln[len("ROW4 "):]) for ln in p.stdout.splitlines() if ln.startswith("ROW4 ")]
    assert got == [{"after_event": True, "current_stream": True}], p.stdout[-2000:]


# ----------------------------------------------------------------------------------------------- worker
def _row4() -> dict:
    import threading

    import cupy
    from cupy import _standin as S
    from mpi4py import MPI

    from lbannpy.comm.mpi import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF.Dup(), owned=True)

    def observed(buf) -> bool:
        a = S.resolve(buf.data.ptr, buf.nbytes)
        uid, seq, _ = a.last_write
        return S._host_clock.get(uid, 0) >= seq

    out = {}
    with cupy.cuda.Device(1):
        side = cupy.cuda.Stream(non_blocking=True)
        with side:  # a producer on a side stream of device 1, with its event
            by_event = cupy.arange(64, dtype=cupy.float64) * 2.0
            ev = side.record(cupy.cuda.Event(disable_timing=True))
        on_null = cupy.arange(64, dtype=cupy.float64) * 3.0  # device 1's current stream

    def thread():  # like the gradient thread: a new thread starts on device 0
        comm._prepare(by_event, "allreduce", after=ev)
        out["after_event"] = observed(by_event)
        comm._prepare(on_null, "allreduce")
        out["current_stream"] = observed(on_null)

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    comm.free()
    return out


if __name__ == "__main__":
    if sys.argv[1] == "row4":
        print("ROW4 " + json.dumps(_row4()), flush=True)
