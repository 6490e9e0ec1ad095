"""The value types of the config schema: each checks a value and returns its normal form or raises a
:class:`ConfigError` naming the path; :class:`Key`, :class:`Section`, :class:`OneOf` and :class:`MapOf`
build the tree that :mod:`lbannpy.config.schema` declares. Layer families declare their keys with these
types."""
from __future__ import annotations

import math
import numbers
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from numpy import bool_ as np_bool

from .config_errors import ConfigError, did_you_mean, join_path

# Names of layers become HDF5 group names and ``--set`` path segments: no '/', '.', '[' or spaces.
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")
MAX_SPATIAL_DIMS = 3
INT_LIMIT = 1 << 63  # integers are stored as int64 in config.h5


class _Missing:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Missing()  # a key without a default that must be given
UNSET = None  # a key without a default that may be left out


# --------------------------------------------------------------------------------------------------------
# value types: check(value, path) returns the normal form or raises ConfigError naming the path


def type_name(value) -> str:
    """A value's kind as an error message names it ("an integer", "a list", ...)."""
    if value is None:
        return "nothing (null)"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


def _is_int(v) -> bool:
    # numbers.Integral admits NumPy integers (from other code's arrays); bool is refused, np.bool_ is not
    # Integral
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class Type:
    """A kind of value. Subclasses implement ``check`` and ``describe`` (one short phrase for docs)."""

    def check(self, value, path: str):  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Type):
    lo: int | None = None
    hi: int | None = None

    def check(self, value, path):
        if not _is_int(value):
            hint = "write a whole number without quotes or a decimal point"
            if isinstance(value, float) and value.is_integer():
                hint = f"write {int(value)} instead of {value}"
            raise ConfigError(path, f"expected an integer, got {type_name(value)} {value!r}", hint)
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise ConfigError(path, f"{value} does not fit in 64 bits", "use a smaller number")
        if self.lo is not None and value < self.lo:
            what = "positive" if self.lo == 1 else f">= {self.lo}"
            raise ConfigError(path, f"must be {what}, got {value}",
                              f"use a value of at least {self.lo}")
        if self.hi is not None and value > self.hi:
            raise ConfigError(path, f"must be <= {self.hi}, got {value}", f"use a value of at most {self.hi}")
        return int(value)

    def describe(self):
        return "int" + _range_text(self.lo, self.hi)


_EXP_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


@dataclass(frozen=True)
class Float(Type):
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # True: value must be > lo rather than >= lo
    hi_open: bool = False

    def check(self, value, path):
        if isinstance(value, str) and _EXP_FLOAT.match(value):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as text; YAML 1.2 and users read a number
        if isinstance(value, (bool, np_bool)) or not isinstance(value, numbers.Real):
            raise ConfigError(path, f"expected a number, got {type_name(value)} {value!r}",
                              "write a plain number such as 0.01 or 1e-3, without quotes")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(path, f"must be finite, got {value}", "use a finite number")
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            op = ">" if self.lo_open else ">="
            raise ConfigError(path, f"must be {op} {self.lo}, got {value}", f"use a value {op} {self.lo}")
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            op = "<" if self.hi_open else "<="
            raise ConfigError(path, f"must be {op} {self.hi}, got {value}", f"use a value {op} {self.hi}")
        return value

    def describe(self):
        lo = "" if self.lo is None else ("(" if self.lo_open else "[") + f"{self.lo:g}"
        hi = "" if self.hi is None else f"{self.hi:g}" + (")" if self.hi_open else "]")
        if not lo and not hi:
            return "float"
        return f"float in {lo or '(-inf'}, {hi or 'inf)'}"


@dataclass(frozen=True)
class Bool(Type):
    def check(self, value, path):
        if isinstance(value, np_bool):
            value = bool(value)
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {type_name(value)} {value!r}",
                              "write true or false without quotes")
        return value

    def describe(self):
        return "bool"


@dataclass(frozen=True)
class Str(Type):
    choices: tuple[str, ...] = ()
    pattern: re.Pattern | None = None
    nonempty: bool = True

    def check(self, value, path):
        if not isinstance(value, str):
            want = f"one of {', '.join(self.choices)}" if self.choices else "a string"
            raise ConfigError(path, f"expected {want}, got {type_name(value)} {value!r}",
                              "quote the value if it looks like a number or boolean")
        if self.choices and value not in self.choices:
            raise ConfigError(path, f"unknown value {value!r}", did_you_mean(value, self.choices))
        bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")]
        if bad:  # NUL ends an HDF5 string; line breaks and controls do not survive YAML or a terminal
            raise ConfigError(path, f"{value!r} contains the control character {bad[0]!r}", "remove it")
        if self.nonempty and not value:
            raise ConfigError(path, "must not be empty", "give a non-empty string")
        if self.pattern is not None and not self.pattern.match(value):
            raise ConfigError(path, f"{value!r} is not a valid name",
                              "start with a letter; use only letters, digits, '_' and '-'")
        return value

    def describe(self):
        return "|".join(self.choices) if self.choices else "str"


