"""Checkpoints prove they are whole: one flipped bit in a weight, a batch-norm running mean or a momentum, a
shard copied in from an older checkpoint, an index whose step was edited, or a dangling link named like a
checkpoint: ``--resume`` falls back to the previous complete checkpoint with one note naming the damaged
file and block, and ends where an uninterrupted run ends; ``export`` refuses the damaged checkpoint in one
line (or, given the directory, takes the previous one with a note)."""
from __future__ import annotations

import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")

# a model with batch-norm statistics and an optimizer with momentum: every kind of tensor a checkpoint holds
LAYERS = [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
          {"name": "b1", "type": "batchnorm"},
          {"name": "r1", "type": "relu"},
          {"name": "f1", "type": "fc", "units": 2}]


def _cfg(d, steps: int) -> dict:
    cfg = util.spec(d, trainer={"steps": steps}, checkpoint={"every_steps": 2},
                    optimizer={"momentum": 0.9})
    cfg["model"]["layers"] = LAYERS
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4 (the one the tests damage), and the same run's final
    tensors (the uninterrupted result every fallback must reproduce)."""
    d = tmp_path_factory.mktemp("ckpt-integrity")
    util.make_data(d / "data.h5")
    job = util.run(d, _cfg(d, 4), ranks=2, timeout=120)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    from lbannpy import checkpoint

    return d, checkpoint.load(str(d / "ck" / "ckpt-00000004"))["tensors"]


def _copy(tmp_path, runs) -> dict:
    d, _ = runs
    shutil.copytree(d, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("pid.*", "rc.*", "*.yaml", "rank.py"))
    return _cfg(tmp_path, 4)


def _shard_holding(ckdir, key: str):
    for f in sorted(ckdir.glob("shard-*.h5")):
        with h5py.File(f, "r") as h:
            if key in h:
                return f
    raise AssertionError(f"no shard of {ckdir} holds {key}")


def _flip_bit(path, key: str, byte: int, bit: int) -> None:
    """Flip one bit of dataset ``key`` in the file's bytes (as a disk or a network would), not through
    HDF5."""
    with h5py.File(path, "r") as f:
        off = f[key].id.get_offset()
        assert off is not None and f[key].nbytes > byte
    with open(path, "r+b") as fh:
        fh.seek(off + byte)
        b = fh.read(1)[0]
        fh.seek(off + byte)
        fh.write(bytes([b ^ (1 << bit)]))


def _damage(ck, how: str) -> tuple[str, str]:
    """Damage ``ckpt-00000004`` under ``ck``; returns the file and the block (or attribute) the note must
    name."""
    new = ck / "ckpt-00000004"
    if how == "weight-bit":
        f = _shard_holding(new, "params/c1.weight")
        _flip_bit(f, "params/c1.weight", 5, 1)  # a low mantissa bit: a plausible value, silently wrong
        return f.name, "params/c1.weight"
    if how == "bn-running-mean-bit":
        f = _shard_holding(new, "state/b1/running_mean")
        _flip_bit(f, "state/b1/running_mean", 6, 3)
        return f.name, "state/b1/running_mean"
    if how == "momentum-exponent":
        key = next(k for k in _keys(new) if k.startswith("optim/f1") and "weight" in k)
        f = _shard_holding(new, key)
        _flip_bit(f, key, 7, 6)  # the top exponent bit of a float64 (or of the last float32 byte)
        return f.name, key
    if how == "shard-from-older":
        old = ck / "ckpt-00000002" / "shard-000001.h5"
        shutil.copy(old, new / "shard-000001.h5")
        return "shard-000001.h5", "another checkpoint"
    if how == "index-step-edited":
        with h5py.File(new / "index.h5", "r+") as f:
            f.attrs["step"] = np.int64(6)
        return "index.h5", "step"
    raise AssertionError(how)


def _keys(ckdir) -> list[str]:
    keys = []
    for f in sorted(ckdir.glob("shard-*.h5")):
        with h5py.File(f, "r") as h:
            h.visititems(lambda name, obj: keys.append(name) if isinstance(obj, h5py.Dataset) else None)
    return keys


DAMAGE = ["weight-bit", "bn-running-mean-bit", "momentum-exponent", "shard-from-older", "index-step-edited"]


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_falls_back_from_a_damaged_checkpoint(tmp_path, runs, how):
    cfg = _copy(tmp_path, runs)
    ck = tmp_path / "ck"
    fname, what = _damage(ck, how)
    job = util.run(tmp_path, cfg, ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    notes = [ln for ln in util.error_lines(job.err) if "cannot be used" in ln]
    assert notes, job.err
    assert all("ckpt-00000004" in ln and fname in ln and what in ln and "trying the previous one" in ln
               for ln in notes), job.err
    # steps 3 and 4 again from the step-2 checkpoint: the result is the uninterrupted run's
    from lbannpy import checkpoint

    got = checkpoint.load(str(ck / "ckpt-00000004"))["tensors"]
    want = runs[1]
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_a_dangling_link_is_skipped_with_a_note(tmp_path, runs):
    cfg = _copy(tmp_path, runs)
    ck = tmp_path / "ck"
    os.symlink(tmp_path / "gone", ck / "ckpt-00000099")
    job = util.run(tmp_path, cfg, ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "ckpt-00000099" in lines[0] and "dangling" in lines[0], job.err


def _export(tmp_path, src) -> subprocess.CompletedProcess:
    return subprocess.run([util.PY, "-m", "lbannpy.export", str(src), "-o", str(tmp_path / "w.safetensors")],
                          env=util.ENV, capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_export_refuses_a_damaged_checkpoint_and_falls_back_in_a_directory(tmp_path, runs):
    _copy(tmp_path, runs)
    ck = tmp_path / "ck"
    fname, what = _damage(ck, "weight-bit")
    r = _export(tmp_path, ck / "ckpt-00000004")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fname in lines[0] and what in lines[0] and "checksum" in lines[0], r.stderr
    assert not (tmp_path / "w.safetensors").exists()
    r = _export(tmp_path, ck)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "cannot be used" in ln]
    assert len(notes) == 1 and "ckpt-00000004" in notes[0] and fname in notes[0], r.stderr
    from lbannpy.export import read_safetensors

    _, meta = read_safetensors(str(tmp_path / "w.safetensors"))
    assert meta["lbannpy_checkpoint"].endswith("ckpt-00000002"), meta


def test_non_finite_values_are_damage_and_the_newest_sound_checkpoint_is_named(tmp_path, capsys):
    """A checkpoint whose checksums verify but whose momentum holds an infinity (written so, or by a bug):
    resume falls back from it with a note, and :func:`newest_sound` (what a non-finite stop names) skips
    it."""
    from lbannpy import checkpoint
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.param import Param
    from lbannpy.optim import SGD

    def make(v: float):
        w = np.full((4, 3), v)
        p = Param("w", w.shape, ((0, 4), (0, 3)), w, w.copy(), Distribution.whole(2, 1), ())
        opt = SGD([p], 0.1, momentum=0.9)
        opt.state["w"]["momentum"] = np.full((4, 3), v)
        opt.t = int(v)
        return [p], opt

    comm = SingleCommunicator()
    for step in (1, 2):
        params, opt = make(float(step))
        if step == 2:
            opt.state["w"]["momentum"][1, 2] = np.inf
        checkpoint.save(comm, str(tmp_path), step, params, opt, {})
    assert checkpoint.newest_sound(str(tmp_path)).endswith("ckpt-00000001")
    params, opt = make(0.0)
    path, info = checkpoint.resume(comm, str(tmp_path), params, opt, [], np)
    assert info["step"] == 1 and np.all(params[0].value == 1.0)
    err = capsys.readouterr().err
    assert "ckpt-00000002 cannot be used" in err and "optim/w/momentum" in err and "non-finite" in err, err


def test_a_non_finite_stop_names_the_newest_checkpoint_that_verifies(tmp_path):
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 40}, checkpoint={"every_steps": 1, "at_start": True},
                    optimizer={"lr": 1e300})
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [6, 6], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1 and "non-finite values at step" in lines[0], job.err
    from lbannpy import checkpoint

    sound = checkpoint.newest_sound(str(tmp_path / "ck"))
    assert sound is not None and f"is {sound} (--resume starts there)" in lines[0], lines[0]
