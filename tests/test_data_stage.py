"""Batches staged off the step's thread (:mod:`lbannpy.data.upload`): the prefetch thread reads, converts
and stages exactly the batches the synchronous reader returns, a stage's error reaches the step's thread
with the synchronous reader's message, and no thread outlives the reader. One reader per rank of a
Distribution (pure geometry); the MPI and GPU (stand-in) versions are in tests/mpi/test_data_stage.py and
tests/gpu_standin/standin_upload_check.py."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

from lbannpy.data.dataset import DataError
from lbannpy.data.mesh import MeshParams, write_mesh
from lbannpy.data.reader import HDF5Reader
from lbannpy.data.upload import HostStage, stage_batches
from lbannpy.dist import Distribution

N_SAMPLES, SIZE, CHANNELS, BATCH = 7, 12, 3, 2   # 3 steps an epoch: the 7th sample is the dropped partial
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def mesh_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stage") / "mesh.h5")
    write_mesh(path, MeshParams(size=SIZE, samples=N_SAMPLES, seed=4, channels=CHANNELS))
    return path


@pytest.fixture(scope="module")
def file_arrays(mesh_file):
    with h5py.File(mesh_file, "r") as fh:
        return fh["inputs"][...], fh["labels"][...]


@dataclass(frozen=True)
class Split:
    name: str
    ranks: int
    degrees: tuple   # (dimension, degree) pairs of Distribution.make

    def dist(self) -> Distribution:
        return Distribution.make(4, ranks=self.ranks, **dict(self.degrees))

    def __str__(self):
        return self.name


SPLITS = [Split("1rank", 1, ()), Split("2ranks-n", 2, (("n", 2),)), Split("2ranks-h", 2, (("h", 2),))]


def threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]


@pytest.mark.parametrize("preload", ["never", "always"])
@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_background_staging_delivers_the_synchronous_batches(split, preload, mesh_file, file_arrays):
    """Over two epoch boundaries (the partial last batch dropped alike), float32 file -> float64."""
    xs, ys = file_arrays
    dist = split.dist()
    steps = 2 * (N_SAMPLES // BATCH) + 1
    for rank in range(split.ranks):
        kw = dict(dist=dist, rank=rank, batch_size=BATCH, seed=3, preload=preload)
        with HDF5Reader(mesh_file, prefetch=False, **kw) as sync, \
             HDF5Reader(mesh_file, prefetch=True, depth=2, **kw) as bg:
            staged = stage_batches(bg, np, "float64", num_classes=2)
            assert staged is bg
            seen = []
            for _ in range(steps):
                a, b = sync.next(), staged.next()
                assert (a.epoch, a.step) == (b.epoch, b.step)
                assert b.inputs.dtype == np.float64 and a.inputs.dtype == np.float32
                # the NumPy reference: the file's samples of this batch, this rank's box, converted by NumPy
                ids = sync.batch_ids(a.epoch, a.step)
                want_x = xs[ids][tuple(slice(lo, hi) for lo, hi in bg.box)].astype(np.float64)
                want_y = ys[ids][tuple(slice(lo, hi) for lo, hi in bg.label_box)]
                assert np.array_equal(b.inputs, want_x) and np.array_equal(b.labels, want_y)
                assert np.array_equal(b.inputs, a.inputs.astype(np.float64))
                assert np.array_equal(b.labels, a.labels)
                assert np.array_equal(b.sample_ids, a.sample_ids)
                seen.append((b.epoch, b.step))
            assert seen[2:4] == [(0, 2), (1, 0)] and seen[-1] == (2, 0)
            assert bg.threaded and threads(), "the staging ran in a thread"
    assert not threads()


def test_a_stage_error_reaches_the_step_thread_with_the_synchronous_message(mesh_file):
    """A conversion the stage refuses (float32 inputs to int32, not a same-kind cast) raises in the
    prefetch thread; the step's thread gets the message the synchronous reader gives, and no thread
    is left running, without a close."""
    messages = []
    for prefetch in (False, True):
        r = HDF5Reader(mesh_file, batch_size=BATCH, seed=1, prefetch=prefetch)
        r.set_stage(HostStage("int32"))
        with pytest.raises(TypeError) as info:
            r.next()
        messages.append(str(info.value))
        assert not threads()
        r.close()
    assert messages[0] == messages[1] and "int32" in messages[0] and "\n" not in messages[0]


def test_a_bad_label_in_the_thread_names_the_sample_as_without_it(tmp_path, mesh_file):
    bad = str(tmp_path / "bad.h5")
    with open(mesh_file, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read())
    with h5py.File(bad, "r+") as fh:
        fh["labels"][5, 3, 4] = 9
    messages = []
    for prefetch in (False, True):
        with HDF5Reader(bad, batch_size=BATCH, seed=0, shuffle=False, prefetch=prefetch,
                        num_classes=2) as r:
            stage_batches(r, np, "float64")
            r.next(), r.next()   # samples 0-3
            with pytest.raises(DataError) as info:
                r.next()         # samples 4, 5
            messages.append(str(info.value))
            assert not threads()
    assert messages[0] == messages[1] and "sample 5" in messages[0], messages


def test_resume_and_close_with_staged_batches_queued(mesh_file):
    """load_state drops the staged batches and reads on from the position; close joins the thread."""
    with HDF5Reader(mesh_file, batch_size=BATCH, seed=2, prefetch=True, depth=3) as r:
        r.set_stage(HostStage("float64"))
        first = [r.next() for _ in range(4)]
        state = dict(r.state())
        more = [r.next() for _ in range(3)]
        r.load_state(state)
        again = [r.next() for _ in range(3)]
        assert [(b.epoch, b.step) for b in again] == [(b.epoch, b.step) for b in more]
        assert all(np.array_equal(a.inputs, b.inputs) for a, b in zip(more, again))
        assert first[0].inputs.dtype == np.float64
    assert not threads()


def test_the_host_stage_is_set_only_where_the_dtype_differs(mesh_file):
    with HDF5Reader(mesh_file, batch_size=BATCH, prefetch=True, preload="always") as r:
        stage_batches(r, np, "float32")
        assert r._stage is None and not r.threaded   # nothing to convert: the preloaded reader stays inline
        stage_batches(r, np, "float64")
        assert isinstance(r._stage, HostStage) and r.threaded


def test_device_uploader_on_the_cuda_standin():
    """The ring of pinned buffers and the device upload, on the strict CuPy stand-in (a subprocess, so
    this process never imports it as cupy)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LBANNPY_STANDIN_DEVICES="4")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS / "gpu_standin"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(TESTS / "gpu_standin" / "standin_upload_check.py")], env=env, cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout, p.stdout[-2000:]
