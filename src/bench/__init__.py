"""Benchmarks: ``python -m lbannpy.bench SUBCOMMAND`` (see :mod:`lbannpy.bench.__main__`)."""
from __future__ import annotations

import re


def describe(doc: str) -> str:
    """A module docstring's first paragraph as an ``--help`` description for people: the
    ``python -m ...``: usage prefix dropped, RST literals unquoted, one line."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    first = re.sub(r"^``python -m [^`]*``:?\s*", "", first)
    text = first.replace("``", "")
    return text[:1].upper() + text[1:]
