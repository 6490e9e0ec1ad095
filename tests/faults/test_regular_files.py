"""Only regular files are opened: a FIFO where a checkpoint, the config or the data file should be gives one
line and a non-zero exit on every rank within seconds (opening a FIFO for reading blocks until a writer
comes, which is never)."""
from __future__ import annotations

import os

import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


@pytest.mark.parametrize("where", ["checkpoint", "data"])
def test_fifo_instead_of_a_file(tmp_path, where):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path)
    args = ()
    if where == "checkpoint":
        (tmp_path / "ck").mkdir()
        os.mkfifo(tmp_path / "ck" / "ckpt-00000002.h5")
        args = ("--resume",)
        name = "ckpt-00000002.h5"
    else:
        os.mkfifo(tmp_path / "fifo.h5")
        cfg["data"]["train"]["path"] = str(tmp_path / "fifo.h5")
        name = "fifo.h5"
    job = util.run(tmp_path, cfg, ranks=2, args=args, timeout=40)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-2000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and name in lines[0], job.err
    if where == "checkpoint":  # (the data file was already refused before: a guard against regressions)
        assert "not a regular file (a FIFO)" in lines[0], job.err


def test_fifo_config(tmp_path):
    os.mkfifo(tmp_path / "cfg.yaml")
    job = util.Job(tmp_path, 2, util.subprocess.Popen(
        [util.MPIEXEC, "-n", "2", util.PY, "-m", "lbannpy.train", str(tmp_path / "cfg.yaml"), "--quiet"],
        env=util.ENV, stdout=util.subprocess.PIPE, stderr=util.subprocess.PIPE, text=True,
        start_new_session=True), util.time.monotonic()).wait(40)
    assert job.proc.returncode == 2
    job.assert_no_traceback()
    assert "regular file" in job.err
