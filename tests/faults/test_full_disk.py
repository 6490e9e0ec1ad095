"""A disk that fills during a run (a small tmpfs as the output directory, filled by the test): the run stops
at the metrics row or the checkpoint it cannot write, on every rank, with one line naming the step, the
reason and the newest complete checkpoint; nothing half-written is left behind; the metric rows logged so
far stay on disk, and the checkpoint that was complete before still resumes. Needs root (mount), as CI
runs."""
from __future__ import annotations

import csv
import os
import subprocess

import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "out"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(directory) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError:
        pass
    os.close(fd)


def test_a_full_disk_stops_the_run_at_the_metrics_row_it_cannot_write(tmp_path, small_disk):
    """Before, a run whose output disk filled kept training to its next checkpoint (thousands of steps
    later, with a long interval): now the first metrics row that cannot be appended stops every rank within
    a step. The checkpoint interval (200) is longer than the rows a page of the file still holds (about
    45), so the rows fail first."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 60}, checkpoint={"every_steps": 200})
    del cfg["checkpoint"]["dir"]  # the default: ckpt/ in the output directory, on the small disk
    job = util.start(tmp_path, cfg, ranks=2)
    metrics = small_disk / "metrics.csv"
    try:
        util.wait_for(lambda: (small_disk / "ckpt" / "ckpt-00000200").is_dir() and metrics.exists()
                      and len(metrics.read_text().splitlines()) > 205, 120, "the step-200 checkpoint")
        _fill(small_disk)
        job.wait(60)
    finally:
        util.kill(job)
    assert job.rank_codes() == [7, 7] and job.proc.returncode == 7, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    line = lines[0]
    assert "metrics.csv could not be written" in line and "No space left on device" in line \
        and "ckpt-00000200" in line and len(line) < 700, line
    stopped = int(line.split("stopped at step ")[1].split(";")[0])
    assert sorted(p.name for p in (small_disk / "ckpt").glob("ckpt-*")) == ["ckpt-00000200"]  # no .tmp
    with open(metrics) as f:
        steps = [int(r["step"]) for r in csv.DictReader(f)]
    assert len(steps) >= 205 and steps == list(range(1, len(steps) + 1))
    # the row after the last one on disk failed; the vote on it is read after the following step
    assert steps[-1] + 1 <= stopped <= steps[-1] + 2 and stopped < 400, (stopped, steps[-1])
    # room again: the run resumes from the complete checkpoint
    os.unlink(small_disk / "filler")
    cfg["trainer"]["steps"] = 202
    job = util.run(tmp_path, cfg, ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    path, data = util.newest_checkpoint(small_disk / "ckpt")
    assert data["step"] == 202


def _leave_free(directory, free_bytes: int) -> None:
    """Fill ``directory`` until only about ``free_bytes`` stay free."""
    import shutil

    with open(directory / "filler", "wb") as fh:
        fh.write(b"\0" * max(shutil.disk_usage(directory).free - free_bytes, 0))
        fh.flush()
        os.fsync(fh.fileno())


@pytest.mark.parametrize("free_kib", [20, 28, 40])  # the disk fills in a shard, or in the index
def test_room_for_the_estimate_but_not_the_checkpoint_ends_with_exit_7(tmp_path, small_disk, free_kib):
    """Free space passes the start-up estimate of one checkpoint but not its real size: the checkpoint is
    refused before writing when the space asked again is below the estimate, and otherwise HDF5 fails in
    the write (h5py's RuntimeError "slist already enabled?", once a crash at exit); either way one line,
    exit 7 on every rank, no ``.tmp`` left."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 4}, checkpoint={"every_steps": 2},
                    parallel={"default": {"c": 2}})
    del cfg["checkpoint"]["dir"]
    _leave_free(small_disk, free_kib * 1024)
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [7, 7] and job.proc.returncode == 7, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    # refused before writing (the free space, asked again, is below the estimate), or failed in the write
    assert ("the checkpoint of step 2 could not be written" in lines[0] and "No space left on device" in
            lines[0]) or ("the checkpoint of step 2 was not written" in lines[0] and "iB free" in lines[0]), \
        lines[0]
    assert "newest complete checkpoint is none" in lines[0], lines[0]
    assert not list((small_disk / "ckpt").glob("ckpt-*")), list((small_disk / "ckpt").iterdir())


def test_free_space_is_checked_again_before_each_checkpoint(tmp_path, small_disk):
    """Room for a checkpoint at start, not at the second one (other writers took it): that checkpoint is
    refused before anything is written, on every rank (exit 7), naming the space and the newest complete
    checkpoint; the metric rows keep being written until then."""
    util.make_data(tmp_path / "data.h5")
    # checkpoints 500 steps apart, a metric row every 10: the disk is filled while the run is hundreds of
    # steps (a second or more) short of its second checkpoint, however fast the steps
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 60}, output={"log_every": 10},
                    checkpoint={"every_steps": 500})
    del cfg["checkpoint"]["dir"]
    job = util.start(tmp_path, cfg, ranks=2)
    metrics = small_disk / "metrics.csv"
    first = small_disk / "ckpt" / "ckpt-00000500"
    try:
        util.wait_for(lambda: first.is_dir() and metrics.exists()
                      and len(metrics.read_text().splitlines()) > 50, 90, "the step-500 checkpoint")
        # the model's 626 parameters make a checkpoint estimate of 3 * 8 * 626 bytes (15 KB): 10 KiB free
        # holds the rows up to step 1000 (50 rows of about 100 bytes), not the checkpoint
        _leave_free(small_disk, 10 * 1024)
        job.wait(60)
    finally:
        util.kill(job)
    assert job.rank_codes() == [7, 7] and job.proc.returncode == 7, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    assert "the checkpoint of step 1000 was not written" in lines[0] and "KiB free" in lines[0] \
        and "ckpt-00000500" in lines[0], lines[0]
    assert sorted(p.name for p in (small_disk / "ckpt").glob("ckpt-*")) == ["ckpt-00000500"]
    with open(metrics) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)][-1] >= 1000
