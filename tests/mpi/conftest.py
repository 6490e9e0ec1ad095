"""The MPI test harness: size-agnostic tests run under ``mpiexec``.

Running
-------
    mpiexec -n P python -m mpi4py -m pytest tests/mpi -q          # P = 1, 2, 3, 4
    mpiexec -n 8 python -m mpi4py -m pytest tests/mpi -q -m ranks8  # oversubscribed, marked tests only
    python -m pytest tests/test_mpi_suites.py                       # all of the above, one test per P

Only rank 0 prints pytest's report; the other ranks write theirs to ``$LBANNPY_MPI_LOGDIR/rank<R>.log``
(or discard it when unset). Failures on any rank still reach rank 0's report (see "Agreement").

Writing tests
-------------
* Tests take the ``comm`` fixture: a fresh duplicate of the world for each test (an
  :class:`~lbannpy.comm.mpi.MPICommunicator` with ``check=True``, so inconsistent ``v`` counts raise
  everywhere instead of hanging; ``LBANNPY_TEST_BACKEND=nccl LBANNPY_TEST_DEVICE=gpu`` gives NCCL on GPUs).
  ``xp`` is the array module for that device; ``runtime`` the session's :class:`~lbannpy.comm.Runtime`.
* Write each test for any size. A test that needs a size or a minimum skips on *every* rank alike, by a
  decision that depends only on ``comm.size`` (``if comm.size < 2: pytest.skip(...)``).
* Never assert on one rank in front of a collective. Compute, then agree with
  ``mpi_util.assert_all(comm, ok, message)`` (or ``assert_allclose_all``, ``collective_check``,
  ``raises_all``); these raise the same failure on every rank. End each test with such a verdict.
* Mark a test ``@pytest.mark.ranks8`` to have it run in the 8-rank suite as well (keep those cheap: eight
  ranks share two cores).

Agreement (why a failing rank cannot hang the others)
-----------------------------------------------------
After the setup, call and teardown phase of every test, all ranks exchange their outcome with a
non-blocking allgather on a private communicator, and wait for it at most ``LBANNPY_MPI_SKEW_TIMEOUT``
seconds (default 30):

* if every rank arrives, the outcome is agreed: a test that failed on any rank fails on every rank, and
  rank 0's report carries the failing ranks' messages; ranks that disagree on a skip fail too;
* if some rank does not arrive (it is stuck in a collective that a failed rank never entered), the ranks
  that did arrive print their own failure to stderr and abort the MPI job, so ``mpiexec`` exits non-zero
  at once rather than at the timeout.

Every test also has a per-test timeout (``LBANNPY_MPI_TEST_TIMEOUT``, default 60 s, thread method: the
stuck rank dumps its stacks and exits, and ``mpiexec`` tears the job down) unless it sets its own
``@pytest.mark.timeout``. The set of collected tests must be the same on every rank (checked at start).
"""
from __future__ import annotations

import os
import sys
import time
import zlib

import numpy as np
import pytest

from lbannpy.comm import Runtime, make_communicator

SKEW_TIMEOUT = float(os.environ.get("LBANNPY_MPI_SKEW_TIMEOUT", "30"))  # seconds
TEST_TIMEOUT = float(os.environ.get("LBANNPY_MPI_TEST_TIMEOUT", "60"))  # seconds
_MAX_TEXT = 20000  # characters of one rank's failure report carried to the others

_state: dict = {}

_PASSED, _SKIPPED, _FAILED = 0, 1, 2
_NAMES = {_PASSED: "passed", _SKIPPED: "skipped", _FAILED: "failed"}


# -------------------------------------------------------------------------------------------------------
# session set-up: runtime, agreement communicator, quiet non-zero ranks


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists, so that it can be quieted
def pytest_configure(config):
    if "runtime" in _state:
        return
    backend = os.environ.get("LBANNPY_TEST_BACKEND", "mpi")
    device = os.environ.get("LBANNPY_TEST_DEVICE", "cpu")
    rt = Runtime(backend=backend, device=device, check=True, abort_on_error=False).__enter__()
    _state["runtime"] = rt
    # a private host-side communicator for the outcome agreement, never used by tests
    _state["agree"] = make_communicator("mpi")
    config.addinivalue_line("markers", "ranks8: also run in the 8-rank oversubscribed suite")
    config.addinivalue_line("markers", "mpi: runs under mpiexec (tests/mpi)")
    if rt.rank != 0:
        _quiet(config, rt.rank)


