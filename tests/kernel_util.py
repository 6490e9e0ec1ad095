"""Shared by the kernel tests: the max-norm relative comparison against a float64 reference, and the rule
for an optional compiled extension that is missing."""
from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest


def require_built(ext, name: str) -> None:
    """The compiled kernels are optional only where nothing can build them: with a C compiler present, a
    missing extension ``ext`` (None) is a failed build (pip only warns), which must not pass as a skip."""
    if ext is not None:
        return
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc):
        pytest.fail(f"the compiled kernels are not built although the C compiler {cc!r} is present: the "
                    f"optional build of lbannpy.layers.kernels.{name} failed (reinstall with "
                    f"'pip install -v -e .' to see why)")
    pytest.skip(f"no C compiler ({cc!r}) in this install: lbannpy.layers.kernels.{name} cannot be built")


def assert_close(ours, ref, rtol=1e-10):
    """Max-norm relative error: ``max|ours - ref| <= rtol * max|ref|``."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-300)
    err = float(np.abs(ours.astype(np.float64) - ref).max())
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol:.0e} x {scale:.3e}"
