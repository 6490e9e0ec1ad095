"""Data set files before any reading: validation (before anything is allocated from sizes in the file), the
sample order of an epoch, the train/validation split and the contiguous read runs of a batch."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..dist import shape_str


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

    problem = external_link_problem(fh, path, name, role)
    if problem:
        raise DataError(problem)
    if name not in fh:
        found = sorted(k for k in fh.keys() if isinstance(fh.get(k), h5py.Dataset))
        raise DataError(f"{path}: {role} dataset '{name}' not found; datasets in the file: "
                        f"{', '.join(found) if found else '(none)'}; set data.*.{role} to one of them")
    obj = fh[name]
    if not isinstance(obj, h5py.Dataset):
        raise DataError(f"{path}: '{name}' ({role}) is a group, not a dataset")
    return obj


def check_storage(ds, path: str, role: str) -> None:
    """A contiguous dataset must lie inside its file: ``offset + Π shape · itemsize`` bytes at most the file's
    size, else the file is truncated or its header lies about the shape (DataError, one line). Chunked or
    compressed datasets may declare more than the file holds (unwritten chunks read as the fill value,
    compression): their sizes are bounded by the memory estimate instead. Reads metadata only."""
    if ds.chunks is not None or ds.compression is not None or ds.shape is None:
        return
    declared = ds.dtype.itemsize
    for s in ds.shape:
        declared *= int(s)
    offset = ds.id.get_offset()
    if offset is None or declared == 0:  # never written: reads return the fill value
        return
    size = os.path.getsize(path)
    if offset + declared > size:
        raise DataError(f"{path}: {role} dataset '{ds.name.lstrip('/')}' declares shape "
                        f"{shape_str(ds.shape)} ({declared} bytes, contiguous at offset {offset}) but "
                        f"the file holds {size} bytes: it is truncated or corrupt; regenerate it")


def _check_virtual_sources(path: str, dset, role: str) -> None:
    """A virtual dataset reads its sources' values; where a source file or dataset is missing HDF5 returns
    the fill value (zeros, or NaN) without an error, so every source is checked before training."""
    if not dset.is_virtual:
        return
    import h5py

    here = os.path.dirname(os.path.abspath(path))
    for src in dset.virtual_sources():
        fname = path if src.file_name == "." else src.file_name
        full = fname if os.path.isabs(fname) else os.path.join(here, fname)
        problem = None
        if not os.path.isfile(full):
            problem = f"its source file {fname} does not exist"
        else:
            try:
                with h5py.File(full, "r") as fh:
                    if src.dset_name not in fh:
                        problem = f"its source file {fname} has no dataset '{src.dset_name}'"
                    else:
                        short = short_virtual_source(src, fh[src.dset_name])
                        problem = short and f"it {short} (in {fname})"
            except OSError as exc:
                problem = f"its source file {fname} cannot be read ({exc})"
        if problem:
            raise DataError(f"{path}: dataset '{dset.name.lstrip('/')}' ({role}) is virtual and {problem}; "
                            f"HDF5 would read fill values in its place")


def validate_dataset(path: str, inputs: str = "inputs", labels: str = "labels",
                     expected_channels: int | None = None,
                     expected_spatial: Sequence[int] | None = None, label_shape: Sequence[int] | None = None,
                     float_labels: bool = False) -> DatasetInfo:
    """Check that ``path`` holds a usable input/label pair; read only metadata.

    Inputs must be floating point ``(M, C, *spatial)`` with 0 to 3 spatial dimensions; labels integer,
    either ``(M,)`` (one class per sample) or ``(M, *spatial)`` (one class per pixel, at input resolution).
    ``expected_channels``/``expected_spatial`` (from the model's input spec) are compared when given.
    A loss that reads other labels says so: ``label_shape``, the per-sample shape they must have (e.g. the
    model output's), and ``float_labels`` for float targets instead of integer classes.
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
        check_storage(dx, path, "inputs")
        check_storage(dy, path, "labels")
        xs, ys = tuple(int(s) for s in dx.shape), tuple(int(s) for s in dy.shape)
        xdt, ydt = dx.dtype, dy.dtype
        for d, role in ((dx, "inputs"), (dy, "labels")):
            _check_virtual_sources(path, d, role)
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
        def chan(n: int) -> str:
            return f"{n} channel{'' if n == 1 else 's'}"

        raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)} with {chan(xs[1])}; the "
                        f"model expects {chan(int(expected_channels))} (expected shape "
                        f"(M, {int(expected_channels)}, ...), found {xs})")
    if expected_spatial is not None:
        want = tuple(int(s) for s in expected_spatial)
        if xs[2:] != want:
            raise DataError(f"{path}: dataset '{inputs}' has shape {shape_str(xs)}, spatial {xs[2:]}; the "
                            f"model expects spatial {want} (expected shape "
                            f"(M, C, {', '.join(map(str, want))}), found {xs})")
    if ydt.kind not in ("f" if float_labels else "iu"):
        want = "floating point targets" if float_labels else "integer class labels"
        raise DataError(f"{path}: dataset '{labels}' has dtype {ydt}; expected {want}")
    if ys[:1] != xs[:1]:
        raise DataError(f"{path}: dataset '{labels}' has shape {shape_str(ys)} but '{inputs}' has "
                        f"{xs[0]} samples; expected labels of shape ({xs[0]},) or ({xs[0]}, "
                        f"{', '.join(map(str, xs[2:]))})")
    if label_shape is not None and ys[1:] != tuple(int(s) for s in label_shape):
        raise DataError(f"{path}: dataset '{labels}' has shape {shape_str(ys)}; the loss needs labels of "
                        f"shape ({xs[0]}, {', '.join(map(str, label_shape))})")
    if label_shape is None and len(ys) > 1 and ys[1:] != xs[2:]:
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


