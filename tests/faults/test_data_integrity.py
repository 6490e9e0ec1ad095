"""Data integrity under mpiexec: a data file truncated or replaced during the run, a class label out of range,
and a -1 pixel label that the label down-sampling of a segmentation model would hide. Each stops every rank
with exit status 2 and one line naming the file (and the sample, pixel and value), no traceback, within
seconds."""
from __future__ import annotations

import os
import time

import h5py
import numpy as np
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


def _rows(tmp_path) -> int:
    path = tmp_path / "out" / "metrics.csv"
    return max(0, len(path.read_text().splitlines()) - 1) if path.exists() else 0


def _change(path, how: str) -> None:
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "rewrite":  # the same size, other input values written in place (the readers hold a lock)
        with h5py.File(path, "r", locking=False) as f:
            offset = f["inputs"].id.get_offset()
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(np.ones(64, np.float32).tobytes())
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    else:  # a new file renamed over the old one (another inode)
        util.make_data(path.with_suffix(".new"), n=8)
        os.replace(path.with_suffix(".new"), path)


@pytest.mark.parametrize("how", ["truncate", "rewrite", "replace"])
def test_data_file_changed_mid_run(tmp_path, how):
    data = tmp_path / "data.h5"
    util.make_data(data, n=8)  # two steps per epoch: an epoch starts every other step
    cfg = util.spec(tmp_path, trainer={"steps": 10**6}, checkpoint={"every_steps": 0})
    job = util.start(tmp_path, cfg, ranks=2)
    try:
        util.wait_for(lambda: _rows(tmp_path) >= 3, 60, "the first metrics rows")
        _change(data, how)
        job.wait(60)  # liveness: the job ends before the harness's timeout (no duration asserted)
    finally:
        util.kill(job)
    assert job.rank_codes() == [2, 2] and job.proc.returncode == 2, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    assert str(data) in lines[0] and "changed while training" in lines[0], lines[0]
    if how == "truncate":
        assert "bytes" in lines[0] and "→" in lines[0], lines[0]
    if how == "replace":
        assert "inode" in lines[0], lines[0]
    assert _rows(tmp_path) >= 3  # the rows written before the change are kept


def test_class_label_out_of_range(tmp_path):
    data = tmp_path / "data.h5"
    util.make_data(data, n=32)
    with h5py.File(data, "r+") as f:
        f["labels"][17] = 7
    cfg = util.spec(tmp_path, trainer={"steps": 16})  # two epochs: sample 17 is read in the first
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [2, 2] and job.proc.returncode == 2, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    assert f"data.train ({data}): sample 17 has label 7; the model has 2 classes (labels 0..1)" in lines[0]


SEG = {"name": "seg", "input": {"channels": 3, "spatial": [8, 8]},
       "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1, "stride": 2},
                  {"name": "r1", "type": "relu"},
                  {"name": "c2", "type": "conv", "filters": 2, "kernel": 1}],
       "loss": "pixel_cross_entropy"}


def _seg_data(path, n=16, bad=(5, 3, 4), value=-1):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 2, (n, 8, 8)).astype(np.int8)
    y[bad[0]] = 1  # the down-sampling (max over each 2x2 cell) would turn the -1 into a 1
    y[bad] = value
    with h5py.File(path, "w") as f:
        f["inputs"] = x
        f["labels"] = y


@pytest.mark.parametrize("parallel", [{}, {"default": {"h": 2}}], ids=["samples", "spatial"])
def test_pixel_label_hidden_by_downsampling(tmp_path, parallel):
    data = tmp_path / "data.h5"
    _seg_data(data)
    cfg = util.spec(tmp_path, trainer={"steps": 8})
    cfg["model"] = SEG
    if parallel:
        cfg["parallel"] = parallel
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [2, 2] and job.proc.returncode == 2, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    assert (f"data.train ({data}): sample 5 has label -1 at pixel (3, 4); the model has 2 classes "
            f"(labels 0..1)") in lines[0], lines[0]


def test_validation_label_out_of_range(tmp_path):
    util.make_data(tmp_path / "data.h5", n=32)
    util.make_data(tmp_path / "val.h5", n=8)
    with h5py.File(tmp_path / "val.h5", "r+") as f:
        f["labels"][6] = 3
    cfg = util.spec(tmp_path, trainer={"steps": 4})
    cfg["data"]["validation"] = {"path": str(tmp_path / "val.h5")}
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [2, 2] and job.proc.returncode == 2, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and f"data.validation ({tmp_path / 'val.h5'}): sample 6 has label 3" in lines[0], \
        job.err


def test_virtual_dataset_with_a_missing_source_is_refused_before_training(tmp_path):
    """HDF5 reads the fill value (here NaN) where a virtual dataset's source file is missing, silently: the
    sources are checked with the rest of the data file, before any step."""
    util.make_data(tmp_path / "src.h5", n=16)
    layout = h5py.VirtualLayout(shape=(16, 3, 8, 8), dtype=np.float32)
    layout[:] = h5py.VirtualSource("src.h5", "inputs", shape=(16, 3, 8, 8))
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_virtual_dataset("inputs", layout, fillvalue=np.nan)
        f["labels"] = np.zeros(16, np.int64)
    cfg = util.spec(tmp_path, trainer={"steps": 4})
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    assert job.rank_codes() == [0, 0], job.err[-3000:]  # with its source the file trains
    os.remove(tmp_path / "src.h5")
    cfg["output"]["dir"] = str(tmp_path / "out2")
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "is virtual and its source file src.h5 does not exist" in lines[0], job.err
    assert not (tmp_path / "out2" / "metrics.csv").exists() or \
        len((tmp_path / "out2" / "metrics.csv").read_text().splitlines()) <= 1
