"""Checkpoints at P real ranks: one writer per unique block, byte-equal restore on 1 .. P ranks.

Parameters, optimizer slots and a layer's per-group statistics are laid out as the layers lay them
(weights split along the output channels of the layer's distribution, replicated along the dimensions
their gradients are reduced over); saved by the P ranks of the world and restored on sub-communicators of
every size 1 .. P, each with a distribution of its own.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

from lbannpy import checkpoint
from lbannpy.checkpoint import StateTensor, is_writer
from lbannpy.dist import Distribution
from lbannpy.layers.param import Param
from lbannpy.optim import SGD
from mpi_util import assert_all, collective_check

W_SHAPE = (12, 5, 3, 3)  # conv weight: filters split along the output's c
OUT_SHAPE = (8, 12, 8, 8)  # the conv output the distribution lays out


def layout(k: int) -> Distribution:
    """A distribution on ``k`` ranks splitting channels, samples and space (with leftover replicas)."""
    return {1: Distribution.make(4, 1), 2: Distribution.make(4, 2, c=2), 3: Distribution.make(4, 3, c=3),
            4: Distribution.make(4, 4, n=2, c=2)}.get(k) or Distribution.make(4, k, c=2, h=2)


def reference():
    rng = np.random.default_rng(11)
    return {"w": rng.standard_normal(W_SHAPE), "m": rng.standard_normal(W_SHAPE),
            "b": rng.standard_normal(W_SHAPE[0]), "bm": rng.standard_normal(W_SHAPE[0]),
            "stat": rng.standard_normal((8, W_SHAPE[0]))}


class GroupStats:
    """A layer keeping one statistic per sample group (as batch norm under ``sync: group``)."""

    name = "bn"

    def __init__(self, dist, rank, ref):
        self.dist, self.rank = dist, rank
        self.groups = dist.parts_of("n")
        self.g = dist.coords(rank)[0]
        self.cbox = dist.box(OUT_SHAPE, rank)[1]
        self.value = ref["stat"][self.g, self.cbox[0]:self.cbox[1]].copy() if ref else None

    def state(self):
        shape = (self.groups, W_SHAPE[0])
        return {"stat": StateTensor(shape, ((self.g, self.g + 1), self.cbox), self.value[None],
                                    is_writer(self.dist, ["h", "w"], self.rank)), "counter": 7}

    def load_state(self, st):
        self.counter = st["counter"]
        rd = st["stat"]
        self.read_shape = rd.global_shape
        self.value = rd.read(((self.g, self.g + 1), self.cbox))[0] if rd.global_shape[0] == self.groups \
            else rd.read(((0, rd.global_shape[0]), self.cbox)).mean(axis=0)


def model(dist: Distribution, rank: int, ref=None):
    fbox = dist.box(OUT_SHAPE, rank)[1]
    wbox = (fbox,) + tuple((0, s) for s in W_SHAPE[1:])
    red = ("n", "h", "w")
    take = (lambda k, box: ref[k][tuple(slice(a, e) for a, e in box)].copy()) if ref else \
        (lambda k, box: np.full(tuple(e - a for a, e in box), np.nan))
    w = Param("conv.weight", W_SHAPE, wbox, take("w", wbox), np.zeros(1), dist, red)
    b = Param("conv.bias", W_SHAPE[:1], (fbox,), take("b", (fbox,)), np.zeros(1), dist, red)
    opt = SGD([w, b], 0.1, momentum=0.9)
    if ref:
        opt.state[w.name]["momentum"] = take("m", wbox)
        opt.state[b.name]["momentum"] = take("bm", (fbox,))
        opt.t = 5
    return [w, b], opt, [GroupStats(dist, rank, ref)]


@pytest.mark.timeout(120)
def test_one_writer_per_block_and_byte_equal_restore_on_every_smaller_count(comm):
    P = comm.size
    ref = reference()
    d = comm.bcast_obj(tempfile.mkdtemp(prefix="lbannpy-ck-") if comm.rank == 0 else None)
    try:
        with collective_check(comm, "save"):
            dist = layout(P)
            params, opt, layers = model(dist, comm.rank, ref)
            path = checkpoint.save(comm, d, 3, params, opt, {"step": 3}, layers)
        # one writer per unique block: every distinct box any rank holds is in the index exactly once,
        # written by the rank that is replica 0 of it
        held = comm.allgather_obj([(f"params/{p.name}", p.box) for p in params])
        ok, msg = True, ""
        if comm.rank == 0:
            ck = checkpoint.Checkpoint(path)
            for key in ("params/conv.weight", "params/conv.bias", "optim/conv.weight/momentum"):
                base = key.replace("optim/", "params/").replace("/momentum", "")
                distinct = {b for r in held for k, b in r if k == base}
                _, boxes, shards = ck.index[key]
                got = [tuple(map(tuple, b.tolist())) for b in boxes]
                writers = {r for r in range(P) if is_writer(dist, ("n", "h", "w"), r)} if P > 1 else {-1}
                if sorted(got) != sorted(distinct) or len(got) != len(set(got)) or set(shards) - writers:
                    ok, msg = False, f"{key}: index {got} by {shards.tolist()}, held {sorted(distinct)}"
            ck.close()
            files = sorted(f for f in os.listdir(path) if f.startswith("shard-"))
            # parameters: replica 0 of each channel block; group statistics: of each (sample group, channel
            # block)
            nwriters = len({r for r in range(P) if is_writer(dist, ("n", "h", "w"), r)
                            or is_writer(dist, ("h", "w"), r)})
            if P > 1 and len(files) != nwriters:
                ok, msg = False, f"{len(files)} shard files for {nwriters} writers: {files}"
        assert_all(comm, ok, msg)
        for k in range(1, P + 1):
            sub = comm.group(list(range(k)) if comm.rank < k else list(range(k, P)))
            with collective_check(comm, f"restore on {k} ranks"):
                if comm.rank < k:
                    nd = layout(k)
                    params2, opt2, layers2 = model(nd, sub.rank)
                    got_path, info = checkpoint.resume(sub, d, params2, opt2, layers2, np)
                    assert got_path == path and info["step"] == 3 and opt2.t == 5
                    for p, key in zip(params2, ("w", "b")):
                        want = ref[key][tuple(slice(a, e) for a, e in p.box)]
                        assert p.value.tobytes() == want.tobytes(), f"{p.name} on {k} ranks"
                        mk = "m" if key == "w" else "bm"
                        mom = opt2.state[p.name]["momentum"]
                        assert mom.tobytes() == ref[mk][tuple(slice(a, e) for a, e in p.box)].tobytes()
                    lay = layers2[0]
                    assert lay.counter == 7
                    rows = dist.parts_of("n")
                    want = (ref["stat"][lay.g] if rows == lay.groups
                            else ref["stat"][:rows].mean(axis=0))[lay.cbox[0]:lay.cbox[1]]
                    assert np.array_equal(lay.value, want), f"group statistics on {k} ranks"
            if sub is not None:
                sub.free()
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(120)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_on_every_rank(comm):
    """A shard of the newest checkpoint lost (or the one data file truncated): the ranks that need it
    fail to read it, every rank agrees, and all restore the previous checkpoint."""
    P = comm.size
    ref = reference()
    d = comm.bcast_obj(tempfile.mkdtemp(prefix="lbannpy-ck-") if comm.rank == 0 else None)
    try:
        dist = layout(P)
        with collective_check(comm, "save"):
            for step, scale in ((1, 1.0), (2, 2.0)):
                params, opt, layers = model(dist, comm.rank, {k: v * scale for k, v in ref.items()})
                newest = checkpoint.save(comm, d, step, params, opt, {}, layers)
        if comm.rank == 0:
            victim = sorted(f for f in os.listdir(newest) if f != "index.h5")[-1]
            with open(os.path.join(newest, victim), "r+b") as f:
                f.truncate(100)
        comm.barrier()
        with collective_check(comm, "resume"):
            params2, opt2, layers2 = model(dist, comm.rank)
            path, info = checkpoint.resume(comm, d, params2, opt2, layers2, np)
            assert info["step"] == 1 and path.endswith("ckpt-00000001")
            want = ref["w"][tuple(slice(a, e) for a, e in params2[0].box)]
            assert params2[0].value.tobytes() == want.tobytes()
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
