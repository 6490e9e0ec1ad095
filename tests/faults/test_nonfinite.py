"""Numerical health: a non-finite loss stops the run with one line naming the step and the first place that
went non-finite; the metrics so far are written, summary.json is valid JSON, and the newest checkpoint holds
finite parameters."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("case", ["nan-pixel", "huge-lr"])
def test_nonfinite_loss_stops_the_run(tmp_path, case):
    if case == "nan-pixel":
        util.make_data(tmp_path / "data.h5", n=32, nan_at=13)
        cfg = util.spec(tmp_path, trainer={"steps": 40}, checkpoint={"every_steps": 2})
        where = "first non-finite: the input batch"
    else:
        util.make_data(tmp_path / "data.h5")
        cfg = util.spec(tmp_path, trainer={"steps": 40}, checkpoint={"every_steps": 1},
                        optimizer={"lr": 1e300})
        where = "first non-finite: the parameters of layer"
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [6, 6] and job.proc.returncode == 6, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "non-finite values at step" in lines[0] and where in lines[0], job.err
    step = int(lines[0].split("at step ")[1].split(":")[0])
    assert 1 <= step < 40
    with open(tmp_path / "out" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    # every step before the failing one; a step whose update made the parameters non-finite (found when its
    # checkpoint was to be written) has its row
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) in (step - 1, step), (steps, step)
    summary = _strict_json((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] in (step - 1, step)
    path, data = util.newest_checkpoint(tmp_path / "ck")
    if path is not None:  # the newest checkpoint is a good one
        assert data["step"] < step
        assert all(np.isfinite(v).all() for v in data["tensors"].values())


def test_nonfinite_gradient_stops_the_run_naming_the_layer(tmp_path):
    """A NaN in one rank's gradient of the first layer at step 3 (the loss of step 3 is finite): the gradient
    norm of step 3 names it; the metrics and the newest checkpoint are those of step 2."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 40}, checkpoint={"every_steps": 2})
    job = util.run(tmp_path, cfg, ranks=2, timeout=90, env={"FAULT_GRAD_NAN": "1:3:c1"})
    assert job.rank_codes() == [6, 6] and job.proc.returncode == 6, (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "non-finite values at step 3: gradient norm nan" in lines[0] \
        and "first non-finite: the gradient of layer 'c1'" in lines[0], job.err
    with open(tmp_path / "out" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert all(np.isfinite(float(r["grad_norm"])) and float(r["grad_norm"]) > 0 for r in rows)
    summary = _strict_json((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] in (2, 3)  # step 3's update ran (buckets are applied as they are reduced)
    path, data = util.newest_checkpoint(tmp_path / "ck")
    assert data["step"] == 2 and all(np.isfinite(v).all() for v in data["tensors"].values())


@pytest.mark.parametrize("ranks,parallel", [(1, {}), (2, {"default": {"n": 2}}), (2, {"default": {"c": 2}})])
def test_gradient_norm_column_is_the_norm_of_the_update(tmp_path, ranks, parallel):
    """Plain SGD moves the weights by lr times the gradient: the logged norm of step 1 equals the norm of the
    change between the step-0 and step-1 checkpoints over lr, whatever the split (each block counted once)."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 1}, optimizer={"lr": 0.5},
                    checkpoint={"every_steps": 1, "at_start": True, "keep": 0})
    if parallel:
        cfg["parallel"] = parallel
    job = util.run(tmp_path, cfg, ranks=ranks, timeout=90)
    assert job.rank_codes() == [0] * ranks, job.err[-3000:]
    from lbannpy import checkpoint

    w0 = checkpoint.load(str(tmp_path / "ck" / "ckpt-00000000"))["tensors"]
    w1 = checkpoint.load(str(tmp_path / "ck" / "ckpt-00000001"))["tensors"]
    keys = [k for k in w0 if k.startswith("params/")]
    assert len(keys) == 4
    want = np.sqrt(sum(float(np.sum((w1[k] - w0[k]) ** 2)) for k in keys)) / 0.5
    with open(tmp_path / "out" / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert float(row["grad_norm"]) == pytest.approx(want, rel=1e-5)
