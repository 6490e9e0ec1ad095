"""The distributed HDF5 reader, tested serially: one reader per rank of a Distribution (pure geometry)."""
from __future__ import annotations

import threading
from dataclasses import dataclass

import h5py
import numpy as np
import pytest

from lbannpy.data.blobs import write_blobs
from lbannpy.data.mesh import MeshParams, write_mesh
from lbannpy.data.dataset import DataError, epoch_order, read_runs, split_indices, validate_dataset
from lbannpy.data.reader import HDF5Reader
from lbannpy.dist import Distribution, DistributionError

N_SAMPLES, SIZE, CHANNELS = 7, 20, 5


@pytest.fixture(scope="module")
def mesh_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reader") / "mesh.h5")
    write_mesh(path, MeshParams(size=SIZE, samples=N_SAMPLES, seed=9, channels=CHANNELS))
    return path


@pytest.fixture(scope="module")
def blobs_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("reader") / "blobs.h5")
    write_blobs(path, size=9, samples=11, classes=3, channels=2, seed=1)
    return path


@pytest.fixture(scope="module")
def file_arrays(mesh_file):
    with h5py.File(mesh_file, "r") as fh:
        return fh["inputs"][...], fh["labels"][...]


@dataclass(frozen=True)
class Case:
    name: str
    ranks: int
    degrees: tuple[tuple[str, int], ...]
    batch: int
    piece_bytes: int = 4 << 20

    def dist(self) -> Distribution:
        return Distribution.make(4, ranks=self.ranks, **dict(self.degrees))

    def __str__(self):
        return self.name


CASES = [
    Case("single", 1, (), 3),
    Case("sample2", 2, (("n", 2),), 4),
    Case("sample3-uneven", 3, (("n", 3),), 5),
    Case("spatial-h2w2", 4, (("h", 2), ("w", 2)), 2),
    Case("spatial-h3-uneven", 3, (("h", 3),), 1),
    Case("hybrid-n2h2", 4, (("n", 2), ("h", 2)), 3),
    Case("hybrid-n2w3-uneven", 6, (("n", 2), ("w", 3)), 3),
    Case("channel-c2-uneven", 2, (("c", 2),), 2),
    Case("replicated-r2", 2, (), 2),
    Case("hybrid-small-pieces", 4, (("n", 2), ("h", 2)), 3, 64),
]


def assemble(readers, batches, x_shape, y_shape):
    """Put every rank's block into a global array; a cell written twice must agree (replicas)."""
    x = np.full(x_shape, np.nan, dtype=np.float32)
    y = np.full(y_shape, 255, dtype=np.uint8)
    for r, b in zip(readers, batches):
        sel = tuple(slice(lo, hi) for lo, hi in r.box)
        prev = x[sel]
        assert np.isnan(prev).all() or np.array_equal(prev, b.inputs), "replicas disagree"
        x[sel] = b.inputs
        y[tuple(slice(lo, hi) for lo, hi in r.label_box)] = b.labels
    return x, y


