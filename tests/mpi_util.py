"""Helpers for size-agnostic MPI tests (``tests/mpi``): collective verdicts and agreed assertions.

The rule: a rank never asserts on its own in front of a collective. Compute locally, then agree:

    assert_all(comm, np.array_equal(got, want), f"got {got}, want {want}")

``assert_all`` gathers every rank's verdict and message and raises the same :class:`CollectiveFailure`
on every rank, naming the ranks that failed, so no rank goes on to a collective the others skipped.
Use :func:`collective_check` to turn any exception in a block into such a verdict, and
:func:`raises_all` for expected errors.
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable

import numpy as np

_MAX_MESSAGE = 4000  # characters per rank carried into the agreed failure


class CollectiveFailure(AssertionError):
    """A check that failed on at least one rank; raised identically on every rank."""


def _to_numpy(a):
    return a.get() if type(a).__module__.startswith("cupy") else np.asarray(a)


def collective_verdict(comm, ok: bool, message: str = "") -> list[tuple[int, str]]:
    """Collective over ``comm``: ``[(rank, message), ...]`` of every rank whose ``ok`` is false."""
    every = comm.allgather_obj((bool(ok), "" if ok else str(message)[:_MAX_MESSAGE]))
    return [(r, m) for r, (good, m) in enumerate(every) if not good]


def format_failures(comm, failed: list[tuple[int, str]]) -> str:
    ranks = [r for r, _ in failed]
    lines = [f"failed on rank(s) {ranks} of {comm.size}:"]
    lines += [f"  [rank {r}] {m}" for r, m in failed]
    return "\n".join(lines)


def assert_all(comm, ok: bool, message: str = "") -> None:
    """Collective over ``comm``: passes on every rank, or raises :class:`CollectiveFailure` on every rank
    with the messages of all the ranks that failed."""
    failed = collective_verdict(comm, ok, message)
    if failed:
        raise CollectiveFailure(format_failures(comm, failed))


def tolerances(dtype) -> tuple[float, float]:
    """(rtol, atol) by dtype: float64 tight, float32/float16 to their own precision."""
    dt = np.dtype(dtype)
    if dt == np.float16:
        return 1e-2, 1e-3
    if dt == np.float32:
        return 1e-5, 1e-6
    if dt.kind in "iub":
        return 0.0, 0.0
    return 1e-12, 1e-13


def assert_allclose_all(comm, actual, desired, rtol: float | None = None, atol: float | None = None,
                        what: str = "") -> None:
    """Collective: every rank's ``actual`` matches its ``desired`` (tolerances by dtype by default)."""
    ok, msg = True, ""
    try:
        a = _to_numpy(actual)
        d = _to_numpy(desired)
        r, t = tolerances(a.dtype)
        np.testing.assert_allclose(a, d, rtol=r if rtol is None else rtol, atol=t if atol is None else atol)
        if a.shape != d.shape:
            raise AssertionError(f"shape {a.shape} != expected {d.shape}")
    except Exception as exc:  # an AssertionError, or a bad array: either is a failed check on this rank
        ok, msg = False, f"{what + ': ' if what else ''}{type(exc).__name__}: {exc}"
    assert_all(comm, ok, msg)


@contextlib.contextmanager
def collective_check(comm, what: str = ""):
    """Collective at the end of the block: any exception in the block becomes this rank's failed verdict;
    the block passes only if it passed on every rank.

        with collective_check(comm, "unpack"):
            got = plan.unpack(buf)
            assert got.shape == want.shape
    """
    ok, msg = True, ""
    try:
        yield
    except Exception as exc:
        ok = False
        tb = traceback.format_exc(limit=-3)
        msg = f"{what + ': ' if what else ''}{type(exc).__name__}: {exc}\n{tb}"
    assert_all(comm, ok, msg)


def raises_all(comm, exc_type, fn: Callable[..., Any], *args, match: str | None = None, **kwargs):
    """Collective: ``fn(*args, **kwargs)`` must raise ``exc_type`` (with ``match`` in its message) on every
    rank. Returns this rank's exception. ``fn`` itself must not be collective unless it fails before
    communicating on every rank."""
    caught = None
    try:
        fn(*args, **kwargs)
        ok, msg = False, f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}"
    except exc_type as exc:
        caught = exc
        ok = match is None or match in str(exc)
        msg = "" if ok else f"raised {type(exc).__name__}({exc!s}) without {match!r} in the message"
    except Exception as exc:
        ok, msg = False, f"raised {type(exc).__name__}({exc!s}) instead of {exc_type.__name__}"
    assert_all(comm, ok, msg)
    return caught
