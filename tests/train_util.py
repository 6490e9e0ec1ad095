"""Helpers of the end-to-end training tests (``tests/test_train_e2e.py`` on NumPy and
``tests/gpu/test_train_gpu.py`` on GPUs): serial commands, the data sets, configs built from a spec, and the
comparison of a run's final weights and metrics with a reference run's."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

PY = sys.executable
# one BLAS thread per process: the ranks of a job share the machine's cores
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")


def sh(cmd, timeout=240, cwd=None, check=True, env=None):
    """Run a command; with ``check``, fail with its output when it fails."""
    p = subprocess.run([str(c) for c in cmd], env=env or ENV, cwd=cwd, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
    return p


def make_data(d: Path, *, blobs_size: int, blobs_samples: int, mesh_size: int, mesh_samples: int) -> Path:
    """``d/blobs.h5`` (4 classes) and ``d/mesh.h5`` (segmentation) of the given sizes; returns ``d``."""
    sh([PY, "-m", "lbannpy.data", "blobs", "--size", blobs_size, "--samples", blobs_samples, "--classes", "4",
        "-o", d / "blobs.h5"])
    sh([PY, "-m", "lbannpy.data", "mesh", "--size", mesh_size, "--samples", mesh_samples, "-o", d / "mesh.h5",
        "-q"])
    return d


def model_spec(work: Path, kind: str, layers: list, spatial: int) -> tuple[dict, dict]:
    """``(model, data)`` sections: ``cls`` on ``blobs.h5`` (3 channels), ``seg`` on ``mesh.h5`` (18)."""
    if kind == "cls":
        return ({"name": "cls", "input": {"channels": 3, "spatial": [spatial, spatial]}, "layers": layers,
                 "loss": "cross_entropy"}, {"train": {"path": str(work / "blobs.h5")}})
    return ({"name": "seg", "input": {"channels": 18, "spatial": [spatial, spatial]}, "layers": layers,
             "loss": "pixel_cross_entropy"}, {"train": {"path": str(work / "mesh.h5")}})


def build_config(work: Path, tag: str, cfg: dict) -> Path:
    """Write ``work/tag.yaml`` and build ``work/tag.h5`` from it; returns the latter."""
    path = work / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    h5 = work / f"{tag}.h5"
    sh([PY, "-m", "lbannpy.config", "build", path, "-o", h5])
    return h5


def final_params(ckpt_dir) -> dict:
    """The parameters of the newest checkpoint in ``ckpt_dir`` (sharded or not), by name."""
    from lbannpy import checkpoint

    _, data = checkpoint.load_newest(str(ckpt_dir))
    return {k[len("params/"):]: v for k, v in data["tensors"].items() if k.startswith("params/")}


def assert_same_weights(a: dict, b: dict, rtol: float, what: str) -> None:
    """Every parameter of ``a`` equals ``b``'s to ``rtol`` relative to its largest magnitude."""
    assert a.keys() == b.keys(), what
    for k in a:
        err = np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1e-30)
        assert err <= rtol, f"{what}: {k} differs by {err:.3g} relative"


def metrics(out_dir) -> list[dict]:
    """The rows of ``out_dir/metrics.csv``."""
    with open(os.path.join(out_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))
