"""The cuDNN Frontend stand-in (tests/gpu_standin/cudnn): its own checks in a subprocess whose PYTHONPATH
starts with tests/gpu_standin (so this process never imports it as ``cudnn``), and its API against the real
``nvidia-cudnn-frontend`` wheel.

The real module imports without a GPU (its pybind library loads libcudnn lazily), so the API surface is read
with ``inspect`` in a second subprocess whose PYTHONPATH is the unpacked wheel. Install the reference outside
every site-packages: ``pip install --no-deps --target /tmp/realcudnn nvidia-cudnn-frontend==1.32.0`` (what
CI does; ``LBANNPY_REAL_CUDNN`` overrides the path, ``LBANNPY_REQUIRE_REAL_CUDNN=1`` makes a missing
reference fail instead of skipping).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_gpu_standin import STANDIN, TESTS, standin_env

REAL = Path(os.environ.get("LBANNPY_REAL_CUDNN", "/tmp/realcudnn"))
REQUIRED = os.environ.get("LBANNPY_REQUIRE_REAL_CUDNN") == "1"
PIN = "nvidia-cudnn-frontend==1.32.0"  # the wheel .ci/run unpacks
HAVE_REAL = (REAL / "cudnn" / "__init__.py").exists()

# Run in a subprocess against either module: its public surface as JSON. A convolution or batch-norm builder
# of the real pygraph takes (*args, name, compute_data_type, out_dims, **kwargs) and reads its ports and
# attributes from a table, so there the positional names are what the builder itself says it takes when
# given a name it does not know; a nanobind function's signature is its ``__nb_signature__``.
DUMP = r'''
import enum, inspect, json, re, sys
import cudnn

def params(f):
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        text = f.__nb_signature__[0][0]
        inner = re.match(r"def \w+\((.*)\)", text).group(1)
        return [[a.split(":")[0].split("=")[0].strip(), "POSITIONAL_OR_KEYWORD"]
                for a in inner.split(",") if a.strip()]
    return [[p.name, p.kind.name] for p in sig.parameters.values()]

def builder(op):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    m = None
    try:
        getattr(g, op)(__unknown__=1)
    except TypeError as e:
        m = re.search(r"tensor ports are \(([^)]*)\), attrs are \(([^)]*)\)", str(e))
    if m is None:  # the stand-in: an ordinary signature
        return params(getattr(cudnn.pygraph, op))
    names = [n.strip().strip("'") for n in (m.group(1) + "," + m.group(2)).split(",") if n.strip()]
    kw = [p for p in params(getattr(cudnn.pygraph, op)) if p[1] == "KEYWORD_ONLY"]
    return [["self", "POSITIONAL_OR_KEYWORD"]] + [[n, "POSITIONAL_OR_KEYWORD"] for n in names] + kw

STANDIN = cudnn.__version__.endswith("+standin")

def members(cls):
    """The stand-in's own members; for the real class, everything it has (inherited too)."""
    out = {}
    own = vars(cls) if STANDIN else {n: inspect.getattr_static(cls, n) for n in dir(cls)}
    for name, v in own.items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(v, property):
            out[name] = "property"
        elif name.startswith(("conv_", "batchnorm")):
            out[name] = builder(name)
        elif callable(v):
            out[name] = params(v)
    return out

def describe(obj):
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return {"kind": "exception"}
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return {"kind": "enum", "members": {k: int(v.value) for k, v in obj.__members__.items()}}
    if isinstance(obj, type):
        return {"kind": "class", "members": members(obj)}
    if callable(obj):
        return {"kind": "function", "params": params(obj)}
    return {"kind": type(obj).__name__}

names = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
out = {}
for name in (names if names is not None else [n for n in vars(cudnn) if not n.startswith("_")]):
    mod, _, attr = name.rpartition(".")
    obj = getattr(getattr(cudnn, mod) if mod else cudnn, attr, None)
    if obj is None:
        out[name] = None
    elif inspect.ismodule(obj):
        for n, v in vars(obj).items():
            if isinstance(v, type) and v.__module__ == obj.__name__ and not n.startswith("_"):
                out[f"{name}.{n}"] = describe(v)
    else:
        out[name] = describe(obj)
print(json.dumps(out))
'''
# constructed by pygraph.tensor, never by the caller: the real class is a dataclass with more fields
NOT_CONSTRUCTED = {"graph_types.Tensor"}


def dump(path: Path, names: list[str] | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    args = [sys.executable, "-c", DUMP] + ([json.dumps(names)] if names is not None else [])
    p = subprocess.run(args, env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_normal_run_does_not_see_the_cudnn_standin():
    mod = sys.modules.get("cudnn")
    assert mod is None or "gpu_standin" not in (getattr(mod, "__file__", "") or "")


def test_standin_cudnn_checks():
    """Convolutions against PyTorch, capture and replay, each refusal
    (tests/gpu_standin/standin_cudnn_check.py)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(STANDIN / "standin_cudnn_check.py")], env=standin_env(), cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    passed = re.search(r"(\d+) passed", p.stdout)
    assert passed and int(passed.group(1)) >= 22, p.stdout[-2000:]


@pytest.mark.skipif(not HAVE_REAL and not REQUIRED,
                    reason=f"the real cuDNN Frontend wheel is not under {REAL}: run `pip install --no-deps "
                           f"--target {REAL} {PIN}` (what CI does) to check the stand-in against it")
def test_standin_api_matches_the_real_cudnn_frontend():
    """Every function, class method and enum member the stand-in provides exists in the real module with the
    same parameter names and kinds (enum members with the same values)."""
    assert HAVE_REAL, f"LBANNPY_REQUIRE_REAL_CUDNN=1 but no cuDNN Frontend wheel under {REAL}"
    ours = dump(STANDIN)
    assert {"pygraph", "set_stream", "create_handle", "data_type", "graph_types.Tensor"} <= set(ours), \
        sorted(ours)
    real = dump(REAL, sorted({n.rpartition(".")[0] if n.startswith("graph_types.") else n for n in ours}))
    problems = []
    for name, mine in sorted(ours.items()):
        theirs = real.get(name)
        if theirs is None or theirs["kind"] != mine["kind"]:
            problems.append(f"{name}: {mine['kind']} in the stand-in, {theirs and theirs['kind']} in cuDNN "
                            f"Frontend")
        elif mine["kind"] == "enum":
            for k, v in mine["members"].items():
                if theirs["members"].get(k) != v:
                    problems.append(f"{name}.{k} = {v} in the stand-in, {theirs['members'].get(k)} in the "
                                    f"real one")
        elif mine["kind"] == "function" and mine["params"] != theirs["params"]:
            problems.append(f"{name}{mine['params']} != real {theirs['params']}")
        elif mine["kind"] == "class":
            for m, sig in mine["members"].items():
                if m == "__init__" and name in NOT_CONSTRUCTED:
                    continue
                if theirs["members"].get(m) != sig:
                    problems.append(f"{name}.{m}: stand-in {sig} != real {theirs['members'].get(m)}")
    assert not problems, "\n".join(problems)