# ``data.preload``: keep a rank's part of a data set in memory, read once at set-up
PRELOAD_CHOICES = ("auto", "always", "never")
PRELOAD_AUTO_BYTES = 512 << 20   # auto preloads a rank's part up to this size


def preloads(mode: str, store_bytes: int) -> bool:
    """Whether a reader whose in-memory copy would take ``store_bytes`` preloads under ``mode``."""
    if mode not in PRELOAD_CHOICES:
        raise DataError(f"data.preload: {mode!r} is not one of {', '.join(PRELOAD_CHOICES)}")
    return mode == "always" or (mode == "auto" and store_bytes <= PRELOAD_AUTO_BYTES)


def store_bytes(num_samples: int, input_sample: Sequence[int], input_itemsize: int,
                label_sample: Sequence[int], label_itemsize: int) -> int:
    """Bytes of a preloaded store of ``num_samples`` samples: this rank's box of every sample's inputs
    (``input_sample``: the box without its sample dimension) and per-pixel labels (``label_sample``; empty
    for class labels, which every reader holds whole anyway)."""
    per = math.prod(input_sample) * input_itemsize
    if len(label_sample):
        per += math.prod(label_sample) * label_itemsize
    return int(num_samples) * per


def external_link_problem(fh, path: str, name: str, role: str) -> str | None:
    """Where ``name`` in the open file ``fh`` is an external link whose file or dataset is missing, one line
    naming both (HDF5 itself reports only that the object cannot be opened)."""
    import h5py

    try:
        link = fh.get(name, getlink=True)
    except (KeyError, OSError, RuntimeError):
        return None
    if not isinstance(link, h5py.ExternalLink):
        return None
    target = link.filename
    full = target if os.path.isabs(target) else os.path.join(os.path.dirname(os.path.abspath(path)), target)
    if not os.path.isfile(full):
        return (f"{path}: {role} dataset '{name}' is an external link to {target}:{link.path}, and the file "
                f"{full} does not exist; put it back or point data.*.{role} at a dataset that exists")
    try:
        with h5py.File(full, "r") as ext:
            if link.path not in ext:
                return (f"{path}: {role} dataset '{name}' is an external link to {target}:{link.path}, and "
                        f"{full} has no dataset '{link.path}'")
    except OSError as exc:
        return f"{path}: {role} dataset '{name}' is an external link to {full}, which cannot be read ({exc})"
    return None


def short_virtual_source(src, source_dset) -> str | None:
    """Where a virtual dataset maps a block of ``source_dset`` that reaches past its end (a source file
    shorter than the mapping), the block and the source's shape (HDF5 fails the read late, or fills)."""
    import h5py

    shape = tuple(int(s) for s in source_dset.shape)
    if src.src_space.get_select_type() == h5py.h5s.SEL_ALL:  # the whole source, as many values as mapped
        need = int(src.vspace.get_select_npoints())
        if int(np.prod(shape)) >= need:
            return None
        return (f"maps {need} values of {src.dset_name} but that source holds {int(np.prod(shape))} (shape "
                f"{shape}): the source is short")
    try:
        lo, hi = src.src_space.get_select_bounds()
    except (ValueError, RuntimeError):
        return None
    if len(hi) != len(shape) or all(int(h) < s for h, s in zip(hi, shape)):
        return None
    return (f"maps {src.dset_name}[{', '.join(f'{a}:{int(b) + 1}' for a, b in zip(lo, hi))}] of a source of "
            f"shape {shape}: the source is short")
