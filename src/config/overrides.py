"""``--set key=value`` overrides: a dotted key path and a value read by the key's schema type.

A string key takes the text exactly as given (``output.dir=/p/exp #3`` is the directory ``/p/exp #3``;
a value wholly inside matching quotes is read as a YAML quoted string, so ``model.name='007'`` and
``output.dir='null'`` work as they always did); integer, number and boolean keys read one plain value of
their type; keys with several forms (per-dimension lists, padding, sections, lists) are read as YAML, with
text after the value that YAML would drop as a comment refused. ``key=null`` unsets any key.
"""
from __future__ import annotations

import re

import yaml

from lbannpy import yamlsafe

from ..config_errors import ConfigError, did_you_mean, join_path
from .schema import COMMON_LAYER_KEYS, LAYER_TYPES, SCHEMA, LayerList, lookup, normalize
from ..config_types import Bool, Float, Int, Key, ListOf, MapOf, PerDim, Section, Str, copy_tree
from .checks import check_references

_SEGMENT = re.compile(r"^([^.\[\]]+)((?:\[\d+\])*)$")
_INT = re.compile(r"^[-+]?\d{1,40}$")
_FLOAT = re.compile(r"^[-+]?(\d{1,400}\.?\d{0,400}|\.\d{1,400})([eE][-+]?\d{1,4})?$")
_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_NULLS = ("null", "Null", "NULL", "~")


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


def parse_value(text: str, key: str, typ=None, where: str | None = None):
    """The value of ``--set key=text`` for a key of schema type ``typ`` (None: not known, read as YAML);
    errors name ``where`` (the key's resolved path, default ``key``)."""
    where = where or key
    if isinstance(typ, Str):
        return _parse_str(text, where)
    word = text.strip()
    if word in _NULLS:
        return None
    if isinstance(typ, (Int, Float, Bool)):
        value = _parse_plain(word, typ)
        if value is not None:
            return value
        _parse_yaml(text, where, False)  # a YAML problem (an alias bomb, a broken bracket) is named as such
        what, example = (("an integer", "3") if isinstance(typ, Int) else ("a number", "0.01 or 1e-3")
                         if isinstance(typ, Float) else ("true or false", "true"))
        note = "; '#' does not start a comment here" if "#" in text else ""
        raise ConfigError(where, f"cannot parse value {text[:80]!r}: expected {what} ({typ.describe()})",
                          f"write e.g. {key}={example}{note}")
    return _parse_yaml(text, where)


def _parse_plain(word: str, typ):
    """``word`` as an int, float or bool of ``typ``'s kind, or None when it is not one."""
    if isinstance(typ, Int):
        return int(word) if _INT.match(word) else None
    if isinstance(typ, Float):
        return float(word) if _FLOAT.match(word) else None
    return _BOOLS.get(word.lower())


def _parse_str(text: str, key: str):
    """A string key's value: the text as given; ``null`` unsets the key; text wholly inside matching
    quotes is a YAML quoted string (``'007'``, ``'null'``, ``'it''s'``)."""
    if text == "null":
        return None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        try:
            value = _parse_yaml(text, key)
        except ConfigError as e:
            raise ConfigError(key, e.message, "a value in matching quotes is read as a YAML quoted string: "
                                              "double a ' inside '...' ('it''s'), or drop the outer "
                                              "quotes") from None
        if isinstance(value, str):
            return value
    return text


def _parse_yaml(text: str, key: str, whole: bool = True):
    """``text`` read as YAML; ``whole``: refuse text after the value (a comment YAML would drop)."""
    if not text.strip():
        return ""
    try:
        value = yamlsafe.load(text)
        rest = _after_value(text) if whole else ""
    except yamlsafe.YamlLimitError as e:
        raise ConfigError(key, f"cannot use value {text[:60]!r}: {e}",
                          "write the value out plainly") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(key, f"cannot parse value {text[:80]!r}: {problem}",
                          "quote strings that contain ':' or '#', e.g. key='a: b'") from None
    if rest:
        raise ConfigError(key, f"cannot parse value {text[:80]!r}: {rest[:40]!r} after the value is a YAML "
                               f"comment and would be dropped", "remove it (in this key's value ' #' starts "
                                                                "a comment)")
    return value


def _after_value(text: str) -> str:
    """What follows the last token of a YAML text (a comment, which YAML drops silently)."""
    end = 0
    for tok in yaml.scan(text, Loader=yaml.SafeLoader):
        if not isinstance(tok, (yaml.StreamStartToken, yaml.StreamEndToken)):
            end = max(end, tok.end_mark.index)
    return text[end:].strip()


def _child_type(typ, k, container):
    """The schema type of ``container[k]`` for a container of type ``typ`` (None: not known)."""
    if isinstance(typ, Section):
        for f in typ.keys:
            if f.name == k or k in getattr(f, "aliases", ()):
                return f.type if isinstance(f, Key) else f
        return None
    if isinstance(typ, MapOf):
        return typ.value
    if isinstance(typ, (ListOf, PerDim)) and isinstance(k, int):
        return typ.item
    if isinstance(typ, LayerList) and isinstance(k, int) and isinstance(container, list):
        layer = container[k] if 0 <= k < len(container) else None
        ltype = layer.get("type") if isinstance(layer, dict) else None
        if isinstance(ltype, str) and ltype in LAYER_TYPES:
            return Section(ltype, "", COMMON_LAYER_KEYS + LAYER_TYPES[ltype].params)
    return None


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
        node, path, typ = tree, "", SCHEMA
        schema_path: list | None = []  # section names from the root; None once inside a list
        for part in parts[:-1]:
            k = _child(node, part, path)
            typ = _child_type(typ, k, node)
            if isinstance(node, dict):
                if k not in node or node[k] is None:
                    node[k] = {}
                if schema_path is not None:
                    schema_path.append(k)
            else:
                schema_path = None
            node, path = node[k], join_path(path, k)
        last = _child(node, parts[-1], path)
        value = parse_value(text, key, _child_type(typ, last, node), join_path(path, last))
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
