"""Bounded allocation (issue #16): every size a spec implies or a data file declares is priced per rank
before anything is allocated. ``python -m lbannpy.config validate`` prints the estimate and refuses a plan
over ``runtime.memory_gib`` (exit 1, one line); the trainer refuses the same at set-up on every rank (exit
2, one line, no traceback, within seconds)."""
from __future__ import annotations

import json
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")

# a run that allocated what these specs imply would take many minutes or die with a MemoryError; refused, it
# is set-up only (interpreter start, MPI start, reading a config and a file's metadata): ending before this
# harness timeout is the liveness check, and no duration is asserted
SET_UP_TIMEOUT_S = 90


def _two_huge_convs(tmp):
    """filters: 200000 twice: the second conv alone has 200000·200000·9 weights (1.3 TiB in float32)."""
    cfg = util.spec(tmp)
    layers = cfg["model"]["layers"]
    layers[0]["filters"] = 200000
    layers.insert(1, {"name": "c2", "type": "conv", "filters": 200000, "kernel": 3, "padding": 1})
    return cfg


def _filters_2_62(tmp):
    cfg = util.spec(tmp)
    cfg["model"]["layers"][0]["filters"] = 2 ** 62
    return cfg


def _declared_samples(tmp):
    """A data file of a few KiB declaring 10^10 samples (chunked, never written: it costs nothing on disk);
    its sample ids alone would be 74.5 GiB."""
    n = 10 ** 10
    with h5py.File(tmp / "data.h5", "w") as f:
        f.create_dataset("inputs", shape=(n, 3, 8, 8), dtype="float32", chunks=(1, 3, 8, 8))
        f.create_dataset("labels", shape=(n,), dtype="int64", chunks=(1024,))
    assert (tmp / "data.h5").stat().st_size < 64 * 1024
    return util.spec(tmp)


def _lazy_images(tmp):
    """Two 18-channel 16384² samples, chunked and never written (a few KiB on disk, 36 GiB declared), and a
    model that reads them: one block of the batch alone is 18 GiB per rank."""
    with h5py.File(tmp / "data.h5", "w") as f:
        f.create_dataset("inputs", shape=(2, 18, 16384, 16384), dtype="float32", chunks=(1, 1, 256, 256))
        f.create_dataset("labels", shape=(2,), dtype="int64")
    assert (tmp / "data.h5").stat().st_size < 64 * 1024
    cfg = util.spec(tmp, trainer={"batch_size": 2})
    cfg["model"]["input"] = {"channels": 18, "spatial": [16384, 16384]}
    return cfg


def _tiny_limit(tmp):
    return util.spec(tmp, runtime={"memory_gib": 0.001})


CASES = {"filters-200000": (_two_huge_convs, "model"), "filters-2**62": (_filters_2_62, "model"),
         "1e10-samples": (_declared_samples, "sample ids"), "lazy-16384^2": (_lazy_images, "batch"),
         "memory_gib-0.001": (_tiny_limit, "limit")}
OWN_DATA = ("1e10-samples", "lazy-16384^2")


def _validate(tmp, cfg, ranks=2):
    path = tmp / "validate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    # the harness's timeout is the liveness check: nothing is allocated, so no duration is asserted
    return subprocess.run([util.PY, "-m", "lbannpy.config", "validate", str(path), "--ranks", str(ranks)],
                          env=util.ENV, capture_output=True, text=True, timeout=SET_UP_TIMEOUT_S, cwd=tmp)


def _assert_refusal_line(line: str, part: str) -> None:
    assert "runtime.memory_gib" in line and "GiB per rank on 2 rank(s)" in line, line
    assert "over the limit of" in line, line
    if part != "limit":
        assert "this machine's memory" in line, line  # the default limit
    else:
        assert "runtime.memory_gib 0.001 GiB" in line, line
    if part == "batch":  # (prefetch 2 + 2) blocks of one 18x16384^2 float32 sample per rank
        assert "batch buffers 72 GiB" in line, line
    if part == "sample ids":
        assert "sample ids and labels 298 GiB" in line, line  # 3 int64 arrays + int64 labels of 10^10


@pytest.mark.parametrize("case", list(CASES))
def test_validate_refuses_over_the_limit(tmp_path, case):
    make, part = CASES[case]
    if case not in OWN_DATA:
        util.make_data(tmp_path / "data.h5")
    p = _validate(tmp_path, make(tmp_path))
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)  # a user error, as the trainer's
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("lbannpy.config: error: runtime.memory_gib:"), p.stderr
    _assert_refusal_line(lines[0], part)


@pytest.mark.parametrize("case", list(CASES))
def test_train_refuses_over_the_limit_on_every_rank(tmp_path, case):
    make, part = CASES[case]
    if case not in OWN_DATA:
        util.make_data(tmp_path / "data.h5")
    job = util.run(tmp_path, make(tmp_path), ranks=2, timeout=SET_UP_TIMEOUT_S)
    job.assert_every_rank_failed()
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and lines[0].startswith("lbannpy.train: error: runtime.memory_gib:"), job.err
    _assert_refusal_line(lines[0], part)
    assert not (tmp_path / "out" / "metrics.csv").exists()


def test_a_normal_run_prints_and_keeps_its_estimate(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path)
    p = _validate(tmp_path, cfg)
    assert p.returncode == 0, p.stderr
    mem = [ln for ln in p.stdout.splitlines() if ln.startswith("memory: peak ")]
    assert len(mem) == 1 and "per rank on 2 rank(s)" in mem[0] and "limit: this machine's memory" in mem[0], \
        p.stdout
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [0, 0] and job.proc.returncode == 0, job.err[-3000:]
    est = json.loads((tmp_path / "out" / "summary.json").read_text())["memory_estimate"]
    assert est["ranks"] == 2 and 0 < est["peak_bytes"] < 2 ** 30, est
    parts = ("model_bytes", "batch_bytes", "index_bytes", "runtime_bytes")
    assert est["peak_bytes"] == sum(est[k] for k in parts), est
    # sample ids: 3 int64 arrays of the 32 samples, and the 32 int64 class labels
    assert est["index_bytes"] == 4 * 8 * 32
    assert np.isclose(float(mem[0].split("peak ")[1].split(" GiB")[0]), est["peak_bytes"] / 2 ** 30,
                      rtol=0.01)
