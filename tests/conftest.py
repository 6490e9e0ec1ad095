"""Test-suite wide settings.

Tests under ``tests/mpi`` run under ``mpiexec``, once per rank count; a plain ``python -m pytest tests``
does not collect them directly but runs them through ``tests/test_mpi_suites.py``, which launches
``mpiexec -n P python -m mpi4py -m pytest tests/mpi`` for P = 1, 2, 3, 4 (and 8 for tests marked
``ranks8``). They are collected when ``LBANNPY_MPI_TESTS=1`` is set (the launcher sets it) or when pytest
was started through ``python -m mpi4py``. See ``tests/mpi/conftest.py`` for the rules MPI tests follow.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # tests import shared helpers as `import mpi_util`
    sys.path.insert(0, _HERE)

# The default machine (parallel.machine: local) is this host's calibration when `bench calibrate` wrote one:
# tests (and their subprocesses) look in an empty folder instead, so a developer's calibration changes no plan
os.environ["LBANNPY_MACHINE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "lbannpy-tests-no-machine")


def mpi_tests_enabled() -> bool:
    return os.environ.get("LBANNPY_MPI_TESTS") == "1" or "mpi4py.MPI" in sys.modules


collect_ignore = [] if mpi_tests_enabled() else ["mpi"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks8: an MPI test (tests/mpi) that also runs in the 8-rank oversubscribed suite")
