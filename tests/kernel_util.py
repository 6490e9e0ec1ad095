"""Shared by the kernel tests: the max-norm relative comparison against a float64 reference."""
from __future__ import annotations

import numpy as np


def assert_close(ours, ref, rtol=1e-10):
    """Max-norm relative error: ``max|ours - ref| <= rtol * max|ref|``."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-300)
    err = float(np.abs(ours.astype(np.float64) - ref).max())
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol:.0e} x {scale:.3e}"
