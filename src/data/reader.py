"""Distributed HDF5 reader: each rank reads only its own hyperslab of each mini-batch, straight from the file.

A mini-batch of ``B`` samples is a tensor of global shape ``(B, C, *spatial)`` laid out by a
:class:`~lbannpy.dist.Distribution`. Rank ``r`` owns the box ``dist.box((B, C, *spatial), r)``: a range of
positions in the batch, a range of channels and a spatial block. The reader maps batch positions to the
file's sample ids through a shuffled order and reads ``inputs[id, c0:c1, h0:h1, w0:w1]`` for each (no
rank-0 read and scatter). Per-pixel labels ``(M, *spatial)`` are read with the spatial box of
``label_dist`` (the distribution of the layer the loss sees; default ``dist``); class labels ``(M,)`` take
only its batch range; float targets ``(M, K, *spatial)`` (regression losses) its whole box, like inputs.

Order and position
------------------
* The order of epoch ``e`` is a permutation of ``indices`` drawn from ``SeedSequence(seed, spawn_key=(e,))``:
  it depends only on the seed and the epoch, so it is the same on every rank without communication.
* An epoch has ``len(indices) // batch_size`` steps; the incomplete last batch is dropped (one shape a step).
* :meth:`HDF5Reader.state` is the position of the next batch :meth:`HDF5Reader.next` returns (prefetched
  batches do not count), so a resumed run reads exactly the batches the interrupted run would have read.

Reading
-------
The rank's sample ids are sorted (h5py's index lists must increase) and read with one ``read_direct`` per
run of ids consecutive in the file and in the batch, each into its final slot (no gather copy afterwards).

Preload
-------
With ``preload`` (``data.preload``: ``always``; ``auto`` where this rank's part of the set is at most
:data:`~lbannpy.data.dataset.PRELOAD_AUTO_BYTES`) the reader reads its box of every sample of ``indices``
once, at set-up, in as few large reads as the file allows, and serves every batch from memory: no HDF5 read
while training. The file is still checked once per epoch (a resume reads it again). LBANN calls this the
preloaded data store.

Prefetch
--------
With ``prefetch=True`` a background thread reads the following batches into a bounded queue (``depth``,
default 2) while the caller computes. h5py holds the GIL for the whole of one ``H5Dread``, so the reader
reads in pieces of ``piece_bytes`` (4 MiB: short stalls), and the read overlaps work that runs without the
GIL (GPU kernels, MPI waits, BLAS; ``python -m lbannpy.bench data`` measures it). The time the caller blocks
on the queue is recorded per step (:attr:`HDF5Reader.wait_times`, :meth:`HDF5Reader.io_stats`). The thread
stops on :meth:`HDF5Reader.close` (stop flag, queue drained, joined); an exception in the thread is re-raised
in the caller at the next :meth:`HDF5Reader.next`.

Stage
-----
:meth:`HDF5Reader.set_stage` installs a function applied to every batch after its read (the conversion to the
compute dtype; on a GPU the copy into a pinned staging buffer, :mod:`lbannpy.data.upload`). It runs in the
prefetch thread, which a preloaded reader then runs too; its errors reach the caller as a read's do.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..dist import Distribution, DistributionError, max_local_shape, shape_str
from ..hostmem import host_memory_bytes
from .dataset import DataError, epoch_order, preloads, read_runs, store_bytes, validate_dataset
from .integrity import FileIdentity, check_complete, check_identity, check_labels
from .prefetch import STOP, Failure, Prefetcher

PIECE_BYTES = 4 << 20   # bytes per H5Dread call (the GIL is held for one call)
STATE_KEYS = ("epoch", "step", "seed", "shuffle", "batch_size", "num_samples")


@dataclass
class Batch:
    """This rank's block of one mini-batch."""

    inputs: np.ndarray          # (local samples, local channels, *local spatial), dtype of the file
    labels: np.ndarray          # (local samples,) or (local samples, *local spatial of label_dist), in
                                # prediction cells when the reader reduces them (``label_factors``)
    epoch: int
    step: int                   # step within the epoch
    sample_ids: np.ndarray      # file indices of the local samples, in batch order
    read_s: float = 0.0         # seconds spent reading this block
    wait_s: float = 0.0         # seconds the caller blocked on it (prefetch) or read it (no prefetch)


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
    num_classes : when given, every block's labels are checked against ``[0, num_classes)`` as read (before
        any down-sampling); a bad label raises :class:`DataError` naming the sample, pixel and value.
    name : how messages name the data set (e.g. ``data.train``); default the path.
    label_factors : per spatial dimension, the input pixels under one prediction cell (the loss's
        ``factors``): per-pixel labels are then reduced to the prediction's cells as they are read (each cell
        keeps the largest label under it, as :func:`lbannpy.layers.kernels.loss.downsample_labels_any`),
        after the ``num_classes`` check on the file's pixels; the preloaded store and every batch hold the
        reduced labels (``prod(label_factors)`` times smaller). Each rank's label box must start on a
        cell boundary. Default: labels at the file's resolution.
    preload : ``auto``, ``always`` or ``never``: keep this rank's part of the set in memory (see Preload).
    label_shape, targets : the labels' per-sample shape where the loss reads others than the default, and
        whether they are float targets of the tensor ``label_dist`` lays out (its whole box; no class check).

    The file's identity (size, modification time, inode, device) is recorded when it is opened and compared
    with a fresh ``os.stat`` at the first read of every epoch and after a failed read: a file truncated or
    rewritten during the run raises :class:`DataError` (HDF5 reads past a truncated end return zeros).
    """

    def __init__(self, path: str, inputs: str = "inputs", labels: str = "labels",
                 dist: Distribution | None = None, rank: int = 0, batch_size: int = 1, seed: int = 0,
                 shuffle: bool = True, indices: Sequence[int] | None = None, prefetch: bool = True,
                 label_dist: Distribution | None = None, depth: int = 2, comm=None,
                 expected_channels: int | None = None, expected_spatial: Sequence[int] | None = None,
                 piece_bytes: int = PIECE_BYTES, num_classes: int | None = None, name: str = "",
                 preload: str = "never", label_factors: Sequence[int] = (), metadata_only: bool = False,
                 label_shape: Sequence[int] | None = None, targets: bool = False):
        self.path = str(path)
        self.name = name or self.path
        self.num_classes = None if num_classes is None or targets else int(num_classes)
        self.targets = bool(targets)
        self._identity: FileIdentity | None = None
        self._checked_epoch: int | None = None
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.prefetch = bool(prefetch)
        self._background = bool(prefetch)   # asked for: a preloaded reader still stages in a thread
        self._stage = None
        self.depth = int(depth)
        self.piece_bytes = int(piece_bytes)
        self._comm = comm
        self._fh = None
        self._pf: Prefetcher | None = None
        self._store: tuple[np.ndarray, np.ndarray | None] | None = None  # preloaded inputs, pixel labels
        self.preload_mode = preload
        self._epoch = 0
        self._step = 0
        self.wait_times: list[float] = []
        self.read_times: list[float] = []

        self._class_labels = None
        error = None
        try:
            self.info = validate_dataset(self.path, inputs, labels, expected_channels, expected_spatial,
                                         label_shape, self.targets)
            if not metadata_only:  # a reader that reads no batch (the scale benchmark) needs no samples
                check_complete(self.path, (inputs, labels))  # storage never written reads as zeros
            self._setup(dist, label_dist, indices, label_factors)
            if comm is not None and (comm.size != self.dist.ranks or comm.rank != self.rank):
                raise DataError(f"the reader was built for rank {self.rank} of {self.dist.ranks} ranks but "
                                f"runs on rank {comm.rank} of a communicator of {comm.size}")
            self._file()
            if self.preloaded:
                self._load_store()
        except (DataError, DistributionError, OSError) as exc:
            error = exc
        self._agree(error)

    # -- set-up ---------------------------------------------------------------------------------------
    def _setup(self, dist, label_dist, indices, label_factors=()):
        info = self.info
        ndim = 1 + len(info.sample_shape)
        if self.batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {self.batch_size}")
        if self.depth < 1:
            raise DataError(f"prefetch depth must be at least 1, got {self.depth}")
        self.dist = dist if dist is not None else Distribution.whole(ndim, 1)
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
        lshape = self._setup_labels(label_dist, ndim, label_factors)
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

        self._decide_preload(lshape)
        # refuse blocks that cannot fit before anything is allocated: depth queued + one in use + one read
        block = math.prod(self.local_shape) * info.input_dtype.itemsize
        block += math.prod(self._label_read_shape) * info.label_dtype.itemsize
        need = block * ((self.depth + 2) if self.prefetch else 1)
        need += self.store_bytes if self.preloaded else 0
        avail = host_memory_bytes()
        if avail and need > avail and self.preloaded:
            raise DataError(f"rank {self.rank}: preloading its part of {self.path} takes "
                            f"{self.store_bytes / 2**30:.2f} GiB but the node has {avail / 2**30:.2f} GiB; "
                            f"set data.preload: never (or auto)")
        if avail and need > avail:
            raise DataError(
                f"rank {self.rank}: a block of the mini-batch from {self.path} is {block / 2**30:.2f} GiB "
                f"(local shape {shape_str(self.local_shape)}, {info.input_dtype}); with prefetch depth "
                f"{self.depth} it needs {need / 2**30:.2f} GiB but the node has {avail / 2**30:.2f} GiB; "
                f"split the samples over more ranks, lower the batch size or the prefetch depth")

    def _setup_labels(self, label_dist, ndim: int, label_factors) -> tuple:
        """This rank's label box, as read and as returned (``label_factors``); returns the global label
        shape the distribution splits."""
        info = self.info
        self.label_dist = label_dist if label_dist is not None else self.dist
        if not 0 <= self.rank < self.label_dist.ranks:
            raise DataError(f"rank {self.rank} outside the {self.label_dist.ranks} ranks of label "
                            f"distribution {self.label_dist}")
        ld = self.label_dist
        if self.targets:  # float targets: blocked like the tensor label_dist lays out, channels included
            lshape = (self.batch_size,) + info.label_shape
            ld.check_shape(lshape, f"targets of {self.path}:{info.labels}")
            self.label_box = ld.box(lshape, self.rank)
        elif info.per_pixel:
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
        self._label_read_shape = tuple(hi - lo for lo, hi in self.label_box)
        self.label_factors = self._cells(label_factors)
        self.label_local_shape = self._label_read_shape
        if self.label_factors:
            self.label_local_shape = self._label_read_shape[:1] + tuple(
                -(-n // f) for n, f in zip(self._label_read_shape[1:], self.label_factors))
        return lshape

    def _cells(self, factors) -> tuple[int, ...]:
        """``label_factors`` checked against the labels and this rank's label box (``()``: no reduction)."""
        factors = tuple(int(f) for f in factors)
        if not factors or all(f == 1 for f in factors):
            return ()
        if not self.info.per_pixel:
            raise DataError(f"{self.path}: label_factors {factors} need per-pixel labels; "
                            f"'{self.info.labels}' holds one label per sample")
        nsp = len(self.info.label_shape)
        if len(factors) != nsp or min(factors) < 1:
            raise DataError(f"label_factors {factors} must give one factor of at least 1 for each of the "
                            f"{nsp} spatial dimensions of the labels")
        starts = [lo for lo, _ in self.label_box[1:]]
        if any(s % f for s, f in zip(starts, factors)):
            raise DataError(f"rank {self.rank}: its label block starts at pixel {tuple(starts)}, not on a "
                            f"boundary of the {factors} prediction cells; choose a spatial split that "
                            f"divides the prediction's size")
        return factors

    def _decide_preload(self, label_shape) -> None:
        """Preload or not: decided on the largest rank's part, so every rank decides the same."""
        info, cut = self.info, 2 - self.targets  # per sample: targets keep their channel dimension
        big = max_local_shape(self.global_shape, self.dist)
        big_labels = max_local_shape(label_shape, self.label_dist)[cut:] if info.per_pixel else ()
        if self.label_factors:
            big_labels = tuple(-(-n // f) for n, f in zip(big_labels, self.label_factors))
        self.store_bytes = store_bytes(len(self.indices), big[1:], info.input_dtype.itemsize, big_labels,
                                       info.label_dtype.itemsize)
        self.preloaded = preloads(self.preload_mode, self.store_bytes)
        if self.preloaded:
            self.prefetch = False  # batches come from memory: nothing to read ahead

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
            self._identity = FileIdentity.of(self.path)
            self._dx = self._fh[self.info.inputs]
            self._dy = self._fh[self.info.labels]
            if not self.info.per_pixel:
                # class labels are small (M integers, the count checked against the inputs): read them once
                labels = np.empty(self.info.num_samples, dtype=self.info.label_dtype)
                self._dy.read_direct(labels)
                self._class_labels = labels
        return self._fh

    # -- pure schedule ---------------------------------------------------------------------------------
    def advance(self, epoch: int, step: int) -> tuple[int, int]:
        """The position after batch ``(epoch, step)`` (pure; the prefetch thread walks the schedule by it)."""
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
        if epoch != self._checked_epoch:  # one os.stat per epoch: the file is still the one opened
            check_identity(self.path, self._identity)
            self._checked_epoch = epoch
        ids = self.batch_ids(epoch, step)
        (b0, b1) = self.box[0]
        mine = ids[b0:b1]
        (l0, l1) = self.label_box[0]
        lids = ids[l0:l1]
        try:
            x, y = self._read_block(mine, lids)
        except Exception:
            check_identity(self.path, self._identity)  # a failed read of a changed file: say so
            raise
        if not self.label_factors:  # reduced labels were checked as read, at the file's resolution
            check_labels(y, lids, self.num_classes, self.name, [lo for lo, _ in self.label_box[1:]])
        dt = time.perf_counter() - t0
        return Batch(x, y, epoch, step, mine.copy(), read_s=dt)

    def _load_store(self) -> None:
        """Read this rank's box of every sample of ``indices`` into memory (see Preload)."""
        ids = np.sort(self.indices)
        self._row = np.full(self.info.num_samples, -1, dtype=np.int64)
        self._row[ids] = np.arange(ids.size)
        x = np.empty((ids.size,) + self.local_shape[1:], dtype=self.info.input_dtype)
        for f0, d0, k in read_runs(ids):
            self._read_run(self._dx, x, f0, d0, k, self.box[1:])
        y = None
        if self.info.per_pixel and self.label_factors:
            y = self._read_cells(ids)
        elif self.info.per_pixel:
            y = np.empty((ids.size,) + self.label_local_shape[1:], dtype=self.info.label_dtype)
            for f0, d0, k in read_runs(ids):
                self._read_run(self._dy, y, f0, d0, k, self.label_box[1:])
        self._store = (x, y)

    def _read_cells(self, ids: np.ndarray) -> np.ndarray:
        """This rank's labels of the file samples ``ids`` (in that order) reduced to prediction cells: read
        at the file's resolution a few samples at a time (at most ``piece_bytes`` of them, at least one),
        checked against ``num_classes`` there (messages name the file's pixel), then reduced."""
        # late: the kernels' package loads every kernel family, which the config and the strategy (importers
        # of this package) must not
        from lbannpy.layers.kernels.loss import downsample_labels_any

        raw_sample = self._label_read_shape[1:]
        per = max(1, self.piece_bytes // max(1, math.prod(raw_sample) * self.info.label_dtype.itemsize))
        out = np.empty((ids.size,) + self.label_local_shape[1:], dtype=self.info.label_dtype)
        raw = np.empty((min(per, ids.size),) + raw_sample, dtype=self.info.label_dtype)
        offset = [lo for lo, _ in self.label_box[1:]]
        for f0, d0, k in read_runs(ids):
            for j in range(0, k, per):
                n = min(per, k - j)
                self._read_run(self._dy, raw, f0 + j, 0, n, self.label_box[1:])
                check_labels(raw[:n], ids[d0 + j:d0 + j + n], self.num_classes, self.name, offset)
                out[d0 + j:d0 + j + n] = downsample_labels_any(raw[:n], self.label_factors)
        return out

    def _read_block(self, mine: np.ndarray, lids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._store is not None:  # preloaded: a gather from memory
            x_all, y_all = self._store
            x = x_all[self._row[mine]]
            y = y_all[self._row[lids]] if y_all is not None else self._class_labels[lids]
            return x, y
        x = np.empty(self.local_shape, dtype=self.info.input_dtype)
        for f0, d0, k in read_runs(mine):
            self._read_run(self._dx, x, f0, d0, k, self.box[1:])
        if self.info.per_pixel and self.label_factors:
            y = self._read_cells(lids)
        elif self.info.per_pixel:
            y = np.empty(self.label_local_shape, dtype=self.info.label_dtype)
            for f0, d0, k in read_runs(lids):
                self._read_run(self._dy, y, f0, d0, k, self.label_box[1:])
        else:
            y = self._class_labels[lids]
        return x, y

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

    def set_stage(self, stage) -> None:
        """Apply ``stage(batch, stop)`` to every batch after its read (see Stage); ``None`` removes it.
        Batches already read ahead are dropped and read again."""
        self._stop_prefetch()
        self._stage = stage

    @property
    def threaded(self) -> bool:
        """Whether batches come from the background thread."""
        return self.prefetch or (self._stage is not None and self._background)

    def next(self) -> Batch:
        """This rank's block of the next mini-batch; records the time blocked (``wait_s``)."""
        epoch, step = self._epoch, self._step
        t0 = time.perf_counter()
        if not self.threaded:
            batch = self.read_batch(epoch, step)
            if self._stage is not None:
                batch = self._stage(batch, None)
        else:
            if self._pf is None:
                self._pf = Prefetcher(self, epoch, step, self.depth, self._stage)
            item = self._pf.get()
            if isinstance(item, Failure):
                self._stop_prefetch()
                raise item.exc
            if item is STOP:
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
        self._epoch, self._step = self.advance(epoch, step)
        return batch

    __next__ = next

    def __iter__(self):
        return self

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
        return {"steps": n, "prefetch": self.threaded, "preloaded": self.preloaded,
                "wait_s_total": float(w.sum()), "wait_s_mean": float(w.mean()) if n else 0.0,
                "wait_s_max": float(w.max()) if n else 0.0,
                "read_s_mean": float(r.mean()) if n else 0.0,
                "bytes_per_step": int(math.prod(self.local_shape) * self.info.input_dtype.itemsize
                                      + math.prod(self.label_local_shape) * self.info.label_dtype.itemsize)}

    def _stop_prefetch(self):
        pf, self._pf = self._pf, None
        if pf is not None:
            pf.close()
            reset = getattr(self._stage, "reset", None)
            if reset is not None:  # the batches it staged and nobody took are dropped: their buffers free
                reset()

    def close(self) -> None:
        """Stop the prefetch thread (joined) and close the file. Idempotent."""
        try:
            self._stop_prefetch()
        finally:
            self._store = None
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
    return v.item() if isinstance(v, np.generic) else v

