"""The NCCL communicator and the runtime's device choice, on the CUDA/CuPy/NCCL stand-in (tests/gpu_standin).

Each case runs this file under ``mpiexec -n P`` with the stand-in first on ``PYTHONPATH`` (each rank
must land on the device of its node-local rank, which MPICH's ``MPI_LOCALRANKID`` makes its rank; Open
MPI's mapping may order them otherwise):

- row 12: ``make_communicator("nccl", device="gpu")`` and ``Runtime`` select the rank's GPU (one code path);
  children made by ``split``/``dup`` stay on it, and the MPI bootstrap is handed over with
  ``MPICommunicator.release``;
- every ``NCCLCommunicator`` method against the MPI backend on the same inputs (host copies), exact;
- a wrong argument order in a call to NCCL fails: each mutation of the argument lists that
  ``comm/nccl.py`` passes (two arguments swapped) makes the stand-in raise or the results differ;
- row 7: waiting on a handle makes the caller's stream wait on the device, never the host, and the
  events are untimed;
- CUDA-aware MPI (backend ``mpi`` with device arrays): the stand-in hands mpi4py the arrays' memory through
  ``__cuda_array_interface__`` and checks, as MPI takes it, that the host has seen the buffer's last write
  complete: a producer on another stream without ``after=`` is a race the checker reports.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
STANDIN = ROOT / "tests" / "gpu_standin"
MPIEXEC = shutil.which("mpiexec")

needs = pytest.mark.skipif(not (STANDIN / "cupy").is_dir(), reason="the CUDA stand-in is not in this tree")


def launch(case: str, ranks: int, *extra: str, env: dict | None = None, timeout: float = 180):
    full = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    full["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)] + [p for p in [os.environ.get(
        "PYTHONPATH")] if p])
    full.update(env or {})
    out = tempfile.mkdtemp(prefix=f"lbannpy-{case}-")
    full["LBANNPY_TEST_RESULTS"] = out
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, str(HERE), case, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full, cwd=str(ROOT))
    r.args_dir = out
    return r


def results(r: subprocess.CompletedProcess) -> list[dict]:
    """Every rank's verdict (each writes ``rank<R>.json`` into ``LBANNPY_TEST_RESULTS``)."""
    assert r.returncode == 0, f"rc {r.returncode}\nstdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-6000:]}"
    where = Path(r.args_dir)
    rows = [json.loads(f.read_text()) for f in sorted(where.glob("rank*.json"))]
    return sorted(rows, key=lambda row: row["rank"])


def report(row: dict) -> None:
    """Worker side: this rank's verdict, for :func:`results`."""
    path = Path(os.environ["LBANNPY_TEST_RESULTS"]) / f"rank{row['rank']}.json"
    path.write_text(json.dumps(row))


@pytest.fixture(autouse=True)
def _mpiexec():
    assert MPIEXEC, "mpiexec not found (pip install mpich)"


@needs
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_gets_its_own_gpu(ranks):
    rows = results(launch("devices", ranks))
    assert len(rows) == ranks
    for row in rows:
        assert row["ok"], row
        assert row["made"] == row["runtime"] == row["local"], row
        assert set(row["children"]) == {row["local"]}, row
    assert sorted(row["local"] for row in rows) == list(range(ranks)), rows  # one GPU each


@needs
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_method_equals_the_mpi_backend(ranks):
    for row in results(launch("methods", ranks)):
        assert row["failed"] == [], row
        assert row["checked"] >= 12, row


