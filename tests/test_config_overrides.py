"""``--set key=value`` overrides."""
from __future__ import annotations

import pytest

from lbannpy.config import ConfigError, apply_overrides, parse_spec

SPEC = {
    "model": {"input": {"channels": 3, "spatial": [8, 8]},
              "layers": [{"name": "c1", "type": "conv", "filters": 4, "padding": 1},
                         {"name": "r1", "type": "relu"},
                         {"name": "f1", "type": "fc", "units": 10}]},
    "data": {"train": {"path": "d.h5"}, "validation": {"fraction": 0.1}},
    "trainer": {"batch_size": 8, "epochs": 2},
}


@pytest.fixture
def cfg():
    return parse_spec(SPEC)


def test_the_documented_examples(cfg):
    out = apply_overrides(cfg, ["trainer.steps=3", "parallel.default.h=2", "model.layers.c1.filters=8"])
    assert out["trainer"]["steps"] == 3 and "epochs" not in out["trainer"]  # exclusive pair
    assert out["parallel"]["default"]["h"] == 2
    assert out["model"]["layers"][0]["filters"] == 8
    assert cfg["trainer"]["epochs"] == 2 and "steps" not in cfg["trainer"]  # the input is not changed


@pytest.mark.parametrize("item,path,value", [
    ("model.layers[2].units=5", ("model", "layers", 2, "units"), 5),
    ("model.layers.2.units=5", ("model", "layers", 2, "units"), 5),
    ("model.layers.c1.kernel=[3, 5]", ("model", "layers", 0, "kernel"), [3, 5]),
    ("model.layers.c1.padding=same", ("model", "layers", 0, "padding"), "same"),
    ("optimizer.lr=1e-3", ("optimizer", "lr"), 0.001),
    ("optimizer.lr=1", ("optimizer", "lr"), 1.0),
    ("comm.overlap=false", ("comm", "overlap"), False),
    ("output.dir='007'", ("output", "dir"), "007"),
    ("parallel.layers.f1={c: 2}", ("parallel", "layers", "f1", "c"), 2),
    ("parallel.layers.f1.n=2", ("parallel", "layers", "f1", "n"), 2),
    ("data.validation.path=v.h5", ("data", "validation", "path"), "v.h5"),
    ("trainer.epochs=null", ("trainer", "epochs"), 1),
    ("model.layers.r1.parents=[x]", ("model", "layers", 1, "parents"), ["x"]),
    # a string key takes the text as given; a value wholly in quotes is a YAML quoted string
    ("output.dir=/p/exp #3", ("output", "dir"), "/p/exp #3"),
    ("output.dir=it's", ("output", "dir"), "it's"),
    ("output.dir='it''s'", ("output", "dir"), "it's"),
    ("output.dir='null'", ("output", "dir"), "null"),
    ("model.name=007", ("model", "name"), "007"),
    ("model.name=a: b", ("model", "name"), "a: b"),
    ("runtime.cuda_graph=on", ("runtime", "cuda_graph"), "on"),
    # numbers and booleans by their type; keys of several forms stay YAML
    ("trainer.steps= 4 ", ("trainer", "steps"), 4),
    ("optimizer.lr=.5", ("optimizer", "lr"), 0.5),
    ("comm.overlap=off", ("comm", "overlap"), False),
    ("optimizer.betas[0]=0.8", ("optimizer", "betas", 0), 0.8),
    ("model.layers.c1.kernel=3", ("model", "layers", 0, "kernel"), 3),
    ("model.layers.c1.padding=[0, 1]", ("model", "layers", 0, "padding"), [0, 1]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_override_forms(cfg, item, path, value):
    out = apply_overrides(cfg, [item])
    node = out
    for p in path:
        node = node[p]
    assert node == value and type(node) is type(value)


def test_validation_path_replaces_fraction(cfg):
    out = apply_overrides(cfg, ["data.validation.path=v.h5"])
    assert out["data"]["validation"] == {"path": "v.h5"}


def test_later_overrides_win(cfg):
    assert apply_overrides(cfg, ["trainer.seed=1", "trainer.seed=2"])["trainer"]["seed"] == 2


@pytest.mark.parametrize("item,path,phrase", [
    ("trainer.stesp=3", "trainer.stesp", "did you mean 'steps'"),
    ("trainr.steps=3", "trainr", "did you mean 'trainer'"),
    ("model.layers.c2.filters=8", "model.layers.c2", "did you mean 'c1'"),
    ("model.layers[7].filters=8", "model.layers[7]", "outside a list of 3"),
    ("model.layers.c1.filters=0", "model.layers[0].filters", "must be positive"),
    ("model.layers.c1.filters=eight", "model.layers[0].filters", "expected an integer"),
    ("model.layers.c1.units=8", "model.layers[0].units", "parameter of fc"),
    ("trainer.steps", "trainer.steps", "no '='"),
    ("trainer.steps=[1, 2", "trainer.steps", "cannot parse value"),
    ("trainer.batch_size.x=1", "trainer.batch_size", "holds a value"),
    ("model..name=a", "model..name", "malformed key"),
    ("model.layers.r1.name=c1", "model.layers[1].name", "duplicate layer name"),
    ("model.layers.c1.parents=[f1]", "model.layers[0].parents", "cycle"),
    ("trainer.steps=!!python/object:os.system ls", "trainer.steps", "cannot parse value"),
    ("trainer.steps=3 #x", "trainer.steps", "expected an integer"),
    ("comm.overlap=maybe", "comm.overlap", "expected true or false"),
    ("optimizer.lr=fast", "optimizer.lr", "expected a number"),
    ("model.layers.c1.kernel=[3, 5] # c", "model.layers[0].kernel", "YAML comment"),
    ("output.dir='it's'", "output.dir", "YAML quoted string"),
], ids=lambda v: v if isinstance(v, str) and "=" in v or v == "trainer.steps" else None)
def test_bad_override(cfg, item, path, phrase):
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, [item])
    assert info.value.path.startswith(path), str(info.value)
    assert phrase in str(info.value)


def test_unsetting_one_key_of_a_pair_keeps_the_other(cfg):
    # the README's way to count steps in a zoo spec that counts epochs, in either order
    for items in (["trainer.steps=3", "trainer.epochs=null"], ["trainer.epochs=null", "trainer.steps=3"]):
        out = apply_overrides(cfg, items)
        assert out["trainer"]["steps"] == 3 and "epochs" not in out["trainer"], items
