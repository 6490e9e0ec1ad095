"""``config validate`` runs train's own start-up checks and set-up (``lbannpy.training.build.check_run``), so
the two give one verdict in the same words: a split whose label blocks miss the prediction cells, a 1-D
model under a layer that computes over planes, a GPU run on a machine without CuPy, and the default job's
weak sweep, whose in-job check now reads the data the point trains on (and whose data holds the largest
point's mini-batch)."""
from __future__ import annotations

import csv
import importlib.util
import os
import stat
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from . import util

needs_mpi = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")
TRAIN_ERR, CONFIG_ERR = "lbannpy.train: error: ", "lbannpy.config: error: "


def _config(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([util.PY, "-m", "lbannpy.config", *args], env=util.ENV, capture_output=True,
                          text=True, timeout=timeout)


def _said(err, prefix: str) -> str:
    """The one error line ``prefix`` begins in ``err`` (a process's stderr), without the prefix (the
    command's name)."""
    err = err if isinstance(err, str) else err.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0][len(prefix):]


def _pixel_spec(tmp_path, size: int) -> dict:
    """A one-layer segmentation model at ``size``² (a stride-2 conv: prediction cells of 2x2 pixels) on
    mesh data of that size."""
    subprocess.run([util.PY, "-m", "lbannpy.data", "mesh", "--size", str(size), "--samples", "8", "-o",
                    str(tmp_path / "data.h5")], env=util.ENV, check=True, capture_output=True, timeout=120)
    return {"model": {"name": "px", "input": {"channels": 18, "spatial": [size, size]},
                      "layers": [{"name": "c1", "type": "conv", "filters": 2, "kernel": 3, "stride": 2,
                                  "padding": 1}],
                      "loss": "pixel_cross_entropy"},
            "data": {"train": {"path": str(tmp_path / "data.h5")}},
            "trainer": {"batch_size": 2, "steps": 1}, "optimizer": {"type": "sgd", "lr": 0.01},
            "output": {"dir": str(tmp_path / "out")}, "checkpoint": {"dir": str(tmp_path / "ck")}}


@needs_mpi
def test_label_blocks_off_the_prediction_cells_are_refused_by_validate_as_by_train(tmp_path):
    """16² labels split 3 ways (6, 5, 5 rows) do not cover 8 prediction rows split 3 ways (3, 3, 2 cells of
    2 rows): validate said ok, train refused at the label blocks."""
    cfg = _pixel_spec(tmp_path, 16)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(cfg))
    sets = ["--set", "parallel.default.h=3"]
    v = _config("validate", str(tmp_path / "s.yaml"), "--ranks", "3", *sets)
    assert v.returncode == 2, (v.stdout, v.stderr)
    job = util.run(tmp_path, cfg, ranks=3, timeout=180, args=tuple(sets))
    assert job.rank_codes() == [2, 2, 2], (job.rank_codes(), job.err[-3000:])
    said = _said(v, CONFIG_ERR)
    assert said == _said(job.err, TRAIN_ERR) and "label block" in said, said


@needs_mpi
@pytest.mark.parametrize("h", [3, 2])
def test_mesh1k_at_128_validate_and_train_agree_on_3_ranks(tmp_path, h):
    """The zoo's mesh1k at 128² on 3 ranks: with h=3 both refuse with one line, with h=2 (one rank holds
    copies) validate's ok is train's set-up passing (it trains a step)."""
    assert _config("zoo", "mesh1k", "-o", str(tmp_path / "z.yaml"), "--input-size", "128", "--batch-size",
                   "2").returncode == 0
    spec = yaml.safe_load((tmp_path / "z.yaml").read_text())
    subprocess.run([util.PY, "-m", "lbannpy.data", "mesh", "--size", "128", "--samples", "4", "-o",
                    str(tmp_path / "data.h5")], env=util.ENV, check=True, capture_output=True, timeout=120)
    spec["data"]["train"]["path"] = str(tmp_path / "data.h5")
    spec["trainer"].pop("epochs")
    spec["trainer"]["steps"] = 1
    spec["output"] = {"dir": str(tmp_path / "out")}
    spec["checkpoint"] = {"dir": str(tmp_path / "ck"), "keep": 1}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    sets = ["--set", f"parallel.default.h={h}"]
    v = _config("validate", str(tmp_path / "s.yaml"), "--ranks", "3", *sets, timeout=300)
    job = util.run(tmp_path, spec, ranks=3, timeout=600, args=tuple(sets))
    codes = job.rank_codes()
    if v.returncode == 0:
        assert codes == [0, 0, 0], (v.stdout, codes, job.err[-3000:])
    else:
        assert v.returncode == 2 and codes == [2, 2, 2], (v.stderr, codes, job.err[-3000:])
        assert _said(v, CONFIG_ERR) == _said(job.err, TRAIN_ERR)