def _mutations() -> list[str]:
    """Every swap of two arguments of every NCCL call that comm/nccl.py makes (``name:i:j``): the calls are
    read from its source, their argument counts from the stand-in's CuPy-compatible signatures (checked
    against the real CuPy in tests/test_gpu_standin_signatures.py)."""
    import ast
    import itertools
    import re

    called = sorted(set(re.findall(r"self\._comm\.(\w+)", (ROOT / "comm" / "nccl.py").read_text())))
    tree = ast.parse((STANDIN / "cupy" / "cuda" / "nccl.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NcclCommunicator")
    arity = {f.name: len(f.args.args) - 1 for f in cls.body if isinstance(f, ast.FunctionDef)}
    return [f"{name}:{i}:{j}" for name in called if name in arity
            for i, j in itertools.combinations(range(arity[name]), 2)]


MUTATIONS = _mutations()


@pytest.fixture(scope="module")
def mutation_outcomes() -> dict:
    """``{mutation: ("rows", [each rank's verdict]) or ("died", the job's output)}`` for every mutation.

    The mutations run in as few jobs as possible (an interpreter and MPI start-up each saves minutes): a job
    takes them in order, and before each one runs the unmutated methods as a control that must pass on
    every rank, so each mutation starts from a state shown clean. A job that dies in a mutation (a stand-in
    error escaping a collective aborts it) gives that mutation its verdict and the next job goes on after
    it; a control that fails after a mutation (the state it left) ends the job and the next job starts
    fresh at the mutation the control was for."""
    outcomes: dict = {}
    todo = list(MUTATIONS)
    while todo:
        r = launch("mutations", 2, *todo, env={"LBANNPY_STANDIN_NCCL_TIMEOUT": "3"},
                   timeout=120 + 15 * len(todo))
        where = Path(r.args_dir)
        done = 0
        while done < len(todo):
            rows = [json.loads(f.read_text()) for f in sorted(where.glob(f"m{done}.rank*.json"))]
            if len(rows) != 2:
                break
            outcomes[todo[done]] = ("rows", sorted(rows, key=lambda row: row["rank"]))
            done += 1
        if done == len(todo):
            assert r.returncode == 0, f"rc {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
            break
        output = r.stderr + r.stdout
        if (where / f"started.{done}").exists():  # the job ended inside this mutation
            outcomes[todo[done]] = ("died", output)
            todo = todo[done + 1:]
        else:  # the control before it failed or died: only a control after an earlier mutation may
            assert done > 0, (f"the unmutated methods failed in a fresh job (rc {r.returncode}):\n"
                              f"{output[-6000:]}")
            todo = todo[done:]
    return outcomes


@needs
@pytest.mark.timeout(900)  # the first test runs every mutation (mutation_outcomes)
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_wrong_argument_order_fails(mutation_outcomes, mutation):
    """Negative control: swap two arguments of one NCCL call made by comm/nccl.py (``name:i:j``)."""
    kind, got = mutation_outcomes[mutation]
    if kind == "rows":  # caught if the stand-in refused the call or a result differs
        assert any(row["failed"] for row in got), got
    else:  # ... or the job died (a stand-in error escaping a collective aborts it)
        assert "Traceback" in got or "Abort" in got, got[-3000:]


@needs
def test_cuda_aware_mpi_reads_only_buffers_whose_writer_finished():
    """A buffer written on a side stream and handed to the MPI backend from the default stream: without
    ``after=`` (the side stream's event) the host never waited for the writer, and the stand-in's checker
    reports the race where mpi4py takes the memory; with it, the allreduce is right on every rank."""
    rows = results(launch("mpi_race", 2, env={"LBANNPY_CUDA_AWARE_MPI": "1"}))
    for row in rows:
        assert row["with_event"] == 2 * 63.0 + 1.0, row  # sum over 2 ranks of (rank + 63)
        assert "RaceError" in row["without_event"] and "never synchronised" in row["without_event"], row


@needs
def test_waiting_never_blocks_the_host():
    for row in results(launch("waits", 2)):
        assert row["ok"], row
        assert row["host_syncs"] == 0, row
        assert row["timed_events"] == 0, row
        assert row["events_made"] == 0 and row["repeats_ok"] == [True] * 3, row  # events reused


# -------------------------------------------------------------------------------------------------------
# the worker, run by mpiexec


def count_host_syncs(cupy) -> list:
    """Wrap every CuPy call that blocks the host on the device (event, stream, device synchronize; device
    to host copies); returns the list each call appends its name to. Works on real CuPy too."""
    calls: list = []

    def wrap(owner, name):
        orig = getattr(owner, name)

        def counted(*a, **k):
            calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return orig(*a, **k)

        setattr(owner, name, counted)

    wrap(cupy.cuda.Event, "synchronize")
    wrap(cupy.cuda.Stream, "synchronize")
    wrap(cupy.cuda.Device, "synchronize")
    wrap(cupy.cuda.runtime, "deviceSynchronize")
    wrap(cupy, "asnumpy")
    wrap(cupy.ndarray, "get")
    return calls


def _devices(out: dict) -> None:  # pragma: no cover - runs under mpiexec
    import cupy

    from lbannpy.comm import Runtime, make_communicator

    from lbannpy.comm.runtime import _env_local_rank

    out["local"] = _env_local_rank()  # the launcher's node-local rank (MPICH's equals the rank)
    c = make_communicator("nccl", device="gpu")
    out["made"] = c._device.id
    cupy.cuda.Device(0).use()  # the Runtime must select the device again, whatever is current
    with Runtime(backend="nccl", device="gpu") as rt:
        out["runtime"] = rt.device_id
        assert rt.world._device.id == rt.device_id == cupy.cuda.Device().id
        assert rt.world._mpi not in rt.world._mpi._children
        kids = [rt.world.dup(), rt.world.split(rt.rank % 2)]
        out["children"] = [k._device.id for k in kids]
        x = cupy.full(3, float(rt.rank + 1))
        got = cupy.asnumpy(kids[0].allreduce(x))
        assert float(got[0]) == sum(r + 1 for r in range(rt.size)), got
        # the bootstrap was handed over: freeing the world's MPI side leaves the child's alone
        assert all(k._mpi not in rt.world._mpi._children for k in kids)
    c.free()
    out["ok"] = True


def _methods(out: dict, mutation: str | None) -> None:  # pragma: no cover - runs under mpiexec
    import cupy
    import numpy as np

    from lbannpy.comm import make_communicator
    from lbannpy.comm import nccl as nccl_backend

    orig = nccl_backend.NCCLCommunicator._nccl_call
    if mutation:
        name, i, j = mutation.split(":")
        i, j = int(i), int(j)

        def swapped(self, what, fn, *args):
            if getattr(fn, "__name__", "") == name:
                args = list(args)
                args[i], args[j] = args[j], args[i]
            return orig(self, what, fn, *args)

        nccl_backend.NCCLCommunicator._nccl_call = swapped
    try:
        _check_methods(out, cupy, np, make_communicator)
    finally:
        nccl_backend.NCCLCommunicator._nccl_call = orig


def _mutation_batch(out: dict, mutations: list[str]) -> None:  # pragma: no cover - runs under mpiexec
    """Each mutation in turn, after a control (the unmutated methods) that passed on every rank; writes
    ``m<i>.rank<R>.json`` per mutation and, on rank 0, ``started.<i>`` as mutation ``i`` starts. Stops
    (for a fresh job to go on) when a control fails."""
    from mpi4py import MPI

    from cupy.cuda import nccl as standin_nccl

    where = Path(os.environ["LBANNPY_TEST_RESULTS"])
    world = MPI.COMM_WORLD
    for k, mutation in enumerate(mutations):
        standin_nccl._group.update(depth=0, ops=[])  # a group a failed call left open is not carried over
        control: dict = {}
        _methods(control, None)
        if not all(world.allgather(not control["failed"] and control["checked"] >= 12)):
            break
        if world.rank == 0:
            (where / f"started.{k}").touch()
        row = {"rank": world.rank}
        _methods(row, mutation)
        (where / f"m{k}.rank{world.rank}.json").write_text(json.dumps(row))
    out["ok"] = True


def _check_methods(out: dict, cupy, np, make_communicator) -> None:  # pragma: no cover - under mpiexec
    gpu = make_communicator("nccl", device="gpu")
    host = make_communicator("mpi")
    p, me = gpu.size, gpu.rank
    failed, checked = [], 0

    def data(shape, dtype, salt=0):
        rng = np.random.default_rng(100 * me + salt)
        return rng.integers(1, 6, size=shape).astype(dtype)  # integers: every sum order is exact

    class Stop(Exception):
        """A call failed on some rank: the ranks stop together (the NCCL communicator may be mid-call)."""

    def check(what, fn_gpu, fn_host):
        nonlocal checked
        checked += 1
        try:
            g = fn_gpu()
            g = [cupy.asnumpy(a) for a in g] if isinstance(g, tuple) else [cupy.asnumpy(g)]
            err = None
        except Exception as exc:
            err = f"{what}: {type(exc).__name__}: {str(exc)[:200]}"
        errs = host.allgather_obj(err)  # every rank learns of a failure anywhere, so none hangs on the next
        if any(errs):
            failed.extend(f"rank {r}: {e}" for r, e in enumerate(errs) if e)
            raise Stop
        h = fn_host()
        h = list(h) if isinstance(h, tuple) else [h]
        if len(g) != len(h) or any(a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b)
                                   for a, b in zip(g, h)):
            failed.append(f"{what}: differs from the MPI backend")

    try:
        cp = cupy.asarray
        for op in ("sum", "max", "min", "prod"):
            for dt in ("float64", "float32", "int32"):
                a = data((3, 4), dt, 1)
                check(f"allreduce {op} {dt}", lambda: gpu.allreduce(cp(a), op), lambda: host.allreduce(a, op))
        a = data((5,), "float64", 2)
        out_g, out_h = cupy.zeros(5), np.zeros(5)
        check("allreduce out", lambda: gpu.allreduce(cp(a), "sum", out_g),
              lambda: host.allreduce(a, "sum", out_h))

        def inplace_g():
            b = cp(a)
            gpu.allreduce(b, "sum", b)
            return b

        def inplace_h():
            b = a.copy()
            host.allreduce(b, "sum", b)
            return b

        check("allreduce in place", inplace_g, inplace_h)
        a = data((2, 3), "float32", 3)
        check("allgather", lambda: gpu.allgather(cp(a)), lambda: host.allgather(a))
        counts = [(r % 3) + 1 for r in range(p)]
        a = data((counts[me],), "float64", 4)
        check("allgatherv", lambda: gpu.allgatherv(cp(a), counts), lambda: host.allgatherv(a, counts))
        for cs in ([2] * p, [(r % 2) + 1 for r in range(p)]):
            a = data((sum(cs),), "float64", 5)
            check(f"reduce_scatter {cs}", lambda: gpu.reduce_scatter(cp(a), cs),
                  lambda: host.reduce_scatter(a, cs))
        sendcounts = [(me + j) % 3 + 1 for j in range(p)]
        recvcounts = [(j + me) % 3 + 1 for j in range(p)]
        a = data((sum(sendcounts),), "float64", 6)
        check("alltoallv", lambda: gpu.alltoallv(cp(a), sendcounts, recvcounts),
              lambda: host.alltoallv(a, sendcounts, recvcounts))
        for root in range(p):
            a = data((4,), "float64", 7 + root)

            def bg(root=root, a=a):
                b = cp(a)
                gpu.bcast(b, root)
                return b

            def bh(root=root, a=a):
                b = a.copy()
                host.bcast(b, root)
                return b

            check(f"bcast root {root}", bg, bh)
        a = data((6,), "float64", 20)
        b = data((3,), "int32", 21)

        def ring(comm, xp):
            right, left = (me + 1) % p, (me - 1) % p
            r1, r2 = xp.zeros(6), xp.zeros(3, dtype=np.int32)
            hs = [comm.irecv(r1, left, tag=1), comm.irecv(r2, right, tag=2),
                  comm.isend(xp.asarray(a), right, tag=1), comm.isend(xp.asarray(b), left, tag=2)]
            comm.flush()
            for h in hs:
                h.wait()
            return r1, r2

        check("isend/irecv ring", lambda: ring(gpu, cupy), lambda: ring(host, np))
    except Stop:
        pass
    gpu.free()
    host.free()
    out.update(failed=failed, checked=checked)


