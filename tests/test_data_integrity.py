"""The reader's integrity checks in one process: the file's identity per epoch and after a failed read, the
label range of each block (class and per-pixel labels, the sample and pixel named in the file's indices)."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from lbannpy.data.dataset import DataError
from lbannpy.data.integrity import FileIdentity, check_labels, describe_change, label_problem
from lbannpy.data.reader import HDF5Reader
from lbannpy.dist import Distribution


def _write(path, n=8, labels=None, seed=0):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["inputs"] = rng.standard_normal((n, 2, 4, 4)).astype(np.float32)
        f["labels"] = rng.integers(0, 2, n) if labels is None else labels
    return str(path)


@pytest.mark.parametrize("prefetch", [False, True])
def test_truncated_file_is_found_at_the_next_epoch(tmp_path, prefetch):
    path = _write(tmp_path / "d.h5")
    with HDF5Reader(path, batch_size=4, seed=0, prefetch=prefetch, depth=1) as r:
        r.next()
        r.next()  # the end of epoch 0
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        with pytest.raises(DataError, match=r"changed while training \(size \d+ → \d+ bytes, modified "):
            for _ in range(4):  # prefetch: at most the batches already queued come first
                r.next()


def test_unchanged_file_and_one_stat_per_epoch(tmp_path, monkeypatch):
    path = _write(tmp_path / "d.h5")
    from lbannpy.data import integrity

    calls = []
    real = integrity.FileIdentity.of.__func__
    monkeypatch.setattr(integrity.FileIdentity, "of", classmethod(lambda cls, p: (calls.append(p),
                                                                                   real(cls, p))[1]))
    with HDF5Reader(path, batch_size=2, seed=0, prefetch=False) as r:
        for _ in range(12):  # three epochs of four steps
            r.next()
    assert len(calls) == 1 + 3  # the open, then once per epoch


def test_describe_change():
    a = FileIdentity(100, 10**18, 5, 1)
    assert describe_change("f.h5", a, a) is None
    msg = describe_change("f.h5", a, FileIdentity(100, 10**18 + 10**9, 6, 1))
    assert msg.startswith("f.h5 changed while training (replaced by another file: inode 5 → 6, "
                          "size 100 bytes, modified ")


def test_class_label_out_of_range(tmp_path):
    labels = np.zeros(8, np.int64)
    labels[6] = 5
    path = _write(tmp_path / "d.h5", labels=labels)
    with HDF5Reader(path, batch_size=8, seed=0, prefetch=False, num_classes=2, name="data.train") as r:
        with pytest.raises(DataError) as exc:
            r.next()
    assert str(exc.value) == "data.train: sample 6 has label 5; the model has 2 classes (labels 0..1)"


def test_pixel_label_names_the_global_pixel(tmp_path):
    y = np.zeros((4, 4, 4), np.int8)
    y[2, 3, 1] = -1
    path = _write(tmp_path / "d.h5", n=4, labels=y)
    dist = Distribution((1, 1, 2, 1), 2)  # two ranks split H: rank 1 holds rows 2..3
    found = []
    for rank in range(2):
        with HDF5Reader(path, dist=dist, rank=rank, batch_size=4, seed=0, prefetch=False,
                        num_classes=2) as r:
            try:
                r.next()
            except DataError as exc:
                found.append((rank, str(exc)))
    assert found == [(1, f"{path}: sample 2 has label -1 at pixel (3, 1); the model has 2 classes "
                         f"(labels 0..1)")]


@pytest.mark.parametrize("preload", ["never", "always"])
def test_pixel_label_checked_before_the_reduction_to_prediction_cells(tmp_path, preload):
    # the reader that reduces labels to 2 x 2 prediction cells checks the file's pixels first: the -1 under
    # a cell whose largest label is 1 (the reduction alone would hide it) is still found and named
    y = np.zeros((4, 4, 4), np.int8)
    y[2, 3, 1], y[2, 2, 0] = -1, 1
    path = _write(tmp_path / "d.h5", n=4, labels=y)
    dist = Distribution((1, 1, 2, 1), 2)
    found = []
    for rank in range(2):
        try:
            with HDF5Reader(path, dist=dist, rank=rank, batch_size=4, seed=0, prefetch=False, num_classes=2,
                            preload=preload, label_factors=(2, 2)) as r:
                assert r.next().labels.shape == (4, 1, 2)
        except DataError as exc:
            found.append((rank, str(exc)))
    assert found == [(1, f"{path}: sample 2 has label -1 at pixel (3, 1); the model has 2 classes "
                         f"(labels 0..1)")]


def test_label_problem():
    assert label_problem(np.array([0, 1, 1]), 0, 1) is None
    assert label_problem(np.array([0, 3, -1, 2]), 0, 1) == ((1,), 3, 3)
    check_labels(np.array([0, 9]), np.array([4, 5]), None, "x")  # no classes: nothing to compare with
