"""The full-resolution mesh-tangling model: trained on 2 ranks splitting the height (equal to 1 rank) from its
documented data, it predicts at the input's resolution; ``predict --png`` says the prediction's resolution
against the input's (a coarse map beside full-resolution labels is named, not left to guess)."""
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


# ---- mesh_unet end to end: its data command, 2 ranks splitting the height, a full-resolution prediction ----

SIZE = 32  # the smallest side whose coarsest level (1/8) still splits 2 ways


def test_mesh_unet_trains_splitting_the_height_and_predicts_at_the_input_resolution(tmp_path):
    from train_util import PY, assert_same_weights, final_params, sh
    from test_zoo_data import documented_command

    cmd = documented_command("mesh_unet").split()
    assert cmd[:4] == ["python", "-m", "lbannpy.data", "mesh"], cmd
    sh([PY, "-m", "lbannpy.data", "mesh", "--size", SIZE, "--samples", 4, "-o", "mesh_unet.h5", "-q"],
       cwd=tmp_path)
    sh([PY, "-m", "lbannpy.config", "zoo", "mesh_unet", "-o", "spec.yaml", "--input-size", SIZE,
        "--batch-size", 2], cwd=tmp_path)
    sh([PY, "-m", "lbannpy.config", "build", "spec.yaml", "-o", "config.h5", "--set", "trainer.steps=3",
        "--set", "parallel.default.h=2", "--set", "trainer.dtype=float64"], cwd=tmp_path)
    sh(["mpiexec", "-n", 2, PY, "-m", "lbannpy.train", "config.h5", "--quiet"], cwd=tmp_path)
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"ranks": 2' in summary, summary
    # the split run is the 1-rank run: transposed convs, skips and batch norm across the block edge
    sh([PY, "-m", "lbannpy.train", "config.h5", "--quiet", "--set", "parallel.default.h=1", "--set",
        "output.dir=one", "--set", "checkpoint.dir=one/ckpt"], cwd=tmp_path)
    assert_same_weights(final_params(tmp_path / "run" / "ckpt"), final_params(tmp_path / "one" / "ckpt"),
                        1e-10, "mesh_unet split h2 against 1 rank")
    p = sh(["mpiexec", "-n", 2, PY, "-m", "lbannpy.predict", "config.h5", "--checkpoint", "run/ckpt",
            "--data", "mesh_unet.h5", "-o", "pred.h5", "--png", 1], cwd=tmp_path)
    line = f"prediction {SIZE}×{SIZE} per pixel at the input's resolution {SIZE}×{SIZE}"
    assert f"lbannpy.predict: {line}\n" in p.stdout, p.stdout
    with h5py.File(tmp_path / "pred.h5") as f, h5py.File(tmp_path / "mesh_unet.h5") as d:
        probs = f["probabilities"][...]
        assert probs.shape == (4, 2, SIZE, SIZE) == (4, 2) + d["labels"].shape[1:]
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-12)
    assert (tmp_path / "pred.png").stat().st_size > 0
