"""The NCCL stand-in's argument lists against the real CuPy wheel's Cython ``embedsignature`` strings.

The real ``cupy_backends.cuda.libs.nccl`` does not import without the CUDA runtime, so this reads the
signatures embedded in the compiled module's text. Install the reference outside every site-packages:
``pip install --no-deps --target /tmp/realcupy cupy-cuda12x`` (``LBANNPY_REAL_CUPY`` overrides the path).
"""
from __future__ import annotations

import ast
import glob
import os
import re
from pathlib import Path

import pytest

REAL = Path(os.environ.get("LBANNPY_REAL_CUPY", "/tmp/realcupy"))
STANDIN = Path(__file__).resolve().parent / "gpu_standin"
SO = sorted(glob.glob(str(REAL / "cupy_backends/cuda/libs/nccl*.so")))
# CI installs the reference wheel and sets this, so that a missing reference fails instead of skipping
REQUIRED = os.environ.get("LBANNPY_REQUIRE_REAL_CUPY") == "1"
PIN = "cupy-cuda12x==14.2.0"  # the wheel .ci/run unpacks
needs_reference = pytest.mark.skipif(
    not SO and not REQUIRED,
    reason=f"the real CuPy wheel's NCCL signatures are not under {REAL}: run `pip install --no-deps --target "
           f"{REAL} {PIN}` (what CI does) to check the stand-in against them")


def real_signatures() -> dict[str, list[str]]:
    text = Path(SO[0]).read_bytes().decode("latin-1")
    sigs = {}
    for m in re.finditer(r"(NcclCommunicator\.)?([A-Za-z_]+)\(([^()\x00]*)\)", text):
        if m.group(1) or m.group(2) in ("NcclCommunicator", "get_unique_id", "groupStart", "groupEnd",
                                         "get_version", "get_build_version"):
            args = [a.split()[-1].split("=")[0] for a in m.group(3).split(",") if a.strip()]
            name = ("NcclCommunicator." + m.group(2)) if m.group(1) else m.group(2)
            if name == "NcclCommunicator":
                if "commId" not in args:  # other functions also mention the class; take the constructor
                    continue
                name = "NcclCommunicator.__init__"
                args = ["self"] + args
            sigs.setdefault(name, args)
    return sigs


def standin_signatures() -> dict[str, list[str]]:
    tree = ast.parse((STANDIN / "cupy/cuda/nccl.py").read_text())
    sigs = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            sigs[node.name] = [a.arg for a in node.args.args]
        if isinstance(node, ast.ClassDef) and node.name == "NcclCommunicator":
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and (not f.name.startswith("_") or f.name == "__init__"):
                    sigs[f"NcclCommunicator.{f.name}"] = [a.arg for a in f.args.args]
    return sigs


@needs_reference
def test_nccl_signatures_match_real_cupy():
    real, ours = real_signatures(), standin_signatures()
    checked = ["NcclCommunicator.__init__", "NcclCommunicator.allReduce", "NcclCommunicator.reduce",
               "NcclCommunicator.broadcast", "NcclCommunicator.bcast", "NcclCommunicator.reduceScatter",
               "NcclCommunicator.allGather", "NcclCommunicator.send", "NcclCommunicator.recv",
               "NcclCommunicator.rank_id", "get_unique_id", "groupStart"]
    for name in checked:
        assert name in real, f"{name} not found in {SO[0]}"
        assert ours.get(name) == real[name], f"{name}: stand-in {ours.get(name)} != CuPy {real[name]}"


@needs_reference
def test_nccl_constants_present_in_real_cupy():
    text = Path(SO[0]).read_bytes().decode("latin-1")
    src = (STANDIN / "cupy/cuda/nccl.py").read_text()
    # the reduction ops and data types lbannpy passes (the stand-in's error codes are its own)
    skip = ("NCCL_ERROR", "NCCL_SUCC", "NCCL_UNIQUE")
    ours = {c for c in re.findall(r"\b(NCCL_[A-Z0-9_]+)\b", src) if not c.startswith(skip)}
    assert {"NCCL_SUM", "NCCL_FLOAT32", "NCCL_BFLOAT16"} <= ours
    missing = [c for c in sorted(ours) if c not in text]
    assert not missing, f"stand-in constants absent from the real module: {missing}"
