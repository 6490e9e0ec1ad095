"""Every zoo model runs from its documented data command: the command in the spec's ``# Data:`` header,
at a small size, writes a file that ``lbannpy.data check`` accepts for the model and that the trainer
trains on; a missing data file makes the trainer print that same command."""
from __future__ import annotations

import csv
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from lbannpy import zoo

PY = sys.executable
# the smallest input each network's strides and pooling take (inception_v3's stem needs 75 pixels)
SMALL = {"lenet5": 32, "alexnet": 64, "vgg16": 32, "resnet50": 32, "inception_v3": 75, "mesh1k": 64,
         "mesh2k": 64, "mesh_tiny": 64, "mesh_unet": 8, "unet3d": 8}


def documented_command(name: str) -> str:
    lines = [ln for ln in zoo.path(name).read_text().splitlines() if ln.startswith("# Data: ")]
    assert len(lines) == 1, f"{name}: one '# Data:' line expected, got {lines}"
    return lines[0][len("# Data: "):]


def run(argv, cwd, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_every_zoo_model_is_covered():
    assert set(SMALL) == set(zoo.names())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_zoo_model_trains_on_its_documented_data(name, tmp_path):
    size = SMALL[name]
    cmd = documented_command(name)
    assert cmd.startswith("python -m lbannpy.data "), cmd
    small = re.sub(r"--size \d+", f"--size {size}", re.sub(r"--samples \d+", "--samples 4", cmd))
    argv = [PY if a == "python" else a for a in shlex.split(small)]
    p = run(argv, tmp_path)
    assert p.returncode == 0, small + "\n" + p.stderr
    p = run([PY, "-m", "lbannpy.config", "zoo", name, "-o", "spec.yaml", "--input-size", str(size),
             "--batch-size", "2"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert re.sub(r"--samples \d+", "--samples 8", small) in p.stdout, p.stdout  # printed for the new size
    p = run([PY, "-m", "lbannpy.config", "build", "spec.yaml", "-o", "config.h5"], tmp_path)
    assert p.returncode == 0, p.stderr  # the build reads the data file and checks its shapes
    data = zoo.get_spec(name)["data"]["train"]["path"]
    p = run([PY, "-m", "lbannpy.data", "check", data, "--spec", "config.h5", "-q"], tmp_path)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr  # shape, classes, labels
    p = run([PY, "-m", "lbannpy.train", "config.h5", "--quiet", "--set", "trainer.steps=2"], tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2], rows
    assert all(math.isfinite(float(r["loss"])) for r in rows), rows


def test_trainer_names_the_data_command_when_the_file_is_missing(tmp_path):
    p = run([PY, "-m", "lbannpy.config", "zoo", "lenet5", "-o", "spec.yaml"], tmp_path)
    assert p.returncode == 0, p.stderr
    p = run([PY, "-m", "lbannpy.train", "spec.yaml", "--quiet"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert documented_command("lenet5") in p.stderr, p.stderr
