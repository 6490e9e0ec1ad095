"""Round trips: YAML -> config.h5 -> YAML gives the normalized YAML, config.h5 -> YAML -> config.h5 gives
an equal tree, for the zoo and for configs generated from the schema itself."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lbannpy import zoo
from lbannpy.config import (FORMAT, SCHEMA, VERSION, ConfigError, load_config, normalize, parse_yaml, read_h5,
                            save_config, to_yaml, validate, write_h5)
from lbannpy.config import io as config_io
from lbannpy.config.schema import COMMON_LAYER_KEYS, LAYER_TYPES, LayerList
from lbannpy.config_types import (INT_LIMIT, NAME_RE, Bool, Float, Int, ListOf, MapOf, Padding, PerDim,
                                  Section, Str)


def strict_equal(a, b) -> bool:
    """Equal values of equal types all the way down (``1 == 1.0 == True`` would hide a type change)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------------------------------------
# the zoo


# the zoo models of up to 200 layers (inception_v3's ~300 only make the suite slower; the generated
# configs below cover concat layers)
ZOO = [n for n in zoo.names() if len(zoo.get_spec(n)["model"]["layers"]) <= 200]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_round_trip(name, tmp_path: Path):
    cfg = validate(zoo.get_spec(name), ranks=4, data=False)
    text = to_yaml(cfg)
    spec = tmp_path / "spec.yaml"
    spec.write_text(text)
    h5 = tmp_path / "config.h5"
    save_config(load_config(str(spec)), str(h5))
    back = load_config(str(h5))
    assert strict_equal(back, cfg)
    assert to_yaml(back) == text  # YAML -> h5 -> YAML is the normalized YAML
    h5b = tmp_path / "again.h5"
    save_config(normalize(parse_yaml(to_yaml(back))), str(h5b))
    assert strict_equal(read_h5(str(h5b)), read_h5(str(h5)))  # h5 -> YAML -> h5: equal trees


def test_config_h5_layout(tmp_path: Path):
    """What h5dump shows: root format/version, groups per section, typed attributes, the layer list."""
    cfg = validate(zoo.get_spec("lenet5"), data=False)
    p = tmp_path / "c.h5"
    save_config(cfg, str(p))
    with h5py.File(p, "r") as f:
        assert f.attrs["format"] == FORMAT and f.attrs["version"] == VERSION
        assert isinstance(f["model"], h5py.Group)
        assert f["model/input"].attrs["spatial"].dtype == np.int64
        assert f["model/layers"].attrs["_kind"] == "list"
        assert f["model/layers/0"].attrs["name"] == cfg["model"]["layers"][0]["name"]
        assert f["comm"].attrs["overlap"].dtype == np.bool_
        assert f["comm"].attrs["bucket_mb"].dtype == np.float64
        assert f["optimizer"].attrs["betas"].tolist() == [0.9, 0.999]
        kinds = set()
        f.visititems(lambda name, obj: kinds.add(type(obj)))
        assert kinds == {h5py.Group}  # attributes only: no datasets, nothing pickled


def test_save_is_atomic(tmp_path: Path, monkeypatch):
    cfg = validate(zoo.get_spec("lenet5"), data=False)
    p = tmp_path / "c.h5"
    save_config(cfg, str(p))
    before = p.read_bytes()

    def boom(group, tree):
        raise RuntimeError("disk full")

    monkeypatch.setattr(config_io, "_write_tree", boom)
    with pytest.raises(RuntimeError):
        save_config(dict(cfg, trainer=dict(cfg["trainer"], seed=7)), str(p))
    assert p.read_bytes() == before  # the old file is untouched
    assert sorted(os.listdir(tmp_path)) == ["c.h5"]  # no temporary left behind


def test_save_refuses_invalid_tree(tmp_path: Path):
    with pytest.raises(ConfigError):
        save_config({"model": {"input": {"channels": 0, "spatial": [4]}, "layers": []}},
                    str(tmp_path / "c.h5"))
    assert not os.listdir(tmp_path)


