"""The data side of the regression, binary and Dice losses: the reader delivers float targets blocked like
the model output (channels and space) and Dice's labels at the output's resolution; ``data check`` scans
targets (non-finite, outside [0, 1] for bce_with_logits) and takes or refuses them against a spec; predict
writes what each loss's output means."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import yaml

from lbannpy.data.__main__ import main
from lbannpy.data.dataset import DataError
from lbannpy.data.reader import HDF5Reader
from lbannpy.dist import Distribution
from lbannpy.predict import output_map

N = 12


def _file(path, labels):
    x = np.random.default_rng(0).standard_normal((N, 3, 10, 10)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["inputs"], f["labels"] = x, labels
    return path


@pytest.mark.parametrize("degrees", [{"h": 2}, {"c": 2, "w": 2}, {"n": 2, "h": 2}])
def test_reader_delivers_targets_blocked_like_the_output(tmp_path, degrees):
    y = np.random.default_rng(1).standard_normal((N, 3, 5, 5))
    path = _file(tmp_path / "t.h5", y)
    ranks = 4 if len(degrees) == 2 else 2
    dist, out = Distribution.make(4, ranks, **degrees), Distribution.make(4, ranks, **degrees)
    for rank in range(ranks):
        for preload in ("never", "always"):
            with HDF5Reader(path, dist=dist, rank=rank, batch_size=4, label_dist=out, prefetch=False,
                            shuffle=False, preload=preload, label_shape=(3, 5, 5), targets=True,
                            num_classes=3) as r:
                b = r.next()
                box = out.box((4, 3, 5, 5), rank)
                want = y[tuple(slice(a, z) for a, z in box)]
                assert b.labels.dtype == np.float64 and np.array_equal(b.labels, want), (rank, preload)


def test_reader_reads_dice_labels_at_the_output_resolution_and_refuses_others(tmp_path):
    y = np.random.default_rng(2).integers(0, 3, (N, 5, 5))
    path = _file(tmp_path / "d.h5", y)
    out = Distribution.make(4, 2, h=2)
    with HDF5Reader(path, dist=out, rank=1, batch_size=4, label_dist=out, prefetch=False, shuffle=False,
                    label_shape=(5, 5), num_classes=3) as r:
        assert np.array_equal(r.next().labels, y[:4, 3:])
    with pytest.raises(DataError, match=r"the loss needs labels of shape \(12, 3, 5, 5\)"):
        HDF5Reader(path, dist=out, rank=0, batch_size=4, label_shape=(3, 5, 5))
    with pytest.raises(DataError, match="expected floating point targets"):
        HDF5Reader(path, dist=out, rank=0, batch_size=4, label_shape=(5, 5), targets=True)


def _spec(tmp_path, loss, filters=2):
    spec = {"model": {"name": "m", "input": {"channels": 3, "spatial": [10, 10]}, "loss": loss,
                      "layers": [{"name": "c", "type": "conv", "filters": filters, "kernel": 3, "stride": 2,
                                  "padding": 1}]},
            "data": {"train": {"path": "x.h5"}}, "trainer": {"batch_size": 4, "steps": 1}}
    path = tmp_path / f"{loss}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _check(argv, capsys):
    code = main(["check", *map(str, argv), "-q"])
    return code, capsys.readouterr().out.splitlines()


def test_data_check_scans_targets(tmp_path, capsys):
    y = np.random.default_rng(3).random((N, 2, 5, 5))
    good = _file(tmp_path / "good.h5", y)
    for argv in ([good], [good, "--spec", _spec(tmp_path, "bce_with_logits")]):
        code, out = _check(argv, capsys)
        assert code == 0 and len(out) == 1 and "float targets (2, 5, 5) float64 in [" in out[0], out
    y[4, 1, 2, 3], y[7, 0, 0, 0], y[9, 0, 1, 1] = np.nan, 1.5, -0.25
    bad = _file(tmp_path / "bad.h5", y)
    code, out = _check([bad, "--spec", _spec(tmp_path, "bce_with_logits")], capsys)
    assert code == 1 and out == [
        "targets non-finite: 1 values in 1 samples of 'labels'; the first in sample 4 (nan)",
        "targets outside [0, 1]: 2 values in 2 samples of 'labels'; the first in sample 7 (1.5)"], out
    code, out = _check([bad, "--spec", _spec(tmp_path, "mse")], capsys)  # any finite value is a target
    assert code == 1 and out == [
        "targets non-finite: 1 values in 1 samples of 'labels'; the first in sample 4 (nan)"], out


def test_data_check_takes_dice_labels_at_the_output_resolution(tmp_path, capsys):
    spec = _spec(tmp_path, "dice", filters=3)
    good = _file(tmp_path / "good.h5", np.random.default_rng(4).integers(0, 3, (N, 5, 5)))
    code, out = _check([good, "--spec", spec], capsys)
    assert code == 0 and "within 3 classes" in out[0], out
    wrong = _file(tmp_path / "wrong.h5", np.zeros((N, 10, 10), np.int64))
    code, out = _check([wrong, "--spec", spec], capsys)
    assert code == 1 and len(out) == 1 and "the loss needs labels of shape (12, 5, 5)" in out[0], out


def test_predict_writes_what_each_loss_output_means():
    z = np.array([[-2.0, 0.0, 3.0]])
    assert output_map("mse")[0] == output_map("l1")[0] == "outputs"
    assert np.array_equal(output_map("mse")[1](z), z)
    name, fn = output_map("bce_with_logits")
    assert name == "probabilities" and np.allclose(fn(z), 1 / (1 + np.exp(-z)), rtol=1e-15)
    for kind in ("dice", "cross_entropy", "pixel_cross_entropy"):
        name, fn = output_map(kind)
        assert name == "probabilities" and np.allclose(fn(z).sum(axis=1), 1.0)


def test_config_names_no_generator_for_targets(tmp_path):
    """A missing data file: the hint names no ``lbannpy.data`` generator for a loss none of them fits."""
    from lbannpy.config import ConfigError, load_config, validate

    for loss in ("mse", "dice"):
        with pytest.raises(ConfigError) as err:
            validate(load_config(str(_spec(tmp_path, loss))), base_dir=str(tmp_path))
        msg = str(err.value)
        assert "does not exist" in msg and "python -m lbannpy.data" not in msg, msg
