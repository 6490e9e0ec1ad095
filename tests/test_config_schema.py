"""The schema: every default, the layer registry, aliases and the schema listing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from lbannpy.config import (COMMON_LAYER_KEYS, SCHEMA, ConfigError, layer_params, layer_type, layer_types,
                            normalize, parse_spec, schema_text)
from lbannpy.config_types import Key, Section

MINIMAL = {"model": {"input": {"channels": 3, "spatial": [8, 8]},
                     "layers": [{"name": "f1", "type": "fc", "units": 2}]}}

# The documented defaults (DESIGN.md and the config issue). Written out rather than read from the schema,
# so that changing a default in the schema fails here until this contract is changed too.
DEFAULTS = {
    "model.name": "model", "model.loss": "cross_entropy",
    "trainer.batch_size": 1, "trainer.epochs": 1, "trainer.seed": 0, "trainer.dtype": "float32",
    "trainer.eval_every": 0, "trainer.watchdog_s": 600.0,
    "optimizer.type": "sgd", "optimizer.lr": 0.01, "optimizer.momentum": 0.0, "optimizer.nesterov": False,
    "optimizer.weight_decay": 0.0, "optimizer.betas": [0.9, 0.999], "optimizer.eps": 1e-8,
    "optimizer.shard_state": False,
    "optimizer.schedule.type": "none", "optimizer.schedule.warmup_steps": 0,
    "optimizer.schedule.step_size": 1000, "optimizer.schedule.gamma": 0.1,
    "parallel.default.n": 1, "parallel.default.c": 1, "parallel.default.d": 1, "parallel.default.h": 1,
    "parallel.default.w": 1, "parallel.layers": {}, "parallel.strategy": "manual",
    "parallel.machine": "local",
    "comm.bucket_mb": 25.0, "comm.first_bucket_mb": 1.0, "comm.overlap": True, "comm.replicate_fc": 0,
    "comm.chunks.k": 0, "runtime.kernels": "auto", "runtime.tf32": False, "runtime.cuda_graph": "auto",
    "checkpoint.keep": 3, "checkpoint.every_steps": 0, "checkpoint.at_start": False,
    "output.dir": "run", "output.log_every": 1, "output.trace": False,
    "runtime.backend": "auto", "runtime.device": "cpu", "runtime.threads": 0, "runtime.share_gpu": False,
}

LAYER_DEFAULTS = {
    "conv": {"kernel": 3, "stride": 1, "padding": 0, "dilation": 1, "bias": True, "groups": 1,
             "padding_mode": "zeros"},
    "pool": {"mode": "max", "kernel": 2, "stride": 2, "padding": 0, "global": False},
    "batchnorm": {"eps": 1e-5, "momentum": 0.1, "sync": "group"},
    "relu": {}, "leaky_relu": {"slope": 0.01}, "dropout": {"p": 0.5},
    "sum": {}, "concat": {"axis": 1}, "fc": {"bias": True}, "flatten": {},
}
REQUIRED_PARAMS = {"conv": {"filters": 4}, "fc": {"units": 2}}


def _get(tree, dotted):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _schema_keys(sec: Section, prefix=""):
    for k in sec.keys:
        path = f"{prefix}{k.name}"
        if isinstance(k, Section):
            yield from _schema_keys(k, path + ".")
        else:
            yield path, k


@pytest.mark.parametrize("dotted", sorted(DEFAULTS))
def test_default(dotted):
    cfg = normalize(MINIMAL)
    value = _get(cfg, dotted)
    assert value == DEFAULTS[dotted] and type(value) is type(DEFAULTS[dotted])


def test_every_schema_default_is_listed_and_filled():
    """The keys with a default (outside the optional data section) are exactly those in DEFAULTS, and all
    of them are filled in the normal form of a minimal spec; a key without a default stays absent."""
    cfg = normalize(MINIMAL)
    keys = {p: k for p, k in _schema_keys(SCHEMA) if not p.startswith("data.")}
    with_default = {p for p, k in keys.items() if not k.required and k.default is not None}
    with_default.add("trainer.epochs")  # the default of the epochs|steps rule
    assert with_default == set(DEFAULTS)
    for p in with_default:
        _get(cfg, p)
    assert "steps" not in cfg["trainer"] and "data" not in cfg


def test_data_defaults():
    cfg = normalize(dict(MINIMAL, data={"train": {"path": "d.h5"}}))
    assert cfg["data"] == {"train": {"path": "d.h5", "inputs": "inputs", "labels": "labels", "shuffle": True},
                           "prefetch": 2, "preload": "auto"}


def test_steps_replaces_epochs_default():
    cfg = normalize(dict(MINIMAL, trainer={"steps": 5}))
    assert cfg["trainer"]["steps"] == 5 and "epochs" not in cfg["trainer"]


def test_registry_lists_the_layer_types():
    assert layer_types() == ["conv", "conv_transpose", "pool", "global_pool", "pad", "upsample",
                             "batchnorm", "instancenorm", "groupnorm", "layernorm", "relu", "leaky_relu",
                             "sigmoid", "tanh", "gelu", "silu", "elu", "prelu", "softmax", "identity",
                             "dropout", "sum", "mul", "concat", "fc", "flatten"]
    assert list(layer_params("conv")) == ["filters", "kernel", "stride", "padding", "dilation", "bias",
                                          "groups", "padding_mode"]
    assert [k.name for k in COMMON_LAYER_KEYS] == ["name", "type", "parents"]
    assert layer_type("sum").min_parents == 2 and layer_type("sum").max_parents is None
    with pytest.raises(ConfigError, match="did you mean 'conv'"):
        layer_params("cnv")


@pytest.mark.parametrize("ltype", sorted(LAYER_DEFAULTS))
def test_layer_defaults(ltype):
    layer = {"name": "l1", "type": ltype, **REQUIRED_PARAMS.get(ltype, {})}
    spec = {"model": {"input": {"channels": 3, "spatial": [8, 8]}, "layers": [layer]}}
    if ltype in ("sum", "concat"):
        layer["parents"] = ["x", "input"]
    out = normalize(spec)["model"]["layers"][0]
    expect_parents = layer.get("parents", ["x"])
    assert out == {"name": "l1", "type": ltype, "parents": expect_parents, **REQUIRED_PARAMS.get(ltype, {}),
                   **LAYER_DEFAULTS[ltype]}
    assert list(out)[:3] == ["name", "type", "parents"]


def test_parents_default_to_previous_layer():
    spec = {"model": {"input": {"channels": 1, "spatial": [4]},
                      "layers": [{"name": "a", "type": "relu"}, {"name": "b", "type": "relu"},
                                 {"name": "c", "type": "sum", "parents": ["a", "b"]}]}}
    layers = parse_spec(spec)["model"]["layers"]
    assert [x["parents"] for x in layers] == [["x"], ["a"], ["a", "b"]]


def test_pool_stride_defaults_to_kernel():
    spec = {"model": {"input": {"channels": 1, "spatial": [8, 8]},
                      "layers": [{"name": "p", "type": "pool", "kernel": [3, 2]}]}}
    assert normalize(spec)["model"]["layers"][0]["stride"] == [3, 2]


def test_aliases_normalize_to_one_name():
    spec = {"model": {"input": {"channels": 1, "spatial": [8]},
                      "layers": [{"name": "d", "type": "dropout", "rate": 0.25},
                                 {"name": "l", "type": "leaky_relu", "negative_slope": 0.2}]}}
    layers = normalize(spec)["model"]["layers"]
    assert layers[0]["p"] == 0.25 and "rate" not in layers[0]
    assert layers[1]["slope"] == 0.2
    spec["model"]["layers"][0]["p"] = 0.5
    with pytest.raises(ConfigError) as info:
        normalize(spec)
    assert info.value.path == "model.layers[0].rate"


@pytest.mark.parametrize("padding,ok", [
    (1, True), ("same", True), ("valid", True), ([0, 1], True), ([[0, 1], "same"], True), ([1, [2, 3]], True),
    (-1, False), ("full", False), ([1, 2, 3, 4], False), ([[1, 2, 3]], False), (1.5, False), (True, False),
])
def test_padding_forms(padding, ok):
    spec = {"model": {"input": {"channels": 1, "spatial": [8, 8]},
                      "layers": [{"name": "c", "type": "conv", "filters": 1, "padding": padding}]}}
    if ok:
        assert normalize(spec)["model"]["layers"][0]["padding"] == padding
    else:
        with pytest.raises(ConfigError) as info:
            normalize(spec)
        assert info.value.path.startswith("model.layers[0].padding")


@pytest.mark.parametrize("value", [True, "3", 3.5, None, [3]])
def test_int_key_refuses_other_types(value):
    spec = dict(MINIMAL, trainer={"batch_size": value})
    if value is None:  # null means unset: the default applies
        assert normalize(spec)["trainer"]["batch_size"] == 1
        return
    with pytest.raises(ConfigError, match="expected an integer") as info:
        normalize(spec)
    assert info.value.path == "trainer.batch_size"


def test_int_beyond_64_bits_is_refused():
    with pytest.raises(ConfigError, match="64 bits"):
        normalize(dict(MINIMAL, trainer={"seed": 1 << 63}))


def test_schema_text_documents_every_key():
    text = schema_text()
    for path, key in _schema_keys(SCHEMA):
        assert f"{key.name}: " in text, path
        assert key.doc and key.doc in text, path
    for t in layer_types():
        assert f"\n{t}:" in text
        for p in layer_params(t).values():
            assert f"  {p.name}: " in text and p.doc in text


def test_cli_schema_prints_the_schema():
    r = subprocess.run([sys.executable, "-m", "lbannpy.config", "schema"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout == schema_text()


def test_keys_are_well_formed():
    """Defaults satisfy their own types (a schema mistake would otherwise surface only in some run)."""
    for path, key in _schema_keys(SCHEMA):
        assert isinstance(key, Key)
        if not key.required and key.default is not None:
            assert key.type.check(key.default, path) == key.default, path
    for t in layer_types():
        for p in layer_params(t).values():
            if not p.required and p.default is not None:
                assert p.type.check(p.default, p.name) == p.default


@pytest.mark.parametrize("text", ["a\x00b", "line\nbreak", "nel\x85", "sep\u2028"],
                         ids=["nul", "newline", "nel", "line-separator"])
def test_strings_refuse_control_characters(text):
    with pytest.raises(ConfigError, match="control character") as info:
        normalize(dict(MINIMAL, output={"dir": text}))
    assert info.value.path == "output.dir"


def test_unicode_strings_are_kept():
    assert normalize(dict(MINIMAL, output={"dir": "résultats/λ"}))["output"]["dir"] == "résultats/λ"


@pytest.mark.parametrize("text,value", [("1e-3", 1e-3), ("2E2", 200.0), ("1.5e-4", 1.5e-4), ("-3e1", None)])
def test_exponent_floats_from_yaml(text, value):
    """PyYAML (YAML 1.1) reads 1e-3 as a string; a number key takes it as the number it is."""
    from lbannpy.config import parse_yaml

    spec = parse_yaml(f"model: {{input: {{channels: 1, spatial: [4]}}, "
                      f"layers: [{{name: f, type: fc, units: 2}}]}}\n"
                      f"optimizer: {{lr: {text}}}\n")
    if value is None:
        with pytest.raises(ConfigError, match="must be > 0"):
            normalize(spec)
    else:
        assert normalize(spec)["optimizer"]["lr"] == value
    with pytest.raises(ConfigError, match="expected a number"):
        normalize(dict(MINIMAL, optimizer={"lr": "fast"}))


def test_numpy_scalars_from_other_code_normalize_to_python():
    import numpy as np

    spec = {"model": {"input": {"channels": np.int64(3), "spatial": [np.int32(8)]},
                      "layers": [{"name": "f", "type": "fc", "units": np.int16(2)}]},
            "optimizer": {"lr": np.float32(0.5)}, "comm": {"overlap": np.bool_(False)}}
    cfg = normalize(spec)
    assert type(cfg["model"]["input"]["channels"]) is int and type(cfg["model"]["input"]["spatial"][0]) is int
    assert type(cfg["optimizer"]["lr"]) is float and cfg["comm"]["overlap"] is False
    with pytest.raises(ConfigError, match="expected an integer"):
        normalize(dict(spec, trainer={"batch_size": np.bool_(True)}))
