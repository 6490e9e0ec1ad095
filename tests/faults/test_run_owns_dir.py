"""A run owns its checkpoint directory: a fresh run refuses another run's checkpoints (``--force-new-run``
moves them aside, never deletes them); pruning deletes only this run's checkpoints older than the one it just
wrote and read back, never one it cannot read; one rule finds checkpoints (any number of digits, no links,
nothing that is not a checkpoint); readers list again when a live run prunes the one they picked; an index
whose shard table or boxes were edited is refused like any damage, and the previous checkpoint is used."""
from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")


def _cfg(d, steps: int = 4, **ckpt) -> dict:
    # the conv and fc weights split in two (c: 2): each tensor is two blocks of one shape, one per shard
    return util.spec(d, trainer={"steps": steps}, checkpoint=dict({"every_steps": 2, "keep": 0}, **ckpt),
                     parallel={"default": {"c": 2}})


@pytest.fixture(scope="module")
def first_run_dir(tmp_path_factory):
    """One 6-step run with checkpoints at steps 2, 4 and 6; each test works on its own copy."""
    d = tmp_path_factory.mktemp("owned")
    util.make_data(d / "data.h5")
    job = util.run(d, _cfg(d, 6), ranks=2, timeout=120)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    return d


def _copy(tmp_path, first_run_dir, keep_six: bool = False) -> None:
    shutil.copytree(first_run_dir, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("pid.*", "rc.*", "*.yaml", "rank.py"))
    if not keep_six:  # the run as it stood after step 4
        shutil.rmtree(tmp_path / "ck" / "ckpt-00000006")


def _names(ck) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("ckpt-"))


def _run_id(path) -> str:
    with h5py.File(path / "index.h5", "r") as f:
        return str(f.attrs["run_id"])


def _state(d) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in d.rglob("*")
            if p.is_file() and p.name != ".lbannpy.lock"}


def _reseal(index) -> None:
    """Recompute an edited index's digest, as a forger would (so only what the digest cannot see tells)."""
    from lbannpy.checkpoint.integrity import INDEX_ATTRS, index_digest

    with h5py.File(index, "r+") as f:
        attrs = {k: f.attrs[k] for k in INDEX_ATTRS}
        tables = {str(t.attrs["key"]): (t.attrs["global_shape"], t["boxes"][()], t["shards"][()],
                                        t["crc32"][()]) for t in f["tensors"].values()}
        digests = {int(r): (d.decode() if isinstance(d, bytes) else str(d))
                   for r, d in zip(f["shard_ranks"][()], f["shard_digests"][()])}
        f.attrs["digest"] = index_digest(attrs, tables, digests)


def _table(index, key: str):
    f = h5py.File(index, "r+")
    return f, next(t for t in f["tensors"].values() if t.attrs["key"] == key)