def _quiet(config, rank: int) -> None:
    """Send this rank's terminal report to a log file (or nowhere)."""
    logdir = os.environ.get("LBANNPY_MPI_LOGDIR")
    if logdir:
        os.makedirs(logdir, exist_ok=True)
        sink = open(os.path.join(logdir, f"rank{rank}.log"), "w", buffering=1)
    else:
        sink = open(os.devnull, "w")
    _state["sink"] = sink
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        from _pytest.config import create_terminal_writer
        reporter._tw = create_terminal_writer(config, sink)


def pytest_unconfigure(config):
    agree = _state.pop("agree", None)
    if agree is not None:
        # Rank 0 has printed its report by now. `python -m mpi4py` aborts the job when a rank exits with
        # failures, so nobody leaves before everybody is done reporting.
        sys.stdout.flush()
        sys.stderr.flush()
        _wait_allgather(agree, np.zeros(1, dtype=np.int64), "end of session")
        agree.free()
    rt = _state.pop("runtime", None)
    if rt is not None:
        rt.__exit__(None, None, None)
    sink = _state.pop("sink", None)
    if sink is not None:
        sink.close()


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.mpi)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT, method="thread"))


def pytest_collection_finish(session):
    """Every rank must run the same tests in the same order, or the agreements would not line up."""
    agree = _state["agree"]
    ids = [item.nodeid for item in session.items]
    digest = zlib.crc32("\n".join(ids).encode())
    every = _wait_allgather(agree, np.array([digest, len(ids)], dtype=np.int64), "collection")
    if len({tuple(row) for row in every.tolist()}) != 1:
        sys.stderr.write(f"[rank {agree.rank}] ranks collected different tests (crc, count per rank: "
                         f"{every.tolist()}); run every rank with the same arguments. Aborting.\n")
        agree.abort(1)


# -------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def runtime():
    """The session's Runtime (backend/device from LBANNPY_TEST_BACKEND / LBANNPY_TEST_DEVICE)."""
    return _state["runtime"]


@pytest.fixture
def comm(runtime):
    """Collective: a fresh duplicate of the world communicator for this test, freed afterwards."""
    c = runtime.world.dup()
    yield c
    c.free()


@pytest.fixture(scope="session")
def xp(runtime):
    """NumPy, or CuPy when the tests run on GPUs."""
    return runtime.xp


# -------------------------------------------------------------------------------------------------------
# outcome agreement


def _wait_allgather(agree, mine: np.ndarray, what: str, own_text: str = "") -> np.ndarray:
    handle = agree.iallgather(mine)
    deadline = time.monotonic() + SKEW_TIMEOUT
    while not handle.test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"\n[rank {agree.rank} of {agree.size}] {what}: waited {SKEW_TIMEOUT:g} s for the other "
                f"ranks to get here and they did not: a rank is stuck, typically in a collective that "
                f"another rank skipped after an exception. Aborting the MPI job.\n{own_text}\n")
            sys.stderr.flush()
            agree.abort(1)
        time.sleep(0.0005)
    return handle.wait()


def _code(report) -> int:
    if report.failed:
        return _FAILED
    if report.skipped:
        return _SKIPPED
    return _PASSED


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    agree = _state.get("agree")
    if agree is None:
        return report
    mine = _code(report)
    own_text = report.longreprtext[:_MAX_TEXT] if mine == _FAILED else ""
    codes = _wait_allgather(agree, np.array([mine], dtype=np.int64), f"{item.nodeid} ({call.when})",
                            own_text).ravel().tolist()
    if all(c == _PASSED for c in codes) or all(c == _SKIPPED for c in codes):
        return report
    if _FAILED not in codes:
        # some ranks skipped, some ran: the skip decision depended on something other than comm.size
        by = {name: [r for r, c in enumerate(codes) if c == code] for code, name in _NAMES.items()}
        report.outcome = "failed"
        report.longrepr = (f"ranks disagree on the outcome of {call.when}: skipped on {by['skipped']}, "
                           f"passed on {by['passed']}; skip only on conditions that are the same on every "
                           f"rank")
        return report
    texts = agree.allgather_obj(own_text)
    failed = [r for r, c in enumerate(codes) if c == _FAILED]
    others = [(r, texts[r]) for r in failed if r != agree.rank]
    if mine == _FAILED:
        if others:
            report.sections.append((f"failed on ranks {failed} of {agree.size}",
                                    "\n".join(f"[rank {r}] {t}" for r, t in others)))
        return report
    report.outcome = "failed"
    report.longrepr = (f"{call.when} failed on rank(s) {failed} of {agree.size} (passed here, rank "
                       f"{agree.rank}):\n" + "\n".join(f"----- rank {r} -----\n{t}" for r, t in others))
    return report