def _waits(out: dict) -> None:  # pragma: no cover - runs under mpiexec
    import cupy

    from lbannpy.comm import make_communicator

    syncs = count_host_syncs(cupy)
    timed, made = [], []
    real_event = cupy.cuda.Event

    def counting_event(*a, **k):
        if not k.get("disable_timing", a[1] if len(a) > 1 else False):
            timed.append(1)
        made.append(1)
        return real_event(*a, **k)

    cupy.cuda.Event = counting_event
    real_record = cupy.cuda.Stream.record

    def record(self, event=None):
        if event is None:  # CuPy then makes a plain (timed) event
            timed.append(1)
        return real_record(self, event)

    cupy.cuda.Stream.record = record
    c = make_communicator("nccl", device="gpu")
    me, p = c.rank, c.size
    x = cupy.full(1000, float(me))
    c.allreduce(x)  # warm
    del syncs[:], timed[:]
    y = c.allreduce(x)
    z = cupy.empty(1000)
    hs = [c.irecv(z, (me - 1) % p), c.isend(x, (me + 1) % p)]
    c.flush()
    for h in hs:
        h.wait()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:  # a handle waited on in another stream orders that stream
        w = c.iallreduce(cupy.ones(10)).wait()
        out["host_syncs"] = len(syncs)
        out["sync_calls"] = sorted(set(syncs))
        w = cupy.asnumpy(w)
    out["timed_events"] = len(timed)
    ok = float(cupy.asnumpy(y)[0]) == sum(range(p)) and float(cupy.asnumpy(z)[0]) == (me - 1) % p
    del made[:]  # the same operations again, as a later step repeats them: no new event
    for k in range(3):
        y2 = c.allreduce(x + k)
        hs = [c.irecv(z, (me - 1) % p), c.isend(x + k, (me + 1) % p)]
        c.flush()
        for h in hs:
            h.wait()
        got = (float(cupy.asnumpy(y2)[0]), float(cupy.asnumpy(z)[0]))
        out.setdefault("repeats_ok", []).append(got == (sum(range(p)) + p * k, (me - 1) % p + k))
    out["events_made"] = len(made)
    out["ok"] = bool(ok and float(w[0]) == p)
    c.free()


