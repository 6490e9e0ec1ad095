"""Synthetic data generators: determinism, layout, attributes, label balance, physical sanity."""
from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest

from lbannpy.data import mesh
from lbannpy.data.__main__ import main as data_main
from lbannpy.data.blobs import BlobsDataError, write_blobs
from lbannpy.data.mesh import CH, CHANNEL_NAMES, MeshDataError, MeshParams, generate_sample, write_mesh


@pytest.fixture(scope="module")
def mesh_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mesh") / "m.h5")
    write_mesh(path, MeshParams(size=48, samples=6, seed=3))
    return path


def test_channel_list_has_18_unique_names():
    assert len(CHANNEL_NAMES) == 18 == mesh.NUM_CHANNELS
    assert len(set(CHANNEL_NAMES)) == 18
    for i, name in enumerate(CHANNEL_NAMES):  # every channel is documented in the module docstring
        assert re.search(rf"^\s*{i}\s+{name}\b", mesh.__doc__, re.M), name


def test_layout_and_attributes(mesh_file):
    with h5py.File(mesh_file, "r") as fh:
        x, y = fh["inputs"], fh["labels"]
        assert x.shape == (6, 18, 48, 48) and x.dtype == np.float32
        assert y.shape == (6, 48, 48) and y.dtype == np.uint8
        assert x.chunks == (1, 18, 48, 48) and y.chunks == (1, 48, 48)
        assert fh.attrs["format"] == "lbannpy-mesh" and int(fh.attrs["version"]) == 1
        assert [str(s) for s in fh.attrs["channel_names"]] == list(CHANNEL_NAMES)
        assert [str(s) for s in x.attrs["channel_names"]] == list(CHANNEL_NAMES)
        params = json.loads(fh.attrs["params"])
        assert params["size"] == 48 and params["samples"] == 6 and params["seed"] == 3
        labels = y[...]
        assert float(fh.attrs["positive_fraction"]) == pytest.approx(labels.mean())
        np.testing.assert_allclose(fh["positive_fraction_per_sample"][...], labels.mean(axis=(1, 2)))
        assert set(np.unique(labels)) <= {0, 1}
        assert np.isfinite(x[...]).all()


def test_same_seed_gives_identical_bytes(tmp_path):
    a, b, c = (str(tmp_path / f"{n}.h5") for n in "abc")
    write_mesh(a, MeshParams(size=24, samples=3, seed=11))
    write_mesh(b, MeshParams(size=24, samples=3, seed=11))
    write_mesh(c, MeshParams(size=24, samples=3, seed=12))
    assert open(a, "rb").read() == open(b, "rb").read()
    with h5py.File(a, "r") as fa, h5py.File(c, "r") as fc:
        assert not np.array_equal(fa["inputs"][...], fc["inputs"][...])  # the seed matters


def test_sample_does_not_depend_on_sample_count():
    x2, y2 = generate_sample(MeshParams(size=20, samples=2, seed=5), 1)
    x9, y9 = generate_sample(MeshParams(size=20, samples=9, seed=5), 1)
    assert np.array_equal(x2, x9) and np.array_equal(y2, y9)


def test_label_balance_within_bounds():
    # at 128² the fraction is close to the 1024² one (about 0.1); tests at tiny sizes see a little more
    p = MeshParams(size=128, samples=8, seed=0)
    frac = np.mean([generate_sample(p, i)[1].mean() for i in range(p.samples)])
    assert 0.02 <= frac <= 0.25, frac


def test_labels_follow_the_jacobian(mesh_file):
    with h5py.File(mesh_file, "r") as fh:
        x, y = fh["inputs"][...], fh["labels"][...]
    j, trend = x[:, CH["jacobian_min"]], x[:, CH["jacobian_trend"]]
    assert (j < 0).any(), "the test data set has no tangled cell; the generator lost its tangling"
    assert (y[j < 0] == 1).all()                              # tangled => needs relaxation
    assert (y[j >= 0.25] == 0).all()                          # healthy => no relaxation
    assert (y[(j >= 0) & (j < 0.25) & (trend < 0)] == 1).all()    # small and decreasing => relax
    assert (y[(j >= 0) & (trend >= 0)] == 0).all()


def test_channels_are_physically_consistent(mesh_file):
    with h5py.File(mesh_file, "r") as fh:
        x = fh["inputs"][...].astype(np.float64)
    g = dict((name, x[:, i]) for i, name in enumerate(CHANNEL_NAMES))
    # an inverted corner has a negative signed angle, and only then
    assert np.array_equal(g["angle_min"] < 0, g["jacobian_min"] < 0)
    np.testing.assert_allclose(g["pressure"], 0.4 * g["density"] * g["internal_energy"], rtol=1e-5)
    assert (g["density"] > 0).all() and (g["internal_energy"] > 0).all()
    assert (g["aspect_ratio"] >= 1 - 1e-6).all()
    assert ((g["skew"] >= 0) & (g["skew"] <= 1 + 1e-6)).all()
    assert ((g["edge_ratio"] > 0) & (g["edge_ratio"] <= g["opposite_edge_ratio"] + 1e-6)).all()
    assert (g["angle_max"] >= g["angle_min"]).all()
    assert (g["artificial_viscosity"] >= 0).all()
    assert (g["artificial_viscosity"][g["divergence"] > 0] == 0).all()
    # 2 * area = J0 + J2 = J1 + J3 (corner Jacobians), so the smallest corner Jacobian never exceeds the area
    assert (g["jacobian_min"] <= g["area"] + 1e-5 * (1 + np.abs(g["area"]))).all()