def test_cli_build_show_round_trip(tmp_path: Path, monkeypatch, capsys):
    from lbannpy.config.__main__ import main

    monkeypatch.chdir(tmp_path)

    def cli(*args):
        capsys.readouterr()
        assert main(list(args)) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    cli("zoo", "mesh_tiny", "-o", "spec.yaml", "--batch-size", "4", "--input-size", "32")
    spec = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    assert spec["trainer"]["batch_size"] == 4 and spec["model"]["input"]["spatial"] == [32, 32]
    cli("build", "spec.yaml", "-o", "config.h5", "--set", "trainer.steps=3")
    shown = cli("show", "config.h5")
    (tmp_path / "shown.yaml").write_text(shown)
    cli("build", "shown.yaml", "-o", "again.h5")
    assert cli("show", "again.h5") == shown
    assert yaml.safe_load(shown)["trainer"]["steps"] == 3
    assert "ok on 4 ranks" in cli("validate", "config.h5", "--ranks", "4", "--no-data")


# --------------------------------------------------------------------------------------------------------
# configs generated from the schema


def values(t):
    """A hypothesis strategy for valid values of schema type ``t`` (driven by the schema itself)."""
    if isinstance(t, Bool):
        return st.booleans()
    if isinstance(t, Int):
        return st.integers(t.lo if t.lo is not None else -INT_LIMIT,
                           t.hi if t.hi is not None else INT_LIMIT - 1)
    if isinstance(t, Float):
        return st.floats(t.lo, t.hi, exclude_min=t.lo_open and t.lo is not None,
                         exclude_max=t.hi_open and t.hi is not None, allow_nan=False, allow_infinity=False)
    if isinstance(t, Str):
        if t.choices:
            return st.sampled_from(t.choices)
        if t.pattern is NAME_RE:
            return st.from_regex(r"[A-Za-z][A-Za-z0-9_\-]{0,6}", fullmatch=True)
        return st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1,
                       max_size=12)
    if isinstance(t, ListOf):
        return st.lists(values(t.item), min_size=t.min_len,
                        max_size=t.max_len if t.max_len is not None else 4)
    if isinstance(t, PerDim):
        return st.one_of(values(t.item), st.lists(values(t.item), min_size=1, max_size=3))
    if isinstance(t, Padding):
        one = st.one_of(st.integers(0, 9), st.sampled_from(t.words))
        return st.one_of(one, st.lists(st.one_of(one, st.lists(st.integers(0, 9), min_size=2, max_size=2)),
                                       min_size=1, max_size=3))
    if isinstance(t, MapOf):
        return st.dictionaries(values(Str(pattern=NAME_RE)), values(t.value), max_size=3)
    if isinstance(t, LayerList):
        return st.lists(layers(), min_size=1, max_size=5)
    if isinstance(t, Section):
        return section(t)
    raise AssertionError(f"no strategy for {t!r}")


def section(sec: Section, keys=None):
    keys = sec.keys if keys is None else keys
    required, optional = {}, {}
    for k in keys:
        if isinstance(k, Section):
            (optional if k.optional else required)[k.name] = values(k)
        else:
            (required if k.required else optional)[k.name] = values(k.type)
    excl = [r.keys for r in sec.rules]

    def one_per_rule(d):
        for ks in excl:
            present = [k for k in ks if k in d]
            for k in present[1:]:
                del d[k]
            if not present and any(r.required for r in sec.rules if r.keys == ks):
                return None
        return d

    return (st.fixed_dictionaries(required, optional=optional).map(one_per_rule)
            .filter(lambda d: d is not None))


@st.composite
def layers(draw):
    ltype = draw(st.sampled_from(list(LAYER_TYPES)))
    keys = tuple(k for k in COMMON_LAYER_KEYS if k.name != "type") + LAYER_TYPES[ltype].params
    layer = draw(section(Section(ltype, "", keys)))
    return {"type": ltype, **layer}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values(SCHEMA))
def test_generated_config_round_trips(raw):
    cfg = normalize(raw)
    assert strict_equal(normalize(cfg), cfg)  # normalizing is idempotent
    text = to_yaml(cfg)
    assert strict_equal(normalize(parse_yaml(text)), cfg)  # YAML round trip
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "c.h5")
        write_h5(cfg, p)
        back = normalize(read_h5(p))
        assert strict_equal(back, cfg)  # h5 round trip
        assert to_yaml(back) == text
        p2 = os.path.join(d, "c2.h5")
        write_h5(normalize(parse_yaml(to_yaml(back))), p2)
        assert strict_equal(read_h5(p2), read_h5(p))