def test_a_fresh_run_refuses_another_runs_checkpoints(tmp_path, first_run_dir):
    _copy(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    old_id = _run_id(ck / "ckpt-00000004")
    before = _state(tmp_path / "out"), _state(ck)
    job = util.run(tmp_path, _cfg(tmp_path), ranks=2, timeout=90)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    lines = util.error_lines(job.err)
    assert len(lines) == 1, job.err
    for word in ("ckpt-00000004", str(ck), "--resume", "output.dir", "--force-new-run"):
        assert word in lines[0], (word, lines[0])
    assert (_state(tmp_path / "out"), _state(ck)) == before  # nothing written, nothing pruned
    # --force-new-run: the old checkpoints moved aside (a line says where), the new run's in their place
    job = util.run(tmp_path, _cfg(tmp_path, keep=1), ranks=2, args=("--force-new-run",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    (aside,) = [p for p in ck.iterdir() if p.name.startswith("aside-")]
    moved = [ln for ln in job.err.splitlines() if "--force-new-run" in ln]
    assert len(moved) == 1 and str(aside) in moved[0], job.err
    assert _names(aside) == ["ckpt-00000002", "ckpt-00000004"]
    assert all(_run_id(aside / n) == old_id for n in _names(aside))
    assert _names(ck) == ["ckpt-00000004"] and _run_id(ck / "ckpt-00000004") != old_id
    from lbannpy.export import load_checkpoint

    found, data = load_checkpoint(str(ck))  # what predict and export take: the new run's
    assert found.endswith("ckpt-00000004") and data["meta"]["run_id"] != old_id
    # --force-new-run with --resume: one line
    job = util.run(tmp_path, _cfg(tmp_path), ranks=2, args=("--resume", "--force-new-run"), timeout=90)
    assert job.rank_codes() == [2, 2] and "--force-new-run" in util.error_lines(job.err)[0], job.err


def _zero_tail(path, frac=0.4):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(int(size * (1 - frac)))
        f.write(b"\0" * (size - int(size * (1 - frac))))


def test_pruning_keeps_what_it_cannot_read_and_the_checkpoint_it_wrote(tmp_path, first_run_dir):
    """The newest checkpoint damaged, keep 1: the run resumes from step 2 and writes step 3; pruning used to
    keep the damaged step 4 (the highest name) and delete steps 3 and 2."""
    _copy(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    for f in (ck / "ckpt-00000004").iterdir():
        _zero_tail(f)
    job = util.run(tmp_path, _cfg(tmp_path, 3, keep=1), ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    assert _names(ck) == ["ckpt-00000003", "ckpt-00000004"]  # step 2 pruned; the damaged one left alone
    path, data = util.newest_checkpoint(ck)
    assert path.endswith("ckpt-00000003") and data["step"] == 3


def test_what_is_not_a_checkpoint_is_never_newest(tmp_path, first_run_dir):
    """Files named like checkpoints (what ``export -o`` or ``predict -o`` wrote there), a file without a
    suffix and a temporary directory: none is taken for the newest checkpoint, so keep 1 keeps the one the
    run wrote (it used to delete every real checkpoint), and none is deleted."""
    _copy(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    (ck / "ckpt-99999999.h5").write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}' * 2)
    with h5py.File(ck / "ckpt-99999998.h5", "w") as f:
        f["probabilities"] = np.zeros((4, 2))
    (ck / "ckpt-00000099").write_text("not a checkpoint")
    (ck / "ckpt-00000098.tmp").mkdir()
    strays = ["ckpt-00000098.tmp", "ckpt-00000099", "ckpt-99999998.h5", "ckpt-99999999.h5"]
    job = util.run(tmp_path, _cfg(tmp_path, 6, keep=1), ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    assert _names(ck) == ["ckpt-00000006"] + strays
    path, data = util.newest_checkpoint(ck)
    assert path.endswith("ckpt-00000006") and data["step"] == 6
    from lbannpy import checkpoint

    # an HDF5 file is a candidate (version 1 was one file; reading it says what it is), the rest are not
    assert [os.path.basename(p) for p in checkpoint.candidates(str(ck))] == ["ckpt-99999998.h5",
                                                                              "ckpt-00000006"]


def _params(value: float):
    from lbannpy.dist import Distribution
    from lbannpy.layers.param import Param
    from lbannpy.optim import SGD

    w = np.full((4, 6), value)
    p = Param("w", w.shape, ((0, 4), (0, 6)), w, w.copy(), Distribution.whole(2, 1), ())
    opt = SGD([p], 0.1, momentum=0.9)
    opt.state["w"]["momentum"] = w * 2
    return [p], opt


def test_steps_past_eight_digits_are_read_and_pruned(tmp_path):
    from lbannpy import checkpoint
    from lbannpy.comm import SingleCommunicator

    comm = SingleCommunicator()
    for step in (99_999_999, 123_456_789, 1_000_000_000):
        params, opt = _params(float(step % 7))
        last = checkpoint.save(comm, str(tmp_path), step, params, opt, {}, run_id="r1")
    assert os.path.basename(last) == "ckpt-1000000000"
    assert [os.path.basename(p) for p in checkpoint.candidates(str(tmp_path))] == \
        ["ckpt-1000000000", "ckpt-123456789", "ckpt-99999999"]
    path, data = checkpoint.load_newest(str(tmp_path))
    assert path == last and data["step"] == 1_000_000_000
    checkpoint.prune(str(tmp_path), 2, run_id="r1", newest=last)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1000000000", "ckpt-123456789"]


def test_a_symlink_named_like_a_checkpoint_does_not_stop_the_save(tmp_path, first_run_dir):
    """``ckpt-00000004`` replaced by a link (here to a copy of step 2): the run resumes from step 2 and
    writes step 4 where the link was (the link moved aside, its target untouched); it used to end with
    exit 7, "full disk", naming the link as the newest complete checkpoint."""
    _copy(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(ck / "ckpt-00000002", elsewhere / "ckpt-00000002")
    shutil.rmtree(ck / "ckpt-00000004")
    os.symlink(elsewhere / "ckpt-00000002", ck / "ckpt-00000004")
    target = _state(elsewhere)
    job = util.run(tmp_path, _cfg(tmp_path), ranks=2, args=("--resume",), timeout=90)
    assert job.rank_codes() == [0, 0], (job.rank_codes(), job.err[-3000:])
    job.assert_no_traceback()
    assert (ck / "ckpt-00000004").is_dir() and not (ck / "ckpt-00000004").is_symlink()
    path, data = util.newest_checkpoint(ck)
    assert path.endswith("ckpt-00000004") and data["step"] == 4
    links = [p for p in ck.rglob("ckpt-00000004") if p.is_symlink()]
    assert len(links) == 1 and os.readlink(links[0]) == str(elsewhere / "ckpt-00000002"), list(ck.rglob("*"))
    assert _state(elsewhere) == target


@pytest.mark.parametrize("forgery", ["shard-minus-2", "swapped-boxes"])
def test_a_forged_index_falls_back_to_the_previous_checkpoint(tmp_path, first_run_dir, capsys, forgery):
    """An index edited and resealed (its digest recomputed): a shard table entry of -2 (a version-1
    marker; was an AttributeError), or two rows' boxes swapped (the blocks' own boxes disagree; was read as
    is: wrong weights). Either is damage: refused with a line, and the previous checkpoint is used."""
    _copy(tmp_path, first_run_dir)
    ck = tmp_path / "ck"
    index = ck / "ckpt-00000004" / "index.h5"
    f, t = _table(index, "params/c1.weight")
    with f:
        if forgery == "shard-minus-2":
            shards = t["shards"][()]
            shards[0] = -2
            t["shards"][...] = shards
        else:
            boxes = t["boxes"][()]
            t["boxes"][...] = boxes[::-1]
    _reseal(index)
    from lbannpy import checkpoint

    with pytest.raises(checkpoint.CheckpointError, match="shard table" if forgery == "shard-minus-2" else
                       "the index puts it at"):
        checkpoint.load(str(ck / "ckpt-00000004"))
    notes = []
    path, data = checkpoint.load_newest(str(ck), note=notes.append)
    assert path.endswith("ckpt-00000002") and data["step"] == 2
    assert len(notes) == 1 and "ckpt-00000004" in notes[0], notes


@pytest.mark.parametrize("reader", ["export", "predict"])
def test_readers_list_again_when_a_live_run_prunes_their_pick(tmp_path, first_run_dir, monkeypatch, reader):
    """``export`` and ``predict`` on the checkpoint directory of a running job: the checkpoint they picked
    (step 4) is pruned as they open it, the run having written step 6. They take step 6 (they used to try
    the older ones, pruned too, and fail)."""
    ck = tmp_path / "ck"
    stash = tmp_path / "stash"
    shutil.copytree(first_run_dir / "ck" / "ckpt-00000006", stash / "ckpt-00000006")
    want = util.newest_checkpoint(stash)[1]["tensors"]
    from lbannpy.checkpoint import read
    from lbannpy.export import load_checkpoint
    from lbannpy.predict import load_weights

    _copy(tmp_path, first_run_dir)
    fired = []

    class LiveRun(read.Checkpoint):
        """Opening step 4 first: the run writes step 6 and prunes steps 2 and 4 (keep 1)."""

        def __init__(self, path, *a, **k):
            if os.path.basename(path.rstrip("/")) == "ckpt-00000004" and not fired:
                fired.append(path)
                shutil.copytree(stash / "ckpt-00000006", ck / "ckpt-00000006")
                shutil.rmtree(ck / "ckpt-00000002")
                shutil.rmtree(ck / "ckpt-00000004")
            super().__init__(path, *a, **k)

    monkeypatch.setattr(read, "Checkpoint", LiveRun)
    if reader == "export":
        found, data = load_checkpoint(str(ck))
        got = data["tensors"]
    else:
        params = [SimpleNamespace(name=k[len("params/"):], global_shape=v.shape,
                                  box=tuple((0, s) for s in v.shape), value=np.zeros(v.shape))
                  for k, v in want.items() if k.startswith("params/")]
        found, step = load_weights(str(ck), SimpleNamespace(params=params, layers=[]), np)
        assert step == 6
        got = {f"params/{p.name}": p.value for p in params}
    assert fired and found.endswith("ckpt-00000006"), found
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
