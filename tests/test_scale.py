"""Per-rank cost independent of the rank count: index math in O(ndim) checked against every-rank brute force,
and call counters on the per-rank helpers during a real set-up and a real training step (real kernels,
recording communicator) at 16, 64 and 256 simulated ranks."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from lbannpy import dist as D
from lbannpy import tensor as T
from lbannpy.comm.loopback import LoopbackCommunicator
from lbannpy.comm.recording import RecordingCommunicator
from lbannpy.dist import Distribution, DistributionError, empty_block, empty_block_brute
from lbannpy.stencil import Stencil
from lbannpy.halo import HaloPlan


def _dists(max_ranks=48):
    for split in itertools.product([1, 2, 3], [1, 2], [1, 3], [1, 2]):
        for rep in [(), (1,), (0, 2)]:
            for mult in (1, 2):
                ranks = math.prod(split) * mult
                if ranks <= max_ranks:
                    yield Distribution(split, ranks, rep)


DIMS = [("n",), ("c",), ("h", "w"), ("n", "h", "w"), ("n", "c", "h", "w"), ("c", "w"), ()]


def test_group_specs_are_the_groups():
    for d in _dists():
        for dims in DIMS:
            for r in range(d.ranks):
                b = d.block_group_spec(r, dims)
                assert b.members() == d.block_group(r, dims), (d, dims, r)
                assert b.members()[b.index] == r and b.size == len(b.members())
                assert b.color == min(b.members())
                g = d.group_spec(r, dims)
                assert g.members() == d.group(r, dims), (d, dims, r)
                assert g.members()[g.index] == r and g.color == min(g.members())


def test_partition_keys_name_partitions():
    """Equal keys exactly when the ranks are cut into the same groups (brute force over many partitions
    of the same rank count), so distributions that cut the ranks alike share one communicator."""
    by_ranks: dict[int, list] = {}
    for d in _dists():
        for dims in DIMS:
            for kind in ("block", "grid"):
                spec = d.block_group_spec if kind == "block" else d.group_spec
                part = frozenset(tuple(spec(r, dims).members()) for r in range(d.ranks))
                by_ranks.setdefault(d.ranks, []).append((spec(0, dims).key, part))
    pairs = 0
    for items in by_ranks.values():
        for (k1, p1), (k2, p2) in itertools.combinations(items, 2):
            assert (k1 == k2) == (p1 == p2), (k1, k2)
            pairs += k1 == k2
    assert pairs > 100  # many different descriptions of one partition were compared


def test_empty_block_is_the_brute_force_answer():
    shapes = [(1, 1, 1, 1), (2, 3, 2, 5), (3, 2, 1, 2), (0, 4, 4, 4), (2, 1, 2, 1), (5, 5, 5, 5)]
    for d in _dists():
        for shape in shapes:
            assert empty_block(d, shape) == empty_block_brute(d, shape), (d, shape)


def test_block_shapes_are_every_block_shape():
    for d in _dists():
        for shape in [(2, 3, 2, 5), (5, 4, 7, 9), (6, 2, 3, 4)]:
            if empty_block(d, shape) is None:
                assert T.block_shapes(d, shape) == {d.local_shape(shape, r) for r in range(d.ranks)}


def test_wrap_checks_the_local_shape_only():
    d = Distribution.make(4, ranks=4, h=2, w=2)
    t = T.DistTensor.wrap(np.zeros((2, 3, 4, 2)), (2, 3, 8, 5), d, 3)  # w: 5 = 3 + 2
    assert (t.local_shape, t.global_shape, t.rank) == ((2, 3, 4, 2), (2, 3, 8, 5), 3)
    assert t.box == d.box((2, 3, 8, 5), 3)
    with pytest.raises(DistributionError, match="rank 0"):
        T.DistTensor.wrap(np.zeros((2, 3, 4, 4)), (2, 3, 8, 5), d, 0)


def _halo_sends_brute(d, shape, stencil, rank):
    """HaloPlan's sends as it computed them before: every block of the replica, its window, intersected."""
    out_shape = stencil.output_shape(shape)
    mine = d.box(shape, rank)
    rep = d.copy_index(rank)
    out = []
    for b in range(d.nblocks):
        coords = D._unravel(b, d.parts)
        peer = d.rank_of(coords, rep)
        if peer == rank:
            continue
        box = D.intersect(stencil.input_window(d.box(out_shape, peer)), mine)
        if box is not None:
            out.append((peer, box))
    return sorted(out)


