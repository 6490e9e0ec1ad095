"""Checkpoints under faults and changes: ``--resume`` refuses a checkpoint of another computation with one
line saying what changed (``--force`` continues with a note), a damaged or incomplete newest checkpoint
falls back to the previous one with a note, old checkpoints are pruned (``checkpoint.keep``) and they go
under the run's output directory by default."""
from __future__ import annotations

import copy
import json
import os
import shutil

import h5py
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")

# (change to the config of the resumed run, what the refusal names)
CHANGES = {
    "stride": ({"model.layers.c1.stride": 2}, "model.layers.c1.stride: 1 -> 2"),
    "activation": ({"model.layers.r1.type": "leaky_relu"}, "model.layers.r1.type: relu -> leaky_relu"),
    "inserted-pool": ({"insert": {"name": "p1", "type": "pool", "kernel": 2, "stride": 2}},
                      "model.layers.p1: (none) -> a pool layer"),
    "optimizer": ({"optimizer.type": "adam"}, "optimizer.type: sgd -> adam"),
    "momentum": ({"optimizer.momentum": 0.9}, "optimizer.momentum: 0.0 -> 0.9"),
    "dtype": ({"trainer.dtype": "float64"}, "trainer.dtype: float32 -> float64"),
}


def _changed(cfg: dict, change: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for key, value in change.items():
        if key == "insert":
            cfg["model"]["layers"].insert(2, value)
            continue
        parts = key.split(".")
        node = cfg
        if parts[:2] == ["model", "layers"]:
            node = next(layer for layer in cfg["model"]["layers"] if layer["name"] == parts[2])
            parts = parts[3:]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


@pytest.fixture(scope="module")
def first_run_dir(tmp_path_factory):
    """One 4-step run with checkpoints at steps 2 and 4 (data, checkpoints, outputs), shared by the tests
    that resume from it: each works on its own copy (:func:`_first_run`)."""
    d = tmp_path_factory.mktemp("first-run")
    util.make_data(d / "data.h5")
    cfg = util.spec(d, trainer={"steps": 4}, checkpoint={"every_steps": 2})
    job = util.run(d, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    return d


def _first_run(tmp_path, first_run_dir) -> dict:
    """The shared first run copied into ``tmp_path``, and its config there. Only data paths, output and
    checkpoint directories differ from the run that wrote it, which resume allows without notice."""
    shutil.copytree(first_run_dir, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("pid.*", "rc.*", "*.yaml", "rank.py"))
    return util.spec(tmp_path, trainer={"steps": 4}, checkpoint={"every_steps": 2})


def _checkpoints(ck) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("ckpt-"))


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_resume_refuses_a_changed_computation(tmp_path, first_run_dir, case):
    cfg = _first_run(tmp_path, first_run_dir)
    before = {p: os.stat(p).st_mtime_ns for p in (tmp_path / "ck").rglob("*")}
    change, named = CHANGES[case]
    resumed = _changed(cfg, change)
    resumed["trainer"]["steps"] = 6  # more steps: allowed without notice
    job = util.run(tmp_path, resumed, ranks=2, args=("--resume",), timeout=60)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "--resume" in lines[0] and named in lines[0] and "--force" in lines[0], job.err
    assert {p: os.stat(p).st_mtime_ns for p in (tmp_path / "ck").rglob("*")} == before  # nothing touched


def test_resume_force_continues_with_a_note(tmp_path, first_run_dir):
    cfg = _first_run(tmp_path, first_run_dir)
    resumed = _changed(cfg, {"optimizer.momentum": 0.9})
    resumed["trainer"]["steps"] = 6
    job = util.run(tmp_path, resumed, ranks=2, args=("--resume", "--force"), timeout=60)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    notes = [ln for ln in job.err.splitlines() if "--force" in ln]
    assert len(notes) == 1 and "optimizer.momentum: 0.0 -> 0.9" in notes[0], job.err
    path, data = util.newest_checkpoint(tmp_path / "ck")
    assert data["step"] == 6 and data["meta"]["computation"]["optimizer"]["momentum"] == 0.9
    # --force alone is a mistake, said in one line
    job = util.run(tmp_path, cfg, ranks=2, args=("--force",), timeout=60)
    assert job.rank_codes() == [2, 2] and "--force only goes with --resume" in job.err, job.err


def _zero_tail(path, frac=0.4):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(int(size * (1 - frac)))
        f.write(b"\0" * (size - int(size * (1 - frac))))


def _drop_reader_meta(ckdir):
    with h5py.File(ckdir / "index.h5", "r+") as f:
        meta = json.loads(str(f.attrs["meta"]))
        del meta["reader"]
        f.attrs["meta"] = json.dumps(meta)


@pytest.mark.parametrize("damage", ["zeroed-tail", "no-reader-meta"])
def test_damaged_newest_checkpoint_falls_back_with_a_note(tmp_path, first_run_dir, damage):
    cfg = _first_run(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    assert _checkpoints(ck) == ["ckpt-00000002", "ckpt-00000004"]
    newest = ck / "ckpt-00000004"
    if damage == "zeroed-tail":
        for f in newest.iterdir():
            _zero_tail(f)
    else:
        _drop_reader_meta(newest)
    resumed = dict(cfg, trainer=dict(cfg["trainer"], steps=6))
    job = util.run(tmp_path, resumed, ranks=2, args=("--resume",), timeout=60)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    job.assert_no_traceback()
    notes = [ln for ln in job.err.splitlines() if "cannot be used" in ln]
    assert notes and all("ckpt-00000004" in ln and "trying the previous one" in ln for ln in notes), job.err
    with open(tmp_path / "out" / "metrics.csv") as f:
        steps = [int(line.split(",")[0]) for line in list(f)[1:]]
    assert steps == [1, 2, 3, 4, 5, 6]  # rows 3 and 4 again, from the step-2 checkpoint
    # every checkpoint damaged: one line, every rank non-zero
    for d in (ck / "ckpt-00000002", ck / "ckpt-00000004", ck / "ckpt-00000006"):
        _drop_reader_meta(d)
    job = util.run(tmp_path, resumed, ranks=2, args=("--resume",), timeout=60)
    assert job.rank_codes() == [2, 2], job.err[-3000:]
    job.assert_no_traceback()
    lines = [ln for ln in util.error_lines(job.err) if "cannot be used" not in ln]
    assert len(lines) == 1 and "no readable checkpoint" in lines[0], job.err


def test_checkpoints_default_to_the_output_directory_and_are_pruned(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 6}, checkpoint={"every_steps": 1, "keep": 2})
    del cfg["checkpoint"]["dir"]
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    assert not (tmp_path / "ckpt").exists()
    assert _checkpoints(tmp_path / "out" / "ckpt") == ["ckpt-00000005", "ckpt-00000006"]
    # keep 0: every one stays
    cfg["checkpoint"]["keep"] = 0
    cfg["output"]["dir"] = str(tmp_path / "out0")
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    assert _checkpoints(tmp_path / "out0" / "ckpt") == [f"ckpt-{s:08d}" for s in range(1, 7)]
