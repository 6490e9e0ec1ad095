"""What people read: loss.png titled and labelled with whole-number steps, the summary's plural, a missing
config named once, help texts with descriptions and defaults."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from lbannpy.training.report import write_plot

PY = sys.executable


def test_loss_plot_title_labels_and_integer_steps(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    seen = {}
    orig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda self, *a, **k: (seen.setdefault("fig", self), orig(self, *a, **k)))
    rows = [{"step": i, "loss": 1.0 / i} for i in (1, 2, 3)]
    write_plot(str(tmp_path / "loss.png"), rows, [{"step": 3, "loss": 0.5, "iou": 0.4}],
               title="mesh_tiny on 2 rank(s), split h2")
    fig = seen["fig"]
    assert fig._suptitle.get_text() == "mesh_tiny on 2 rank(s), split h2"
    left, right = fig.axes
    assert left.get_ylabel() == "loss" and right.get_ylabel() == "validation metric"
    for ax in (left, right):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_one_step_is_singular_and_a_missing_config_is_named_once(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([PY, "-m", "lbannpy.train", "nonexist.h5"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("nonexist.h5") == 1, p.stderr
    import h5py
    import numpy as np
    import yaml

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["inputs"] = np.zeros((4, 1, 4, 4))
        f["labels"] = np.zeros(4, dtype=np.int64)
    spec = {"model": {"input": {"channels": 1, "spatial": [4, 4]},
                      "layers": [{"name": "f", "type": "fc", "units": 2}]},
            "data": {"train": {"path": "d.h5"}}, "trainer": {"batch_size": 4, "steps": 1}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    p = subprocess.run([PY, "-m", "lbannpy.train", "s.yaml", "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "lbannpy.train: 1 step on 1 rank(s)" in p.stdout, p.stdout


@pytest.mark.parametrize("cmd", [["lbannpy.train"], ["lbannpy.predict"], ["lbannpy.export"]])
def test_help_has_a_description_and_defaults(cmd):
    p = subprocess.run([PY, "-m", *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert "``" not in p.stdout  # no raw RST usage line as the description
    assert "(default:" in p.stdout


def test_plain_progress_lines_for_logs():
    import io

    from lbannpy.training.report import PlainProgress

    t = [0.0]
    out = io.StringIO()
    bar = PlainProgress(100, 0, file=out, every_s=30.0, clock=lambda: t[0])
    for step in range(1, 101):
        t[0] += 0.1 if step < 50 else 5.0  # slow steps from the 50th: the time rule takes over
        bar.update(1)
        bar.set_postfix(loss=f"{1.0 / step:.4f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("lbannpy.train: step 10/100 (10%)") and lines[0].endswith("loss 0.1000")
    assert lines[-1].startswith("lbannpy.train: step 100/100 (100%)")
    steps = [int(ln.split()[2].split("/")[0]) for ln in lines]
    assert steps == sorted(steps) and len(lines) < 30 and any(b - a < 10 for a, b in zip(steps, steps[1:]))


BENCH = ["halo", "overlap", "memory", "scaling", "strategy", "data", "scale", "peer", "costmodel", "overhead",
         "layers", "calibrate"]


@pytest.mark.parametrize("cmd", [["lbannpy.data"], ["lbannpy.data", "mesh"], ["lbannpy.data", "blobs"]]
                         + [["lbannpy.bench", b] for b in BENCH])
def test_more_help_texts(cmd):
    p = subprocess.run([PY, "-m", *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "``" not in p.stdout
    text = p.stdout.replace("\n", " ")
    assert "(default" in text or cmd == ["lbannpy.data"]
    lines = p.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("options:"))
    # every option has a help text on its line or the next
    for i, ln in enumerate(lines[start + 1:], start + 1):
        s = ln.strip()
        if not (ln.startswith("  -") and not ln.startswith("   ")):  # not an option's own line
            continue
        own = len([x for x in s.split("  ") if x.strip()]) > 1
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        assert own or (nxt.startswith(" " * 8) and not nxt.strip().startswith("-")), ln


def test_scaling_png_beside_scaling_csv(tmp_path):
    import json

    for sweep, p, t in (("strong", 1, 1.0), ("strong", 2, 0.6), ("strong", 4, 0.4), ("weak", 1, 1.0),
                        ("weak", 2, 1.1)):
        (tmp_path / f"{sweep}-{p}").mkdir()
        (tmp_path / f"{sweep}-{p}" / "summary.json").write_text(json.dumps({"median_step_s": t}))
    p = subprocess.run([PY, "-m", "lbannpy.jobs", "scaling", str(tmp_path), "-o",
                        str(tmp_path / "scaling.csv")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "scaling.csv").is_file() and (tmp_path / "scaling.png").stat().st_size > 10_000


def test_metrics_columns_in_a_fixed_order_after_resume(tmp_path):
    import csv

    import h5py
    import numpy as np
    import yaml

    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["inputs"] = rng.standard_normal((8, 1, 4, 4))
        f["labels"] = rng.integers(0, 2, 8)
    spec = {"model": {"input": {"channels": 1, "spatial": [4, 4]},
                      "layers": [{"name": "f", "type": "fc", "units": 2}]},
            "data": {"train": {"path": "d.h5"}}, "trainer": {"batch_size": 4, "steps": 4},
            "checkpoint": {"every_steps": 2}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    heads = []
    for extra in ([], ["--resume", "--set", "trainer.steps=6"]):
        p = subprocess.run([PY, "-m", "lbannpy.train", "s.yaml", "--quiet", *extra], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        with open(tmp_path / "run" / "metrics.csv") as f:
            heads.append(next(csv.reader(f)))
    assert heads[0] == heads[1] and heads[0][:3] == ["step", "epoch", "loss"], heads


def test_a_large_checkpoint_write_is_announced_and_timed(tmp_path):
    """A checkpoint over the size threshold (here lowered to 1 byte) gets a line before and after its write;
    --quiet and small checkpoints stay silent."""
    import yaml
    from faults import util

    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 2}, checkpoint={"every_steps": 1})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    script = ("import sys\nfrom lbannpy.training import loop\nloop.CKPT_PROGRESS_BYTES = int(sys.argv[2])\n"
              "from lbannpy.train import main\nraise SystemExit(main([sys.argv[1], *sys.argv[3:]]))")
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(threshold, *args):
        shutil.rmtree(tmp_path / "ck", ignore_errors=True)  # each run a fresh one (a run owns its directory)
        r = subprocess.run([PY, "-c", script, str(tmp_path / "c.yaml"), str(threshold), *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        return [ln for ln in r.stderr.splitlines() if "checkpoint" in ln]

    lines = run(1)
    assert len(lines) == 4, lines  # steps 1 and 2: announced, then timed
    assert lines[0].startswith("lbannpy.train: step 1: writing a checkpoint of about 0 MiB into ")
    assert lines[1].startswith("lbannpy.train: step 1: checkpoint written in ")
    assert lines[1].endswith("MiB/s)")
    assert run(1, "--quiet") == [] and run(64 << 20) == []
