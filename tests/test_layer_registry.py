"""The layer registry is the one place a layer type is declared.

* every shipped type's name is declared by its own module and named by no other module outside the tests,
  the model zoo, the benchmarks and the communicators (where "sum" is a reduction, not a layer);
* ``INPUT_NAMES`` is defined once;
* a type added in a test module through ``register`` alone (``tests/toy_layer.py``) passes the schema,
  shape inference and the planner, and trains under a spatial split (2 ranks, h2) to the weights of the
  1-rank run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lbannpy.config import ConfigError, normalize
from lbannpy.layers.registry import layer_classes, layer_specs, loss_specs

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
MPIEXEC = shutil.which("mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
# places that may name a layer type without declaring it: specs written as examples or benchmarks, and the
# communicators' reduction operators
EXEMPT = ("tests", "zoo", "bench", "comm", ".git", "build", "shared")


def source_files(root: Path) -> list[Path]:
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        if not any(part in EXEMPT or part.startswith(".") for part in rel[:-1]):
            out.append(path)
    return out


def mentions(files: dict[str, str], name: str) -> list[str]:
    """Files whose code names ``name`` as a string literal."""
    pat = re.compile(r"[\"']%s[\"']" % re.escape(name))
    return sorted(f for f, text in files.items() if pat.search(text))


#: the PyTorch importer maps ATen ops to layer types by name (DESIGN.md: "a table from ATen ops to
#: registered layer types"); it is the one other place a type is named, and it names registered types only
IMPORTER = "src/from_torch/"


def repo_texts() -> dict[str, str]:
    """Every source file but the importer's (checked on their own below)."""
    return {str(p.relative_to(REPO)): p.read_text() for p in source_files(REPO)
            if not str(p.relative_to(REPO)).startswith(IMPORTER)}


def test_the_importer_names_registered_types_only():
    text = "".join(p.read_text() for p in sorted((REPO / IMPORTER).glob("*.py")))
    named = set(re.findall(r"emit\(node, [\"']([a-z_0-9]+)[\"']", text))
    assert len(named) >= 10 and named <= set(layer_specs()), sorted(named - set(layer_specs()))


def test_each_layer_type_is_declared_once_and_named_nowhere_else():
    texts = repo_texts()
    assert "layers/registry.py" in texts and "src/strategy/cost.py" in texts  # the scan sees the sources
    for name, cls in layer_classes().items():
        home = str(Path(sys.modules[cls.__module__].__file__).resolve().relative_to(REPO))
        assert mentions(texts, name) == [home], f"layer type {name!r} is named outside {home}"
        decl = re.compile(r"LayerSpec\(\s*[\"']%s[\"']" % re.escape(name))
        assert sum(len(decl.findall(t)) for t in texts.values()) == 1, name


def test_the_check_finds_a_second_declaration():
    # negative control: a type list anywhere else is caught
    texts = dict(repo_texts(), **{"src/strategy/elsewhere.py": 'POINTWISE = ("relu", "dropout")\n'})
    assert mentions(texts, "relu") == ["layers/simple.py", "src/strategy/elsewhere.py"]


def test_input_names_is_defined_once():
    defs = [f for f, t in repo_texts().items() if re.search(r"^INPUT_NAMES\s*=", t, re.M)]
    assert defs == ["layers/registry.py"]


def test_schema_graph_and_runtime_read_the_same_declarations():
    from lbannpy.config.schema import LAYER_TYPES
    from lbannpy.strategy.graph import build_graph

    assert list(LAYER_TYPES) == list(layer_specs()) == list(layer_classes())
    for name, spec in layer_specs().items():
        assert LAYER_TYPES[name] is spec and layer_classes()[name].spec is spec
        assert layer_classes()[name].splittable == spec.split_dims
    # keys the schema refuses, the graph refuses too (a transposed conv's output_padding on a conv and an
    # unknown loss are refused everywhere)
    model = {"input": {"channels": 3, "spatial": [8, 8]},
             "layers": [{"name": "c", "type": "conv", "filters": 4, "output_padding": 1}]}
    with pytest.raises(ValueError, match="output_padding"):
        build_graph(model, 2)
    with pytest.raises(ConfigError, match="output_padding"):
        normalize({"model": model})
    model = {"input": {"channels": 3, "spatial": [8, 8]}, "loss": "huber",
             "layers": [{"name": "c", "type": "conv", "filters": 4}]}
    with pytest.raises(ValueError, match="unknown loss 'huber'"):
        build_graph(model, 2)


def test_defaults_live_in_the_declaration():
    from lbannpy.layers.pool import Pool

    hp = Pool("p", kernel=3).hparams
    assert (hp["mode"], hp["stride"], hp["padding"], hp["global"]) == ("max", 3, 0, False)
    assert layer_classes()["dropout"]("d", rate=0.25).hparams["p"] == 0.25


# -- a new type through the registry alone -----------------------------------------------------------------

