"""The layer families of tests/case_sets (one test per family) against PyTorch, float64, 1e-10 relative,
at any rank count: forward, input gradient and every parameter gradient (tests/layer_cases.compare)."""
from __future__ import annotations

import pytest

from case_sets import families
from layer_cases import compare
from mpi_util import assert_all


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sorted(families()))
def test_family_matches_pytorch(comm, family):
    cases = families()[family](comm.size)
    bad = []
    for case in cases:
        try:
            bad += compare(case, comm)
        except Exception as exc:  # one broken case must not hide the others; every rank reports its own
            bad.append(f"{case.id}: {type(exc).__name__}: {exc}")
    assert_all(comm, bool(cases) and not bad, "\n".join(bad) or f"family {family}: no cases at {comm.size}")
