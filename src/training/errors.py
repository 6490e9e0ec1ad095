"""Errors the trainer reports to the user (agreed on by all ranks, printed once, no traceback)."""
from __future__ import annotations

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
