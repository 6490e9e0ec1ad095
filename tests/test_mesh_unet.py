"""The full-resolution mesh-tangling model: ``predict --png`` says the prediction's resolution against the
input's (a coarse map beside full-resolution labels is named, not left to guess)."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from lbannpy.predict import resolution_line


@pytest.mark.parametrize("shape,spatial,want", [
    ((3, 2, 64, 64), [64, 64], "prediction 64×64 per pixel at the input's resolution 64×64"),
    ((3, 2, 8, 8), [64, 64], "prediction 8×8 per pixel, 1/8 of the input's resolution 64×64"),
    ((1, 2, 8, 16), [64, 64], "prediction 8×16 per pixel, 8/64×16/64 of the input's resolution 64×64"),
    ((1, 2, 8, 8, 8), [8, 8, 8], "prediction 8×8×8 per voxel at the input's resolution 8×8×8"),
    ((4, 10), [32, 32], "prediction per sample (10 classes) for inputs of 32×32"),
])
def test_resolution_line(tmp_path, shape, spatial, want):
    out = tmp_path / "pred.h5"
    with h5py.File(out, "w") as f:
        f.create_dataset("probabilities", shape=shape, dtype=np.float32)
    assert resolution_line(str(out), {"model": {"input": {"spatial": spatial}}}) == want
