"""Checkpoint plan arithmetic at P = 1024 (pure, no MPI), atomicity, version 1 files and damaged files.

The plan is the code the save and restore run (``checkpoint.param_pieces``/``is_writer`` decide who writes
what; ``restore_plan`` is what ``Checkpoint.read`` does), evaluated here for every one of 1024 simulated
ranks with the boxes the layers compute (weights split along the output channels of the layer's
distribution, replicated along the dimensions their gradients are reduced over).
"""
from __future__ import annotations

import json
import math
import os
import time

import h5py
import numpy as np
import pytest

from lbannpy import checkpoint
from lbannpy.checkpoint import CheckpointError, Piece, StateTensor, is_writer, restore_plan, save_plan
from lbannpy.comm import SingleCommunicator
from lbannpy.dist import Distribution
from lbannpy.layers.param import Param
from lbannpy.optim import SGD

CONV_W, CONV_OUT = (64, 32, 3, 3), (256, 64, 64, 64)
FC_W, FC_OUT = (128, 4096), (256, 128)


def pieces_of(rank: int, conv: Distribution, fc: Distribution, writer=is_writer) -> list[Piece]:
    """Rank ``rank``'s pieces as the conv, fc and batch-norm layers lay them out (params, a momentum
    slot each, per-group batch-norm statistics)."""
    out = []
    fbox = conv.box(CONV_OUT, rank)[1]
    w = writer(conv, ("n", "h", "w"), rank)
    for key, shape, box in [("conv.weight", CONV_W, (fbox,) + tuple((0, s) for s in CONV_W[1:])),
                            ("bn.scale", (64,), (fbox,))]:
        out += [Piece(f"params/{key}", shape, box, w), Piece(f"optim/{key}/momentum", shape, box, w)]
    g = conv.coords(rank)[0]
    out.append(Piece("state/bn/running_mean", (conv.parts_of("n"), 64), ((g, g + 1), fbox),
                     writer(conv, ("h", "w"), rank)))
    cbox = fc.box(FC_OUT, rank)[1]
    wf = writer(fc, ("n",), rank)
    out += [Piece("params/fc.weight", FC_W, (cbox, (0, FC_W[1])), wf),
            Piece("optim/fc.weight/momentum", FC_W, (cbox, (0, FC_W[1])), wf)]
    return out


def index_of(P, conv, fc, writer=is_writer) -> dict:
    """What rank 0 builds from the shard files: per tensor the written boxes and their writers."""
    rows: dict = {}
    for r in range(P):
        for pc in pieces_of(r, conv, fc, writer):
            if pc.writer:
                rows.setdefault(pc.key, (pc.global_shape, [], []))
                rows[pc.key][1].append(pc.box)
                rows[pc.key][2].append(r)
    return {k: (g, np.asarray(b, dtype=np.int64), np.asarray(s, dtype=np.int64))
            for k, (g, b, s) in rows.items()}


def check_plan(P, conv, fc, P2, conv2, fc2, writer=is_writer):
    index = index_of(P, conv, fc, writer)
    entries = sum(len(s) for _, _, s in index.values())
    worst_save = worst_restore = 0.0
    for r in range(P):
        pcs = pieces_of(r, conv, fc, writer)
        sp = save_plan(pcs, r, entries)
        assert sp.peak_extra_bytes <= sp.held_bytes
        worst_save = max(worst_save, sp.received_bytes / sp.held_bytes)
    for r in range(P2):
        pcs = pieces_of(r, conv2, fc2)
        rp = restore_plan(index, pcs)
        held = sum(p.nbytes for p in pcs)
        worst_restore = max(worst_restore, (rp["read_bytes"] + rp["index_bytes"]) / held)
        assert rp["read_bytes"] >= held, f"rank {r} reads {rp['read_bytes']} bytes for {held} held"
    return index, worst_save, worst_restore


def test_plan_at_1024_ranks_moves_at_most_twice_a_ranks_own_shard():
    P = 1024
    conv = Distribution.make(4, P, n=16, c=4, h=4, w=4)
    fc = Distribution.make(2, P, n=256, c=4)
    conv2 = Distribution.make(4, 512, n=8, c=8, h=8)  # resumed on another rank count and layout
    fc2 = Distribution.make(2, 512, n=64, c=8)
    t0 = time.perf_counter()
    index, worst_save, worst_restore = check_plan(P, conv, fc, 512, conv2, fc2)
    elapsed = time.perf_counter() - t0
    # one writer per unique block: the written blocks tile every tensor exactly once
    for key, (gshape, boxes, shards) in index.items():
        vol = int(np.prod(boxes[:, :, 1] - boxes[:, :, 0], axis=1).sum())
        assert vol == math.prod(gshape), key
        assert len({b.tobytes() for b in boxes}) == len(boxes), key
    assert len(index["params/conv.weight"][2]) == 4 and len(index["state/bn/running_mean"][2]) == 64
    print(f"P=1024: worst save traffic into a rank {worst_save:.4f}x its shard, worst restore "
          f"{worst_restore:.4f}x; plan for all ranks in {elapsed:.2f} s")
    assert worst_save <= 2.0 and worst_restore <= 2.0
    # what the allgather of version 1 moved into every rank: every rank's pieces
    pcs = pieces_of(5, conv, fc)
    assert P * sum(p.nbytes for p in pcs) > 100 * sum(p.nbytes for p in pcs)


