"""Every ``LBANNPY_*`` environment variable the package reads is documented with its effect in
``docs/environment.md`` (generated from :data:`lbannpy.docs.ENVIRONMENT`), and the page is current."""
from __future__ import annotations

import re
from pathlib import Path

from lbannpy.docs import ENVIRONMENT, environment_page

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("src", "layers", "comm")  # lbannpy, lbannpy.layers, lbannpy.comm
NAME = re.compile(r"\bLBANNPY_[A-Z0-9_]*[A-Z0-9]\b")


def read_variables(text: str) -> set[str]:
    return set(NAME.findall(text))


def package_variables() -> dict[str, list[str]]:
    """``{variable: [files naming it]}`` over the package's source (Python and the job templates in it)."""
    found: dict[str, list[str]] = {}
    for top in PACKAGE:
        for p in sorted((ROOT / top).rglob("*.py")):
            for name in read_variables(p.read_text(encoding="utf-8")):
                found.setdefault(name, []).append(str(p.relative_to(ROOT)))
    return found


def test_every_variable_the_package_reads_is_documented():
    documented = {name for name, _, _ in ENVIRONMENT}
    missing = {k: v for k, v in package_variables().items() if k not in documented}
    assert not missing, f"add these to lbannpy.docs.ENVIRONMENT (name, who reads it, its effect): {missing}"
    assert all(effect.strip() and scope for _, scope, effect in ENVIRONMENT)


def test_the_environment_page_is_current():
    assert (ROOT / "docs" / "environment.md").read_text(encoding="utf-8") == environment_page(), \
        "docs/environment.md is stale: python -m lbannpy.docs"


def test_the_scan_finds_a_planted_variable():
    """Negative control: a read the table lacks is found (and a bare prefix is not a variable)."""
    planted = 'os.environ.get("LBANNPY_PLANTED_X", "")\nprefix = "LBANNPY_"\n'
    assert read_variables(planted) == {"LBANNPY_PLANTED_X"}
    assert "LBANNPY_PLANTED_X" not in {name for name, _, _ in ENVIRONMENT}
