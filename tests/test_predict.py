"""``python -m lbannpy.predict`` on the demo's trained model.

* acceptance: under ``mpiexec -n 2`` with the training rank layout, on the validation part of the demo's
  data, the written probabilities give (computed here, from the file, with NumPy) the IoU the trainer
  reported for its validation; the command prints the same value;
* the same samples predicted on 1 rank with another batch size (and a tail batch) get the same
  probabilities, and every sample of the file is written once, in order;
* trained on 2 ranks with h=2, predicted on 1 and on 3 ranks (predict chooses its split): equal;
* a file without labels is predicted (no metrics); a wrong input shape is refused with a message;
* ``--png`` writes an image.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from lbannpy.predict import batches

MPIEXEC = shutil.which("mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
PY = sys.executable


def sh(cmd, cwd, timeout=300, check=True):
    p = subprocess.run(cmd, env=ENV, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
    return p


def test_batches_cover_every_id_once_with_a_tail():
    ids = np.arange(10, 17)
    got = list(batches(ids, 3))
    assert [b.tolist() for b, _ in got] == [[10, 11, 12], [13, 14, 15], [14, 15, 16]]
    assert [f for _, f in got] == [0, 0, 2]
    written = np.concatenate([b[f:] for b, f in got])
    assert written.tolist() == ids.tolist()
    assert [f for _, f in batches(np.arange(6), 3)] == [0, 0]


def downsample_any(labels, f):
    n, h, w = labels.shape
    return labels.reshape(n, h // f, f, w // f, f).max(axis=(2, 4))


def iou_binary(pred, lab):
    tp = np.sum((pred == 1) & (lab == 1))
    fp = np.sum((pred == 1) & (lab == 0))
    fn = np.sum((pred == 0) & (lab == 1))
    return tp / (tp + fp + fn) if tp + fp + fn else 0.0


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: the predict test needs MPI (pip install mpich)")
    d = tmp_path_factory.mktemp("demo")
    sh([PY, "-m", "lbannpy.demo", "--dir", "d", "--size", "64", "--samples", "16", "--steps", "6",
        "--ranks", "2", "--batch-size", "4"], cwd=d)
    with open(d / "d" / "run" / "summary.json") as f:
        summary = json.load(f)
    return d, summary


def test_predict_iou_equals_trainer_validation(demo):
    d, summary = demo
    p = sh([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt",
            "--data", "d/mesh64.h5", "--subset", "validation", "-o", "p/val.h5", "--png", "2"], cwd=d)
    want = summary["validation"]["iou"]
    assert f"iou {want:.6f}" in p.stdout, p.stdout
    with h5py.File(d / "p" / "val.h5") as f:
        probs, ids = f["probabilities"][()], f["sample_ids"][()]
        assert f.attrs["metric_iou"] == pytest.approx(want, abs=1e-12)
    with h5py.File(d / "d" / "mesh64.h5") as f:
        labels = f["labels"][()][ids]
    assert probs.shape == (len(ids), 2, 8, 8)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-6)
    lab = downsample_any(labels, 64 // 8)
    batch = 4  # the demo's batch: the trainer averages each full batch's IoU
    per_batch = [iou_binary(probs[i:i + batch].argmax(axis=1), lab[i:i + batch])
                 for i in range(0, len(ids) - batch + 1, batch)]
    assert np.mean(per_batch) == pytest.approx(want, abs=1e-12)
    # negative control: the same probabilities against another sample's labels do not give that IoU
    assert iou_binary(probs.argmax(axis=1), np.roll(lab, 1, axis=0)) != pytest.approx(want, abs=1e-3)
    assert (d / "p" / "val.png").stat().st_size > 10_000


def test_predict_other_layout_batch_and_tail_agree(demo):
    d, _ = demo
    sh([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt",
        "--data", "d/mesh64.h5", "--subset", "validation", "-o", "p/val2.h5"], cwd=d)
    # 16 samples in batches of 3: five full batches and a tail of one, on 1 rank (no split)
    sh([PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt", "--data", "d/mesh64.h5",
        "--set", "trainer.batch_size=3", "--set", "parallel.default.h=1", "-o", "p/all.h5"], cwd=d)
    with h5py.File(d / "p" / "all.h5") as f:
        allp, allids = f["probabilities"][()], f["sample_ids"][()]
    with h5py.File(d / "p" / "val2.h5") as f:
        valp, valids = f["probabilities"][()], f["sample_ids"][()]
    assert allids.tolist() == list(range(16))
    np.testing.assert_allclose(allp[valids], valp, atol=1e-5)
    assert np.abs(allp[valids] - allp[(valids + 1) % 16]).max() > 1e-3  # the comparison can fail


def test_predict_on_any_rank_count_equals_the_training_ranks(demo):
    """Trained on 2 ranks splitting the height (the demo): predicted on 1 and on 3 ranks with no --set, the
    probabilities equal the 2-rank prediction; the command says which split it chose instead."""
    d, _ = demo
    got = {}
    for n in (2, 1, 3):
        p = sh([MPIEXEC, "-n", str(n), PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt",
                "--data", "d/mesh64.h5", "-o", f"p/ranks{n}.h5"], cwd=d)
        assert (n == 2) == ("training split does not run" not in p.stdout), p.stdout
        with h5py.File(d / "p" / f"ranks{n}.h5") as f:
            got[n] = f["probabilities"][()]
            assert f["sample_ids"][()].tolist() == list(range(16))
    assert "predicting with parallel.default n3" in p.stdout, p.stdout
    for n in (1, 3):
        np.testing.assert_allclose(got[n], got[2], atol=1e-5)
    assert np.abs(got[2] - np.roll(got[2], 1, axis=0)).max() > 1e-3  # the comparison can fail


def test_resolution_line_of_a_regression_model(tmp_path):
    """mse/l1 models write ``outputs`` instead of ``probabilities``: --png's line reads either."""
    from lbannpy.predict import resolution_line

    out = tmp_path / "pred.h5"
    with h5py.File(out, "w") as f:
        f.create_dataset("outputs", shape=(2, 1, 64, 64), dtype=np.float32)
    assert resolution_line(str(out), {"model": {"input": {"spatial": [64, 64]}}}) == \
        "prediction 64×64 per pixel at the input's resolution 64×64"


