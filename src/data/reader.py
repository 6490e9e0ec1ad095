"""Distributed HDF5 reader: each rank reads only its own hyperslab of each mini-batch, straight from the file.

A mini-batch of ``B`` samples is a tensor of global shape ``(B, C, *spatial)`` laid out by a
:class:`~lbannpy.dist.Distribution`. Rank ``r`` owns the box ``dist.box((B, C, *spatial), r)``: a range of
positions in the batch, a range of channels and a spatial block. The reader maps the batch positions to
sample ids of the file through a shuffled order and reads ``inputs[id, c0:c1, h0:h1, w0:w1]`` for each of
them (no rank-0 read and scatter, no whole-sample reads). Per-pixel labels ``(M, *spatial)`` are read with
the spatial box of ``label_dist`` (the distribution of the layer the loss sees; default ``dist``);
class labels ``(M,)`` take only the batch range of ``label_dist``.

Order and position
------------------
* The order of epoch ``e`` is a permutation of ``indices`` drawn from ``SeedSequence(seed, spawn_key=(e,))``:
  it depends only on the seed and the epoch, so it is the same on every rank without communication.
* An epoch has ``len(indices) // batch_size`` steps; the incomplete last batch is dropped so that every
  step has the same global shape (and every rank the same box).
* :meth:`HDF5Reader.state` is the position of the next batch :meth:`HDF5Reader.next` will return (batches
  prefetched but not yet returned do not count), so a run resumed with :meth:`HDF5Reader.load_state` or
  :meth:`HDF5Reader.from_state` reads exactly the batches the interrupted run would have read.

Reading
-------
h5py selections with a list of indices must be increasing; a shuffled batch is not. The reader sorts the
rank's sample ids and issues one ``read_direct`` per maximal run of ids that are consecutive both in the
file and in the batch, each into its final slot of the output buffer (no gather copy afterwards).

Prefetch
--------
With ``prefetch=True`` a background thread reads the following batches into a bounded queue (``depth``,
default 2) while the caller computes. h5py holds the GIL for the whole of one ``H5Dread``, so a
pure-Python thread stalls for most of a read; the reader therefore reads in pieces of ``piece_bytes``
(4 MiB: short stalls), and the read overlaps work that runs without the GIL: GPU kernels, MPI waits,
sleeps, BLAS. NumPy code that takes the GIL between operations is slowed while a read runs beside it
(``python -m lbannpy.bench data`` measures both), so the
prefetch pays where the compute step runs on a GPU or in long GIL-free kernels. The time the caller
blocks on the queue is recorded per step (:attr:`HDF5Reader.wait_times`, :meth:`HDF5Reader.io_stats`).
The thread stops on :meth:`HDF5Reader.close` (stop flag, queue drained, joined); an exception in the thread
is re-raised in the caller at the next :meth:`HDF5Reader.next`.
"""
from __future__ import annotations

import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..dist import Distribution, DistributionError, shape_str

PIECE_BYTES = 4 << 20   # bytes per H5Dread call (the GIL is held for one call)
STATE_KEYS = ("epoch", "step", "seed", "shuffle", "batch_size", "num_samples")


class DataError(ValueError):
    """A data file, dataset, shape or reader setting that cannot work (the message names file and dataset)."""


# --------------------------------------------------------------------------------------------------------
# validation (before anything is allocated from sizes in the file)


@dataclass(frozen=True)
class DatasetInfo:
    """Shapes and types of a validated input/label pair."""

    path: str
    inputs: str
    labels: str
    num_samples: int
    sample_shape: tuple[int, ...]       # (C, *spatial) of one input sample
    input_dtype: np.dtype
    label_shape: tuple[int, ...]        # () for class labels, spatial for per-pixel labels
    label_dtype: np.dtype

    @property
    def channels(self) -> int:
        return self.sample_shape[0]

    @property
    def spatial(self) -> tuple[int, ...]:
        return self.sample_shape[1:]

    @property
    def per_pixel(self) -> bool:
        return len(self.label_shape) > 0


