"""Data integrity while training: the identity of an open data file and the range of a batch's labels.

* :class:`FileIdentity` is ``(st_size, st_mtime_ns, st_ino, st_dev)`` of the file when the reader opened
  it. The reader compares it with a fresh ``os.stat`` once per epoch and whenever a read fails: HDF5 reads
  past the end of a truncated file return zeros without an error, so the per-epoch comparison is what finds
  a file truncated or rewritten under a running job.
* :func:`check_labels` compares the labels of a block (as read, at input resolution: before any
  down-sampling of per-pixel labels) with ``[0, num_classes)``: a ``min``/``max`` on every block, the
  search for the first bad label only when one is out of range.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import numpy as np

from .dataset import DataError


@dataclass(frozen=True)
class FileIdentity:
    size: int
    mtime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str) -> "FileIdentity":
        st = os.stat(path)
        return cls(int(st.st_size), int(st.st_mtime_ns), int(st.st_ino), int(st.st_dev))


def _when(mtime_ns: int) -> str:
    return datetime.datetime.fromtimestamp(mtime_ns / 1e9).isoformat(sep=" ", timespec="seconds")


def describe_change(path: str, old: FileIdentity, new: FileIdentity) -> str | None:
    """One line naming what changed between ``old`` and ``new``; None when nothing did."""
    parts = []
    if (old.ino, old.dev) != (new.ino, new.dev):
        parts.append(f"replaced by another file: inode {old.ino} → {new.ino}")
    if old.size != new.size:
        parts.append(f"size {old.size} → {new.size} bytes")
    else:
        parts.append(f"size {new.size} bytes")
    if old.mtime_ns != new.mtime_ns:
        parts.append(f"modified {_when(new.mtime_ns)}")
    if len(parts) == 1 and parts[0].startswith("size ") and "→" not in parts[0]:
        return None
    return (f"{path} changed while training ({', '.join(parts)}); keep the data file unchanged during a run "
            f"(write a new file and start a new run on it)")


def check_identity(path: str, opened: FileIdentity | None) -> None:
    """Raise :class:`DataError` when ``path`` is no longer the file opened as ``opened`` (one ``os.stat``)."""
    if opened is None:
        return
    try:
        now = FileIdentity.of(path)
    except OSError as exc:
        raise DataError(f"{path} changed while training (it can no longer be found: "
                        f"{exc.strerror or exc}); keep the data file in place during a run") from None
    msg = describe_change(path, opened, now)
    if msg is not None:
        raise DataError(msg)


def label_problem(labels: np.ndarray, lo: int, hi: int):
    """``None`` when every label of ``labels`` lies in ``[lo, hi]``, else ``(index, value, count)``: the
    first bad label in C order (as an index tuple of ``labels``), its value and the number of bad labels."""
    if labels.size == 0:
        return None
    # here, not at import: loading a config (which reads this module) loads no layer kernels
    from lbannpy.layers.kernels.loss import in_class_range

    if lo == 0 and in_class_range(labels, hi + 1):
        return None
    if lo != 0 and int(labels.min()) >= lo and int(labels.max()) <= hi:
        return None
    bad = (labels < lo) | (labels > hi)
    flat = int(np.argmax(bad.reshape(-1)))
    index = np.unravel_index(flat, labels.shape)
    return tuple(int(i) for i in index), int(labels[index]), int(np.count_nonzero(bad))


def label_message(where: str, sample: int, value: int, num_classes: int, pixel=None) -> str:
    at = f" at pixel ({', '.join(str(p) for p in pixel)})" if pixel else ""
    return (f"{where}: sample {sample} has label {value}{at}; the model has {num_classes} classes "
            f"(labels 0..{num_classes - 1})")


def check_labels(labels: np.ndarray, sample_ids: np.ndarray, num_classes: int | None, where: str,
                 offset=()) -> None:
    """Raise :class:`DataError` naming the file's sample index, the pixel (per-pixel labels: ``offset`` is
    the start of the block in the sample) and the value of the first label outside ``[0, num_classes)``.
    ``labels`` is ``(samples,)`` or ``(samples, *block)``; ``sample_ids`` the file index of each sample."""
    if num_classes is None:
        return
    found = label_problem(labels, 0, int(num_classes) - 1)
    if found is None:
        return
    index, value, _ = found
    pixel = tuple(int(o) + i for o, i in zip(offset, index[1:])) if labels.ndim > 1 else None
    raise DataError(label_message(where, int(sample_ids[index[0]]), value, int(num_classes), pixel))


# -- completeness: storage that was never written -----------------------------------------------------------
def first_unwritten(dset) -> tuple[int, int, int] | None:
    """``(first sample, chunks written, chunks declared)`` of an HDF5 dataset whose storage was never
    (wholly) written, or None. HDF5 reads unwritten storage as the fill value (zeros) without an error, so a
    file whose writer died reads as a full data set. Metadata only: the chunk count (O(1)); the chunk table
    is walked only when chunks are missing. Contiguous storage is allocated whole at the first write, so
    only a never-written contiguous dataset is found here."""
    import math

    import h5py

    if dset.size == 0 or dset.is_virtual or dset.external:
        return None
    if dset.chunks is None:
        if dset.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS and dset.id.get_storage_size() == 0:
            return 0, 0, 1
        return None
    chunks = tuple(int(c) for c in dset.chunks)
    grid = [math.ceil(int(s) / c) for s, c in zip(dset.shape, chunks)]
    total = math.prod(grid)
    have = int(dset.id.get_num_chunks())
    if have >= total:
        return None
    per_row = total // grid[0]  # chunks in one row of chunks along the sample axis
    rows = np.zeros(grid[0], dtype=np.int64)

    def count(info):
        rows[int(info.chunk_offset[0]) // chunks[0]] += 1

    if hasattr(dset.id, "chunk_iter"):
        dset.id.chunk_iter(count)
    else:
        for i in range(have):
            count(dset.id.get_chunk_info(i))
    first = int(np.argmax(rows < per_row))
    return first * chunks[0], have, total


def check_complete(path: str, names) -> None:
    """Raise :class:`DataError` naming the dataset and its first sample never written, for each of the
    datasets ``names`` in ``path`` (inputs, labels): training on them would train on fill-value zeros."""
    import h5py

    with h5py.File(path, "r") as fh:
        for name in names:
            if name not in fh:
                continue
            found = first_unwritten(fh[name])
            if found is not None:
                first, have, total = found
                raise DataError(f"{path}: dataset '{name}' declares {fh[name].shape[0]} samples but its "
                                f"storage was never written from sample {first} on ({have} of {total} chunks "
                                f"written: a writer that stopped early?); write the file again, or use only "
                                f"its first {first} samples")