class Switch(Str):
    """A :class:`Str` of choices that include ``on`` and ``off``: YAML 1.1 reads a bare ``on``/``off``
    (as ``--set key=on`` writes it) as a boolean, which is taken as the word it was."""

    def check(self, value, path):
        if isinstance(value, bool):
            value = "on" if value else "off"
        return super().check(value, path)


class Registered(Str):
    """A string naming an entry of a registry (e.g. the losses that layers/ declares): a :class:`Str` whose
    ``choices`` are read when a value is checked, not when the schema is built (the schema module must load
    without the layer families)."""

    def __init__(self, what: str, names):
        for k, v in (("pattern", None), ("nonempty", True), ("what", what), ("names", names)):
            object.__setattr__(self, k, v)

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self.names())


@dataclass(frozen=True)
class ListOf(Type):
    item: Type
    min_len: int = 0
    max_len: int | None = None

    def check(self, value, path):
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list of {self.item.describe()}, got {type_name(value)} "
                                    f"{value!r}", "write a list such as [1, 2]")
        n = len(value)
        if n < self.min_len or (self.max_len is not None and n > self.max_len):
            span = (f"{self.min_len}" if self.min_len == self.max_len
                    else f"{self.min_len} to {self.max_len if self.max_len is not None else 'any'}")
            raise ConfigError(path, f"expected {span} entries, got {n}", f"give {span} entries")
        return [self.item.check(v, join_path(path, i)) for i, v in enumerate(value)]

    def describe(self):
        n = ("" if self.max_len is None and not self.min_len else
             f"{self.min_len}" if self.min_len == self.max_len else
             f"{self.min_len}..{'' if self.max_len is None else self.max_len}")
        return f"[{self.item.describe()}]" + (f"×{n}" if n else "")


@dataclass(frozen=True)
class PerDim(Type):
    """One value for every spatial dimension, or a list with one entry per spatial dimension."""

    item: Type

    def check(self, value, path):
        if isinstance(value, list):
            return ListOf(self.item, 1, MAX_SPATIAL_DIMS).check(value, path)
        return self.item.check(value, path)

    def describe(self):
        d = self.item.describe()
        return f"{d} | [{d}] per spatial dim"


@dataclass(frozen=True)
class Padding(Type):
    """``int >= 0``, ``'same'``, ``'valid'``, ``[lo, hi]`` or a per-dimension list of those
    (as in :meth:`lbannpy.stencil.Stencil.conv`: a two-int list means ``[lo, hi]`` only for one spatial
    dimension, otherwise one entry per dimension)."""

    words: tuple[str, ...] = ("same", "valid")

    def _one(self, value, path, allow_pair: bool):
        if isinstance(value, str):
            return Str(self.words).check(value, path)
        if isinstance(value, list) and allow_pair:
            return ListOf(Int(0), 2, 2).check(value, path)
        if _is_int(value):
            return Int(0).check(value, path)
        raise ConfigError(path, f"expected padding (an int >= 0, 'same', 'valid' or [lo, hi]), got "
                                f"{type_name(value)} {value!r}", "write e.g. 1, 'same' or [0, 1]")

    def check(self, value, path):
        if isinstance(value, list):
            if not 1 <= len(value) <= MAX_SPATIAL_DIMS:
                raise ConfigError(path, f"expected 1 to {MAX_SPATIAL_DIMS} entries, got {len(value)}",
                                  "give one entry per spatial dimension, or [lo, hi]")
            return [self._one(v, join_path(path, i), True) for i, v in enumerate(value)]
        return self._one(value, path, False)

    def describe(self):
        return "int>=0 | same | valid | [lo, hi] | per-dim list"


def _range_text(lo, hi) -> str:
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f" >= {lo}"
    if lo is None:
        return f" <= {hi}"
    return f" in [{lo}, {hi}]"


# --------------------------------------------------------------------------------------------------------
# keys, sections, rules


@dataclass(frozen=True)
class Key:
    name: str
    type: Type
    default: Any = UNSET  # REQUIRED, UNSET (may be absent) or a value in normal form
    doc: str = ""
    default_from: str | None = None  # when unset, copy the (normalized) value of this sibling key
    aliases: tuple[str, ...] = ()  # other accepted spellings; the normal form uses ``name``
    # ``((sibling, value, default), ...)``: when unset and the sibling key holds that value, this default
    # instead of ``default`` (Adam's learning rate)
    default_when: tuple = ()

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def default_text(self) -> str:
        if self.required:
            return "required"
        if self.default_from:
            return self.default_from
        if self.default is UNSET:
            return "optional"
        when = "".join(f"; {sib} {val}: {_yaml_scalar(d)}" for sib, val, d in self.default_when)
        return _yaml_scalar(self.default) + when