@pytest.mark.parametrize("preload", ["never", "always"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_union_of_rank_blocks_is_the_shuffled_global_batch(case, preload, mesh_file, file_arrays):
    xs, ys = file_arrays
    dist = case.dist()
    readers = [HDF5Reader(mesh_file, dist=dist, rank=r, batch_size=case.batch, seed=4, prefetch=False,
                          piece_bytes=case.piece_bytes, preload=preload) for r in range(dist.ranks)]
    assert all(r.preloaded == (preload == "always") for r in readers)
    try:
        steps = readers[0].steps_per_epoch
        assert steps == N_SAMPLES // case.batch
        seen = []
        for _ in range(steps + 1):   # one epoch and the first step of the next
            batches = [r.next() for r in readers]
            epoch, step = batches[0].epoch, batches[0].step
            assert all((b.epoch, b.step) == (epoch, step) for b in batches)
            ids = epoch_order(np.arange(N_SAMPLES), 4, epoch)[step * case.batch:(step + 1) * case.batch]
            assert np.array_equal(readers[-1].batch_ids(epoch, step), ids)
            x, y = assemble(readers, batches, (case.batch, CHANNELS, SIZE, SIZE), (case.batch, SIZE, SIZE))
            assert np.array_equal(x, xs[ids]) and np.array_equal(y, ys[ids])
            for r, b in zip(readers, batches):
                assert b.inputs.shape == r.local_shape
                assert np.array_equal(b.sample_ids, ids[r.box[0][0]:r.box[0][1]])
            if epoch == 0:
                seen.extend(ids.tolist())
        assert len(set(seen)) == len(seen) == steps * case.batch   # no sample twice in an epoch
    finally:
        for r in readers:
            r.close()


def test_shuffle_differs_between_epochs_and_not_between_ranks():
    idx = np.arange(50)
    orders = [epoch_order(idx, 7, e) for e in range(3)]
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[1], orders[2])
    assert np.array_equal(epoch_order(idx, 7, 1), orders[1])
    assert all(np.array_equal(np.sort(o), idx) for o in orders)
    assert np.array_equal(epoch_order(idx, 7, 5, shuffle=False), idx)
    # the documented contract (checkpoints of older runs rely on it): SeedSequence(seed, spawn_key=(epoch,))
    want = np.random.default_rng(np.random.SeedSequence(7, spawn_key=(0,))).permutation(50)
    assert np.array_equal(orders[0], want)


@pytest.mark.parametrize("preload", ["never", "always"])
def test_label_dist_takes_the_labels_box(mesh_file, file_arrays, preload):
    # inputs split over samples, labels compared with a spatially split output: each rank gets its label box
    _, ys = file_arrays
    dist = Distribution.make(4, ranks=4, n=4)
    ldist = Distribution.make(4, ranks=4, n=2, w=2)
    readers = [HDF5Reader(mesh_file, dist=dist, label_dist=ldist, rank=r, batch_size=4, seed=0,
                          prefetch=False, preload=preload) for r in range(4)]
    batches = [r.next() for r in readers]
    ids = readers[0].batch_ids(0, 0)
    y = np.full((4, SIZE, SIZE), 255, np.uint8)
    for r, b in zip(readers, batches):
        assert b.labels.shape == ldist.local_shape((4, 1, SIZE, SIZE), r.rank)[:1] + (SIZE, SIZE // 2)
        y[tuple(slice(lo, hi) for lo, hi in r.label_box)] = b.labels
        assert b.inputs.shape == (1, CHANNELS, SIZE, SIZE)
    assert np.array_equal(y, ys[ids])
    for r in readers:
        r.close()


@pytest.mark.parametrize("preload", ["never", "always"])
def test_class_labels(blobs_file, preload):
    with h5py.File(blobs_file, "r") as fh:
        xs, ys = fh["inputs"][...], fh["labels"][...]
    dist = Distribution.make(4, ranks=2, n=2)
    readers = [HDF5Reader(blobs_file, dist=dist, rank=r, batch_size=4, seed=2, preload=preload)
               for r in range(2)]
    for _ in range(3):
        batches = [r.next() for r in readers]
        ids = readers[0].batch_ids(batches[0].epoch, batches[0].step)
        assert np.array_equal(np.concatenate([b.labels for b in batches]), ys[ids])
        assert np.array_equal(np.concatenate([b.inputs for b in batches]), xs[ids])
        assert batches[0].labels.dtype == np.int64
    for r in readers:
        r.close()


@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
def test_resume_reads_the_same_batches(mesh_file, prefetch):
    dist = Distribution.make(4, ranks=2, h=2)
    kw = dict(dist=dist, rank=1, batch_size=2, seed=13, prefetch=prefetch)
    with HDF5Reader(mesh_file, **kw) as ref:
        want = [ref.next() for _ in range(9)]
    with HDF5Reader(mesh_file, **kw) as first:
        for _ in range(4):
            first.next()
        state = first.state()
    assert state["epoch"] == 4 // 3 and state["step"] == 4 % 3 and state["seed"] == 13
    # values as they come back from an HDF5 checkpoint (NumPy scalars)
    stored = {k: (np.int64(v) if not isinstance(v, bool) else np.bool_(v)) for k, v in state.items()}
    kw2 = {k: v for k, v in kw.items() if k not in ("seed", "batch_size")}
    with HDF5Reader.from_state(stored, mesh_file, **kw2) as resumed:
        got = [resumed.next() for _ in range(5)]
    for w, g in zip(want[4:], got):
        assert (w.epoch, w.step) == (g.epoch, g.step)
        assert np.array_equal(w.inputs, g.inputs) and np.array_equal(w.labels, g.labels)


def test_load_state_refuses_a_different_run(mesh_file):
    with HDF5Reader(mesh_file, batch_size=2, seed=1, prefetch=False) as r:
        state = r.state()
    with HDF5Reader(mesh_file, batch_size=2, seed=2, prefetch=False) as other:
        with pytest.raises(DataError, match="seed"):
            other.load_state(state)
        with pytest.raises(DataError, match="lacks"):
            other.load_state({"epoch": 0})
        bad = dict(other.state(), step=99)
        with pytest.raises(DataError, match="outside an epoch"):
            other.load_state(bad)


def test_prefetch_on_and_off_give_identical_batches(mesh_file):
    dist = Distribution.make(4, ranks=4, n=2, w=2)
    for rank in range(4):
        with HDF5Reader(mesh_file, dist=dist, rank=rank, batch_size=2, seed=5, prefetch=False) as a, \
             HDF5Reader(mesh_file, dist=dist, rank=rank, batch_size=2, seed=5, prefetch=True, depth=3) as b:
            for _ in range(8):
                x, y = a.next(), b.next()
                assert (x.epoch, x.step) == (y.epoch, y.step)
                assert np.array_equal(x.inputs, y.inputs) and np.array_equal(x.labels, y.labels)
            assert len(a.wait_times) == 8 and len(b.wait_times) == 8
            stats = b.io_stats()
            assert stats["steps"] == 8 and stats["prefetch"] is True
            assert stats["wait_s_total"] == pytest.approx(sum(b.wait_times))


def test_prefetch_hides_reads_behind_compute(mesh_file):
    """While the consumer computes (does not call ``next``) the following batches are read, on another
    thread: each read is seen to complete by an event while the consumer waits, never by a clock."""
    with HDF5Reader(mesh_file, batch_size=3, seed=0, prefetch=True, depth=2) as r:
        slow = r.read_batch
        done = {}       # (epoch, step) -> set once that batch's read has returned
        readers = []    # the thread of each read

        def read_watched(epoch, step):
            readers.append(threading.current_thread())
            batch = slow(epoch, step)
            done.setdefault((epoch, step), threading.Event()).set()
            return batch

        def read_done(epoch, step):
            return done.setdefault((epoch, step), threading.Event())

        r.read_batch = read_watched
        b = r.next()
        for _ in range(4):
            # "compute": the next batch is read while the consumer does not call next (the timeout only
            # guards against a hang; a reader that reads inside next() never sets the event)
            nxt = r.advance(b.epoch, b.step)
            assert read_done(*nxt).wait(timeout=60), f"batch {nxt} was not read ahead"
            b = r.next()
            assert (b.epoch, b.step) == nxt
        assert readers and threading.current_thread() not in readers, readers


def test_validation_split(mesh_file):
    tr, va = split_indices(100, 0.2, seed=3)
    assert len(va) == 20 and len(tr) == 80
    assert np.array_equal(np.sort(np.concatenate([tr, va])), np.arange(100))
    tr2, va2 = split_indices(100, 0.2, seed=3)
    assert np.array_equal(tr, tr2) and np.array_equal(va, va2)
    assert not np.array_equal(va, split_indices(100, 0.2, seed=4)[1])
    assert len(split_indices(10, 0.01)[1]) == 1
    with pytest.raises(DataError):
        split_indices(4, 1.0)
    tr, va = split_indices(N_SAMPLES, 0.3, seed=0)
    with HDF5Reader(mesh_file, batch_size=2, indices=va, shuffle=False, prefetch=False) as r:
        b = r.next()
        assert np.array_equal(b.sample_ids, va[:2]) and r.steps_per_epoch == len(va) // 2


def test_read_runs_plan():
    assert read_runs([]) == []
    assert read_runs([3, 4, 5]) == [(3, 0, 3)]
    assert read_runs([5, 3, 4]) == [(3, 1, 2), (5, 0, 1)]
    assert read_runs([9, 2, 7, 1]) == [(1, 3, 1), (2, 1, 1), (7, 2, 1), (9, 0, 1)]


def test_thread_exception_reaches_the_consumer_and_nothing_hangs(mesh_file):
    r = HDF5Reader(mesh_file, batch_size=1, seed=0, prefetch=True)
    real = r.read_batch

    def failing(epoch, step):
        if step == 2:
            raise OSError("disk went away")
        return real(epoch, step)

    r.read_batch = failing
    r.next()
    r.next()
    # the failure reaches the consumer as the thread's own exception; a hang fails by the test's timeout
    with pytest.raises(OSError, match="disk went away"):
        r.next()
    r.close()
    r.close()   # idempotent
    assert not any(t.name.startswith("lbannpy-prefetch") for t in threading.enumerate())


@pytest.mark.timeout(120)
def test_close_with_a_full_queue_joins_the_thread(mesh_file):
    r = HDF5Reader(mesh_file, batch_size=1, seed=0, prefetch=True, depth=1)
    real = r.read_batch
    reads = []
    blocked = threading.Event()

    def counted(epoch, step):
        reads.append((epoch, step))
        if len(reads) == 3:  # batch 0 taken, batch 1 queued (depth 1): this one waits for a free slot
            blocked.set()
        return real(epoch, step)

    r.read_batch = counted
    r.next()
    assert blocked.wait(timeout=60), reads
    r.close()   # a hang here fails by the test's timeout
    assert not any(t.name.startswith("lbannpy-prefetch") for t in threading.enumerate())
    assert len(reads) == 3, reads  # the producer stopped at its blocked put, it read nothing more


def test_validate_dataset_errors(tmp_path, mesh_file):
    with pytest.raises(DataError, match="does not exist"):
        validate_dataset(str(tmp_path / "nope.h5"))
    txt = tmp_path / "x.txt"
    txt.write_text("hello")
    with pytest.raises(DataError, match="not an HDF5 file"):
        validate_dataset(str(txt))
    with pytest.raises(DataError, match=r"'images' not found.*inputs, labels"):
        validate_dataset(mesh_file, inputs="images")
    with pytest.raises(DataError, match=rf"mesh.h5.*'inputs'.*{CHANNELS} channels.*expects 18"):
        validate_dataset(mesh_file, expected_channels=18)
    with pytest.raises(DataError, match=rf"expects spatial \(64, 64\).*found \(7, {CHANNELS}, 20, 20\)"):
        validate_dataset(mesh_file, expected_spatial=(64, 64))
    info = validate_dataset(mesh_file, expected_channels=CHANNELS, expected_spatial=(SIZE, SIZE))
    assert info.num_samples == N_SAMPLES and info.per_pixel and info.spatial == (SIZE, SIZE)

    bad = str(tmp_path / "bad.h5")
    with h5py.File(bad, "w") as fh:
        fh.create_dataset("inputs", data=np.zeros((4, 2, 6, 6), np.float32))
        fh.create_dataset("int_inputs", data=np.zeros((4, 2, 6, 6), np.int32))
        fh.create_dataset("labels", data=np.zeros((4, 6, 5), np.uint8))
        fh.create_dataset("short", data=np.zeros((3,), np.int64))
        fh.create_dataset("float_labels", data=np.zeros((4,), np.float32))
        fh.create_dataset("flat", data=np.zeros((4,), np.float32))
        fh.create_group("grp")
    with pytest.raises(DataError, match=r"labels must match.*expected \(4, 6, 6\), found \(4, 6, 5\)"):
        validate_dataset(bad)
    with pytest.raises(DataError, match="'short' has shape 3 but 'inputs' has 4 samples"):
        validate_dataset(bad, labels="short")
    with pytest.raises(DataError, match="dtype float32; expected integer"):
        validate_dataset(bad, labels="float_labels")
    with pytest.raises(DataError, match="dtype int32; expected floating"):
        validate_dataset(bad, inputs="int_inputs", labels="short")
    with pytest.raises(DataError, match="1 dimensions"):
        validate_dataset(bad, inputs="flat", labels="short")
    with pytest.raises(DataError, match="is a group"):
        validate_dataset(bad, inputs="grp")


def test_reader_refuses_bad_settings(mesh_file):
    with pytest.raises(DataError, match="exceeds the 7 samples"):
        HDF5Reader(mesh_file, batch_size=8)
    with pytest.raises(DistributionError, match="cannot be split 4 ways along 'n'"):
        HDF5Reader(mesh_file, dist=Distribution.make(4, ranks=4, n=4), batch_size=3)
    with pytest.raises(DataError, match="3 dimensions"):
        HDF5Reader(mesh_file, dist=Distribution.make(3, ranks=1), batch_size=1)
    with pytest.raises(DataError, match="rank 2 outside"):
        HDF5Reader(mesh_file, dist=Distribution.make(4, ranks=2, n=2), rank=2, batch_size=2)
    with pytest.raises(DataError, match="duplicates"):
        HDF5Reader(mesh_file, batch_size=1, indices=[1, 1, 2])
    with pytest.raises(DataError, match=r"in \[0, 7\)"):
        HDF5Reader(mesh_file, batch_size=1, indices=[0, 7])
    with pytest.raises(DataError, match="expects 18"):
        HDF5Reader(mesh_file, batch_size=1, expected_channels=18)


def test_preloaded_reader_reads_the_file_once_and_starts_no_thread(mesh_file, file_arrays, monkeypatch):
    xs, ys = file_arrays
    dist = Distribution.make(4, ranks=2, h=2)
    reads = []
    real = h5py.Dataset.read_direct

    def counted(ds, *a, **k):
        reads.append(ds.name)
        return real(ds, *a, **k)

    monkeypatch.setattr(h5py.Dataset, "read_direct", counted)
    threads = threading.active_count()
    with HDF5Reader(mesh_file, dist=dist, rank=1, batch_size=2, seed=3, prefetch=True,
                    preload="always") as r:
        at_setup = len(reads)
        assert at_setup == 2  # the inputs and the pixel labels of all 7 samples: one run each
        assert r.preloaded and not r.prefetch and r.io_stats()["preloaded"] is True
        (h0, h1), (w0, w1) = r.box[2], r.box[3]
        for _ in range(7):  # two epochs and more
            b = r.next()
            ids = r.batch_ids(b.epoch, b.step)
            assert np.array_equal(b.inputs, xs[ids][:, :, h0:h1, w0:w1])
            assert np.array_equal(b.labels, ys[ids][:, h0:h1, w0:w1])
            assert threading.active_count() == threads
        assert len(reads) == at_setup


def test_preload_auto_follows_the_size_of_a_ranks_part(mesh_file, monkeypatch):
    import lbannpy.data.reader as reader_mod

    dist = Distribution.make(4, ranks=2, h=2)
    with HDF5Reader(mesh_file, dist=dist, rank=0, batch_size=2, preload="auto") as r:
        assert r.preloaded  # 7 samples of 5 x 10 x 20 float32 and uint8 labels: far below the limit
        # every rank decides on the largest rank's part, so ranks of an uneven split agree
        assert r.store_bytes == N_SAMPLES * (CHANNELS * 10 * SIZE * 4 + 10 * SIZE)
        small = r.store_bytes - 1
    monkeypatch.setattr(reader_mod, "preloads", lambda mode, nbytes: __import__(
        "lbannpy.data.dataset", fromlist=["x"]).preloads(mode, nbytes) and nbytes <= small)
    with HDF5Reader(mesh_file, dist=dist, rank=0, batch_size=2, preload="auto") as r:
        assert not r.preloaded and r.prefetch
    with pytest.raises(DataError, match="data.preload"):
        HDF5Reader(mesh_file, dist=dist, rank=0, batch_size=2, preload="yes")


def test_preload_decision_threshold():
    from lbannpy.data.dataset import PRELOAD_AUTO_BYTES, preloads

    assert preloads("auto", PRELOAD_AUTO_BYTES) and not preloads("auto", PRELOAD_AUTO_BYTES + 1)
    assert preloads("always", 10**15) and not preloads("never", 1)


def test_preloaded_reader_still_sees_a_changed_file(tmp_path):
    path = str(tmp_path / "m.h5")
    write_mesh(path, MeshParams(size=8, samples=4, seed=1, channels=2))
    with HDF5Reader(path, batch_size=2, seed=0, preload="always") as r:
        r.next(), r.next()  # epoch 0
        write_mesh(path + ".new", MeshParams(size=8, samples=4, seed=2, channels=2))
        import os

        os.replace(path + ".new", path)
        with pytest.raises(DataError, match="changed while training"):
            r.next()  # the first batch of epoch 1 checks the file, as a streaming reader does


@pytest.mark.parametrize("preload", ["never", "always"])
def test_labels_reduced_to_prediction_cells_as_read(mesh_file, file_arrays, preload):
    # inputs split over samples, labels over a 2 x 2 spatial grid of a prediction with 5 x 2 pixel cells:
    # every rank's batch holds its cells, each the largest label under it (a global NumPy reference)
    _, ys = file_arrays
    dist, ldist = Distribution.make(4, ranks=4, n=4), Distribution.make(4, ranks=4, h=2, w=2)
    f = (5, 2)
    readers = [HDF5Reader(mesh_file, dist=dist, label_dist=ldist, rank=r, batch_size=4, seed=3,
                          prefetch=False, preload=preload, label_factors=f, num_classes=2) for r in range(4)]
    for epoch in range(2):  # one step an epoch (7 samples, batch 4)
        batches = [r.next() for r in readers]
        ids = readers[0].batch_ids(epoch, 0)
        want = ys[ids].reshape(4, SIZE // 5, 5, SIZE // 2, 2).max(axis=(2, 4))
        got = np.full_like(want, 255)
        for r, b in zip(readers, batches):
            assert b.labels.shape == (4, SIZE // 2 // 5, SIZE // 2 // 2) == r.label_local_shape
            got[(slice(None),) + tuple(slice(lo // k, hi // k) for (lo, hi), k in zip(r.label_box[1:], f))] \
                = b.labels
        assert np.array_equal(got, want)
    # the preloaded store holds cells: 7 samples of (1, 5, 20, 20) float32 inputs and 2 x 5 uint8 cells
    assert readers[0].store_bytes == N_SAMPLES * (CHANNELS * SIZE * SIZE * 4 + 2 * 5)
    for r in readers:
        r.close()


def test_label_factors_refused_where_they_cannot_apply(mesh_file, blobs_file):
    ldist = Distribution.make(4, ranks=2, h=2)  # rank 1's label rows start at 10
    with pytest.raises(DataError, match=r"rank 1: its label block starts at pixel \(10, 0\), not on a "
                                        r"boundary of the \(3, 1\) prediction cells"):
        HDF5Reader(mesh_file, dist=ldist, rank=1, batch_size=2, prefetch=False, label_factors=(3, 1))
    with pytest.raises(DataError, match="one factor of at least 1 for each of the 2 spatial"):
        HDF5Reader(mesh_file, batch_size=2, prefetch=False, label_factors=(2,))
    with pytest.raises(DataError, match="need per-pixel labels"):
        HDF5Reader(blobs_file, batch_size=2, prefetch=False, label_factors=(3, 3))