TOY_MODEL = {"name": "toy", "input": {"channels": 18, "spatial": [32, 32]}, "loss": "pixel_cross_entropy",
             "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                        {"name": "t1", "type": "toy_scale", "init": 0.5},
                        {"name": "r1", "type": "relu"},
                        {"name": "predict", "type": "conv", "filters": 2, "kernel": 1}]}


def sh(cmd, timeout=240):
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-3000:]}\n" \
                              f"{p.stderr[-3000:]}"
    return p


def test_unregistered_type_is_refused_here():
    # negative control for the tests below: this process never imported toy_layer
    with pytest.raises(ConfigError, match="unknown layer type 'toy_scale'"):
        normalize({"model": TOY_MODEL})


def test_a_toy_type_is_planned_through_the_registry():
    code = ("import json, toy_layer\n"
            "from lbannpy.strategy.graph import build_graph\n"
            "from lbannpy.strategy.planner import enumerate_splits, plan\n"
            f"g = build_graph({TOY_MODEL!r}, 4)\n"
            "node = g['t1']\n"
            "p = plan(g, 2)\n"
            "print(json.dumps({'shape': node.out_shape, 'params': node.n_params, 'flops': node.flops_fwd,\n"
            "    'splits': sorted(str(d) for d in enumerate_splits(node, 2)),\n"
            "    'chosen': str(p.choice['t1'])}))\n")
    out = json.loads(sh([sys.executable, "-c", code]).stdout.strip().splitlines()[-1])
    assert out["shape"] == [4, 4, 32, 32] and out["params"] == 4 and out["flops"] == 4 * 4 * 32 * 32
    assert len(out["splits"]) >= 3 and out["chosen"]


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_a_toy_type_trains_under_a_spatial_split_like_one_rank(tmp_path):
    data = tmp_path / "mesh.h5"
    sh([sys.executable, "-m", "lbannpy.data", "mesh", "--size", "32", "--samples", "16", "-o", str(data),
        "-q"])

    def run(ranks: int, parallel: dict, tag: str) -> dict:
        cfg = {"model": TOY_MODEL, "data": {"train": {"path": str(data)}},
               "trainer": {"batch_size": 4, "steps": 3, "seed": 5, "dtype": "float64"},
               "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9},
               "parallel": parallel,
               "checkpoint": {"dir": str(tmp_path / tag / "ckpt"), "every_steps": 0},
               "output": {"dir": str(tmp_path / tag / "out")}}
        spec = tmp_path / f"{tag}.yaml"
        spec.write_text(yaml.safe_dump(cfg))
        driver = ("import sys, toy_layer\nfrom lbannpy.train import main\nraise SystemExit(main())")
        sh([MPIEXEC, "-n", str(ranks), sys.executable, "-c", driver, str(spec), "--quiet"])
        from lbannpy import checkpoint

        _, ckpt = checkpoint.load_newest(str(tmp_path / tag / "ckpt"))
        return {k[len("params/"):]: v for k, v in ckpt["tensors"].items() if k.startswith("params/")}

    one = run(1, {}, "one")
    two = run(2, {"default": {"h": 2}}, "two")
    assert "t1.scale" in one and not np.allclose(one["t1.scale"], 0.5)  # the toy layer trained
    assert one.keys() == two.keys()
    for k in one:
        err = np.abs(one[k] - two[k]).max() / max(np.abs(one[k]).max(), 1e-30)
        assert err <= 1e-10, f"{k} differs by {err:.3g} between 1 rank and 2 ranks (h2)"


def test_config_and_strategy_load_no_layer_family_and_no_mpi():
    code = ("import sys\n"
            "import lbannpy.config, lbannpy.strategy\n"
            "fam = [m for m in sys.modules\n"
            "       if m.startswith('lbannpy.layers.') and m != 'lbannpy.layers.registry']\n"
            "from lbannpy.strategy.graph import build_graph\n"
            "from lbannpy.strategy.planner import plan\n"
            "g = build_graph({'input': {'channels': 3, 'spatial': [8, 8]}, 'layers': [{'name': 'c', 'type': "
            "'conv', 'filters': 4}, {'name': 'f', 'type': 'fc', 'units': 2}]}, 4)\n"
            "plan(g, 2)\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch', 'cupy')]\n"
            "print(fam, heavy)\n")
    assert sh([sys.executable, "-c", code]).stdout.split() == ["[]", "[]"]


@pytest.mark.parametrize("first", ["lbannpy.layers.conv", "lbannpy.layers.loss", "lbannpy.layers.base",
                                   "lbannpy.model", "lbannpy.strategy.cost", "lbannpy.config.checks"])
def test_any_import_order_gives_the_whole_registry(first):
    code = (f"import {first}\nfrom lbannpy.layers.registry import layer_specs, loss_specs\n"
            "print(len(layer_specs()), len(loss_specs()))\n")
    # every module of layers/ and every loss it registers, whatever was imported first
    whole = [str(len(layer_specs())), str(len(loss_specs()))]
    assert sh([sys.executable, "-c", code]).stdout.split() == whole
