"""``python -m lbannpy.strategy`` smoke tests: tables, --explain, --compare, --write, errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from lbannpy import zoo
from lbannpy.strategy.__main__ import main


@pytest.fixture
def spec_file(tmp_path):
    f = tmp_path / "mesh_tiny.yaml"
    f.write_text(yaml.safe_dump(zoo.get_spec("mesh_tiny", batch_size=4), sort_keys=False))
    return f


def test_explain_compare_write(spec_file, capsys):
    assert main([str(spec_file), "--ranks", "4", "--explain", "--compare", "--write"]) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "conv1_1" in out
    assert "dropped" in out and "chose" in out
    for name in ("data-parallel", "model-parallel", "owt", "chosen (layer-wise)", "longest-path"):
        assert name in out
    tree = yaml.safe_load(spec_file.read_text())
    layers = tree["parallel"]["layers"]
    assert set(layers) == {lay["name"] for lay in tree["model"]["layers"]}
    for degrees in layers.values():
        assert "n" in degrees and 4 % (degrees["n"] * degrees.get("c", 1) * degrees.get("h", 1)
                                       * degrees.get("w", 1)) == 0
    assert tree["model"] == zoo.get_spec("mesh_tiny", batch_size=4)["model"]


def test_h5_roundtrip_through_config_module(tmp_path, capsys):
    config = pytest.importorskip("lbannpy.config")
    f = tmp_path / "c.h5"
    config.save_config(zoo.get_spec("mesh_tiny", batch_size=4), str(f))
    assert main([str(f), "--ranks", "2", "--write"]) == 0
    assert set(config.load_config(str(f))["parallel"]["layers"]) >= {"conv1_1", "predict"}


def test_errors_exit_2_with_message(spec_file, tmp_path, capsys):
    assert main([str(spec_file), "--ranks", "0"]) == 2
    assert "--ranks must be a positive integer" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml"), "--ranks", "2"]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {input: {channels: 3, spatial: [8, 8]}, layers: [{name: s, type: sum}]}\n")
    assert main([str(bad), "--ranks", "2"]) == 2
    assert "needs at least two parents" in capsys.readouterr().err
    assert main([str(spec_file), "--ranks", "2", "--machine", "no-such-machine"]) == 2
    assert "unknown machine" in capsys.readouterr().err


def test_module_entry_point(spec_file):
    r = subprocess.run([sys.executable, "-m", "lbannpy.strategy", str(spec_file), "--ranks", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "predicted step" in r.stdout
