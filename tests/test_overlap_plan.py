"""The overlap engine's pure parts: bucket plans and the hidden-fraction measure; and the engine itself
on one rank (blocking and threaded) against summing by hand."""
from __future__ import annotations

import numpy as np
import pytest

from lbannpy.comm import SingleCommunicator
from lbannpy.comm.overlap import OverlapEngine, hidden_fraction, plan_buckets


class P:
    def __init__(self, name, n):
        self.name = name
        self.grad = np.zeros(n, dtype=np.float32)
        self.value = np.zeros(n, dtype=np.float32)


PARAMS = [P("c1.weight", 1000), P("c1.bias", 10), P("c2.weight", 2000), P("c2.bias", 10),
          P("f1.weight", 5000), P("f1.bias", 10)]


def test_buckets_are_cut_in_reverse_order_with_a_small_first_bucket():
    comms = [object()] * len(PARAMS)
    plan = plan_buckets(PARAMS, comms, bucket_bytes=12_000, first_bucket_bytes=100)
    flat = [i for b in plan for i in b]
    assert flat == list(range(len(PARAMS)))[::-1]          # backprop order, every parameter once
    assert plan[0] == [5]                                    # the small first bucket
    assert all(sum(PARAMS[i].grad.nbytes for i in b) <= 12_000 or len(b) == 1 for b in plan[1:])
    assert plan == plan_buckets(PARAMS, comms, 12_000, 100)  # deterministic


def test_buckets_never_mix_communicators_and_two_chunk_mode_cuts_by_layer():
    a, b = object(), object()
    comms = [a, a, a, a, b, b]
    for bucket in plan_buckets(PARAMS, comms, 1 << 20, 1 << 20):
        assert len({id(comms[i]) for i in bucket}) == 1
    chunks = plan_buckets(PARAMS, [a] * 6, 1 << 20, 1 << 20, lambda p: p.name.split(".")[0], chunk_layers=2)
    assert [sorted(c) for c in chunks] == [[2, 3, 4, 5], [0, 1]]


def test_hidden_fraction():
    assert hidden_fraction([(0, 1)], [(0, 1)]) == 1.0
    assert hidden_fraction([(0, 2)], [(1, 3)]) == 0.5
    assert hidden_fraction([(0, 1), (2, 3)], [(0.5, 2.5)]) == 0.5
    assert hidden_fraction([(5, 6)], [(0, 1)]) == 0.0
    assert hidden_fraction([], [(0, 1)]) == 0.0


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "thread"])
def test_engine_delivers_every_bucket_and_updates_out_of_order(overlap):
    params = [P(p.name, p.grad.size) for p in PARAMS]
    comm = SingleCommunicator()
    eng = OverlapEngine(params, [comm] * len(params), bucket_bytes=9000, first_bucket_bytes=100,
                        overlap=overlap)
    try:
        for step in range(3):
            eng.start_step()
            for i, p in enumerate(params):
                p.grad[...] = step + i
            for layer in ("f1", "c2", "c1"):
                eng.layer_done(layer)
            seen = []
            eng.finish(on_bucket=lambda ps: seen.extend(p.name for p in ps))
            assert sorted(seen) == sorted(p.name for p in params)
            for i, p in enumerate(params):
                assert np.all(p.grad == step + i)
        assert len(eng.records) == 3 * len(eng.buckets)
    finally:
        eng.close()
        eng.close()


def test_the_engine_keeps_the_records_of_the_last_steps_only(monkeypatch):
    """A long run holds a bounded list: the records of at most twice ``RECORD_STEPS`` steps, the newest
    kept in order, each step's still readable from the mark taken after ``start_step``."""
    import lbannpy.comm.overlap as overlap

    monkeypatch.setattr(overlap, "RECORD_STEPS", 3)
    params = [P(p.name, p.grad.size) for p in PARAMS]
    eng = OverlapEngine(params, [SingleCommunicator()] * len(params), bucket_bytes=9000,
                        first_bucket_bytes=100, overlap=False)
    nb = len(eng.buckets)
    try:
        for step in range(20):
            eng.start_step()
            mark = len(eng.records)
            for layer in ("f1", "c2", "c1"):
                eng.layer_done(layer)
            eng.finish()
            assert [b for b, *_ in eng.records[mark:]] == list(range(nb))
            assert len(eng.records) <= 2 * 3 * nb
            posts = [post for _, _, post, _, _ in eng.records]
            assert posts == sorted(posts)
        assert len(eng.records) >= 3 * nb
    finally:
        eng.close()


def test_gradients_live_in_the_bucket_buffers():
    """No packing or unpacking: after set-up every gradient is a view into its bucket's flat buffer,
    keeping its shape and the values it had."""
    params = [P(p.name, p.grad.size) for p in PARAMS]
    for i, p in enumerate(params):
        p.grad = np.full((p.grad.size // 10, 10) if p.grad.size >= 10 else p.grad.size, i, np.float32)
    shapes = [p.grad.shape for p in params]
    eng = OverlapEngine(params, [SingleCommunicator()] * len(params), bucket_bytes=9000,
                        first_bucket_bytes=100, overlap=False)
    try:
        for i, p in enumerate(params):
            bucket = next(b for b in eng.buckets if any(q is p for q in b.params))
            assert np.shares_memory(p.grad, bucket.buffer), p.name
            assert p.grad.shape == shapes[i] and np.all(p.grad == i)
    finally:
        eng.close()


class _StuckComm:
    """Two ranks' worth of communicator whose allreduce blocks until released (a peer that never comes)."""

    size = 2

    def __init__(self):
        import threading

        self.release = threading.Event()
        self.entered = threading.Event()
        self.freed = 0

    def dup(self):
        return self

    def free(self):
        self.freed += 1

    def allreduce(self, buf, out=None):
        self.entered.set()
        self.release.wait()


def test_close_refuses_to_free_communicators_under_a_live_thread():
    """A gradient thread stuck in a collective may still use its communicators: close leaves them and says
    so (False); once the thread has ended, a later close frees them."""
    params = [P("f1.weight", 10)]
    comm = _StuckComm()
    eng = OverlapEngine(params, [comm], bucket_bytes=1 << 20, first_bucket_bytes=1 << 20, overlap=True)
    eng.start_step()
    eng.layer_done("f1")
    assert comm.entered.wait(30)  # the thread is inside the collective
    assert eng.close(join_s=0.05) is False and comm.freed == 0
    comm.release.set()
    assert eng.close(join_s=30) is True and comm.freed == 1