def _open_dataset(fh, path: str, name: str, role: str):
    import h5py

    if name not in fh:
        found = sorted(k for k in fh.keys() if isinstance(fh[k], h5py.Dataset))
        raise DataError(f"{path}: {role} dataset '{name}' not found; datasets in the file: "
                        f"{', '.join(found) if found else '(none)'}; set data.*.{role} to one of them")
    obj = fh[name]
    if not isinstance(obj, h5py.Dataset):
        raise DataError(f"{path}: '{name}' ({role}) is a group, not a dataset")
    return obj


def validate_dataset(path: str, inputs: str = "inputs", labels: str = "labels",
                     expected_channels: int | None = None,
                     expected_spatial: Sequence[int] | None = None) -> DatasetInfo:
    """Check that ``path`` holds a usable input/label pair; read only metadata.

    Inputs must be floating point ``(M, C, *spatial)`` with 0 to 3 spatial dimensions; labels integer,
    either ``(M,)`` (one class per sample) or ``(M, *spatial)`` (one class per pixel, at input resolution).
    ``expected_channels``/``expected_spatial`` (from the model's input spec) are compared when given.
    Raises :class:`DataError` naming the file, the dataset and the expected and found shapes.
    """
    import h5py

    if not os.path.exists(path):
        raise DataError(f"data file {path} does not exist")
    if not os.path.isfile(path):
        raise DataError(f"data file {path} is not a regular file")
    if not h5py.is_hdf5(path):
        raise DataError(f"data file {path} is not an HDF5 file")
    with h5py.File(path, "r") as fh:
        dx = _open_dataset(fh, path, inputs, "inputs")
        dy = _open_dataset(fh, path, labels, "labels")
        xs, ys = tuple(int(s) for s in dx.shape), tuple(int(s) for s in dy.shape)
        xdt, ydt = dx.dtype, dy.dtype
    if not 2 <= len(xs) <= 5:
        raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)} ({len(xs)} dimensions); "
                        f"expected (samples, channels[, spatial...]) with 2 to 5 dimensions")
    if xdt.kind != "f":
        raise DataError(f"{path}: dataset '{inputs}' has dtype {xdt}; expected floating point "
                        f"(float32 or float64)")
    if xs[0] < 1:
        raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)}: no samples")
    if any(s < 1 for s in xs[1:]):
        raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)}: an empty dimension")
    if expected_channels is not None and xs[1] != int(expected_channels):
        raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)} with {xs[1]} channels; the "
                        f"model expects {int(expected_channels)} channels (expected shape "
                        f"(M, {int(expected_channels)}, ...), found {xs})")
    if expected_spatial is not None:
        want = tuple(int(s) for s in expected_spatial)
        if xs[2:] != want:
            raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)}, spatial {xs[2:]}; the "
                            f"model expects spatial {want} (expected shape "
                            f"(M, C, {', '.join(map(str, want))}), found {xs})")
    if ydt.kind not in "iu":
        raise DataError(f"{path}: dataset '{labels}' has dtype {ydt}; expected integer class labels")
    if ys[:1] != xs[:1]:
        raise DataError(f"{path}: dataset '{labels}' has shape {shape_str(ys)} but '{inputs}' has "
                        f"{xs[0]} samples; expected labels of shape ({xs[0]},) or ({xs[0]}, "
                        f"{', '.join(map(str, xs[2:]))})")
    if len(ys) > 1 and ys[1:] != xs[2:]:
        raise DataError(f"{path}: dataset '{labels}' has shape {shape_str(ys)}; per-pixel labels must match "
                        f"the input's spatial shape: expected ({xs[0]}, {', '.join(map(str, xs[2:]))}), "
                        f"found {ys}")
    return DatasetInfo(path, inputs, labels, xs[0], xs[1:], np.dtype(xdt), ys[1:], np.dtype(ydt))


# --------------------------------------------------------------------------------------------------------
# order and splits (pure)


