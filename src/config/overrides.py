"""``--set key=value`` overrides: a dotted key path and a YAML scalar (or flow list/mapping) value."""
from __future__ import annotations

import re

import yaml

from lbannpy import yamlsafe

from ..config_errors import ConfigError, did_you_mean, join_path
from .schema import lookup, normalize
from ..config_types import Section, copy_tree
from .checks import check_references

_SEGMENT = re.compile(r"^([^.\[\]]+)((?:\[\d+\])*)$")


def parse_key(key: str) -> list:
    """``'model.layers[3].kernel'`` -> ``['model', 'layers', 3, 'kernel']``; digits alone are indices
    (``model.layers.3.kernel``); any other segment after a list selects the layer of that name."""
    if not key:
        raise ConfigError("--set", "empty key", "write key=value, e.g. trainer.steps=3")
    parts: list = []
    for seg in key.split("."):
        m = _SEGMENT.match(seg)
        if not m:
            raise ConfigError(key, f"malformed key segment {seg!r}", "write e.g. model.layers.c1.filters or "
                                                                      "model.layers[0].filters")
        name, idx = m.groups()
        parts.append(int(name) if name.isdigit() else name)
        parts += [int(i) for i in re.findall(r"\[(\d+)\]", idx)]
    return parts


def parse_value(text: str, key: str):
    try:
        return yamlsafe.load(text) if text.strip() else ""
    except yamlsafe.YamlLimitError as e:
        raise ConfigError(key, f"cannot use value {text[:60]!r}: {e}",
                          "write the value out plainly") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(key, f"cannot parse value {text!r}: {problem}",
                          "quote strings that contain ':' or '#', e.g. key='a: b'") from None


def _child(node, part, path: str):
    """The child of a dict or list for one key segment (a list of layers is indexed by name too)."""
    if isinstance(node, list):
        if isinstance(part, int):
            if not 0 <= part < len(node):
                raise ConfigError(join_path(path, part), f"index {part} outside a list of {len(node)}",
                                  f"use an index below {len(node)}")
            return part
        names = [x.get("name") for x in node if isinstance(x, dict)]
        if part not in names:
            raise ConfigError(f"{path}.{part}", f"no entry named {part!r} in {path}",
                              did_you_mean(part, [n for n in names if isinstance(n, str)], "names"))
        return names.index(part)
    if isinstance(node, dict):
        return str(part)
    raise ConfigError(path, f"{path} holds a value, not a section", "set the key itself, not a sub-key")


def apply_overrides(cfg: dict, overrides) -> dict:
    """A copy of ``cfg`` with each ``"key=value"`` applied in order, then normalized and checked.

    Setting one key of an exclusive pair (``trainer.epochs``/``trainer.steps``, ``data.validation.path``
    /``fraction``) drops the other; ``key=null`` unsets a key (its default applies again) and leaves the
    other key of its pair alone (``trainer.steps=3 trainer.epochs=null`` runs 3 steps).
    """
    tree = copy_tree(cfg)
    for item in overrides:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(key or "--set", f"override {item!r} has no '='", "write key=value, e.g. "
                                                                              "trainer.steps=3")
        parts = parse_key(key)
        value = parse_value(text, key)
        node, path = tree, ""
        schema_path: list | None = []  # section names from the root; None once inside a list
        for part in parts[:-1]:
            k = _child(node, part, path)
            if isinstance(node, dict):
                if k not in node or node[k] is None:
                    node[k] = {}
                if schema_path is not None:
                    schema_path.append(k)
            else:
                schema_path = None
            node, path = node[k], join_path(path, k)
        last = _child(node, parts[-1], path)
        node[last] = value
        section = lookup(schema_path) if schema_path is not None and isinstance(node, dict) else None
        for rule in section.rules if isinstance(section, Section) and value is not None else ():
            if last in rule.keys:
                for other in rule.keys:
                    if other != last:
                        node.pop(other, None)
    out = normalize(tree)
    check_references(out)
    return out
