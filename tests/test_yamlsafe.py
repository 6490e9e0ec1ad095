"""Bounded YAML (issue #16, bounded parsing): aliases, deep nesting and duplicate keys are refused fast, with
line and column, in specs, ``--set`` values and machine files; plain YAML reads as yaml.safe_load does."""
import subprocess
import sys
import time

import pytest
import yaml

from lbannpy import yamlsafe
from lbannpy.config import ConfigError, apply_overrides, parse_yaml
from lbannpy.machine import MachineError, load_machine

BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
DEEP = "[" * 50_000 + "]" * 50_000
SPEC = "model: {input: {channels: 1, spatial: [8, 8]}, layers: [{name: f, type: fc, units: 2}]}\n"


def test_plain_yaml_reads_as_safe_load():
    text = SPEC + "trainer: {batch_size: 4, steps: 2}\nlist: [1, 2.5, 'x', null, true]\n"
    assert yamlsafe.load(text) == yaml.safe_load(text)


@pytest.mark.parametrize("text,problem", [
    (BOMB, "aliases"),
    (DEEP, "nested more than"),
    ("a: 1\nb: 2\na: 3\n", r"duplicate key 'a' \(first at line 1\)"),
])
def test_refused_fast_with_line_and_column(text, problem):
    t0 = time.perf_counter()
    with pytest.raises(yamlsafe.YamlLimitError, match=problem) as info:
        yamlsafe.load(text)
    assert time.perf_counter() - t0 < 1.0
    line, col = info.value.where.split(":")
    assert int(line) >= 1 and int(col) >= 1


def test_the_control_without_limits_expands_the_bomb():
    # what the limit prevents: safe_load builds 9**9 references from this text (kept small here: 9**4)
    small = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abc", "bcd"))
    tree = yaml.safe_load(small)
    assert len(tree["d"]) == 9 and len(tree["d"][0][0][0]) == 9


def test_specs_set_values_and_machine_files_use_it(tmp_path):
    with pytest.raises(ConfigError, match="aliases"):
        parse_yaml(SPEC + BOMB, "spec.yaml")
    with pytest.raises(ConfigError, match="duplicate key 'model'"):
        parse_yaml(SPEC + SPEC, "spec.yaml")
    with pytest.raises(ConfigError, match="aliases"):
        apply_overrides(parse_yaml(SPEC, "s"), ["trainer.seed=" + BOMB.replace("\n", ", ").join("{}")])
    bad = tmp_path / "m.yaml"
    bad.write_text("name: m\n" + BOMB)
    t0 = time.perf_counter()
    with pytest.raises(MachineError, match="aliases"):
        load_machine(str(bad))
    assert time.perf_counter() - t0 < 1.0


def test_the_command_line_prints_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    cmd = [sys.executable, "-m", "lbannpy.config", "build", str(spec), "-o", str(tmp_path / "c.h5"),
           "--set", "trainer.seed=" + BOMB.replace("\n", ", ").join("{}")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "aliases" in lines[0], p.stderr
