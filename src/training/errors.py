"""Errors the trainer reports to the user (agreed on by all ranks, printed once, no traceback)."""
from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix (config, data, distribution); reported without a traceback."""
