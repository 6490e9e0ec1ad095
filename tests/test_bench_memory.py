"""`python -m lbannpy.bench memory`: the split run takes the strategy selector's per-layer splits (or one
dimension for every layer), and a small run measures and prints every process's peak."""
import os
import re
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("torch")

from lbannpy.bench import memory, peer  # noqa: E402


def test_the_selector_splits_mesh1k_by_height_then_by_filters():
    case = peer.Case("mesh1k-1024", "mesh1k", 1024, 1)
    spec = peer.network(case)[0]
    layers = memory.split_layers(spec, case, 2, "auto", None)
    assert set(layers) == {ly["name"] for ly in spec["model"]["layers"]}
    # the first blocks carry the activations of 1024² (split in space), the last ones most of the
    # 52 M parameters (split by filters: each rank holds half of them, their gradients and momentum)
    assert layers["conv1_1"] == {"n": 1, "h": 2} and layers["bn1_1"] == {"n": 1, "h": 2}
    assert layers["conv6_3"] == {"n": 1, "c": 2} and layers["bn6_3"] == {"n": 1, "c": 2}
    assert memory.split_layers(spec, case, 2, "h", None) is None
    assert memory.describe_split(None, "h", 2) == "h2"
    described = memory.describe_split(layers, "h", 2)
    assert re.fullmatch(r"(\w+ x\d+)(, \w+ x\d+)*", described), described
    assert sum(int(n) for n in re.findall(r"x(\d+)", described)) == len(layers)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("split", ["auto", "h"])
def test_a_small_run_reports_every_peak(tmp_path, split):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    kernels = "own" if split == "h" else "auto"  # lbannpy's runs, with either kernel set
    cmd = [sys.executable, "-m", "lbannpy.bench", "memory", "--model", "mesh_tiny", "--size", "32",
           "--steps", "1", "--runs", "lbannpy", "split", "--split", split, "--dir", str(tmp_path),
           "--kernels", kernels]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    one = float(re.search(r"lbannpy 1 rank\s+(\d+) MiB", out).group(1))
    ranks = re.search(r"lbannpy 2 ranks \((.*)\)\s+(\d+) MiB per rank \(ranks: (\d+), (\d+)\)", out)
    assert ranks, out
    assert one > 50 and all(float(v) > 50 for v in ranks.groups()[1:]), out
    assert ranks.group(1).startswith("strategy selector: " if split == "auto" else "every layer: h2"), out
    # the verdict is the one the printed peaks give (they print rounded to 1 MiB, the ratio to 0.001)
    got = re.search(r"2 ranks / 1 rank, per rank: ([0-9.]+)x \(target <= 0.55x: (met|NOT met)\)", out)
    assert got, out
    ratio = max(float(v) for v in ranks.groups()[2:]) / one
    assert float(got.group(1)) == pytest.approx(ratio, abs=0.001 + 1.0 / one), out
    if abs(ratio - 0.55) > 0.001 + 1.0 / one:  # clear of the target: the rounding cannot flip it
        assert got.group(2) == ("met" if ratio <= 0.55 else "NOT met"), out
    written = yaml.safe_load(open(tmp_path / "split.yaml", encoding="utf-8"))
    assert ("layers" in written["parallel"]) == (split == "auto")
    assert f"lbannpy's kernels: {kernels}" in out, out
    for tag in ("split", "lbannpy"):
        cfg = yaml.safe_load(open(tmp_path / f"{tag}.yaml", encoding="utf-8"))
        assert cfg["runtime"]["kernels"] == kernels, tag


def test_the_report_compares_unrounded_ratios():
    from types import SimpleNamespace

    from lbannpy.bench.memory import report

    lines = report(SimpleNamespace(label="m"), 2, {"lbannpy": [3195.0], "split": [1764.0, 1765.0],
                                                    "torch": [4500.0]}, 0.55)
    assert "  2 ranks / 1 rank, per rank: 0.552x (target <= 0.55x: NOT met)" in lines  # 1765 / 3195
    assert "  lbannpy / PyTorch, 1 rank: 0.710x (target <= 1.00x: met)" in lines
    lines = report(SimpleNamespace(label="m"), 2, {"lbannpy": [3200.0], "split": [1760.0]}, 0.55)
    assert lines[-1] == "  2 ranks / 1 rank, per rank: 0.550x (target <= 0.55x: met)"