@pytest.mark.parametrize("kernel,stride,pad", [(3, 1, 1), (3, 2, 1), (5, 1, 2), (1, 2, 0), (7, 3, 3)])
def test_halo_sends_match_brute_force(kernel, stride, pad):
    st = Stencil.conv(4, kernel, stride, pad)
    for split in [(1, 1, 4, 1), (2, 1, 2, 3), (1, 1, 3, 3), (1, 2, 4, 2)]:
        for mult in (1, 2):
            d = Distribution(split, math.prod(split) * mult, (1,) if split[1] > 1 else ())
            shape = (2, 2, 23, 19)
            for r in range(d.ranks):
                p = HaloPlan(d, shape, st, r)
                assert [(s.peer, s.box) for s in p.sends] == _halo_sends_brute(d, shape, st, r)


def test_loopback_and_recording_groups_from_specs():
    d = Distribution.make(4, ranks=32, n=2, h=4)  # 4 outer replicas
    r = 21
    for spec in (d.block_group_spec(r, ("h",)), d.group_spec(r, ("n", "h"))):
        c = LoopbackCommunicator(32, r).group(spec)
        assert (c.size, c.rank) == (len(spec.members()), spec.members().index(r))
        rc = RecordingCommunicator(32, r)
        g = rc.group(spec)
        assert (g.size, g.rank) == (c.size, c.rank) and rc.recorder.groups == [c.size]


# --------------------------------------------------------------------------------------------------------
# call counters on a real set-up and a real step


HELPERS = [(D.ProcessGrid, "coords"), (D.ProcessGrid, "rank"), (D.Distribution, "group"),
           (D.Distribution, "block_group"), (D.Distribution, "block_ranks"), (D.GroupSpec, "members")]


class Counter:
    def __init__(self, monkeypatch):
        self.n = {}
        for owner, name in HELPERS:
            self._wrap(monkeypatch, owner, name)
        for mod, name in [(D, "empty_block"), (D, "empty_block_brute")]:
            fn = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._counting(name, fn))
        import lbannpy.halo
        import lbannpy.shuffle

        for mod in (T, lbannpy.halo, lbannpy.shuffle):
            if hasattr(mod, "empty_block"):
                monkeypatch.setattr(mod, "empty_block", getattr(D, "empty_block"))

    def _counting(self, key, fn):
        def wrapped(*a, **k):
            self.n[key] = self.n.get(key, 0) + 1
            return fn(*a, **k)
        return wrapped

    def _wrap(self, monkeypatch, owner, name):
        monkeypatch.setattr(owner, name, self._counting(f"{owner.__name__}.{name}", getattr(owner, name)))

    def take(self) -> dict:
        out, self.n = self.n, {}
        return out


def _clear_caches():
    from lbannpy.halo import halo_plan
    from lbannpy.shuffle import local_only, same_layout, shuffle_plan

    for c in (halo_plan, shuffle_plan, local_only, same_layout, T._validate, T.block_shape):
        getattr(c, "cache_clear", lambda: None)()  # the negative control replaces one by a plain function


def _run(P, counter):
    """Set-up and two real steps of mesh_tiny (64x64) split n·h4·w4 at ``P`` simulated ranks, for the rank
    at spatial block (1, 1) of sample group 0; returns the call counts of set-up and of the second step."""
    from lbannpy.bench.scale import RankSetup, model_spec

    _clear_caches()
    spec = model_spec("mesh_tiny", 64)
    n = P // 16
    comm = RecordingCommunicator(P, 5)
    counter.take()
    setup = RankSetup(spec, n, {"n": n, "h": 4, "w": 4}, comm, data_dir=None, reader=False)
    at_setup = counter.take()
    model, loss, rank = setup.model, setup.loss, 5
    x = T.DistTensor(np.ones(model.input_dist.local_shape(model.input_shape, rank), np.float32),
                     model.input_shape, model.input_dist, rank)
    labels = np.zeros(tuple(b - a for a, b in loss.label_box()), np.int32)
    counts = []
    for _ in range(2):
        counter.take()
        setup.engine.start_step()
        model.set_train(True)
        y = model.forward(x)
        loss.forward(y, labels)
        model.backward(loss.backward(), on_layer=setup.engine.layer_done, input_grad=False)
        setup.engine.finish()
        counts.append(counter.take())
    groups = len(setup.ctx._groups)
    setup.close()
    return at_setup, counts[1], groups, comm.recorder


