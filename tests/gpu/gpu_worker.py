"""The ``__main__`` of a GPU tier worker that ``gpu_launch`` runs under mpiexec: a GPU communicator from the
launch's environment (``LBANNPY_TEST_BACKEND``, ``LBANNPY_TEST_SHARE_GPU``), the case named by ``argv[1]``
called as ``case(comm, cupy, out)``, and one ``RESULT`` line per rank (an exception becomes the row's
``error``, with its traceback)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_worker(cases: dict) -> None:
    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "mpi")]
    from mpi4py import MPI

    import cupy

    from lbannpy.comm import make_communicator

    comm = make_communicator(os.environ.get("LBANNPY_TEST_BACKEND", "nccl"), device="gpu",
                             share_gpu=os.environ.get("LBANNPY_TEST_SHARE_GPU") == "1")
    out = {"rank": comm.rank, "error": None}
    try:
        cases[sys.argv[1]](comm, cupy, out)
    except Exception as exc:
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    print("RESULT " + json.dumps(out), flush=True)
    comm.free()
    MPI.COMM_WORLD.Barrier()
