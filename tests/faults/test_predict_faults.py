"""``predict`` under ``train``'s rules: ``-o`` naming one of its inputs is refused before anything is opened
(the input stays byte for byte), and a checkpoint with a shard missing or damaged on one rank ends every rank
with one line instead of one rank waiting forever in a collective; given the checkpoint directory, the
previous complete checkpoint is taken with a note."""
from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")

# each rank: run predict's entry point in-process and record its exit status
RANK = """
import os, sys
rank = os.environ.get("PMI_RANK", "0")
from lbannpy.predict import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
open(os.path.join(os.environ["FAULT_DIR"], f"rc.{rank}"), "w").write(str(code))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run at 2 ranks with checkpoints at steps 2 and 4, the weights split over the ranks (each
    rank writes a shard)."""
    d = tmp_path_factory.mktemp("predict-faults")
    util.make_data(d / "data.h5")
    cfg = util.spec(d, trainer={"steps": 4}, checkpoint={"every_steps": 2}, parallel={"default": {"c": 2}})
    job = util.run(d, cfg, ranks=2, timeout=120)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    return d


def _copy(tmp_path, trained):
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("pid.*", "rc.*", "rank.py"))


def _predict(tmp_path, ckpt, out, data=None, timeout=60) -> util.Job:
    for f in tmp_path.glob("rc.*"):
        f.unlink()
    script = tmp_path / "predict_rank.py"
    script.write_text(RANK)
    cmd = [util.MPIEXEC, "-n", "2", util.PY, str(script), str(tmp_path / "cfg.yaml"), "--checkpoint",
           str(ckpt), "--data", str(data or tmp_path / "data.h5"), "-o", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(util.ENV, FAULT_DIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return util.Job(tmp_path, 2, proc, util.time.monotonic()).wait(timeout)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_output_naming_the_input_is_refused_and_the_input_kept(tmp_path, trained):
    _copy(tmp_path, trained)
    data = tmp_path / "data.h5"
    before = _digest(data)
    job = _predict(tmp_path, tmp_path / "ck", out=tmp_path / "." / "data.h5")
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "-o" in lines[0] and "data.h5" in lines[0] and "--data" in lines[0], job.err
    assert _digest(data) == before


def test_a_missing_shard_ends_every_rank_with_one_line(tmp_path, trained):
    _copy(tmp_path, trained)
    newest = tmp_path / "ck" / "ckpt-00000004"
    (newest / "shard-000001.h5").unlink()
    job = _predict(tmp_path, newest, out=tmp_path / "p.h5")
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "shard-000001.h5" in lines[0], job.err
    assert not list(tmp_path.glob("p.h5*"))  # no output, not even a partial one
    # the directory: the previous complete checkpoint, with a note naming the one skipped
    job = _predict(tmp_path, tmp_path / "ck", out=tmp_path / "p.h5")
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    notes = [ln for ln in job.err.splitlines() if "cannot be used" in ln]
    assert len(notes) == 1 and "ckpt-00000004" in notes[0] and "shard-000001.h5" in notes[0], job.err
    import h5py

    with h5py.File(tmp_path / "p.h5", "r") as f:
        assert f.attrs["step"] == 2 and f["probabilities"].shape[0] == 32
    assert sorted(p.name for p in tmp_path.glob("p.h5*")) == ["p.h5"]  # no temporary left