@dataclass(frozen=True)
class OneOf:
    """At most one of ``keys`` may be given (exactly one when ``required``); ``default`` fills
    ``(key, value)`` when none is given."""

    keys: tuple[str, ...]
    required: bool = False
    default: tuple[str, Any] | None = None

    def describe(self) -> str:
        what = "exactly one" if self.required else "at most one"
        d = f"; default {self.default[0]}: {_yaml_scalar(self.default[1])}" if self.default else ""
        return f"{what} of {', '.join(self.keys)}{d}"


@dataclass(frozen=True)
class Section(Type):
    """A mapping with a fixed set of keys. ``optional``: when absent from its parent it stays absent
    (instead of being filled with defaults)."""

    name: str
    doc: str
    keys: tuple = ()  # Key or Section, in the order they are written
    rules: tuple[OneOf, ...] = ()
    optional: bool = False

    def field(self, name: str):
        for k in self.keys:
            if k.name == name:
                return k
        return None

    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    def _unalias(self, value: dict, path: str) -> dict:
        out = dict(value)
        for k in self.keys:
            for a in getattr(k, "aliases", ()):
                if a in out:
                    if out.get(k.name) is not None:
                        raise ConfigError(join_path(path, a),
                                          f"{a!r} and {k.name!r} give the same value twice",
                                          f"keep only {k.name!r}")
                    out[k.name] = out.pop(a)
        return out

    def check(self, value, path):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(path or "(top level)",
                              f"expected a mapping of keys ({', '.join(self.names())}), "
                              f"got {type_name(value)} {value!r}",
                              "write 'key: value' lines indented under the section")
        value = self._unalias(value, path)
        for k in value:
            if not isinstance(k, str) or self.field(k) is None:
                raise ConfigError(join_path(path, str(k)), f"unknown key {str(k)!r} in {path or 'the spec'}",
                                  did_you_mean(str(k), self.names(), "keys"))
        given = {k: v for k, v in value.items() if v is not None}
        for rule in self.rules:
            both = [k for k in rule.keys if k in given]
            if len(both) > 1:
                raise ConfigError(join_path(path, both[1]), f"{' and '.join(both)} are exclusive",
                                  f"give only one of {', '.join(rule.keys)}")
            if not both and rule.required:
                raise ConfigError(path, f"needs one of {', '.join(rule.keys)}",
                                  f"add one of {', '.join(rule.keys)}")
        out = {}
        for k in self.keys:
            kpath = join_path(path, k.name)
            if isinstance(k, Section):
                if k.name in value:
                    out[k.name] = k.check(value[k.name], kpath)
                elif not k.optional:
                    out[k.name] = k.check({}, kpath)
                continue
            if k.name in given:
                out[k.name] = k.type.check(given[k.name], kpath)
            elif k.required:
                raise ConfigError(kpath, f"missing required key {k.name!r}",
                                  f"add {k.name}: {k.type.describe()} ({k.doc})")
            elif k.default_from is None and k.default is not UNSET:
                out[k.name] = copy_tree(k.default)
        for k in self.keys:  # defaults copied from siblings, once those are normal
            if isinstance(k, Key) and k.default_from and k.name not in out and k.default_from in out:
                out[k.name] = copy_tree(out[k.default_from])
        for k in self.keys:  # defaults that depend on a sibling's value
            if isinstance(k, Key) and k.name not in given:
                for sib, val, d in k.default_when:
                    if out.get(sib) == val:
                        out[k.name] = copy_tree(d)
        for rule in self.rules:
            if rule.default and not any(k in out for k in rule.keys):
                out[rule.default[0]] = copy_tree(rule.default[1])
        return {k: out[k] for k in self.names() if k in out}  # schema order

    def describe(self):
        return "{" + ", ".join(self.names()) + "}"


@dataclass(frozen=True)
class MapOf(Type):
    """A mapping from user-chosen names (e.g. layer names) to values of one type."""

    value: Type
    doc: str = ""

    def check(self, value, path):
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping of names, got {type_name(value)} {value!r}",
                              "write 'name: {...}' entries")
        out = {}
        for k, v in value.items():
            kp = join_path(path, str(k))
            Str(pattern=NAME_RE).check(k, kp)
            out[k] = self.value.check(v, kp)
        return {k: out[k] for k in sorted(out)}  # sorted: HDF5 lists group members by name

    def describe(self):
        return "{name: " + self.value.describe() + "}"


# --------------------------------------------------------------------------------------------------------
# the layer registry


def copy_tree(v):
    """A copy of a config tree's lists and mappings (leaves shared: they are immutable)."""
    if isinstance(v, list):
        return [copy_tree(x) for x in v]
    if isinstance(v, dict):
        return {k: copy_tree(x) for k, x in v.items()}
    return v


def _yaml_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml_scalar(x)}" for k, x in v.items()) + "}"
    if isinstance(v, float):
        return repr(v)
    return str(v)
