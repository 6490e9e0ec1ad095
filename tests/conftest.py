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



def _pin_the_local_machine() -> None:
    """The default machine (parallel.machine: local) is this host's calibration when `bench calibrate` wrote
    one, else a model of this host's CPU: tests (and their subprocesses) price plans on the lassen preset
    instead, written as this host's calibration in a folder of their own, so that neither a developer's
    calibration nor the host's cores change a plan (tests of the local machine set LBANNPY_MACHINE_DIR)."""
    import socket
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"lbannpy-tests-machines-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    src = os.path.join(os.path.dirname(_HERE), "src", "machines", "lassen.yaml")
    dst = os.path.join(folder, f"{socket.gethostname() or 'localhost'}.yaml")
    tmp = f"{dst}.{os.getpid()}"
    with open(src, encoding="utf-8") as f, open(tmp, "w", encoding="utf-8") as g:
        g.write(f.read())
    os.replace(tmp, dst)
    os.environ["LBANNPY_MACHINE_DIR"] = folder


_pin_the_local_machine()


def mpi_tests_enabled() -> bool:
    return os.environ.get("LBANNPY_MPI_TESTS") == "1" or "mpi4py.MPI" in sys.modules


collect_ignore = [] if mpi_tests_enabled() else ["mpi"]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "ranks8: an MPI test (tests/mpi) that also runs in the 8-rank oversubscribed suite")
