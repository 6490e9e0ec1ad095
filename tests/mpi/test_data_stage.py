"""Batches staged in the prefetch thread under MPI, at any number of ranks: each rank's converted block is
the file's, as the synchronous reader returns it, and a bad label that only one rank reads stops every
rank, in the trainer's data agreement, with the one line that names the sample."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from lbannpy.data.mesh import MeshParams, write_mesh
from lbannpy.data.reader import HDF5Reader
from lbannpy.data.upload import stage_batches
from lbannpy.dist import Distribution
from lbannpy.training.errors import DataStop
from lbannpy.training.loop import Trainer
from mpi_util import assert_all

SIZE, SAMPLES, CHANNELS, BATCH = 16, 5, 3, 2   # 2 steps an epoch, the fifth sample dropped
BAD_SAMPLE, BAD_ROW = 3, 13                    # a label in the last rows: read by the last rank of an h split


@pytest.fixture
def files(comm):
    """Collective: a mesh file and a copy with one bad label, written by rank 0; removed afterwards."""
    tmp = tempfile.mkdtemp(prefix="lbannpy-stage-mpi-") if comm.rank == 0 else None
    ok, msg = True, ""
    if comm.rank == 0:
        try:
            good, bad = os.path.join(tmp, "m.h5"), os.path.join(tmp, "bad.h5")
            write_mesh(good, MeshParams(size=SIZE, samples=SAMPLES, seed=3, channels=CHANNELS))
            shutil.copy(good, bad)
            with h5py.File(bad, "r+") as fh:
                fh["labels"][BAD_SAMPLE, BAD_ROW, 2] = 7
        except Exception as exc:  # agreed below, so no rank waits for a file that never came
            ok, msg = False, repr(exc)
    tmp = comm.bcast_obj(tmp)
    assert_all(comm, ok, msg)
    yield os.path.join(tmp, "m.h5"), os.path.join(tmp, "bad.h5")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def dist_for(size: int) -> Distribution:
    return Distribution.make(4, ranks=size, h=size)


@pytest.mark.timeout(60)
def test_staged_blocks_are_the_synchronous_readers(comm, files):
    good, _ = files
    ok, msg = True, ""
    try:
        kw = dict(dist=dist_for(comm.size), rank=comm.rank, batch_size=BATCH, seed=4, comm=comm)
        with HDF5Reader(good, prefetch=False, **kw) as sync, HDF5Reader(good, prefetch=True, **kw) as bg, \
             h5py.File(good, "r") as fh:
            stage_batches(bg, np, "float64")
            for _ in range(2 * bg.steps_per_epoch + 1):   # across two epoch boundaries
                a, b = sync.next(), bg.next()
                ids = sync.batch_ids(a.epoch, a.step)
                want = np.stack([fh["inputs"][i] for i in ids])[tuple(slice(lo, hi) for lo, hi in bg.box)]
                if not ((a.epoch, a.step) == (b.epoch, b.step) and b.inputs.dtype == np.float64
                        and np.array_equal(b.inputs, want.astype(np.float64))
                        and np.array_equal(b.labels, a.labels)):
                    ok, msg = False, f"batch ({a.epoch}, {a.step}) differs"
                    break
    except Exception as exc:
        ok, msg = False, repr(exc)
    ok = ok and not [t for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]
    assert_all(comm, ok, msg)


@pytest.mark.timeout(60)
def test_a_bad_label_on_one_rank_stops_every_rank_naming_the_sample(comm, files):
    _, bad = files
    trainer = SimpleNamespace(world=comm)   # Trainer.next_batch needs only the world
    seen, ok, msg = None, True, ""
    with HDF5Reader(bad, dist=dist_for(comm.size), rank=comm.rank, batch_size=BATCH, seed=0, shuffle=False,
                    prefetch=True, comm=comm, num_classes=2, name="data.train") as reader:
        stage_batches(reader, np, "float64")
        try:
            Trainer.next_batch(trainer, reader)   # samples 0, 1
            Trainer.next_batch(trainer, reader)   # samples 2, 3: the bad one
            ok, msg = False, "no error"
        except DataStop as exc:
            seen = str(exc)
    every = comm.allgather_obj(seen)
    if ok:
        ok = all(s == every[0] for s in every) and f"sample {BAD_SAMPLE} has label 7" in every[0] \
            and "\n" not in every[0]
        msg = repr(every)
    ok = ok and not [t for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]
    assert_all(comm, ok, msg)