def test_a_1d_model_under_a_conv_is_refused_by_build_validate_and_train_with_the_way_to_write_it(tmp_path):
    """``spatial: [16]`` under a conv passed build and validate; train refused, telling the user to move the
    layer before the fully-connected ones. Now all three refuse in one line that says how to write a line
    of W (spatial [1, W], kernel [1, k]), and that form trains."""
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "d1.h5", "w") as f:
        f["inputs"] = rng.standard_normal((8, 3, 16)).astype(np.float32)
        f["labels"] = rng.integers(0, 2, 8)
    layers = [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
              {"name": "r1", "type": "relu"}, {"name": "f1", "type": "fc", "units": 2}]
    spec = {"model": {"name": "d1", "input": {"channels": 3, "spatial": [16]}, "layers": layers,
                      "loss": "cross_entropy"},
            "data": {"train": {"path": str(tmp_path / "d1.h5")}}, "trainer": {"batch_size": 2, "steps": 1},
            "optimizer": {"type": "sgd", "lr": 0.01}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    b = _config("build", str(tmp_path / "s.yaml"), "-o", str(tmp_path / "c.h5"))
    v = _config("validate", str(tmp_path / "s.yaml"))
    t = subprocess.run([util.PY, "-m", "lbannpy.train", str(tmp_path / "s.yaml"), "--quiet"], env=util.ENV,
                       capture_output=True, text=True, timeout=120)
    assert (b.returncode, v.returncode, t.returncode) == (2, 2, 2), (b.stderr, v.stderr, t.stderr)
    said = _said(v, CONFIG_ERR)
    assert said == _said(b, CONFIG_ERR) == _said(t, TRAIN_ERR), (said, t.stderr)
    assert "model.spatial" not in said and "fully-connected" not in said and "[1, W]" in said, said
    # the hinted form trains
    with h5py.File(tmp_path / "d2.h5", "w") as f:
        f["inputs"] = rng.standard_normal((8, 3, 1, 16)).astype(np.float32)
        f["labels"] = rng.integers(0, 2, 8)
    spec["model"]["input"]["spatial"] = [1, 16]
    spec["model"]["layers"][0].update(kernel=[1, 3], padding=[0, 1])
    spec["data"]["train"]["path"] = str(tmp_path / "d2.h5")
    (tmp_path / "s2.yaml").write_text(yaml.safe_dump(spec))
    assert _config("validate", str(tmp_path / "s2.yaml")).returncode == 0
    t = subprocess.run([util.PY, "-m", "lbannpy.train", str(tmp_path / "s2.yaml"), "--quiet"], env=util.ENV,
                       capture_output=True, text=True, timeout=120)
    assert t.returncode == 0, t.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
@pytest.mark.parametrize("key,value", [("runtime.device", "gpu"), ("runtime.backend", "nccl")])
def test_a_gpu_run_without_cupy_is_refused_by_validate_naming_the_key(tmp_path, key, value):
    """``runtime.device: gpu`` (or ``backend: nccl``) where CuPy is missing: validate said ok and train
    failed (exit 1). Validate now refuses as a configuration problem: exit 2, one line naming the key."""
    util.make_data(tmp_path / "data.h5")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(util.spec(tmp_path)))
    v = _config("validate", str(tmp_path / "s.yaml"), "--set", f"{key}={value}")
    assert v.returncode == 2 and v.stdout == "", (v.stdout, v.stderr)
    assert _said(v, CONFIG_ERR).startswith(f"{key}: "), v.stderr


FAKE_SRUN = """#!/bin/bash
# srun -n P python -m lbannpy.train CONFIG [--set ...] [--resume]: the shared start-up check of that run on
# P ranks (python -m lbannpy.config validate), then a summary.json as a finished run writes
set -euo pipefail
[[ "$1" == -n ]] || {{ echo "fake srun: expected -n P, got $*" >&2; exit 9; }}
ranks="$2"; shift 4; shift  # -n P python -m lbannpy.train
config="$1"; shift
args=(); out=""
for a in "$@"; do
    [[ "$a" == --resume ]] && continue
    [[ "$a" == output.dir=* ]] && out="${{a#output.dir=}}"
    args+=("$a")
done
echo "$ranks $*" >> "{log}"
{py} -m lbannpy.config validate "$config" --ranks "$ranks" "${{args[@]}}"
mkdir -p "$out" && echo '{{"timing": {{"step_time_s": 1.0}}}}' > "$out/summary.json"
"""


def test_the_default_weak_sweep_at_8_tasks_builds_the_data_its_largest_point_reads(tmp_path):
    """The mesh1k job rendered for 8 tasks, run on its default config (the zoo's mesh_tiny at 64² to keep
    it small: batch 8) with the weak sweep: the point at 8 ranks trains a batch of 64, more than the 16
    samples the job built; the in-job check (validate --no-data) passed it, train refused, and the job ended
    without scaling.csv. Each point is run here through the shared check at its rank count (srun replaced
    by ``config validate --ranks P`` of the same arguments)."""
    script = tmp_path / "mesh1k.sbatch"
    subprocess.run([util.PY, "-m", "lbannpy.jobs", "render", "mesh1k", "--site", "local", "--nodes", "1",
                    "--tasks-per-node", "8", "-o", str(script)], env=util.ENV, check=True,
                   capture_output=True, timeout=120)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(log=tmp_path / "srun.log", py=util.PY))
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    run_dir = tmp_path / "run"
    env = dict(util.ENV, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="44",
               SLURM_NTASKS="8", LBANNPY_RUN_DIR=str(run_dir), LBANNPY_MODEL="mesh_tiny",
               LBANNPY_MESH_SIZE="64", LBANNPY_STEPS="1", LBANNPY_SWEEPS="weak")
    for k in ("LBANNPY_MESH_SAMPLES", "LBANNPY_BATCH_SIZE", "SLURM_RESTART_COUNT"):
        env.pop(k, None)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    ran = (tmp_path / "srun.log").read_text().split("\n")
    assert [line.split()[0] for line in ran if line] == ["1", "2", "4", "8"], ran
    assert "trainer.batch_size=64" in ran[3], ran
    with h5py.File(run_dir / "input" / "mesh.h5", "r") as f:
        assert f["inputs"].shape[0] >= 64
    with open(run_dir / "scaling.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["sweep"], int(r["ranks"])) for r in rows] == [("weak", p) for p in (1, 2, 4, 8)], rows
    assert not (run_dir / "skipped.txt").exists()
