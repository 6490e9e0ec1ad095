"""Outputs written as they happen: the output and checkpoint directories are checked before any step (one
line, every rank non-zero), a lock file names the run holding a directory, and metrics.csv holds every logged
row while the run goes on (a run killed with -9 keeps them)."""
from __future__ import annotations

import csv
import os
import signal

import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


@pytest.mark.parametrize("case", ["ckpt-dir-is-a-file", "ckpt-dir-in-proc", "out-dir-is-a-file"])
def test_bad_output_directory_is_refused_before_training(tmp_path, case):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 40}, checkpoint={"every_steps": 20})
    if case == "ckpt-dir-is-a-file":
        (tmp_path / "ckfile").write_text("x")
        cfg["checkpoint"]["dir"], key = str(tmp_path / "ckfile"), "checkpoint.dir"
    elif case == "ckpt-dir-in-proc":
        cfg["checkpoint"]["dir"], key = "/proc/self/lbannpy-ck", "checkpoint.dir"
    else:
        (tmp_path / "outfile").write_text("x")
        cfg["output"]["dir"], key = str(tmp_path / "outfile"), "output.dir"
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and key in lines[0], job.err
    assert not (tmp_path / "out" / "metrics.csv").exists() or case == "out-dir-is-a-file"


def test_two_runs_into_one_directory_and_metrics_as_they_happen(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 1000})
    first = util.start(tmp_path, cfg, ranks=2)
    try:
        pids = first.pids()
        metrics = tmp_path / "out" / "metrics.csv"
        util.wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0 and
                      len(metrics.read_text().splitlines()) > 5, 90, "rows in metrics.csv")
        # a second run into the same directories: one line naming the first, nothing of the first touched
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        util.make_data(second_dir / "data.h5")
        cfg2 = util.spec(second_dir, trainer={"steps": 3})
        cfg2["output"]["dir"] = str(tmp_path / "out")
        second = util.run(second_dir, cfg2, ranks=2, timeout=60)
        assert second.rank_codes() == [2, 2], (second.rank_codes(), second.err[-3000:])
        second.assert_no_traceback()
        lines = util.error_lines(second.err)
        assert len(lines) == 1 and "output.dir" in lines[0] and "is in use by the run of model" in lines[0] \
            and f"pid {pids[0]}" in lines[0], second.err
        # the first run dies hard: the rows it logged are on disk
        os.kill(pids[1], signal.SIGKILL)
        first.wait(30)
    finally:
        util.kill(first)
    with open(tmp_path / "out" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) > 5 and [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["loss"] for r in rows)