def test_no_loop_over_ranks_in_set_up_or_step(monkeypatch):
    counter = Counter(monkeypatch)
    runs = {P: _run(P, counter) for P in (16, 64, 256)}
    setups = [runs[P][0] for P in runs]
    steps = [runs[P][1] for P in runs]
    # the step: the same calls at every rank count, and none of the every-rank helpers
    assert steps[0] == steps[1] == steps[2], steps
    for key in ("Distribution.group", "Distribution.block_group", "Distribution.block_ranks",
                "empty_block_brute", "GroupSpec.members"):
        assert steps[0].get(key, 0) == 0, (key, steps[0])
    # set-up: the same calls at every rank count; group communicators from O(ndim) specs, one split per
    # distinct partition, never a member list
    assert setups[0] == setups[1] == setups[2], setups
    for key in ("Distribution.group", "Distribution.block_group", "GroupSpec.members", "empty_block_brute"):
        assert setups[0].get(key, 0) == 0, (key, setups[0])
    for P, (_, _, groups, rec) in runs.items():
        assert 0 < len(rec.groups) <= groups  # splits: at most one per (distribution, dims) asked for


def test_the_counters_see_a_loop_over_ranks(monkeypatch):
    """Negative control: validating every tensor against every rank again (the old ``_check_global``)
    makes the step's counts grow with P, and the test above would fail."""
    def brute(dist, global_shape, what):
        if D.empty_block_brute(dist, global_shape) is not None:
            raise DistributionError("empty")

    monkeypatch.setattr(T, "_validate", brute)
    monkeypatch.setattr(T.DistTensor, "wrap", classmethod(lambda cls, lay, s, d, r: cls(lay, s, d, r)))
    counter = Counter(monkeypatch)
    steps = [_run(P, counter)[1] for P in (16, 64)]
    assert steps[0] != steps[1]
    assert steps[1]["empty_block_brute"] > 0
    assert steps[1]["ProcessGrid.coords"] > 3 * steps[0]["ProcessGrid.coords"]


# --------------------------------------------------------------------------------------------------------
# the strategy cost model's redistribution times: exact, at a fraction of the ranks


def _shuffle_times_every_rank(shape, srcs, dsts, machine):
    """The slowest rank's time of every pair, evaluated on every rank (the formula before periods)."""
    from lbannpy.strategy import cost

    vol, peers = cost._shuffle_arrays(shape, srcs, dsts)
    link = machine.redistribution_link or machine.link(srcs[0].ranks)
    msgs = np.ceil(np.log2(np.maximum(peers, 2)))
    t = np.where(vol > 0, msgs * link.alpha_s + vol * (machine.dtype_bytes * link.beta_s_per_byte), 0.0)
    return t.max(axis=-1)


def test_shuffle_times_equal_the_every_rank_maximum():
    from lbannpy.strategy import cost
    from lbannpy.machine import load_machine

    machine = load_machine("lassen")
    rng = np.random.default_rng(3)
    ranks = 256
    degrees = [1, 2, 4, 8, 16]
    shape = (32, 64, 28, 14)
    cands = []
    while len(cands) < 14:
        split = tuple(int(rng.choice(degrees)) for _ in range(4))
        if ranks % math.prod(split) == 0 and all(s <= n for s, n in zip(split, shape)):
            rep = (1,) if rng.random() < 0.2 and split[1] > 1 else ()
            cands.append(Distribution(split, ranks, rep))
    srcs, dsts = cands[:7], cands[7:] + cands[:2]
    got = cost.shuffle_times(shape, srcs, dsts, machine)
    want = _shuffle_times_every_rank(shape, srcs, dsts, machine)
    assert np.allclose(got, want, rtol=1e-12, atol=0), (got, want)
    assert (want > 0).sum() > 10