def test_plan_detects_blocks_written_by_every_replica():
    """Negative control: a writer rule that lets every replica write duplicates blocks; the restore plan
    then reads each byte many times, far above the 2x bound."""
    P = 64
    conv = Distribution.make(4, P, n=4, c=4, h=4)
    fc = Distribution.make(2, P, n=16, c=4)
    _, _, worst = check_plan(P, conv, fc, P, conv, fc, writer=lambda d, dims, r: True)
    assert worst > 2.0


def make_params(value: float, rank=0, size=1):
    d = Distribution.whole(2, size)
    w = np.full((4, 6), value)
    p = Param("w", w.shape, ((0, 4), (0, 6)), w, w.copy(), d, ())
    opt = SGD([p], 0.1, momentum=0.9)
    opt.state["w"]["momentum"] = w * 2
    opt.t = int(value)
    return [p], opt


class Counter:
    name = "drop"

    def __init__(self, step=0):
        self.step = step

    def state(self):
        return {"step": self.step}

    def load_state(self, st):
        self.step = int(st["step"])


def test_resume_restores_params_optimizer_and_layer_counters(tmp_path):
    comm = SingleCommunicator()
    params, opt = make_params(3.0)
    checkpoint.save(comm, str(tmp_path), 3, params, opt, {"reader": {"pos": 9}}, [Counter(17)])
    params2, opt2 = make_params(0.0)
    lay = Counter()
    path, info = checkpoint.resume(comm, str(tmp_path), params2, opt2, [lay], np)
    assert path.endswith("ckpt-00000003") and info["step"] == 3 and info["meta"]["reader"] == {"pos": 9}
    assert np.array_equal(params2[0].value, params[0].value) and opt2.t == 3 and lay.step == 17
    assert np.array_equal(opt2.state["w"]["momentum"], opt.state["w"]["momentum"])


def test_half_written_checkpoint_is_never_newest_and_damaged_newest_falls_back(tmp_path, capsys):
    comm = SingleCommunicator()
    for step in (1, 2):
        params, opt = make_params(float(step))
        checkpoint.save(comm, str(tmp_path), step, params, opt, {})
    # a write killed before the rename: a temporary directory with its shards but no final name
    params, opt = make_params(3.0)
    checkpoint.save(comm, str(tmp_path), 3, params, opt, {})
    os.rename(tmp_path / "ckpt-00000003", tmp_path / "ckpt-00000003.tmp")
    assert checkpoint.candidates(str(tmp_path))[0].endswith("ckpt-00000002")
    # the newest complete one damaged (its data file truncated): the previous one, with a note
    data = tmp_path / "ckpt-00000002" / "data.h5"
    data.write_bytes(data.read_bytes()[:200])
    params2, opt2 = make_params(0.0)
    path, info = checkpoint.resume(comm, str(tmp_path), params2, opt2, [], np)
    assert info["step"] == 1 and np.all(params2[0].value == 1.0)
    assert "ckpt-00000002 cannot be used" in capsys.readouterr().err
    # nothing readable at all: a clear error naming every file
    (tmp_path / "ckpt-00000001" / "index.h5").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        checkpoint.resume(comm, str(tmp_path), params2, opt2, [], np)


def test_sizes_read_from_a_damaged_index_are_checked_before_allocating(tmp_path):
    comm = SingleCommunicator()
    params, opt = make_params(1.0)
    path = checkpoint.save(comm, str(tmp_path), 1, params, opt, {})
    with h5py.File(os.path.join(path, "index.h5"), "r+") as f:
        t = next(iter(f["tensors"].values()))
        t.attrs["global_shape"] = np.asarray([1 << 30, 1 << 30], dtype=np.int64)
    with pytest.raises(CheckpointError, match="implausible shape"):
        checkpoint.Checkpoint(path)


class Stats:
    """Per-group statistics as batch norm keeps them (here one group, channels 0..5)."""

    name = "bn"

    def __init__(self):
        self.mean = None

    def state(self):
        return {"running_mean": StateTensor((1, 6), ((0, 1), (0, 6)), np.arange(6.0)[None], True)}

    def load_state(self, st):
        rd = st["running_mean"]
        self.mean = rd.read(((0, rd.global_shape[0]), (0, 6))).mean(axis=0)


def test_version_1_checkpoints_still_read(tmp_path):
    """A file as version 1 wrote it: global tensors, layer statistics as JSON lists."""
    with h5py.File(tmp_path / "ckpt-00000004.h5", "w") as f:
        f.attrs.update({"format": "lbannpy-checkpoint", "version": 1, "step": 4, "optimizer_steps": 4})
        f.attrs["meta"] = json.dumps({"reader": {}, "layers": {"bn": {"running_mean": [5.0] * 6}}})
        f["params/w"] = np.full((4, 6), 7.0)
        f["optim/w/momentum"] = np.full((4, 6), 8.0)
    params, opt = make_params(0.0)
    stats = Stats()
    path, info = checkpoint.resume(SingleCommunicator(), str(tmp_path), params, opt, [stats], np)
    assert info["step"] == 4 and np.all(params[0].value == 7.0) and np.all(opt.state["w"]["momentum"] == 8)
    assert np.array_equal(stats.mean, np.full(6, 5.0))


def test_layer_state_tensors_round_trip(tmp_path):
    comm = SingleCommunicator()
    params, opt = make_params(1.0)
    checkpoint.save(comm, str(tmp_path), 1, params, opt, {}, [Stats()])
    s = Stats()
    checkpoint.resume(comm, str(tmp_path), *make_params(0.0), [s], np)
    assert np.array_equal(s.mean, np.arange(6.0))
