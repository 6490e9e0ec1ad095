"""Issue #13 rows with no home in the other GPU tiers, on the CUDA stand-in (``tests/gpu/revert_rows.py``
undoes each row's fix and checks that its test fails):

- row 9 (gradient buckets): on a GPU with NCCL the bucket times, ``comm_time_s`` and
  ``hidden_comm_fraction`` come from CUDA events on the communicator's stream, and ``summary.json``'s
  ``clock`` says so; the CPU run keeps host times;
- a ``CommError`` while the Runtime starts is one line per rank on stderr, no traceback, exit non-zero.
"""
from __future__ import annotations

import csv

# the end-to-end tier's helpers and fixtures (``work``: its data sets; ``train``: an mpiexec run)
from test_train_gpu import GPU, spec, summary, train, work  # noqa: F401


def _logged_rows(d, tag) -> list[dict]:
    with open(d / tag / "out" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_bucket_times_are_cuda_events_on_a_gpu(work, train):  # noqa: F811  (fixtures)
    cfg = {"bucket_mb": 0.001, "first_bucket_mb": 0.0005}  # several buckets
    train(2, spec(work, "cls", "rows-cpu", {"default": {"n": 2}}, cfg, steps=4))
    s = summary(work, "rows-cpu")
    assert s["clock"] == {"layers": "host", "step": "host", "buckets": "host", "io_wait": "host"}, s["clock"]
    for overlap in (True, False):
        tag = f"rows-gpu-{overlap}"
        train(2, spec(work, "cls", tag, {"default": {"n": 2}}, {**cfg, "overlap": overlap}, steps=4), *GPU,
              "--set", "output.log_every=2")
        s = summary(work, tag)
        assert s["clock"]["buckets"] == "cuda-events", (overlap, s["clock"])
        assert len(s["buckets"]) > 1 and all(b["median_s"] is not None and b["median_s"] > 0
                                             for b in s["buckets"]), s["buckets"]
        rows = _logged_rows(work, tag)
        assert [int(r["step"]) for r in rows] == [2, 4], rows
        for r in rows:  # logged steps: the events of the step read once its marks are settled
            assert float(r["comm_time_s"]) > 0, r
            assert 0.0 <= float(r["hidden_comm_fraction"]) <= 1.0, r
        assert s["comm_time_s"] > 0 and 0.0 <= s["hidden_comm_fraction"] <= 1.0, s


def test_a_comm_error_at_runtime_start_is_one_line_per_rank(work, train):  # noqa: F811
    """``backend nccl`` on ``device cpu``: the Runtime refuses before any rank builds anything."""
    cfg = spec(work, "cls", "rows-error", steps=1)
    p = train(2, cfg, "--set", "runtime.backend=nccl", check=False)
    assert p.returncode != 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert 1 <= len(lines) <= 2, lines  # one line per rank at most
    for ln in lines:
        assert "CommError" in ln and "needs device='gpu'" in ln and "failure-rank" in ln, ln
