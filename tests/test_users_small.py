"""Small things a new user met: a checkpoint directory's index.h5 accepted by export and predict, predict's
own prefix, config's exit status 2 on a user error, "1 channel", a sample split larger than the batch named
as such, and the help texts of the checkpoint arguments."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def sh(argv, cwd, timeout=300):
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("lenet5")
    for argv in ([PY, "-m", "lbannpy.data", "blobs", "--size", "32", "--channels", "1", "--classes", "10",
                  "--samples", "8", "-o", "lenet5.h5"],
                 [PY, "-m", "lbannpy.config", "zoo", "lenet5", "-o", "spec.yaml", "--batch-size", "4"],
                 [PY, "-m", "lbannpy.config", "build", "spec.yaml", "-o", "config.h5"],
                 [PY, "-m", "lbannpy.train", "config.h5", "--quiet", "--set", "trainer.steps=2"]):
        p = sh(argv, d)
        assert p.returncode == 0, p.stderr
    (index,) = list((d / "run" / "ckpt").glob("ckpt-*/index.h5"))
    return d, index


def test_export_and_predict_take_a_checkpoint_index(trained):
    d, index = trained
    p = sh([PY, "-m", "lbannpy.export", index, "-o", "w.safetensors"], d)
    assert p.returncode == 0 and "(step 2)" in p.stdout, p.stderr
    p = sh(["mpiexec", "-n", "2", PY, "-m", "lbannpy.predict", "config.h5", "--checkpoint", index,
            "--data", "lenet5.h5", "-o", "pred.h5"], d, timeout=600)
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert "lbannpy.predict: 2 rank(s) left free" in out and "lbannpy.train" not in out, out


def test_config_user_error_exits_2_as_train_does(tmp_path):
    p = sh([PY, "-m", "lbannpy.config", "build", "nosuch.yaml", "-o", "x.h5"], tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("lbannpy.config: error:"), (p.returncode, p.stderr)
    p = sh([PY, "-m", "lbannpy.train", "nosuch.yaml"], tmp_path)
    assert p.returncode == 2, p.stderr


def test_one_channel_is_singular_and_batch_split_is_named(trained, tmp_path):
    d, _ = trained
    p = sh([PY, "-m", "lbannpy.data", "blobs", "--size", "32", "--channels", "2", "--classes", "10",
            "--samples", "4", "-o", tmp_path / "two.h5"], tmp_path)
    assert p.returncode == 0, p.stderr
    p = sh([PY, "-m", "lbannpy.predict", d / "config.h5", "--checkpoint", d / "run" / "ckpt", "--data",
            tmp_path / "two.h5", "-o", tmp_path / "p.h5"], d)
    assert p.returncode == 2 and "with 2 channels; the model expects 1 channel (" in p.stderr, p.stderr
    p = sh([PY, "-m", "lbannpy.config", "validate", d / "config.h5", "--ranks", "2", "--no-data", "--set",
            "parallel.default.n=2", "--set", "trainer.batch_size=1"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "a batch of 1 sample(s) cannot be split 2 ways over the samples" in p.stderr, p.stderr
    assert "halo" not in p.stderr, p.stderr


def test_checkpoint_help_texts_name_the_directory_layout(tmp_path):
    for mod in ("lbannpy.export", "lbannpy.predict"):
        p = sh([PY, "-m", mod, "--help"], tmp_path)
        assert p.returncode == 0 and "ckpt-<step>/" in p.stdout and "index.h5" in p.stdout, p.stdout
