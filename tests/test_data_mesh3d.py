"""The 3-D mesh-tangling generator (``python -m lbannpy.data mesh3d``): layout, determinism, labels per voxel,
and the mesh arithmetic its channels rest on (corner Jacobians, the velocity gradient)."""
from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest

from lbannpy.data import mesh3d
from lbannpy.data.__main__ import main as data_main
from lbannpy.data.mesh import MeshDataError
from lbannpy.data.mesh3d import CH, CHANNEL_NAMES, Mesh3DParams, generate_sample, write_mesh3d
from lbannpy.zoo.zoo import MESH3D_CHANNELS


def test_channels_are_documented_and_the_zoo_knows_their_count():
    assert len(set(CHANNEL_NAMES)) == len(CHANNEL_NAMES) == mesh3d.NUM_CHANNELS == MESH3D_CHANNELS
    for i, name in enumerate(CHANNEL_NAMES):
        assert re.search(rf"^\s*{i}\s+{name}\b", mesh3d.__doc__, re.M), name


def test_layout_attributes_and_determinism(tmp_path):
    a, b = str(tmp_path / "a.h5"), str(tmp_path / "b.h5")
    write_mesh3d(a, Mesh3DParams(size=12, depth=6, samples=3, seed=2))
    write_mesh3d(b, Mesh3DParams(size=12, depth=6, samples=3, seed=2))
    assert open(a, "rb").read() == open(b, "rb").read()
    with h5py.File(a, "r") as f:
        x, y = f["inputs"], f["labels"]
        assert x.shape == (3, 14, 6, 12, 12) and x.dtype == np.float32 and x.chunks == (1, 14, 6, 12, 12)
        assert y.shape == (3, 6, 12, 12) and y.dtype == np.uint8
        assert f.attrs["format"] == "lbannpy-mesh3d"
        assert json.loads(f.attrs["params"])["depth"] == 6
        labels = y[...]
        assert set(np.unique(labels)) <= {0, 1} and np.isfinite(x[...]).all()
        assert float(f.attrs["positive_fraction"]) == pytest.approx(labels.mean())
    x1, y1 = generate_sample(Mesh3DParams(size=12, depth=6, samples=1, seed=2), 2)  # independent of count
    with h5py.File(a, "r") as f:
        np.testing.assert_array_equal(f["inputs"][2], x1)
        np.testing.assert_array_equal(f["labels"][2], y1)


def test_labels_are_the_tangled_and_tangling_cells_and_not_rare():
    fracs = []
    for seed in range(4):
        x, y = generate_sample(Mesh3DParams(size=24, samples=1, seed=seed), 0)
        j, trend = x[CH["jacobian_min"]], x[CH["jacobian_trend"]]
        np.testing.assert_array_equal(y, (j < 0) | ((j < 0.25) & (trend < 0)))
        fracs.append(y.mean())
    assert 0.02 < np.mean(fracs) < 0.4, fracs


def test_mesh_arithmetic_on_known_fields():
    h = 1 / 6
    z, y, x = np.meshgrid(*(np.arange(7) * h,) * 3, indexing="ij")
    jac = mesh3d.corner_jacobians([x, y, z])
    assert all(np.allclose(c, h ** 3) for c in jac)
    inverted = mesh3d.corner_jacobians([x, y, -z])  # a mirror image turns every cell inside out
    assert all((c < 0).all() for c in inverted)
    one = np.ones((6, 6, 6))
    rot = mesh3d.cell_features([x, y, z], [-(y - 0.5), x - 0.5, 0 * z], [x, y, z], one, one, one * h ** 3, h)
    assert np.allclose(rot[CH["divergence"]], 0) and np.allclose(rot[CH["vorticity"]], 2)
    grow = mesh3d.cell_features([x, y, z], [x, 2 * y, 3 * z], [x, y, z], one, one, one * h ** 3, h)
    assert np.allclose(grow[CH["divergence"]], 6) and np.allclose(grow[CH["vorticity"]], 0)
    assert np.allclose(grow[CH["volume"]], 1) and np.allclose(grow[CH["aspect_ratio"]], 1)


def test_command_line(tmp_path, capsys):
    out = tmp_path / "v.h5"
    argv = ["mesh3d", "--size", "8", "--samples", "2", "--channels", "5", "-o", str(out), "-q"]
    assert data_main(argv) == 0
    assert "inputs 2×5×8×8×8 float32" in capsys.readouterr().out
    assert data_main(["mesh3d", "--size", "8", "--depth", "1", "--samples", "1", "-o", str(out)]) == 2
    assert "--depth must be at least 2" in capsys.readouterr().err
    with pytest.raises(MeshDataError, match="--channels"):
        Mesh3DParams(channels=15)
