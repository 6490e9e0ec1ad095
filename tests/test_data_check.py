"""``python -m lbannpy.data check``: a clean file, non-finite inputs, labels out of range (per sample and per
pixel), shapes that do not fit a spec's model; the scan in small chunks finds the same as in one."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml

from lbannpy.data.__main__ import main
from lbannpy.data.check import Expect, check_file

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

SPEC = {"model": {"name": "m", "input": {"channels": 3, "spatial": [8, 8]},
                  "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                             {"name": "f1", "type": "fc", "units": 2}],
                  "loss": "cross_entropy"},
        "data": {"train": {"path": "data.h5", "inputs": "x", "labels": "y"}},
        "trainer": {"batch_size": 4, "steps": 1}}


def _data(path, n=40, shape=(3, 8, 8), labels=None, nan=(), names=("inputs", "labels")):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n,) + shape).astype(np.float32)
    for i in nan:
        x[i, 0, 1, 2] = np.nan
    y = rng.integers(0, 2, n) if labels is None else labels
    with h5py.File(path, "w") as f:
        f[names[0]] = x
        f[names[1]] = y
    return path


def _check(argv, capsys):
    code = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def test_clean_file(tmp_path, capsys):
    path = _data(tmp_path / "d.h5")
    code, out, err = _check([path, "--classes", 2], capsys)
    assert code == 0 and len(out) == 1 and out[0].startswith("ok: 40 samples"), out
    assert "labels 0..1 within 2 classes" in out[0] and "all finite" in out[0]
    assert "check: 40/40 samples (100%)" in err  # plain progress lines: stderr is not a terminal here
    assert len(err.splitlines()) <= 5


@pytest.mark.parametrize("chunk", [1, 3000, 64 << 20])  # one sample per chunk, a few, all at once
def test_nan_inputs_and_bad_labels(tmp_path, capsys, chunk):
    labels = np.zeros(40, np.int64)
    labels[[17, 30]] = [7, -1]
    path = _data(tmp_path / "d.h5", labels=labels, nan=(13, 25, 26))
    code, out, _ = _check([path, "--classes", 2, "--chunk-bytes", chunk, "-q"], capsys)
    assert code == 1 and len(out) == 2, out
    assert out[0] == "non-finite inputs: 3 values in 3 samples of 'inputs'; the first in sample 13 (nan)"
    assert out[1] == ("labels out of range: 2 labels in 2 samples of 'labels' outside 0..1 (2 classes); the "
                      "first: sample 17 has label 7")


def test_pixel_labels(tmp_path, capsys):
    y = np.zeros((12, 8, 8), np.int8)
    y[5, 3, 4] = -1
    y[9, 0, 0] = -1
    path = _data(tmp_path / "d.h5", n=12, labels=y)
    code, out, _ = _check([path, "--classes", 2, "--chunk-bytes", 1000, "-q"], capsys)
    assert code == 1 and out == ["labels out of range: 2 labels in 2 samples of 'labels' outside 0..1 "
                                 "(2 classes); the first: sample 5 has label -1 at pixel (3, 4)"], out


def test_spec_shapes_names_and_classes(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    good = _data(tmp_path / "good.h5", names=("x", "y"))
    code, out, _ = _check([good, "--spec", spec, "-q"], capsys)
    assert code == 0 and "within 2 classes" in out[0] and f"fits the model of {spec}" in out[0], out
    labels = np.full(40, 1)
    labels[3] = 2  # the spec's fc has 2 units: classes from the spec
    wrong = _data(tmp_path / "wrong.h5", shape=(3, 9, 8), labels=labels, names=("x", "y"))
    code, out, _ = _check([wrong, "--spec", spec, "-q"], capsys)
    assert code == 1 and len(out) == 2, out
    assert out[0].startswith("shape: ") and "spatial (9, 8)" in out[0] and "expects spatial (8, 8)" in out[0]
    assert out[1].endswith("the first: sample 3 has label 2")
    pixel = _data(tmp_path / "pixel.h5", labels=np.zeros((40, 8, 8), np.int64), names=("x", "y"))
    code, out, _ = _check([pixel, "--spec", spec, "-q"], capsys)
    assert code == 1 and len(out) == 1 and "one label per sample (M,) for cross_entropy" in out[0], out


def test_errors(tmp_path, capsys):
    code, out, _ = _check([tmp_path / "missing.h5", "-q"], capsys)
    assert code == 1 and out == [f"file: data file {tmp_path / 'missing.h5'} does not exist"]
    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text("model: {input: 3}\n")
    code, out, err = _check([_data(tmp_path / "d.h5"), "--spec", bad_spec], capsys)
    assert code == 2 and not out and err.startswith("python -m lbannpy.data check: error: ") \
        and len(err.splitlines()) == 1, err
    code, out, err = _check([tmp_path / "d.h5", "--classes", 0], capsys)
    assert code == 2 and "--classes must be at least 1" in err


def test_chunks_are_bounded(tmp_path, monkeypatch):
    """The scan reads at most ``chunk_bytes`` (rounded down to whole samples) at a time."""
    from lbannpy.data import check

    path = _data(tmp_path / "d.h5", n=40)
    sizes = []
    real = check._scan_inputs
    monkeypatch.setattr(check, "_scan_inputs", lambda x, a, f: (sizes.append(x.nbytes), real(x, a, f)))
    out = io.StringIO()
    assert check_file(str(path), Expect(classes=2), chunk_bytes=3 * (3 * 8 * 8 * 4 + 8), quiet=True,
                      out=out) == 0
    assert sizes == [3 * 3 * 8 * 8 * 4] * 13 + [3 * 8 * 8 * 4], sizes


def test_command_line(tmp_path):
    path = _data(tmp_path / "d.h5")
    run = subprocess.run([sys.executable, "-m", "lbannpy.data", "check", str(path), "--classes", "2"],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("ok: 40 samples"), run
    assert "Traceback" not in run.stderr
