"""The HDF5 reader under MPI, at any number of ranks: each rank reads its own hyperslab of each batch.

Rank 0 writes a tiny mesh file into a directory every rank sees; each rank's block must equal the
matching part of the global batch that the rank reads from the file by itself, the blocks must tile the
batch exactly, and a bad dataset name must stop every rank with the same error.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest

from lbannpy.data.mesh import MeshParams, write_mesh
from lbannpy.data.dataset import DataError
from lbannpy.data.reader import HDF5Reader
from lbannpy.dist import Distribution
from mpi_util import assert_all

SIZE, SAMPLES, CHANNELS = 16, 6, 3


@pytest.fixture
def shared_file(comm):
    """Collective: a mesh file written by rank 0, its path known on every rank; removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="lbannpy-data-mpi-") if comm.rank == 0 else None
    ok, msg = True, ""
    if comm.rank == 0:
        try:
            write_mesh(os.path.join(tmp, "m.h5"), MeshParams(size=SIZE, samples=SAMPLES, seed=2,
                                                             channels=CHANNELS))
        except Exception as exc:  # agreed below, so no rank waits for a file that never came
            ok, msg = False, repr(exc)
    tmp = comm.bcast_obj(tmp)
    assert_all(comm, ok, msg)
    yield os.path.join(tmp, "m.h5")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def distribution_for(size: int) -> tuple[Distribution, int]:
    """A hybrid sample/spatial distribution for ``size`` ranks (uneven blocks where the size allows)."""
    n = 2 if size % 2 == 0 else 1
    dist = Distribution.make(4, ranks=size, n=n, h=size // n)
    return dist, 2 * n if size > 1 else 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
def test_each_rank_reads_its_hyperslab(comm, shared_file, prefetch):
    dist, batch = distribution_for(comm.size)
    ok, msg, elements = True, "", 0
    try:
        with HDF5Reader(shared_file, dist=dist, rank=comm.rank, batch_size=batch, seed=7, prefetch=prefetch,
                        comm=comm) as reader, h5py.File(shared_file, "r") as fh:
            for _ in range(reader.steps_per_epoch + 1):
                b = reader.next()
                ids = reader.batch_ids(b.epoch, b.step)
                xs = np.stack([fh["inputs"][i] for i in ids])
                ys = np.stack([fh["labels"][i] for i in ids])
                want_x = xs[tuple(slice(lo, hi) for lo, hi in reader.box)]
                want_y = ys[tuple(slice(lo, hi) for lo, hi in reader.label_box)]
                if not (np.array_equal(b.inputs, want_x) and np.array_equal(b.labels, want_y)):
                    ok, msg = False, f"block of step ({b.epoch}, {b.step}) differs from the file"
                    break
                elements += b.inputs.size
            steps = reader.steps_per_epoch + 1
    except Exception as exc:
        ok, msg, steps = False, repr(exc), 0
    assert_all(comm, ok, msg)
    # the blocks tile the batch: their sizes add up to the global batch, step by step
    total = comm.allreduce_obj(elements)
    want = steps * batch * CHANNELS * SIZE * SIZE
    assert_all(comm, total == want, f"ranks read {total} elements in all, the batches hold {want}")


@pytest.mark.timeout(60)
def test_a_missing_dataset_stops_every_rank(comm, shared_file):
    dist, batch = distribution_for(comm.size)
    # only the last rank names a dataset that does not exist; every rank must refuse, naming that rank
    name = "no_such" if comm.rank == comm.size - 1 else "inputs"
    try:
        HDF5Reader(shared_file, inputs=name, dist=dist, rank=comm.rank, batch_size=batch, comm=comm)
        ok, msg = False, "no error"
    except DataError as exc:
        text = str(exc)
        ok = f"[rank {comm.size - 1}]" in text and "'no_such' not found" in text
        msg = text
    assert_all(comm, ok, msg)
    assert math.isfinite(comm.allreduce_obj(1.0))   # every rank is still in step after the error