def epoch_order(indices: np.ndarray, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Sample ids of epoch ``epoch`` in reading order; the same on every rank (seed and epoch only)."""
    if not shuffle:
        return indices
    rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(epoch),)))
    return indices[rng.permutation(len(indices))]


def split_indices(num_samples: int, validation_fraction: float,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic train/validation split: ``round(fraction * M)`` samples (at least one when the fraction
    is positive) chosen by a permutation drawn from ``seed``; both parts sorted."""
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(f"validation fraction must be in [0, 1), got {validation_fraction}")
    n_val = int(round(validation_fraction * num_samples))
    if validation_fraction > 0:
        n_val = max(n_val, 1)
    if n_val >= num_samples:
        raise DataError(f"a validation fraction of {validation_fraction} of {num_samples} samples leaves no "
                        f"training samples; lower it")
    # a stream of its own (spawn key 2**32 - 1 is never an epoch number in practice)
    rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(2**32 - 1,)))
    perm = rng.permutation(num_samples)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def read_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Plan reads of ``ids`` (the batch order): ``(file_start, dest_start, count)`` runs in increasing file
    order, each a block of ids consecutive both in the file and in the destination."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return []
    pos = np.argsort(ids, kind="stable")
    sid = ids[pos]
    runs = []
    f0, d0, k = int(sid[0]), int(pos[0]), 1
    for f, d in zip(sid[1:].tolist(), pos[1:].tolist()):
        if f == f0 + k and d == d0 + k:
            k += 1
        else:
            runs.append((f0, d0, k))
            f0, d0, k = f, d, 1
    runs.append((f0, d0, k))
    return runs


# --------------------------------------------------------------------------------------------------------
# the reader


@dataclass
class Batch:
    """This rank's block of one mini-batch."""

    inputs: np.ndarray          # (local samples, local channels, *local spatial), dtype of the file
    labels: np.ndarray          # (local samples,) or (local samples, *local spatial of label_dist)
    epoch: int
    step: int                   # step within the epoch
    sample_ids: np.ndarray      # file indices of the local samples, in batch order
    read_s: float = 0.0         # seconds spent reading this block
    wait_s: float = 0.0         # seconds the caller blocked on it (prefetch) or read it (no prefetch)


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


_STOP = object()   # sentinel: the producer has stopped


@dataclass
class _Prefetcher:
    """Background thread that reads batches from a start position into a bounded queue."""

    reader: "HDF5Reader"
    epoch: int
    step: int
    depth: int
    q: queue.Queue = field(init=False)
    stop: threading.Event = field(init=False)
    thread: threading.Thread = field(init=False)

    def __post_init__(self):
        self.q = queue.Queue(maxsize=self.depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"lbannpy-prefetch-r{self.reader.rank}",
                                       daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        epoch, step = self.epoch, self.step
        try:
            while not self.stop.is_set():
                batch = self.reader.read_batch(epoch, step)
                if not self._put(batch):
                    return
                epoch, step = self.reader._advance(epoch, step)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(_Failure(exc))
            return
        finally:
            # wake a consumer that is waiting; never blocks (the queue may be full and nobody reading)
            try:
                self.q.put_nowait(_STOP)
            except queue.Full:
                pass

    def get(self):
        while True:
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                if not self.thread.is_alive() and self.q.empty():
                    return _Failure(DataError(f"rank {self.reader.rank}: the prefetch thread of "
                                              f"{self.reader.path} ended without a batch"))

    def close(self, timeout: float = 30.0):
        self.stop.set()
        while self.thread.is_alive():
            try:  # drain so a put in progress returns at once
                while True:
                    self.q.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.05)
            timeout -= 0.05
            if timeout <= 0:
                raise DataError(f"rank {self.reader.rank}: the prefetch thread of {self.reader.path} did not "
                                f"stop (an HDF5 read is stuck)")


