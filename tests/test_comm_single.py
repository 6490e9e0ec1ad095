"""The single-rank backend, Handle semantics, the Runtime and the factory without mpiexec."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lbannpy.comm import CommError, Handle, Runtime, SingleCommunicator, make_communicator, wait_all


@pytest.fixture
def comm():
    return SingleCommunicator()


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_allreduce_is_a_copy(comm, op):
    x = np.arange(6.0).reshape(2, 3)
    got = comm.allreduce(x, op)
    assert got is not x and np.array_equal(got, x)
    out = np.empty_like(x)
    assert comm.allreduce(x, op, out=out) is out and np.array_equal(out, x)
    assert comm.allreduce(x, op, out=x) is x


def test_unknown_op(comm):
    with pytest.raises(CommError, match="unknown reduction 'mean'"):
        comm.allreduce(np.ones(2), "mean")


def test_gathers_and_scatters(comm):
    x = np.arange(4.0)
    assert comm.allgather(x).shape == (1, 4)
    assert np.array_equal(comm.allgatherv(x, [4]), x)
    assert np.array_equal(comm.reduce_scatter(x, [4]), x)
    assert np.array_equal(comm.alltoallv(x, [4], [4]), x)
    assert np.array_equal(comm.alltoall(x.reshape(1, 4)), x.reshape(1, 4))
    with pytest.raises(CommError, match="2 counts given for 1 ranks"):
        comm.reduce_scatter(x, [2, 2])
    with pytest.raises(CommError, match="sum to 3"):
        comm.alltoallv(x, [3], [3])


def test_bcast_in_place(comm):
    x = np.ones(3)
    assert comm.bcast(x) is x
    with pytest.raises(CommError, match="rank 1 does not exist"):
        comm.bcast(x, root=1)


def test_self_send_recv(comm):
    buf = np.empty(3)
    r = comm.irecv(buf, 0, tag=4)
    comm.isend(np.array([1.0, 2.0, 3.0]), 0, tag=4).wait()
    assert r.wait() is buf and buf.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(CommError, match="never sent"):
        comm.irecv(np.empty(1), 0, tag=9).wait()


def test_split_dup_objects(comm):
    assert comm.split(-1) is None
    assert comm.split(3).size == 1 and comm.dup().rank == 0
    assert comm.bcast_obj({"a": 1}) == {"a": 1} and comm.allgather_obj(5) == [5]
    assert comm.allreduce_obj(True, "and") is True
    comm.free()
    comm.free()


def test_handle_wait_twice_and_buffers():
    calls = []
    keep = np.ones(3)
    h = Handle(lambda: calls.append("wait"), lambda: True, lambda: "result", (keep,), "demo")
    assert h.test() and not h.done
    assert h.wait() == "result" and h.done and calls == ["wait"]
    with pytest.raises(CommError, match="waiting twice"):
        h.wait()
    with pytest.raises(CommError, match="already waited"):
        h.test()
    assert wait_all([Handle.completed(1), Handle.completed(2)]) == [1, 2]


def test_runtime_single_backend():
    with Runtime(backend="single") as rt:
        assert rt.backend == "single" and rt.size == 1 and rt.rank == 0 and rt.local_rank == 0
        assert rt.xp is np and isinstance(rt.world, SingleCommunicator)
        assert rt.world.allreduce(np.ones(2)).tolist() == [1.0, 1.0]


def test_runtime_auto_one_rank_and_mpi_backend():
    with Runtime() as rt:  # one process, not under mpiexec: no need for an MPI communicator
        assert rt.backend == "single" and rt.size == 1
    with Runtime(backend="mpi") as rt:
        assert rt.backend == "mpi" and rt.world.size == 1 and rt.thread_level in (
            "single", "funneled", "serialized", "multiple")
        assert rt.world.allreduce(np.ones(2), "max").tolist() == [1.0, 1.0]
        world = rt.world
    assert world.freed  # teardown freed the communicator


def test_runtime_rejects_bad_arguments():
    with pytest.raises(CommError, match="unknown communication backend 'gloo'"):
        Runtime(backend="gloo")
    with pytest.raises(CommError, match="unknown device 'tpu'"):
        Runtime(device="tpu")
    with pytest.raises(CommError, match="needs device='gpu'"):
        make_communicator("nccl", device="cpu")


def test_runtime_exception_propagates_on_one_rank():
    with pytest.raises(KeyError):
        with Runtime(backend="single"):
            raise KeyError("one rank: the exception leaves the block as usual")


def test_factory():
    assert isinstance(make_communicator("single"), SingleCommunicator)
    c = make_communicator("mpi")
    assert c.backend == "mpi" and c.size == 1
    c.free()


def run_isolated(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_import_does_no_mpi_work():
    r = run_isolated("""
        import sys
        import lbannpy.comm
        assert "mpi4py.MPI" not in sys.modules, "importing lbannpy.comm initialized MPI"
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_single_rank_without_mpi4py():
    r = run_isolated("""
        import sys
        sys.modules["mpi4py"] = None  # as if mpi4py were not installed
        import numpy as np
        from lbannpy.comm import Runtime, CommError
        with Runtime() as rt:
            assert rt.backend == "single", rt.backend
            assert rt.world.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
        try:
            Runtime(backend="mpi").__enter__()
        except CommError as exc:
            assert "needs mpi4py" in str(exc), exc
        else:
            raise SystemExit("backend='mpi' without mpi4py did not fail")
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_nccl_module_imports_without_cupy():
    r = run_isolated("""
        import sys
        sys.modules["cupy"] = None  # as if CuPy were not installed
        import lbannpy.comm.nccl as nccl
        from lbannpy.comm import CommError, make_communicator
        try:
            nccl._nccl()
        except CommError as exc:
            assert "needs CuPy" in str(exc), exc
        else:
            raise SystemExit("NCCL without CuPy did not fail")
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
