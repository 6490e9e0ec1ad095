"""Every command exposes ``build_parser()`` (and ``subcommands()`` where it has subcommands), which its
``main`` parses with and the docs generator renders: no command is run to reach its parser, and nothing
patches argparse."""
from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

import pytest

from lbannpy.bench.__main__ import SUBCOMMANDS
from lbannpy.docs import COMMANDS, command_module

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_builds_its_parser(command):
    if command == "lbannpy.bench":  # a table of subcommands, each a module with its own parser
        for name, (module, _) in SUBCOMMANDS.items():
            assert isinstance(importlib.import_module(module).build_parser(), argparse.ArgumentParser), name
        return
    mod = command_module(command)
    parser = mod.build_parser()
    assert isinstance(parser, argparse.ArgumentParser) and command in parser.prog
    for name, sub in getattr(mod, "subcommands", dict)().items():
        assert isinstance(sub, argparse.ArgumentParser) and sub.prog.endswith(name)


def test_the_docs_generator_patches_nothing():
    """No assignment to an attribute of argparse (or of anything it did not create) in lbannpy.docs."""
    tree = ast.parse((ROOT / "src" / "docs.py").read_text())
    writes = [ast.unparse(t) for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AugAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Attribute) or (isinstance(t, ast.Tuple) and any(
                  isinstance(e, ast.Attribute) for e in t.elts))]
    assert writes == [], writes
