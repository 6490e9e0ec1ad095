"""The GPU uploader (lbannpy.data.upload.DeviceUploader) on the CuPy stand-in, run by
tests/test_data_stage.py in a subprocess whose PYTHONPATH starts with tests/gpu_standin.

The batches that reach the device are the file's (a NumPy reference, converted to the compute dtype) across
epoch boundaries; the pinned staging buffers are a fixed ring reused step after step; the step's thread
never asks or waits on an event (the prefetch thread asks for a slot's last copy); a resume reads the same
batches; no thread outlives the uploader."""
import threading
import time

import h5py
import numpy as np
import pytest

import cupy
from lbannpy.data.mesh import MeshParams, write_mesh
from lbannpy.data.reader import HDF5Reader
from lbannpy.data.upload import DeviceUploader, StagedBatch
from lbannpy.dist import Distribution

N_SAMPLES, SIZE, CHANNELS, BATCH = 7, 12, 3, 2


def test_is_the_standin():
    assert cupy.__file__.replace("\\", "/").endswith("tests/gpu_standin/cupy/__init__.py")


@pytest.fixture(scope="module")
def mesh_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("upload") / "mesh.h5")
    write_mesh(path, MeshParams(size=SIZE, samples=N_SAMPLES, seed=6, channels=CHANNELS))
    with h5py.File(path, "r") as fh:
        return path, fh["inputs"][...], fh["labels"][...]


class EventWatch:
    """Which threads ask an event whether it is done or wait on it (wraps the stand-in's Event)."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.devices = []   # (current device, the event's device) at each query
        watch = self
        real = cupy.cuda.Event

        class Event(real):
            def synchronize(self):
                watch.calls.append(("synchronize", threading.current_thread().name))
                return real.synchronize(self)

            @property
            def done(self):
                watch.calls.append(("done", threading.current_thread().name))
                watch.devices.append((cupy.cuda.runtime.getDevice(), self.device_id))
                return real.done.fget(self)

        monkeypatch.setattr(cupy.cuda, "Event", Event)

    def on(self, thread_name):
        return [c for c in self.calls if c[1] == thread_name]


@pytest.mark.parametrize("preload", ["never", "always"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_uploaded_batches_are_the_files_and_the_ring_is_fixed(mesh_file, monkeypatch, ranks, preload):
    path, xs, ys = mesh_file
    watch = EventWatch(monkeypatch)
    dist = Distribution.make(4, ranks=ranks, h=ranks)
    steps = 2 * (N_SAMPLES // BATCH) + 2
    for rank in range(ranks):
        cupy.cuda.Device(ranks).use()   # not device 0, where a new thread starts
        reader = HDF5Reader(path, dist=dist, rank=rank, batch_size=BATCH, seed=8, prefetch=True, depth=2,
                            num_classes=2, preload=preload)
        up = DeviceUploader(reader, cupy, "float64", num_classes=2)
        assert up.slots == 4
        buffers, devices = set(), set()
        real_upload = up._upload

        def upload(staged):
            assert isinstance(staged, StagedBatch)
            buffers.add(staged.inputs.__array_interface__["data"][0])
            out = real_upload(staged)
            devices.add(out[0].inputs.data.ptr)
            return out
        up._upload = upload
        for _ in range(steps):
            b = up.next()
            assert isinstance(b.inputs, cupy.ndarray) and b.inputs.dtype == np.float64
            ids = reader.batch_ids(b.epoch, b.step)
            want_x = xs[ids][tuple(slice(lo, hi) for lo, hi in reader.box)].astype(np.float64)
            want_y = ys[ids][tuple(slice(lo, hi) for lo, hi in reader.label_box)]
            np.testing.assert_array_equal(cupy.asnumpy(b.inputs), want_x)
            np.testing.assert_array_equal(cupy.asnumpy(b.labels), want_y)
        # steps + 1 uploads through a ring of 4 pinned slots and 2 device buffers, none made per step
        assert len(buffers) == up.slots and len(devices) == 2, (buffers, devices)
        up.close()
    step_thread = threading.current_thread().name
    assert watch.on(step_thread) == [], watch.on(step_thread)
    # the prefetch thread asks whether a slot's last copy is done, and never blocks on the device
    assert any(c[0] == "done" and c[1].startswith("lbannpy-prefetch") for c in watch.calls)
    assert not [c for c in watch.calls if c[0] == "synchronize"], watch.calls
    assert watch.devices and all(cur == dev == ranks for cur, dev in watch.devices), watch.devices
    cupy.cuda.Device(0).use()
    assert not [t for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]


def settle(up, held: int) -> None:
    """Until the prefetch thread holds ``held`` slots (queued or waiting to queue): what a resume drops."""
    for _ in range(1000):
        if up._free.qsize() <= up.slots - held:
            return
        time.sleep(0.01)


@pytest.mark.timeout(60)   # slots lost at a resume would starve the thread: a hang, failed here
def test_resume_through_the_uploader_reads_the_same_batches(mesh_file):
    path, _, _ = mesh_file
    with HDF5Reader(path, batch_size=BATCH, seed=1, prefetch=True, depth=2) as reader:
        up = DeviceUploader(reader, cupy, "float32")
        for _ in range(4):
            up.next()
        state = dict(up.state())
        after = [cupy.asnumpy(up.next().inputs) for _ in range(3)]
        for _ in range(3):   # resumes repeatedly: the staged batches dropped each time free their slots
            settle(up, 3)    # two queued, one staged and waiting for room
            up.load_state(state)
            again = [cupy.asnumpy(up.next().inputs) for _ in range(3)]
            assert all(np.array_equal(a, b) for a, b in zip(after, again))
        up.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]


def test_a_bad_label_stops_the_uploader_with_the_readers_line(tmp_path, mesh_file):
    path, _, _ = mesh_file
    bad = str(tmp_path / "bad.h5")
    with open(path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read())
    with h5py.File(bad, "r+") as fh:
        fh["labels"][3, 1, 2] = 5
    with HDF5Reader(bad, batch_size=BATCH, seed=0, shuffle=False, prefetch=True, num_classes=2) as reader:
        up = DeviceUploader(reader, cupy, "float32", num_classes=2)
        with pytest.raises(Exception) as info:   # the batch of samples 2, 3 is uploaded ahead at step 1
            up.next()
        assert "sample 3 has label 5" in str(info.value) and "\n" not in str(info.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("lbannpy-prefetch")]
