"""Every Communicator method against NumPy references, at any number of ranks.

Each rank's input is a pure function of its rank, so every rank can compute the global reference itself.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import pytest

from lbannpy.comm import CommError, wait_all
from mpi_util import assert_all, assert_allclose_all, collective_check, raises_all


def rank_data(rank: int, shape, dtype) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)


def as_xp(xp, a):
    return xp.asarray(a)


REFERENCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


@dataclass(frozen=True)
class ReduceCase:
    op: str
    dtype: str
    shape: tuple
    mode: str  # "new": fresh output, "out": caller's output, "inplace": out is buf

    @property
    def id(self) -> str:
        return f"{self.op}-{self.dtype}-{'x'.join(map(str, self.shape)) or 'scalar'}-{self.mode}"


REDUCE_CASES = [ReduceCase(op, dt, shape, mode)
                for op in ("sum", "max", "min", "prod")
                for dt, shape in (("float64", (3, 5)), ("float32", (7,)), ("int64", (2, 2, 2)))
                for mode in ("new", "out", "inplace")]
REDUCE_CASES += [ReduceCase("sum", "float64", (0,), "new"),
                 ReduceCase("sum", "float32", (1 << 16,), "inplace")]


@pytest.mark.ranks8
@pytest.mark.parametrize("case", REDUCE_CASES, ids=lambda c: c.id)
def test_allreduce(comm, xp, case):
    mine = rank_data(comm.rank, case.shape, case.dtype)
    every = np.stack([rank_data(r, case.shape, case.dtype) for r in range(comm.size)])
    want = REFERENCE[case.op](every, axis=0)
    buf = as_xp(xp, mine)
    if case.mode == "new":
        got = comm.allreduce(buf, case.op)
        ok_input = bool((buf == as_xp(xp, mine)).all()) if buf.size else True
        assert_all(comm, ok_input, "input buffer was modified by an out-of-place allreduce")
    elif case.mode == "out":
        out = xp.zeros_like(buf)
        got = comm.allreduce(buf, case.op, out=out)
        assert_all(comm, got is out, "allreduce(out=...) did not return the given output")
    else:
        got = comm.allreduce(buf, case.op, out=buf)
        assert_all(comm, got is buf, "in-place allreduce did not return the input buffer")
    assert_allclose_all(comm, got, want.astype(case.dtype), what=case.id)


def test_iallreduce_many_in_flight_waited_in_reverse(comm, xp):
    n = 6
    handles = [comm.iallreduce(as_xp(xp, rank_data(comm.rank, (4, k + 1), "float64"))) for k in range(n)]
    results = [h.wait() for h in reversed(handles)][::-1]
    for k, got in enumerate(results):
        want = sum(rank_data(r, (4, k + 1), "float64") for r in range(comm.size))
        assert_allclose_all(comm, got, want, what=f"handle {k}")


def test_handle_keeps_buffers_alive(comm, xp):
    # the caller keeps no reference to the input or output: the handle must
    h = comm.iallreduce(as_xp(xp, rank_data(comm.rank, (1000,), "float64")))
    gc.collect()
    junk = [np.full(1000, -1.0) for _ in range(50)]  # reuse any freed memory
    got = h.wait()
    del junk
    want = sum(rank_data(r, (1000,), "float64") for r in range(comm.size))
    assert_allclose_all(comm, got, want)


def test_wait_twice_is_an_error(comm, xp):
    h = comm.iallreduce(as_xp(xp, np.ones(3)))
    h.wait()
    raises_all(comm, CommError, h.wait, match="waiting twice")
    raises_all(comm, CommError, h.test, match="already waited")
    assert_all(comm, h.done, "handle not marked done after wait")


def test_test_eventually_true(comm, xp):
    h = comm.iallreduce(as_xp(xp, np.ones(10)))
    for _ in range(10_000_000):
        if h.test():
            break
    completed = h.test()
    got = h.wait()
    assert_all(comm, completed, "test() never reported completion")
    assert_allclose_all(comm, got, np.full(10, float(comm.size)))


@pytest.mark.parametrize("shape", [(3,), (2, 3), (0,)], ids=lambda s: "x".join(map(str, s)))
def test_allgather(comm, xp, shape):
    got = comm.allgather(as_xp(xp, rank_data(comm.rank, shape, "float64")))
    want = np.stack([rank_data(r, shape, "float64") for r in range(comm.size)])
    assert_allclose_all(comm, got, want)


def uneven_counts(size: int) -> list[int]:
    return [(2 * r + 1) % 4 for r in range(size)]  # includes zeros from 4 ranks on


def test_allgatherv_uneven(comm, xp):
    counts = uneven_counts(comm.size)
    got = comm.allgatherv(as_xp(xp, rank_data(comm.rank, (counts[comm.rank],), "float32")), counts)
    want = np.concatenate([rank_data(r, (counts[r],), "float32") for r in range(comm.size)])
    assert_allclose_all(comm, got, want)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_uneven(comm, xp, op):
    counts = [c + (r % 2) for r, c in enumerate(uneven_counts(comm.size))]
    total = sum(counts)
    got = comm.reduce_scatter(as_xp(xp, rank_data(comm.rank, (total,), "float64")), counts, op)
    full = REFERENCE[op](np.stack([rank_data(r, (total,), "float64") for r in range(comm.size)]), axis=0)
    lo = sum(counts[:comm.rank])
    assert_allclose_all(comm, got, full[lo:lo + counts[comm.rank]])


def a2a_count(i: int, j: int) -> int:
    """Elements rank i sends to rank j (zeros included)."""
    return (i + 2 * j) % 3


def a2a_block(i: int, j: int) -> np.ndarray:
    return 1000.0 * i + 10.0 * j + np.arange(a2a_count(i, j))


@pytest.mark.ranks8
@pytest.mark.parametrize("given_out", [False, True], ids=["new", "out"])
def test_alltoallv(comm, xp, given_out):
    p, me = comm.size, comm.rank
    send = np.concatenate([a2a_block(me, j) for j in range(p)])
    sendcounts = [a2a_count(me, j) for j in range(p)]
    recvcounts = [a2a_count(i, me) for i in range(p)]
    out = xp.full(sum(recvcounts), -1.0) if given_out else None
    got = comm.alltoallv(as_xp(xp, send), sendcounts, recvcounts, out=out)
    if given_out:
        assert_all(comm, got is out, "alltoallv(out=...) did not return the given output")
    want = np.concatenate([a2a_block(i, me) for i in range(p)])
    assert_allclose_all(comm, got, want)


def test_ialltoallv_overlaps_with_iallreduce(comm, xp):
    p, me = comm.size, comm.rank
    send = np.concatenate([a2a_block(me, j) for j in range(p)])
    h1 = comm.ialltoallv(as_xp(xp, send), [a2a_count(me, j) for j in range(p)],
                         [a2a_count(i, me) for i in range(p)])
    h2 = comm.iallreduce(as_xp(xp, np.full(5, float(me))))
    got_a2a, got_sum = wait_all([h1, h2])
    assert_allclose_all(comm, got_a2a, np.concatenate([a2a_block(i, me) for i in range(p)]))
    assert_allclose_all(comm, got_sum, np.full(5, p * (p - 1) / 2))


def test_alltoall(comm, xp):
    p, me = comm.size, comm.rank
    send = np.array([[100 * me + j, -j] for j in range(p)], dtype=np.int64)
    got = comm.alltoall(as_xp(xp, send))
    want = np.array([[100 * i + me, -me] for i in range(p)], dtype=np.int64)
    assert_allclose_all(comm, got, want)


def test_bcast_from_every_root(comm, xp):
    for root in range(comm.size):
        buf = as_xp(xp, rank_data(comm.rank, (4, 3), "float64"))
        got = comm.bcast(buf, root)
        assert_all(comm, got is buf, "bcast must fill the given buffer in place")
        assert_allclose_all(comm, got, rank_data(root, (4, 3), "float64"), what=f"root {root}")


@pytest.mark.ranks8
def test_ring_isend_irecv_both_directions(comm, xp):
    p, me = comm.size, comm.rank
    right, left = (me + 1) % p, (me - 1) % p
    from_left = xp.empty(6)
    from_right = xp.empty(6)
    handles = [comm.irecv(from_left, left, tag=1), comm.irecv(from_right, right, tag=2),
               comm.isend(as_xp(xp, np.full(6, float(me))), right, tag=1),
               comm.isend(as_xp(xp, np.full(6, 10.0 * me)), left, tag=2)]
    results = wait_all(handles)
    assert_all(comm, results[0] is from_left and results[2] is None, "recv must return its buffer, send None")
    assert_allclose_all(comm, from_left, np.full(6, float(left)), what="from left (tag 1)")
    assert_allclose_all(comm, from_right, np.full(6, 10.0 * right), what="from right (tag 2)")


def test_recv_after_test_keeps_its_status(comm, xp):
    # test() completing a receive must not lose the message size that wait() checks afterwards
    p, me = comm.size, comm.rank
    r = comm.irecv(xp.empty(4), (me - 1) % p, tag=8)
    s = comm.isend(as_xp(xp, np.full(4, float(me))), (me + 1) % p, tag=8)
    for _ in range(1_000_000):
        if r.test():
            break
    s.wait()
    with collective_check(comm, "wait after a successful test"):
        got = r.wait()
        np.testing.assert_array_equal(got, np.full(4, float((me - 1) % p)))


def test_sendrecv_noncontiguous_send(comm, xp):
    p, me = comm.size, comm.rank
    base = as_xp(xp, np.arange(12.0).reshape(3, 4) + 100 * me)
    view = base.T  # not contiguous: the send side must copy it
    got = comm.sendrecv(view, (me + 1) % p, xp.empty((4, 3)), (me - 1) % p, tag=7)
    left = (me - 1) % p
    assert_allclose_all(comm, got, (np.arange(12.0).reshape(3, 4) + 100 * left).T)


def test_recv_size_mismatch_is_an_error(comm, xp):
    p, me = comm.size, comm.rank

    def exchange():
        r = comm.irecv(xp.empty(5), (me - 1) % p, tag=3)
        s = comm.isend(as_xp(xp, np.ones(3)), (me + 1) % p, tag=3)
        s.wait()
        r.wait()

    raises_all(comm, CommError, exchange, match="rank")


def test_errors_name_rank_and_sizes(comm, xp):
    p, me = comm.size, comm.rank
    err = raises_all(comm, CommError, comm.allgatherv, as_xp(xp, np.ones(2)), [1] * (p + 1))
    assert_all(comm, f"rank {me}" in str(err) and str(p + 1) in str(err), str(err))
    err = raises_all(comm, CommError, comm.reduce_scatter, as_xp(xp, np.ones(5)), [1] * p)
    assert_all(comm, "sum to" in str(err) and "5" in str(err), str(err))
    raises_all(comm, CommError, comm.allreduce, as_xp(xp, np.ones(2)), "mean", match="unknown reduction")
    raises_all(comm, CommError, comm.isend, as_xp(xp, np.ones(2)), p, match="does not exist")
    raises_all(comm, CommError, comm.bcast, as_xp(xp, np.ones(2)), -1, match="does not exist")
    raises_all(comm, CommError, comm.allreduce, as_xp(xp, np.ones(4)), "sum", xp.empty(3), match="needs 4")
    raises_all(comm, CommError, comm.irecv, xp.empty((4, 4)).T, 0, match="non-contiguous")


def test_inconsistent_alltoallv_counts_fail_everywhere(comm, xp):
    # rank 0 expects one element more from the last rank than it sends: with check=True every rank
    # refuses before communicating, naming the pair
    p, me = comm.size, comm.rank
    sendcounts = [1] * p
    recvcounts = [1] * p
    if me == 0:
        recvcounts[p - 1] = 2
    raises_all(comm, CommError, comm.alltoallv, as_xp(xp, np.ones(p)), sendcounts, recvcounts,
               match="expects 2")


def test_cupy_array_without_cuda_aware_mpi_takes_the_host_staged_path(comm, monkeypatch):
    """Where MPI is not CUDA-aware a CuPy array is staged through host memory (comm/hoststaged.py, tested
    on the CUDA stand-in in tests/gpu/test_hoststaged_gpu.py), never handed to MPI as a device pointer."""
    if comm.backend != "mpi":
        pytest.skip("the CUDA-awareness check belongs to the MPI backend")
    from lbannpy.comm.mpi import MPICommunicator

    def stage(self, what, buf, after=None):
        raise CommError(f"staged {what}")

    monkeypatch.setenv("LBANNPY_CUDA_AWARE_MPI", "0")
    monkeypatch.setattr(MPICommunicator, "_stage", stage)
    fake = type("ndarray", (), {"__module__": "cupy._core.core", "size": 3, "shape": (3,), "dtype": "f8"})()
    raises_all(comm, CommError, comm.allreduce, fake, match="staged allreduce")


@pytest.mark.ranks8
def test_split_by_parity_reversed_order(comm, xp):
    p, me = comm.size, comm.rank
    sub = comm.split(me % 2, key=-me)
    members = [r for r in range(p) if r % 2 == me % 2]
    with collective_check(comm, "split"):
        assert sub.size == len(members), f"sub size {sub.size}, want {len(members)}"
        assert sub.rank == sorted(members, reverse=True).index(me), f"sub rank {sub.rank}"
    got = sub.allreduce(as_xp(xp, np.array([float(me)])))
    ranks = sub.allgather_obj(me)
    sub.free()
    assert_all(comm, ranks == sorted(members, reverse=True), f"members in order {ranks}")
    assert_allclose_all(comm, got, np.array([float(sum(members))]))


def test_split_negative_color_gives_none(comm, xp):
    sub = comm.split(-1 if comm.rank == 0 else 0)
    ok = (sub is None) if comm.rank == 0 else (sub is not None and sub.size == comm.size - 1)
    if sub is not None:
        sub.free()
    assert_all(comm, ok, f"split with negative color gave {sub}")


def test_dup_separates_messages(comm, xp):
    p, me = comm.size, comm.rank
    other = comm.dup()
    r_dup = other.irecv(xp.empty(2), (me - 1) % p, tag=0)
    r_base = comm.irecv(xp.empty(2), (me - 1) % p, tag=0)
    s_base = comm.isend(as_xp(xp, np.full(2, 1.0)), (me + 1) % p, tag=0)
    s_dup = other.isend(as_xp(xp, np.full(2, 2.0)), (me + 1) % p, tag=0)
    got_dup, got_base, _, _ = wait_all([r_dup, r_base, s_base, s_dup])
    other.free()
    assert_allclose_all(comm, got_dup, np.full(2, 2.0), what="message on the duplicate")
    assert_allclose_all(comm, got_base, np.full(2, 1.0), what="message on the original")


def test_free_is_idempotent_and_use_after_free_fails(comm, xp):
    other = comm.dup()
    other.free()
    other.free()
    raises_all(comm, CommError, other.allreduce, as_xp(xp, np.ones(1)), match="freed")


def test_release_hands_over_ownership(comm, xp):
    if comm.backend != "mpi":
        pytest.skip("release belongs to the MPI backend (the bootstrap of NCCL communicators)")
    parent = comm.dup()
    child = parent.dup()
    assert parent.release(child) is child
    again = raises_all(comm, CommError, parent.release, child, match="released already")
    parent.free()  # no longer frees the child
    got = child.allreduce(as_xp(xp, np.ones(2)))
    assert_all(comm, not child.freed and "release" in str(again), "child freed with its old parent")
    assert_allclose_all(comm, got, np.full(2, float(comm.size)), what="allreduce on the released child")
    child.free()


def test_objects(comm):
    p, me = comm.size, comm.rank
    every = comm.allgather_obj({"rank": me})
    root_obj = comm.bcast_obj(("root", me) if me == p - 1 else None, root=p - 1)
    total = comm.allreduce_obj(me + 1)
    anyone = comm.allreduce_obj(me == p - 1, op="or")
    everyone = comm.allreduce_obj(me >= 0, op="and")
    assert_all(comm, every == [{"rank": r} for r in range(p)], f"allgather_obj {every}")
    assert_all(comm, root_obj == ("root", p - 1), f"bcast_obj {root_obj}")
    assert_all(comm, total == p * (p + 1) // 2 and anyone and everyone, f"allreduce_obj {total}")


def test_barrier_and_rank_size(comm):
    comm.barrier()
    ranks = comm.allgather_obj(comm.rank)
    assert_all(comm, ranks == list(range(comm.size)), f"ranks {ranks}")
