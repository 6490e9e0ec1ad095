"""Errors the trainer reports to the user (agreed on by all ranks, printed once, no traceback)."""
from __future__ import annotations

import errno
import os
import sys

from lbannpy.checkpoint import CheckpointError
from lbannpy.comm.runtime import launched_rank_size
from lbannpy.config import ConfigError
from lbannpy.data.dataset import DataError
from lbannpy.dist import DistributionError
from lbannpy.layers.base import LayerError

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 6  # a non-finite loss stopped the run (one line naming the step and where)
EXIT_WRITE_FAILED = 7  # a checkpoint or an output file could not be written (a full or read-only disk)


class UserError(Exception):
    """A problem the user can fix (config, data, distribution); reported without a traceback."""


class Stopped(Exception):
    """The ranks agreed to stop after ``step`` on a signal (SIGTERM, SIGUSR1); a checkpoint and the metrics
    have been written. Not a failure of the run: it can be resumed with ``--resume``."""

    def __init__(self, signal: str, step: int, ckpt_dir: str, out_dir: str):
        super().__init__(f"stopped by {signal} after step {step}; checkpoint in {ckpt_dir}/, metrics in "
                         f"{out_dir}/; resume with --resume")
        self.signal, self.step = signal, step


class NonFinite(Exception):
    """A non-finite loss (or parameters) at ``step``; the metrics so far have been written and the last good
    checkpoint is the newest."""

    def __init__(self, step: int, what: str, where: str):
        super().__init__(f"non-finite values at step {step}: {what}; first non-finite: {where}")
        self.step = step


class WriteFailed(Exception):
    """A checkpoint or an output file could not be written (every rank raises it alike); the run stopped
    after writing what it still could. The newest complete checkpoint is named in the message."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a user can fix (config, data, layer, distribution, checkpoint, file system): these
    are reported as one line, everything else as a failure with its traceback in the run directory."""
    return (UserError, ConfigError, DataError, LayerError, DistributionError, CheckpointError, OSError)


def refuse_before_mpi(prog: str, msg: str) -> int:
    """A problem every rank finds alike before MPI starts (the device, backend and GPUs against this
    machine: :func:`lbannpy.backend.device_problem`): the launcher's rank 0 prints ``<prog>: error:
    <msg>`` and every rank ends with :data:`EXIT_USER_ERROR`, none having started MPI."""
    if launched_rank_size()[0] == 0:
        sys.stderr.write(f"{prog}: error: {msg}\n")
        sys.stderr.flush()
    return EXIT_USER_ERROR


def agree_on_error(world, err: str | None, prog: str) -> bool:
    """Who calls: every rank (collective). Each rank's error (or None) is gathered; when any rank has one,
    rank 0 prints the first as ``<prog>: error[ (rank r)]: <message>`` (the rank named only when the
    ranks disagree) and every rank returns True, so all of them stop together."""
    errors = world.allgather_obj(err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad and world.rank == 0:
        r, e = bad[0]
        where = "" if all(x == e for _, x in bad) else f" (rank {r})"
        sys.stderr.write(f"{prog}: error{where}: {e}\n")
        sys.stderr.flush()
    return bool(bad)


class DataStop(UserError):
    """A data problem found while training (a label out of range, the data file changed), agreed on by every
    rank: all of them stop before the same step and the run ends with one line and exit status 2."""


def agree_on_data(world, err: str | None) -> None:
    """Who calls: every rank, once per batch (collective: a one-integer max-allreduce; the messages are
    gathered only when some rank has one). Raise :class:`DataStop` on every rank when any rank's ``err`` is
    set, with the first such message (naming its rank when the ranks' messages differ)."""
    if world.size == 1:
        if err:
            raise DataStop(err)
        return
    import numpy as np

    comm = world.host  # a host integer: an NCCL world agrees over its MPI communicator
    flag = comm.allreduce(np.array([1 if err else 0], dtype=np.int64), op="max")
    if not int(flag[0]):
        return
    errors = comm.allgather_obj(err)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    r, e = bad[0]
    raise DataStop(e if all(x == e for _, x in bad) else f"{e} (rank {r})")


EXIT_READER_GONE = 141  # what a shell reports for a program SIGPIPE ended (128 + 13), as in `yes | head`


class GuardedStdout:
    """``sys.stdout`` for a command whose standard output may be closed, a pipe whose reader left (``| head``)
    or a full device: writing to it never fails the command. The first failure switches file descriptor 1
    to ``/dev/null`` (so no later flush, at exit either, fails again) and is kept in :attr:`failed`; a full
    or failing device (not a reader that left, not a closed stdout) is named once on stderr as it happens,
    so the command's work (a training run's checkpoints and metrics, a written config) goes on and is kept.

    :meth:`install` at the start of ``main``; at its end :attr:`reader_gone` and :attr:`failed` say what
    happened (a command whose output is its product ends with :data:`EXIT_READER_GONE` or an error)."""

    def __init__(self, prog: str):
        self.prog = prog
        self.failed: OSError | None = None
        self.closed_at_start = False
        self._stream = None

    def install(self) -> "GuardedStdout":
        """Make this ``sys.stdout`` (the one already installed, when a command runs twice in a process)."""
        if isinstance(sys.stdout, GuardedStdout):
            return sys.stdout
        stream = sys.stdout
        if stream is None:  # descriptor 1 closed: /dev/null takes it, so no file opened later lands there
            self.closed_at_start = True
            self._to_devnull()
            stream = open(1, "w", closefd=False)
        self._stream = stream
        sys.stdout = self
        return self

    @property
    def reader_gone(self) -> bool:
        return self.failed is not None and self.failed.errno in (errno.EPIPE, errno.ECONNRESET)

    def write(self, text: str) -> int:
        if self.failed is None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as exc:
                self._fail(exc)
        return len(text)

    def flush(self) -> None:
        if self.failed is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._fail(exc)

    def isatty(self) -> bool:
        return self.failed is None and self._stream.isatty()

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _fail(self, exc: BaseException) -> None:
        if not isinstance(exc, OSError):  # ValueError: the stream was closed under us
            exc = OSError(errno.EBADF, "standard output was closed")
        self.failed = exc
        self._to_devnull()
        if not self.reader_gone:
            try:
                sys.stderr.write(f"{self.prog}: standard output could not be written "
                                 f"({exc.strerror or exc}); its lines are dropped from here on\n")
                sys.stderr.flush()
            except Exception:  # a closed stderr too: nothing left to tell
                pass

    @staticmethod
    def _to_devnull() -> None:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != 1:
            os.dup2(null, 1)
            os.close(null)
