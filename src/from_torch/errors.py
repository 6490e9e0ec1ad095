"""The importer's one error: a refusal, reported as one line and exit status 2."""
from __future__ import annotations

from lbannpy.training.errors import UserError


class Refused(UserError):
    """An operator, argument or module the importer cannot map exactly: ``<module path> -> <op>: <what> is not
    supported; supported: <what is>``. Raised before anything is written."""
