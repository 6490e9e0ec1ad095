"""``config validate`` refuses what ``train`` refuses in set-up, with the same words: a per-layer split
that leaves ranks with empty blocks (``parallel.layers.f1.c=4`` on a layer of 2 outputs) passed validate
and was refused by train."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


def test_validate_refuses_a_split_with_empty_blocks_as_train_does(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, parallel={"layers": {"f1": {"c": 4}}})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [util.PY, "-m", "lbannpy.config", "validate", str(tmp_path / "s.yaml"), "--ranks", "4"]
    r = subprocess.run(cmd, env=util.ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    said = r.stderr.strip()
    job = util.run(tmp_path, cfg, ranks=4, timeout=120)
    assert job.rank_codes() == [2, 2, 2, 2], (job.rank_codes(), job.err[-3000:])
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    core = lines[0][lines[0].index("output of layer 'f1'"):]
    assert "cannot be split 4 ways along 'c'" in core and core in said, (said, lines[0])


def test_validate_refuses_soft_labels_as_train_does(tmp_path):
    """Soft labels (float32 (N, C) probabilities) passed validate and were refused by train; the hint
    suggested them. Now both refuse, and the hint names what the reader takes."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["inputs"] = rng.standard_normal((32, 3, 8, 8)).astype(np.float32)
        f["labels"] = rng.dirichlet([1.0, 1.0], 32).astype(np.float32)
    cfg = util.spec(tmp_path)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [util.PY, "-m", "lbannpy.config", "validate", str(tmp_path / "s.yaml"), "--ranks", "2"]
    r = subprocess.run(cmd, env=util.ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    said = r.stderr.strip()
    assert "labels" in said and "probabilities" not in said.replace("no probabilities", ""), said
    job = util.run(tmp_path, cfg, ranks=2, timeout=120)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    assert len(util.error_lines(job.err)) == 1, job.err
