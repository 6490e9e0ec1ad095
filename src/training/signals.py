"""Signals: every rank reacts to SIGINT, SIGTERM, SIGUSR1 and SIGHUP within seconds, whatever it is doing.

Python runs signal handlers in the main thread between bytecodes, so a rank blocked inside an MPI call would
never run one, and a signal reaching a single rank (``srun`` forwards Ctrl-C to one task; SLURM may signal
one) would leave the job hanging. :class:`SignalWatch` therefore makes the C-level handler write the signal
number to a socket (``signal.set_wakeup_fd``) that a thread of its own reads; the thread acts at once:

- SIGTERM and SIGUSR1 (SLURM's time-limit and preemption signals; ``#SBATCH --signal=USR1@120``) while the
  step loop runs: a *stop request*. The loop combines the request across ranks after each step (a one-integer
  non-blocking allreduce, so every rank stops after the same step), writes a checkpoint and the metrics, and
  the job exits with :data:`EXIT_STOPPED` on every rank. Further SIGTERMs and SIGUSR1s while that stop is
  under way change nothing: a pre-emption signals every task and then the launcher (SLURM signals each
  task; the job's trap forwards TERM to ``srun``, which signals them again), and abandoning the checkpoint
  being written would lose the run's work since the last one. Only the grace time ends a stop that does
  not finish (a rank stuck in a collective, a slow file system): the job is aborted then. SIGKILL, which
  comes after a scheduler's own grace, ends it without one anyway.
- anything else, or any of them outside the step loop (set-up, where there is nothing to save): the rank
  prints one line and aborts the job (``MPI_Abort``; ``os._exit`` alone), every rank exits non-zero.
"""
from __future__ import annotations

import enum
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

EXIT_STOPPED = 4  # stopped by SIGTERM/SIGUSR1 after writing a checkpoint and the metrics: resubmit --resume
EXIT_SIGNAL_ABORT = 5  # aborted by a signal (nothing more was written)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
ABORT_SIGNALS = (signal.SIGINT, signal.SIGHUP)
GRACE_ENV = "LBANNPY_STOP_GRACE_S"  # seconds a stop request may take before the job is aborted
DEFAULT_GRACE_S = 60.0


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class SignalWatch:
    """Installed once per process, from the main thread, before the work that must be interruptible.

    ``abort(code)``: ends every rank of the job (not collective: ``Communicator.abort``). ``requested``: the
    number of the signal that asked this rank to stop (0: none); the step loop reads it.
    """

    def __init__(self, rank: int, size: int, abort, grace_s: float | None = None):
        self.rank, self.size, self.abort = rank, size, abort
        if grace_s is None:
            try:
                grace_s = float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))
            except ValueError:
                grace_s = DEFAULT_GRACE_S
        self.grace_s = grace_s
        self.requested = 0
        self.graceful = False  # True while the step loop can honour a stop request
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._previous: dict = {}
        self._socks = None

    def install(self) -> "SignalWatch":
        r, w = socket.socketpair()
        r.setblocking(True)
        w.setblocking(False)
        self._socks = (r, w)
        # the Python-level handler does nothing: the thread below acts (a handler that raised could leave
        # a collective half-entered); setting one keeps the default action (death) from happening
        for s in STOP_SIGNALS + ABORT_SIGNALS:
            self._previous[s] = signal.signal(s, _ignore)
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="lbannpy-signals", daemon=True).start()
        return self

    def finished(self) -> None:
        """The stop request (if any) has been honoured: the grace timer must not abort."""
        self._done.set()

    def _run(self) -> None:
        r = self._socks[0]
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                self._on(signum)

    def _on(self, signum: int) -> None:
        name = signal_name(signum)
        with self._lock:
            if signum in STOP_SIGNALS and self.graceful and not self.requested and not self._done.is_set():
                self.requested = signum
                threading.Thread(target=self._grace, args=(name,), name="lbannpy-stop-grace",
                                 daemon=True).start()
                return
            if signum in STOP_SIGNALS and (self.requested or self._done.is_set()):
                # the stop is under way (its grace timer bounds it) or written: nothing to add
                return
            during = f" while stopping on {signal_name(self.requested)}" if self.requested else ""
        self._abort(f"{name} received{during}; ending the job without a checkpoint", EXIT_SIGNAL_ABORT)

    def _grace(self, name: str) -> None:
        if not self._done.wait(self.grace_s):
            self._abort(f"{name}: the checkpoint and metrics were not written within {self.grace_s:g} s "
                        f"({GRACE_ENV}); ending the job", EXIT_SIGNAL_ABORT)

    def _abort(self, reason: str, code: int) -> None:
        end_job(f"lbannpy: rank {self.rank} of {self.size}: {reason}", self.abort if self.size > 1 else None,
                code)


