"""Data that is not all there: a file whose inputs declare more samples than a writer (that died) wrote. HDF5
reads the unwritten chunks as zeros without an error; the reader refuses the file before training (every
rank, exit 2, one line naming the dataset and the first sample never written), and ``data check`` says the
same instead of ok."""
from __future__ import annotations

import subprocess

import h5py
import numpy as np
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


def _half_written(path, declared: int = 1000, written: int = 32) -> None:
    """The file a writer leaves when it dies after ``written`` samples of a data set created at full size."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("inputs", shape=(declared, 3, 8, 8), dtype="f4", chunks=(4, 3, 8, 8))
        y = f.create_dataset("labels", shape=(declared,), dtype="i8", chunks=(64,))
        x[:written] = rng.standard_normal((written, 3, 8, 8)).astype(np.float32)
        y[:written] = rng.integers(0, 2, written)


def test_training_refuses_a_file_whose_samples_were_never_written(tmp_path):
    _half_written(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"epochs": 1, "steps": None})
    del cfg["trainer"]["steps"]
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "'inputs'" in lines[0] and "sample 32" in lines[0] and "data.h5" in lines[0], \
        job.err
    assert not (tmp_path / "out" / "metrics.csv").exists() or \
        len((tmp_path / "out" / "metrics.csv").read_text().splitlines()) <= 1  # not one step trained


def test_data_check_finds_the_samples_never_written(tmp_path):
    _half_written(tmp_path / "data.h5")
    r = subprocess.run([util.PY, "-m", "lbannpy.data", "check", str(tmp_path / "data.h5"), "--classes", "2"],
                       env=util.ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "sample 32" in r.stdout and "'inputs'" in r.stdout and "ok" not in r.stdout.split(":")[0], r.stdout


def _external_link_to_a_missing_file(tmp_path):
    util.make_data(tmp_path / "real.h5")
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["inputs"] = h5py.ExternalLink("gone.h5", "/inputs")
        with h5py.File(tmp_path / "real.h5", "r") as r:
            f["labels"] = r["labels"][()]
    return "external link to gone.h5:/inputs", "does not exist"


def _virtual_dataset_with_a_short_source(tmp_path):
    util.make_data(tmp_path / "src.h5", n=16)
    layout = h5py.VirtualLayout(shape=(32, 3, 8, 8), dtype="f4")
    layout[:32] = h5py.VirtualSource(str(tmp_path / "src.h5"), "inputs", shape=(32, 3, 8, 8))
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_virtual_dataset("inputs", layout, fillvalue=0)
        f["labels"] = np.zeros(32, dtype=np.int64)
    return "is virtual", "the source is short"


@pytest.mark.parametrize("make", [_external_link_to_a_missing_file, _virtual_dataset_with_a_short_source],
                         ids=["external-link", "virtual-short-source"])
def test_a_missing_or_short_source_file_is_named_before_training(tmp_path, make):
    what, why = make(tmp_path)
    cfg = util.spec(tmp_path, trainer={"steps": 4})
    job = util.run(tmp_path, cfg, ranks=2, timeout=60)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and what in lines[0] and why in lines[0] and "'inputs'" in lines[0], job.err
    assert not (tmp_path / "out" / "metrics.csv").exists() or \
        len((tmp_path / "out" / "metrics.csv").read_text().splitlines()) <= 1