class HDF5Reader:
    """Reads this rank's hyperslab of each shuffled mini-batch from an HDF5 file.

    Parameters
    ----------
    path, inputs, labels : file and dataset names.
    dist : Distribution of the input tensor ``(B, C, *spatial)``; default: one rank holding everything.
    rank : the rank whose block is read (any rank of ``dist``: tests instantiate one reader per rank).
    batch_size : global mini-batch size ``B``.
    seed, shuffle : the order of every epoch (see :func:`epoch_order`).
    indices : sample ids to read from (e.g. one part of :func:`split_indices`); default all.
    prefetch, depth : background reading of up to ``depth`` batches ahead.
    label_dist : Distribution of the tensor the labels are compared with (per-pixel labels take its batch
        range and spatial box; class labels its batch range); default ``dist``.
    comm : optional communicator over the ``dist.ranks`` ranks; when given, file validation and the
        reader settings are agreed (collective over ``comm``), so a bad file stops every rank with the
        same message.
    expected_channels, expected_spatial : compared with the file (see :func:`validate_dataset`).
    piece_bytes : largest single HDF5 read; smaller pieces hand the GIL back sooner.
    """

    def __init__(self, path: str, inputs: str = "inputs", labels: str = "labels",
                 dist: Distribution | None = None, rank: int = 0, batch_size: int = 1, seed: int = 0,
                 shuffle: bool = True, indices: Sequence[int] | None = None, prefetch: bool = True,
                 label_dist: Distribution | None = None, depth: int = 2, comm=None,
                 expected_channels: int | None = None, expected_spatial: Sequence[int] | None = None,
                 piece_bytes: int = PIECE_BYTES):
        self.path = str(path)
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.prefetch = bool(prefetch)
        self.depth = int(depth)
        self.piece_bytes = int(piece_bytes)
        self._comm = comm
        self._fh = None
        self._pf: _Prefetcher | None = None
        self._epoch = 0
        self._step = 0
        self.wait_times: list[float] = []
        self.read_times: list[float] = []

        self._class_labels = None
        error = None
        try:
            self.info = validate_dataset(self.path, inputs, labels, expected_channels, expected_spatial)
            self._setup(dist, label_dist, indices)
            if comm is not None and (comm.size != self.dist.ranks or comm.rank != self.rank):
                raise DataError(f"the reader was built for rank {self.rank} of {self.dist.ranks} ranks but "
                                f"runs on rank {comm.rank} of a communicator of {comm.size}")
            self._file()
        except (DataError, DistributionError, OSError) as exc:
            error = exc
        self._agree(error)

    # -- set-up ---------------------------------------------------------------------------------------
    def _setup(self, dist, label_dist, indices):
        info = self.info
        ndim = 1 + len(info.sample_shape)
        if self.batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {self.batch_size}")
        if self.depth < 1:
            raise DataError(f"prefetch depth must be at least 1, got {self.depth}")
        self.dist = dist if dist is not None else Distribution.replicated(ndim, 1)
        if self.dist.ndim != ndim:
            raise DataError(f"{self.path}: dataset '{info.inputs}' holds {ndim}-dimensional batches "
                            f"(B, {', '.join(map(str, info.sample_shape))}) but the distribution {self.dist} "
                            f"has {self.dist.ndim} dimensions")
        if not 0 <= self.rank < self.dist.ranks:
            raise DataError(f"rank {self.rank} outside the {self.dist.ranks} ranks of distribution "
                            f"{self.dist}")
        self.global_shape = (self.batch_size,) + info.sample_shape
        self.dist.check_shape(self.global_shape, f"input mini-batch of {self.path}:{info.inputs}")
        self.box = self.dist.box(self.global_shape, self.rank)
        self.local_shape = tuple(hi - lo for lo, hi in self.box)

        self.label_dist = label_dist if label_dist is not None else self.dist
        if not 0 <= self.rank < self.label_dist.ranks:
            raise DataError(f"rank {self.rank} outside the {self.label_dist.ranks} ranks of label "
                            f"distribution {self.label_dist}")
        ld = self.label_dist
        if info.per_pixel:
            if ld.ndim != ndim:
                raise DataError(f"{self.path}: per-pixel labels '{info.labels}' need a label distribution "
                                f"over (n, c, {', '.join(ld.dim_names[2:]) or 'spatial'}) with {ndim} "
                                f"dimensions; got {ld} with {ld.ndim}")
            lshape = (self.batch_size, ld.split[1]) + info.label_shape
            ld.check_shape(lshape, f"labels of {self.path}:{info.labels}")
            lbox = ld.box(lshape, self.rank)
            self.label_box = (lbox[0],) + lbox[2:]
        else:
            lshape = (self.batch_size,) + ld.split[1:]
            ld.check_shape(lshape, f"labels of {self.path}:{info.labels}")
            self.label_box = (ld.box(lshape, self.rank)[0],)
        self.label_local_shape = tuple(hi - lo for lo, hi in self.label_box)

        m = info.num_samples
        if indices is None:
            self.indices = np.arange(m, dtype=np.int64)
        else:
            idx = np.asarray(indices)
            if idx.ndim != 1 or idx.dtype.kind not in "iu":
                raise DataError(f"indices must be a 1-D array of sample ids, got shape {idx.shape} "
                                f"dtype {idx.dtype}")
            idx = idx.astype(np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= m):
                raise DataError(f"{self.path}: indices must lie in [0, {m}) (the file has {m} samples); "
                                f"found [{idx.min()}, {idx.max()}]")
            if np.unique(idx).size != idx.size:
                raise DataError("indices contain duplicates; each sample may appear once per epoch")
            self.indices = idx
        self.steps_per_epoch = len(self.indices) // self.batch_size
        if self.steps_per_epoch < 1:
            raise DataError(f"{self.path}: batch size {self.batch_size} exceeds the {len(self.indices)} "
                            f"samples available; lower trainer.batch_size")

        # refuse blocks that cannot fit before anything is allocated: depth queued + one in use + one read
        block = math.prod(self.local_shape) * info.input_dtype.itemsize
        block += math.prod(self.label_local_shape) * info.label_dtype.itemsize
        need = block * ((self.depth + 2) if self.prefetch else 1)
        avail = _physical_memory()
        if avail and need > avail:
            raise DataError(
                f"rank {self.rank}: a block of the mini-batch from {self.path} is {block / 2**30:.2f} GiB "
                f"(local shape {shape_str(self.local_shape)}, {info.input_dtype}); with prefetch depth "
                f"{self.depth} it needs {need / 2**30:.2f} GiB but the node has {avail / 2**30:.2f} GiB; "
                f"split the samples over more ranks, lower the batch size or the prefetch depth")

    def _agree(self, error):
        """Raise the same error on every rank when any rank failed (collective over ``comm`` when given)."""
        comm = self._comm
        if comm is None:
            if error is not None:
                raise error
            return
        msg = "" if error is None else f"{type(error).__name__}: {error}"
        every = comm.allgather_obj(msg)
        failed = [(r, m) for r, m in enumerate(every) if m]
        if failed:
            lines = "; ".join(f"[rank {r}] {m}" for r, m in failed)
            if error is not None:
                raise DataError(lines) from error
            raise DataError(lines)
        mine = (self.seed, self.batch_size, self.shuffle, len(self.indices), int(self.indices.sum()),
                str(self.dist), self.dist.split, self.steps_per_epoch)
        every = comm.allgather_obj(mine)
        if any(e != every[0] for e in every):
            bad = [r for r, e in enumerate(every) if e != every[0]]
            raise DataError(f"reader settings differ between ranks (rank 0: {every[0]}; ranks {bad} differ: "
                            f"{[every[r] for r in bad]}); every rank must use the same seed, batch size, "
                            f"indices and distribution")

    # -- file ------------------------------------------------------------------------------------------
    def _file(self):
        if self._fh is None:
            import h5py

            self._fh = h5py.File(self.path, "r")
            self._dx = self._fh[self.info.inputs]
            self._dy = self._fh[self.info.labels]
            if not self.info.per_pixel:
                # class labels are small (M integers, the count checked against the inputs): read them once
                labels = np.empty(self.info.num_samples, dtype=self.info.label_dtype)
                self._dy.read_direct(labels)
                self._class_labels = labels
        return self._fh

    # -- pure schedule ---------------------------------------------------------------------------------
    def _advance(self, epoch: int, step: int) -> tuple[int, int]:
        step += 1
        if step == self.steps_per_epoch:
            return epoch + 1, 0
        return epoch, step

    def batch_ids(self, epoch: int, step: int) -> np.ndarray:
        """Sample ids of the whole global mini-batch ``(epoch, step)``, in batch order (any rank)."""
        if not 0 <= step < self.steps_per_epoch:
            raise DataError(f"step {step} outside the {self.steps_per_epoch} steps of an epoch")
        order = self._order(epoch)
        return order[step * self.batch_size:(step + 1) * self.batch_size]

    def _order(self, epoch: int) -> np.ndarray:
        cache = getattr(self, "_order_cache", None)
        if cache is None or cache[0] != epoch:
            cache = (epoch, epoch_order(self.indices, self.seed, epoch, self.shuffle))
            self._order_cache = cache   # one tuple assignment: safe between the two threads
        return cache[1]

    # -- reading ---------------------------------------------------------------------------------------
    def read_batch(self, epoch: int, step: int) -> Batch:
        """Read this rank's block of batch ``(epoch, step)`` now (no prefetch, position unchanged)."""
        t0 = time.perf_counter()
        self._file()
        ids = self.batch_ids(epoch, step)
        (b0, b1) = self.box[0]
        mine = ids[b0:b1]
        x = np.empty(self.local_shape, dtype=self.info.input_dtype)
        for f0, d0, k in read_runs(mine):
            self._read_run(self._dx, x, f0, d0, k, self.box[1:])
        (l0, l1) = self.label_box[0]
        lids = ids[l0:l1]
        if self.info.per_pixel:
            y = np.empty(self.label_local_shape, dtype=self.info.label_dtype)
            for f0, d0, k in read_runs(lids):
                self._read_run(self._dy, y, f0, d0, k, self.label_box[1:])
        else:
            y = self._class_labels[lids]
        dt = time.perf_counter() - t0
        return Batch(x, y, epoch, step, mine.copy(), read_s=dt)

    def _read_run(self, ds, out: np.ndarray, f0: int, d0: int, k: int, box) -> None:
        """Read file samples ``[f0, f0+k)`` restricted to ``box`` into ``out[d0:d0+k]``.

        h5py holds the GIL for the whole of one ``H5Dread``, so a large hyperslab is read in pieces of
        about ``piece_bytes`` (whole samples, else groups of the first non-sample dimension): between pieces
        the thread that computes gets the interpreter back within milliseconds.
        """
        rest = tuple(slice(lo, hi) for lo, hi in box)
        sample_bytes = out[0].nbytes if out.ndim > 1 else out.itemsize
        if k * sample_bytes <= self.piece_bytes or out.ndim == 1:
            ds.read_direct(out, source_sel=(slice(f0, f0 + k),) + rest, dest_sel=np.s_[d0:d0 + k])
            return
        if sample_bytes <= self.piece_bytes:
            per = max(1, self.piece_bytes // sample_bytes)
            for a in range(0, k, per):
                b = min(k, a + per)
                ds.read_direct(out, source_sel=(slice(f0 + a, f0 + b),) + rest, dest_sel=np.s_[d0 + a:d0 + b])
            return
        extent = out.shape[1]
        rows = max(1, self.piece_bytes // (sample_bytes // extent))
        lo = box[0][0]
        for s in range(k):
            for a in range(0, extent, rows):
                b = min(extent, a + rows)
                ds.read_direct(out, source_sel=(slice(f0 + s, f0 + s + 1), slice(lo + a, lo + b)) + rest[1:],
                               dest_sel=np.s_[d0 + s:d0 + s + 1, a:b])

    def next(self) -> Batch:
        """This rank's block of the next mini-batch; records the time blocked (``wait_s``)."""
        epoch, step = self._epoch, self._step
        t0 = time.perf_counter()
        if not self.prefetch:
            batch = self.read_batch(epoch, step)
        else:
            if self._pf is None:
                self._pf = _Prefetcher(self, epoch, step, self.depth)
            item = self._pf.get()
            if isinstance(item, _Failure):
                self._stop_prefetch()
                raise item.exc
            if item is _STOP:
                self._stop_prefetch()
                raise DataError(f"rank {self.rank}: the prefetch thread of {self.path} stopped")
            batch = item
            if (batch.epoch, batch.step) != (epoch, step):
                self._stop_prefetch()
                raise DataError(f"rank {self.rank}: prefetched batch ({batch.epoch}, {batch.step}) does not "
                                f"match the position ({epoch}, {step})")
        batch.wait_s = time.perf_counter() - t0
        self.wait_times.append(batch.wait_s)
        self.read_times.append(batch.read_s)
        self._epoch, self._step = self._advance(epoch, step)
        return batch

    __next__ = next

    def __iter__(self):
        return self

    def epoch_batches(self):
        """The remaining batches of the current epoch."""
        epoch = self._epoch
        while self._epoch == epoch:
            yield self.next()

    # -- position --------------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        return self._step

    def state(self) -> dict[str, Any]:
        """Position of the next batch :meth:`next` returns, plus what must match on resume."""
        return {"epoch": self._epoch, "step": self._step, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "num_samples": int(len(self.indices))}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state`); refuses a state of a different order or batch."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"reader state lacks {missing}; expected keys {list(STATE_KEYS)}")
        mine = self.state()
        for k in ("seed", "shuffle", "batch_size", "num_samples"):
            if _as_scalar(state[k]) != mine[k]:
                raise DataError(f"reader state has {k}={state[k]!r} but this reader has {k}={mine[k]!r}: "
                                f"resuming would read different batches; keep the data and trainer settings "
                                f"of the interrupted run")
        epoch, step = int(_as_scalar(state["epoch"])), int(_as_scalar(state["step"]))
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise DataError(f"reader state position (epoch {epoch}, step {step}) is outside an epoch of "
                            f"{self.steps_per_epoch} steps")
        self._stop_prefetch()
        self._epoch, self._step = epoch, step

    @classmethod
    def from_state(cls, state: dict[str, Any], path: str, **kwargs) -> "HDF5Reader":
        """A reader positioned at ``state``; its seed, shuffle and batch size come from the state."""
        kwargs = dict(kwargs)
        for k in ("seed", "shuffle", "batch_size"):
            if k in kwargs and kwargs[k] != _as_scalar(state.get(k)):
                raise DataError(f"from_state: {k}={kwargs[k]!r} contradicts the state's {state.get(k)!r}")
            if k in state:
                kwargs[k] = _as_scalar(state[k])
        reader = cls(path, **kwargs)
        reader.load_state(state)
        return reader

    # -- statistics and teardown -----------------------------------------------------------------------
    def io_stats(self) -> dict[str, float]:
        """Per-step I/O figures for the trainer's summary (seconds)."""
        w = np.asarray(self.wait_times, dtype=np.float64)
        r = np.asarray(self.read_times, dtype=np.float64)
        n = int(w.size)
        return {"steps": n, "prefetch": self.prefetch,
                "wait_s_total": float(w.sum()), "wait_s_mean": float(w.mean()) if n else 0.0,
                "wait_s_max": float(w.max()) if n else 0.0,
                "read_s_mean": float(r.mean()) if n else 0.0,
                "bytes_per_step": int(math.prod(self.local_shape) * self.info.input_dtype.itemsize
                                      + math.prod(self.label_local_shape) * self.info.label_dtype.itemsize)}

    def _stop_prefetch(self):
        pf, self._pf = self._pf, None
        if pf is not None:
            pf.close()

    def close(self) -> None:
        """Stop the prefetch thread (joined) and close the file. Idempotent."""
        try:
            self._stop_prefetch()
        finally:
            fh, self._fh = self._fh, None
            if fh is not None:
                fh.close()

    def __enter__(self) -> "HDF5Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<HDF5Reader {self.path}:{self.info.inputs} rank {self.rank} of {self.dist} "
                f"batch {self.batch_size} local {shape_str(self.local_shape)} epoch {self._epoch} "
                f"step {self._step}>")


def _as_scalar(v):
    """Values from an HDF5 checkpoint come back as NumPy scalars; compare them as Python values."""
    if isinstance(v, np.generic):
        return v.item()
    return v


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class DeviceUploader:
    """Batches of a reader uploaded to the GPU one batch ahead, asynchronously.

    :meth:`next` returns the batch uploaded during the previous call (inputs converted to ``dtype``, labels
    as read, both device arrays) and starts the upload of the following one: the host batch is copied
    into a page-locked staging buffer, then ``ndarray.set(..., stream=copy stream)`` copies it to the device
    without blocking the host, after the compute stream is done with the memory it lands in (the copy
    stream waits on an event of the compute stream). The compute stream waits on the copy's event when the
    batch is handed out, so the first kernel that reads it is ordered after its copy and nothing
    blocks the host. Two staging buffers alternate; one is refilled once the copy that read it a step
    earlier is done (asked without blocking; a fresh buffer otherwise).

    Labels are range-checked on the host before the upload (``num_classes``): a check on the device would
    stall every step.

    :meth:`state` is the position of the batch :meth:`next` returns next (the batch uploaded ahead counts
    as not yet read), so checkpoints and resumes see the same batches as without the uploader. Attributes
    it does not define (``steps_per_epoch``, ``indices``, ``io_stats``...) are the reader's.
    """

    def __init__(self, reader, xp, dtype, num_classes: int | None = None):
        self.reader, self.xp = reader, xp
        self.dtype = np.dtype(dtype)
        self.num_classes = num_classes
        cuda = xp.cuda
        self.copy_stream = cuda.Stream(non_blocking=True)
        self._staging: list[dict] = [{}, {}]   # per slot: name -> (pinned host array, copy-done event)
        self._slot = 0
        self._ahead = None                     # (Batch with device arrays, copy-done event)
        self._retired: list = []               # (pinned array, event) still read by a copy

    def __getattr__(self, name):
        if name == "reader":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.reader, name)

    def _pinned(self, slot: dict, name: str, shape, dtype):
        """The staging array ``name`` of a slot, reused when its last copy (issued a step ago) is done and
        the shape fits. The host never waits: a buffer still being read is retired (kept alive until its
        copy is done, asked without blocking) and a fresh one is used."""
        self._retired = [(a, e) for a, e in self._retired if not e.done]
        have = slot.get(name)
        if have is not None:
            arr, done = have
            if done is not None and not done.done:
                self._retired.append((arr, done))
            elif arr.shape == tuple(shape) and arr.dtype == dtype:
                return arr
        nbytes = max(int(math.prod(shape)) * dtype.itemsize, 1)
        alloc = getattr(self.xp.cuda, "alloc_pinned_memory", None)
        if alloc is None:  # an array module without page-locked memory (the test suite's CUDA stand-in)
            arr = np.empty(tuple(shape), dtype)
            slot[name] = (arr, None)
            return arr
        mem = alloc(nbytes)  # as cupyx.empty_pinned does
        arr = np.ndarray(tuple(shape), dtype=dtype, buffer=mem)
        slot[name] = (arr, None)
        return arr

    def _upload(self, batch: Batch):
        from lbannpy.layers.kernels.loss import check_label_range

        xp = self.xp
        if self.num_classes is not None and np.issubdtype(batch.labels.dtype, np.integer):
            check_label_range(batch.labels, self.num_classes)
        slot = self._staging[self._slot]
        self._slot ^= 1
        # device memory comes from the compute stream's pool: the copy must not land before the compute
        # stream's earlier work on that memory is done
        compute = xp.cuda.get_current_stream()
        x = xp.empty(batch.inputs.shape, dtype=self.dtype)
        y = xp.empty(batch.labels.shape, dtype=batch.labels.dtype)
        freed = xp.cuda.Event(disable_timing=True)
        freed.record(compute)
        self.copy_stream.wait_event(freed)
        for name, host, dev in (("inputs", batch.inputs, x), ("labels", batch.labels, y)):
            pinned = self._pinned(slot, name, host.shape, dev.dtype)
            np.copyto(pinned, host, casting="same_kind" if name == "inputs" else "no")
            dev.set(pinned, stream=self.copy_stream)
        done = xp.cuda.Event(disable_timing=True)
        done.record(self.copy_stream)
        for name in ("inputs", "labels"):
            slot[name] = (slot[name][0], done)
        up = Batch(x, y, batch.epoch, batch.step, batch.sample_ids, batch.read_s, batch.wait_s)
        return up, done

    def next(self) -> Batch:
        """The next batch on the device (ordered before every later kernel of the compute stream)."""
        if self._ahead is None:
            self._ahead = self._upload(self.reader.next())
        batch, done = self._ahead
        self._ahead = None
        self.xp.cuda.get_current_stream().wait_event(done)
        # the reader's epochs repeat, so there always is a following batch (the one uploaded after the last
        # step of a run is never used)
        self._ahead = self._upload(self.reader.next())
        return batch

    __next__ = next

    def state(self) -> dict[str, Any]:
        """The reader's state at the batch :meth:`next` returns next (the batch uploaded ahead counts as
        unread)."""
        st = self.reader.state()
        if self._ahead is not None:
            st["epoch"], st["step"] = self._ahead[0].epoch, self._ahead[0].step
        return st

    def load_state(self, state: dict[str, Any]) -> None:
        self._ahead = None
        self.reader.load_state(state)

    def close(self) -> None:
        self._ahead = None
        self.reader.close()
