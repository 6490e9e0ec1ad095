"""Bounded YAML (issue #16, bounded parsing): aliases, deep nesting and duplicate keys are refused fast, with
line and column, in specs, ``--set`` values and machine files; plain YAML reads as yaml.safe_load does."""
import subprocess
import sys

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


@pytest.fixture
def documents_built(monkeypatch):
    """How many documents the loader began to construct (a refusal while composing builds none)."""
    built = []
    real = yaml.SafeLoader.construct_document

    def counting(self, node):
        built.append(node)
        return real(self, node)

    monkeypatch.setattr(yaml.SafeLoader, "construct_document", counting)
    return built


@pytest.mark.parametrize("text,problem,where,constructs", [
    (BOMB, "aliases", "2:8", 0),                 # the first alias, before any expansion
    (DEEP, "nested more than", "1:65", 0),       # the first level past MAX_DEPTH
    ("a: 1\nb: 2\na: 3\n", r"duplicate key 'a' \(first at line 1\)", "3:1", 1),
], ids=["alias-bomb", "deep", "duplicate"])
def test_refused_early_with_line_and_column(documents_built, text, problem, where, constructs):
    """Refused at the first offending token, not after building the tree: the error's place is that
    token's, and an alias or nesting refusal comes before any construction."""
    assert yamlsafe.MAX_DEPTH == 64  # the "deep" case's column
    with pytest.raises(yamlsafe.YamlLimitError, match=problem) as info:
        yamlsafe.load(text)
    assert info.value.where == where
    assert len(documents_built) == constructs


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
    with pytest.raises(MachineError, match="aliases.*3:8|3:8.*aliases"):  # the first alias, line 3
        load_machine(str(bad))


def test_the_command_line_prints_one_line(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    cmd = [sys.executable, "-m", "lbannpy.config", "build", str(spec), "-o", str(tmp_path / "c.h5"),
           "--set", "trainer.seed=" + BOMB.replace("\n", ", ").join("{}")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "aliases" in lines[0], p.stderr
