"""Errors the trainer reports to the user (agreed on by all ranks, printed once, no traceback)."""
from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 6  # a non-finite loss stopped the run (one line naming the step and where)


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
