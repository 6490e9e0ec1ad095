"""The run config: the validated spec as one frozen, typed value, built once (:func:`run_config`) and passed
to everything that reads settings.

Each section of :data:`~lbannpy.config.schema.SCHEMA` is a frozen dataclass with one field per key, holding
the value in the schema's normal form (lists as tuples, mappings read-only): ``run.trainer.batch_size`` is an
``int`` and always there, since validation filled every default. No code outside the schema states a
default; a key the schema leaves unset (``checkpoint.dir``) is ``None``, and an optional section that was
not given (``data.validation``) is ``None``. A run config has no ``get``: a missing key is an
``AttributeError`` at the line that reads it, not a second default.

``run.spec`` is the validated tree itself, for the code that takes the whole tree (the model graph, the
strategy planner, the memory estimate, the checkpoint's record of the computation).
"""
from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from types import MappingProxyType
from typing import Any

from ..config_types import Section
from .schema import SCHEMA


def _freeze(value):
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _class_name(section: Section, prefix: str) -> str:
    return prefix + "".join(part.capitalize() for part in section.name.split("_"))


def _section_class(section: Section, prefix: str = "") -> type:
    name = _class_name(section, prefix)
    cls = make_dataclass(name, [(k.name, Any) for k in section.keys], frozen=True)
    cls.__doc__ = f"``{prefix.lower() + '.' if prefix else ''}{section.name}``: {section.doc}"
    cls.__module__ = __name__
    return cls


_CLASSES: dict[int, type] = {}


def _classes(section: Section, prefix: str = "") -> None:
    _CLASSES[id(section)] = _section_class(section, prefix)
    for k in section.keys:
        if isinstance(k, Section):
            _classes(k, _class_name(section, prefix))


for _top in SCHEMA.keys:
    if isinstance(_top, Section):
        _classes(_top)


def section_value(section: Section, tree: dict):
    """The frozen value of one section of a validated tree (the schema's normal form)."""
    kw = {}
    for k in section.keys:
        if isinstance(k, Section):
            kw[k.name] = None if tree.get(k.name) is None else section_value(k, tree[k.name])
        else:
            kw[k.name] = _freeze(tree.get(k.name))
    return _CLASSES[id(section)](**kw)


def section_config(name: str, given: dict | None):
    """A top-level section from values a caller gives (a benchmark's optimizer, a test's), checked and
    filled with the schema's defaults as a spec's would be."""
    section = SCHEMA.field(name)
    return section_value(section, section.check(dict(given or {}), name))


@dataclass(frozen=True)
class RunConfig:
    """One run's settings, by section (see the module docstring)."""

    spec: Any
    model: Any
    data: Any
    trainer: Any
    optimizer: Any
    parallel: Any
    comm: Any
    checkpoint: Any
    output: Any
    runtime: Any


def run_config(spec: dict) -> RunConfig:
    """The run config of a validated spec (:func:`lbannpy.config.validate`'s result)."""
    sections = {k.name: (None if spec.get(k.name) is None else section_value(k, spec[k.name]))
                for k in SCHEMA.keys if isinstance(k, Section)}
    return RunConfig(spec=spec, **sections)


def launch_sections(cfg: dict | None) -> tuple:
    """``(runtime, output)`` of a config in normal form (:func:`lbannpy.config.load_config`'s result, every
    default filled), or of the schema's defaults where the config could not be read: what a command needs
    before its full validation, to start its Runtime and to say where a traceback goes."""
    values = []
    for name in ("runtime", "output"):
        section = SCHEMA.field(name)
        tree = cfg[name] if cfg else section.check({}, name)
        values.append(section_value(section, tree))
    return tuple(values)