def test_predict_unlabelled_and_wrong_shape(demo):
    d, _ = demo
    with h5py.File(d / "d" / "mesh64.h5") as f:
        x = f["inputs"][:5]
    with h5py.File(d / "new.h5", "w") as f:
        f["inputs"] = x
    with h5py.File(d / "bad.h5", "w") as f:
        f["inputs"] = x[:, :, :32, :32]
    p = sh([PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt", "--data", "new.h5",
            "--set", "parallel.default.h=1", "-o", "p/new.h5"], cwd=d)
    assert "iou" not in p.stdout
    with h5py.File(d / "p" / "new.h5") as f:
        assert f["probabilities"].shape == (5, 2, 8, 8)
        assert "metric_iou" not in f.attrs
    p = sh([PY, "-m", "lbannpy.predict", "d/config.h5", "--checkpoint", "d/ckpt", "--data", "bad.h5",
            "--set", "parallel.default.h=1", "-o", "p/bad.h5"], cwd=d, check=False)
    assert p.returncode != 0
    assert "(18, 32, 32)" in p.stderr and "(18, 64, 64)" in p.stderr, p.stderr


def test_predict_batch_script_runs(demo, tmp_path):
    """The rendered SLURM script, with ``srun`` standing in as ``mpiexec -n $SLURM_NTASKS``."""
    from lbannpy.jobs.render import JobSpec, render

    d, summary = demo
    script = tmp_path / "predict.sbatch"
    script.write_text(render(JobSpec.for_site("predict", site="local")))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # the pyenv shim of mpiexec puts its own python first on PATH: name this interpreter explicitly
    (bindir / "srun").write_text(f'#!/bin/bash\n[[ "$1" == python ]] && shift && set -- {PY} "$@"\n'
                                 f'exec {MPIEXEC} -n "$SLURM_NTASKS" "$@"\n')
    (bindir / "python").write_text(f'#!/bin/bash\nexec {PY} "$@"\n')
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = dict(ENV, PATH=f"{bindir}:{ENV['PATH']}", SLURM_JOB_ID="77", SLURM_NTASKS="2", LBANNPY_PNG="1")
    p = subprocess.run(["bash", str(script), "d/config.h5", "d/ckpt", "d/mesh64.h5"], cwd=d, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"done: {d}/run/predict-77/predictions.h5" in p.stdout  # one run directory, named in full
    with h5py.File(d / "run" / "predict-77" / "predictions.h5") as f:
        assert f["probabilities"].shape == (16, 2, 8, 8)
    assert (d / "run" / "predict-77" / "predictions.png").is_file()
    p = subprocess.run(["bash", str(script), "d/config.h5"], cwd=d, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "usage: sbatch jobs/predict.sbatch" in p.stderr
