"""The run config (:mod:`lbannpy.config.run`): one frozen, typed value built once from the validated spec;
no default is restated outside the schema.

The AST check: in every module that reads a run's settings (the trainer package, the optimizer, the train and
predict commands, and any module that imports :mod:`lbannpy.config.run`), a ``.get("key", default)`` whose key
is a key of the schema is a second default for that key, and fails. A negative control plants one and sees it
caught."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lbannpy.config import validate
from lbannpy.config.run import RunConfig, run_config, section_config
from lbannpy.config.schema import SCHEMA
from lbannpy.config_types import Section

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# the modules that read settings from the run config (or its sections), by path below src/
READERS = ("training", "optim.py", "train.py", "predict.py")


def schema_keys() -> set[str]:
    names: set[str] = set()

    def walk(sec):
        for k in sec.keys:
            names.add(k.name)
            if isinstance(k, Section):
                walk(k)

    walk(SCHEMA)
    return names


def restated_defaults(source: str, keys: set[str]) -> list[str]:
    """``line: call`` of each ``x.get("key", default)`` with a schema key in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in keys):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def reader_modules() -> list[Path]:
    paths = set()
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC)
        if rel.parts[0] == "config":
            continue  # the schema's own package: where defaults are stated and filled
        if rel.parts[0] in READERS or str(rel) in READERS or "lbannpy.config.run" in p.read_text():
            paths.add(p)
    return sorted(paths)


def test_no_module_that_reads_settings_restates_a_default():
    keys = schema_keys()
    modules = reader_modules()
    assert {"loop.py", "optim.py", "train.py", "predict.py"} <= {p.name for p in modules}
    bad = {str(p.relative_to(ROOT)): hits for p in modules
           if (hits := restated_defaults(p.read_text(), keys))}
    assert not bad, f"defaults restated outside the schema (read the run config's typed field): {bad}"


def test_the_check_catches_a_planted_default():
    """Negative control: the three shapes the trainer used to have."""
    planted = ('tr.get("seed", 0)\ncfg["comm"].get("overlap", True)\n'
               '(cfg.get("checkpoint") or {}).get("at_start", False)\n')
    assert len(restated_defaults(planted, schema_keys())) == 3
    assert restated_defaults('row.get("spam", 0)\nd.get("seed")\n', schema_keys()) == []


SPEC = {"model": {"input": {"channels": 1, "spatial": [4, 4]},
                  "layers": [{"name": "f", "type": "fc", "units": 2}]},
        "data": {"train": {"path": "x.h5"}}, "optimizer": {"type": "adam"}}


def test_the_run_config_is_frozen_typed_and_has_every_default_of_the_schema():
    run = run_config(validate(SPEC, data=False, memory=False))
    assert isinstance(run, RunConfig) and not hasattr(run.trainer, "get")
    assert run.trainer.batch_size == 1 and run.trainer.epochs == 1 and run.trainer.steps is None
    assert run.optimizer.lr == 1e-3 and run.optimizer.betas == (0.9, 0.999)  # Adam's own default
    assert run.optimizer.schedule.type == "none" and run.comm.chunks.k == 0
    assert run.checkpoint.dir is None and run.data.validation is None  # unset key, absent optional section
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.trainer.seed = 3
    with pytest.raises(TypeError):
        run.model.layers[0]["units"] = 3  # read-only all the way down


def test_a_section_given_as_a_mapping_is_checked_and_filled_by_the_schema():
    assert section_config("optimizer", {"type": "sgd"}).lr == 0.01
    assert section_config("optimizer", {"type": "adam", "lr": 0.5}).lr == 0.5
    with pytest.raises(Exception, match="optimizer.type"):
        section_config("optimizer", {"type": "rmsprop"})