def _mpi_race(out: dict) -> None:
    import cupy
    from mpi4py import MPI

    from lbannpy.comm.mpi import MPICommunicator

    c = MPICommunicator(MPI.COMM_WORLD.Dup(), owned=True)
    me = c.rank
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.arange(64, dtype=cupy.float64) + me
        ev = side.record(cupy.cuda.Event(disable_timing=True))
    out["with_event"] = float(cupy.asnumpy(c.allreduce(x, after=ev))[-1])
    with side:
        y = cupy.arange(64, dtype=cupy.float64) + me  # a new write, on the side stream, not waited for
    try:
        c.allreduce(y)  # syncs this thread's current (null) stream only: the side stream's write races
        out["without_event"] = "no error"
    except Exception as exc:  # noqa: BLE001  (reported to the test)
        out["without_event"] = f"{type(exc).__name__}: {exc}"
    c.free()
    out["ok"] = True


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from mpi4py import MPI

    case = sys.argv[1]
    result = {"rank": MPI.COMM_WORLD.Get_rank(), "ok": False}
    if case == "devices":
        _devices(result)
    elif case == "methods":
        _methods(result, sys.argv[2] if len(sys.argv) > 2 else None)
    elif case == "mutations":
        _mutation_batch(result, sys.argv[2:])
    elif case == "waits":
        _waits(result)
    elif case == "mpi_race":
        _mpi_race(result)
    report(result)