def _ignore(signum, frame) -> None:
    return None


class _OnlyFrom:
    """A stream that passes on what one thread writes and drops what any other writes."""

    def __init__(self, stream, thread: int):
        self._stream, self._thread = stream, thread

    def write(self, text: str) -> int:
        if threading.get_ident() != self._thread:
            return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    @property
    def inner(self):
        return self._stream

    def __getattr__(self, name):
        return getattr(self._stream, name)


def only_this_thread_speaks() -> None:
    """From now on only the calling thread's writes reach stderr: it is ending the job, and what the other
    threads report from here on are consequences of that, not causes."""
    if not isinstance(sys.stderr, _OnlyFrom) and sys.stderr is not None:
        sys.stderr = _OnlyFrom(sys.stderr, threading.get_ident())


def every_thread_speaks() -> None:
    """Undo :func:`only_this_thread_speaks` (an abort that returned: one rank's world ends the thread, not
    the process)."""
    if isinstance(sys.stderr, _OnlyFrom):
        sys.stderr = sys.stderr.inner


def end_job(line: str, abort, code: int) -> None:
    """End this rank (and through ``abort(code)``, when given, the job) after ``line`` on stderr, from a
    thread that is not the one doing the work (the signal thread, the watchdog).

    Ending the job tears down what the main thread is using: an NCCL world aborts its communicator first,
    so the step in flight fails with "communicator destroyed" while MPI_Abort is still on its way, and that
    failure would be reported after ``line`` as if it were the cause: from here on only this thread's
    writes reach stderr (:func:`only_this_thread_speaks`; the consequences' tracebacks still go to their
    failure logs). Never returns."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not stop the abort
        pass
    only_this_thread_speaks()
    if abort is not None:
        abort(code)
    os._exit(code)


class StopReason(enum.IntEnum):
    """Why the ranks stop, as the stop vote agrees on it: the largest any rank posts wins."""

    GO_ON = 0
    SIGNAL = 1  # SIGTERM or SIGUSR1 on some rank: a checkpoint, the outputs, exit 4
    METRICS_WRITE_FAILED = 2  # rank 0 could not append to metrics.csv: the outputs, then the write error


@dataclass(frozen=True)
class Vote:
    """The agreed result of one stop vote: the reason, and for :attr:`StopReason.SIGNAL` the signal number
    (the largest any rank received)."""

    reason: StopReason = StopReason.GO_ON
    signum: int = 0


class StopVote:
    """A non-blocking agreement on stop requests: :meth:`post` after each step starts a two-integer
    max-allreduce of this rank's reason and signal and returns the previous vote's :class:`Vote` (its wait
    is on an operation that had a whole step to complete). Every rank sees the same results in the same
    order, so all stop after the same step. Who calls: every rank, once after each step (collective)."""

    def __init__(self, world):
        import numpy as np

        self.world = world.host  # host integers: an NCCL world votes over its MPI communicator
        self._np = np
        self._pending = None
        self._buf = None

    def post(self, reason: StopReason, signum: int = 0) -> Vote:
        """Start this step's vote; the result of the previous vote."""
        agreed = self.drain()
        self._buf = self._np.array([int(reason), int(signum)], dtype=self._np.int64)
        self._pending = self.world.iallreduce(self._buf, op="max")
        return agreed

    def drain(self) -> Vote:
        """Wait for the vote in flight (if any); its result."""
        if self._pending is None:
            return Vote()
        out = self._pending.wait()
        self._pending = None
        return Vote(StopReason(int(out[0])), int(out[1]))
