"""Same helpers as ``tests/mpi_util.py`` (importable as ``mpi_util`` too); see there."""
from mpi_util import (CollectiveFailure, assert_all, assert_allclose_all, collective_check,  # noqa: F401
                      collective_verdict, format_failures, raises_all, tolerances)
