"""Bounded YAML: what every spec, ``--set`` value and machine file is read with.

``yaml.safe_load`` never runs code, but it expands aliases (a 280-byte alias bomb becomes gigabytes),
recurses once per nesting level (a spec nested 50 000 deep is a RecursionError), silently keeps the last
of two equal keys, and is slow enough that a huge text keeps a job busy for minutes before its error.
:func:`load` refuses all four before the tree is built, naming line and column (a text over
:data:`MAX_BYTES` before parsing, with the limit in the message).
"""
from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 64  # nesting of mappings and lists; the deepest real spec is 5
MAX_BYTES = 4 << 20  # a spec is a few KiB (the largest zoo model's is under 100 KiB)


class YamlLimitError(ValueError):
    """A YAML text outside the limits: ``where`` is ``line:column`` (1-based), ``problem`` the reason."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


def _at(mark) -> str:
    return f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "?"


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without aliases, with a nesting limit and with duplicate keys refused."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YamlLimitError(_at(event.start_mark), "YAML aliases (*name) are not supported: write the "
                                                         "repeated values out")
        if self.check_event(yaml.MappingStartEvent, yaml.SequenceStartEvent):
            self._depth = getattr(self, "_depth", 0) + 1
            if self._depth > MAX_DEPTH:
                raise YamlLimitError(_at(self.peek_event().start_mark),
                                     f"nested more than {MAX_DEPTH} levels deep")
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class reports an unhashable key
            if key in seen:
                raise YamlLimitError(_at(key_node.start_mark),
                                     f"duplicate key {key!r} (first at line {seen[key]}); give each key once")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load(text: str) -> Any:
    """The tree of ``text``; :class:`YamlLimitError` for an alias, too deep a nesting or a duplicate key,
    ``yaml.YAMLError`` for text that is not YAML; a text over :data:`MAX_BYTES` is refused unparsed."""
    size = len(text.encode("utf-8", errors="surrogatepass")) if len(text) * 4 > MAX_BYTES else len(text)
    if size > MAX_BYTES:
        raise YamlLimitError("1:1", f"{size / 2**20:.1f} MiB of YAML is over the limit of "
                                    f"{MAX_BYTES / 2**20:g} MiB for a spec; a spec is a few KiB")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