def test_undeformed_mesh_metrics():
    n = 4
    grid = np.arange(n + 1, dtype=np.float64) / n
    xx, yy = np.meshgrid(grid, grid)
    zero = np.zeros_like(xx)
    f = mesh.cell_features(xx, yy, zero, zero, xx, yy, np.ones((n, n)), np.ones((n, n)),
                           mesh.jacobian_min(xx, yy), 1.0 / n)
    ch = dict(zip(CHANNEL_NAMES, f))
    np.testing.assert_allclose(ch["area"], 1.0)
    np.testing.assert_allclose(ch["jacobian_min"], 1.0)
    np.testing.assert_allclose(ch["aspect_ratio"], 1.0)
    np.testing.assert_allclose(ch["skew"], 0.0, atol=1e-7)
    np.testing.assert_allclose(ch["angle_min"], np.pi / 2, rtol=1e-6)
    np.testing.assert_allclose(ch["angle_max"], np.pi / 2, rtol=1e-6)
    np.testing.assert_allclose(ch["displacement"], 0.0)
    np.testing.assert_allclose(ch["jacobian_trend"], 0.0)


def test_green_gradient_of_a_linear_field_is_exact():
    # u = (a x + b y, c x + d y) on a sheared mesh: divergence a + d, vorticity c - b in every cell
    n = 5
    grid = np.arange(n + 1, dtype=np.float64) / n
    xx, yy = np.meshgrid(grid, grid)
    xs, ys = xx + 0.3 * yy, yy + 0.1 * np.sin(3 * xx)
    a, b, c, d = 0.7, -1.3, 2.1, 0.4
    ux, uy = a * xs + b * ys, c * xs + d * ys
    f = mesh.cell_features(xs, ys, ux, uy, xx, yy, np.ones((n, n)), np.ones((n, n)),
                           mesh.jacobian_min(xs, ys), 1.0 / n)
    np.testing.assert_allclose(f[CH["divergence"]], a + d, rtol=1e-5)
    np.testing.assert_allclose(f[CH["vorticity"]], c - b, rtol=1e-5)


def test_channel_subset(tmp_path):
    path = str(tmp_path / "c4.h5")
    write_mesh(path, MeshParams(size=16, samples=2, seed=1, channels=4))
    full, _ = generate_sample(MeshParams(size=16, samples=2, seed=1), 1)
    with h5py.File(path, "r") as fh:
        assert fh["inputs"].shape == (2, 4, 16, 16)
        assert [str(s) for s in fh.attrs["channel_names"]] == list(CHANNEL_NAMES[:4])
        assert np.array_equal(fh["inputs"][1], full[:4])


@pytest.mark.parametrize("kw", [{"size": 1}, {"samples": 0}, {"channels": 19}, {"channels": 0},
                                {"steps": 1}, {"seed": -1}],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_bad_parameters_are_refused(kw):
    with pytest.raises(MeshDataError):
        MeshParams(**kw)


def test_cli_mesh_and_blobs(tmp_path, capsys):
    out = str(tmp_path / "cli.h5")
    assert data_main(["mesh", "--size", "16", "--samples", "2", "-o", out, "--seed", "4"]) == 0
    text = capsys.readouterr().out
    assert "positive fraction" in text
    with h5py.File(out, "r") as fh:
        assert fh["inputs"].shape == (2, 18, 16, 16)
    assert data_main(["mesh", "--size", "16", "--samples", "2", "-o", out, "--channels", "30"]) == 2
    assert "--channels" in capsys.readouterr().err
    bl = str(tmp_path / "blobs.h5")
    assert data_main(["blobs", "--size", "12", "--samples", "10", "--classes", "3", "-o", bl]) == 0
    with h5py.File(bl, "r") as fh:
        assert fh["inputs"].shape == (10, 3, 12, 12) and fh["inputs"].dtype == np.float32
        assert fh["labels"].shape == (10,) and fh["labels"].dtype == np.int64


def test_blobs_deterministic_and_learnable(tmp_path):
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    info = write_blobs(a, size=24, samples=240, classes=4, seed=2)
    write_blobs(b, size=24, samples=240, classes=4, seed=2)
    assert open(a, "rb").read() == open(b, "rb").read()
    assert min(info["class_counts"]) > 30
    with h5py.File(a, "r") as fh:
        x, y = fh["inputs"][...], fh["labels"][...]
    assert set(np.unique(y)) == {0, 1, 2, 3}
    # orientation is the class: the phase-free power spectrum separates it (nearest class mean)
    feat = np.abs(np.fft.fft2(x.sum(axis=1))).reshape(len(x), -1)
    feat /= np.linalg.norm(feat, axis=1, keepdims=True)
    tr, te = slice(0, 160), slice(160, None)
    means = np.stack([feat[tr][y[tr] == k].mean(axis=0) for k in range(4)])
    acc = np.mean(np.argmax(feat[te] @ means.T, axis=1) == y[te])
    assert acc > 0.8, acc


def test_blobs_bad_parameters(tmp_path):
    with pytest.raises(BlobsDataError):
        write_blobs(str(tmp_path / "x.h5"), size=8, samples=4, classes=1)
