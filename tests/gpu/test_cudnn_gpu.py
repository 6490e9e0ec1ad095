"""cuDNN Frontend's convolutions (``runtime.kernels: cudnn``, :mod:`lbannpy.layers.kernels.cudnn`) on GPUs:
the same numbers as the reference, inside the captured step, chosen by ``auto`` where cuDNN Frontend
imports, and never imported by a CPU run.

On the CUDA/CuPy/NCCL stand-in with its cuDNN Frontend stand-in (``tests/gpu_standin/cudnn``) in every test
run; on real CuPy, NCCL and cuDNN Frontend with ``LBANNPY_GPU=real`` (see conftest.py).

- every convolution and transposed-convolution case of the layer tests (tests/mpi/test_layers.py, its
  windowless cases, tests/case_sets/transpose.py) and grouped convolutions, forward, input gradient and
  filter/bias gradients on the cudnn set equal PyTorch (float64, 1e-10) at 1, 2 and 4 ranks, every conv
  layer on that set, and a second pass over the same shapes plans nothing new;
- the kernels one by one, 1-D to 3-D, strides, padding, dilation, groups: float64 to 1e-10 and float32 to
  its round-off against lbannpy's NumPy kernels in float64;
- the step captured with cudnn kernels trains as the eager step bit for bit (the runs of
  tests/gpu/test_graph_gpu.py), and a replayed unlogged step makes no host synchronisation;
- ``runtime.kernels: auto`` picks cudnn on a GPU where it imports and ``cuda_graph: auto`` captures;
  without it, the own kernels as before; ``cudnn`` where it cannot run is one line, exit 2;
- ``summary.json`` names each layer's kernels (``layers.<name>.kernels``).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]
import test_graph_gpu as G  # noqa: E402
from train_util import PY, make_data  # noqa: E402

REAL = os.environ.get("LBANNPY_GPU", "") == "real"
GPU = ("--set", "runtime.device=gpu")
# a command that runs lbannpy.train with the cudnn module made unimportable (as where it is not installed)
NO_CUDNN = ("-c", "import sys; sys.modules['cudnn'] = None; from lbannpy.train import main; "
                  "sys.exit(main(sys.argv[1:]))")
# the frontend installed without the cuDNN library it loads: its first call into cuDNN raises
NO_LIBRARY = ("-c", "import sys, cudnn; cudnn._NO_LIBRARY = 'Unable to dlopen libcudnn.so.9'; "
                    "from lbannpy.train import main; sys.exit(main(sys.argv[1:]))")


# ------------------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("gpu-cudnn"), blobs_size=8, blobs_samples=16, mesh_size=8,
                     mesh_samples=4)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_cudnn_convolutions_match_pytorch(gpu_launch, ranks):
    rows = gpu_launch(HERE, "tier", ranks, timeout=600)
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["bad"] == [], "\n".join(row["bad"])
        assert row["cases"] >= 40 and row["other_sets"] == [], row
        assert row["plans"] > 0 and row["new_plans"] == 0, row
        print(f"rank {row['rank']}: {row['cases']} cases, {row['plans']} plans, {row['taken']} windowless")
        assert ranks == 1 or row["taken"] > 0, row


def test_cudnn_kernels_match_the_numpy_kernels_in_both_types(gpu_launch):
    (row,) = gpu_launch(HERE, "kernels", 1)
    assert row["error"] is None, row["error"]
    assert row["checked"] >= 30, row
    assert row["bad"] == [], "\n".join(row["bad"])


@pytest.mark.parametrize("ranks,parallel,layers,optimizer,comm,name", G.GRAPHED_RUNS,
                         ids=[r[-1] for r in G.GRAPHED_RUNS])
def test_the_captured_step_with_cudnn_trains_as_the_eager_one_bit_for_bit(work, gpu_run, ranks, parallel,
                                                                          layers, optimizer, comm, name):
    """tests/gpu/test_graph_gpu.py's runs with ``runtime.kernels: cudnn``: the captured run (``on``) ends
    with the eager run's every checkpoint tensor, logged value and validation metric, bit for bit, and
    every conv layer computed with cuDNN Frontend."""
    common = dict(steps=G.STEPS, parallel=parallel, optimizer=optimizer, comm=comm,
                  data={"validation": {"fraction": 0.25}}, trainer={"eval_every": 3},
                  output={"log_every": 2}, checkpoint={"every_steps": 3})
    run = ("mpiexec", "-n", ranks, PY, "-m", "lbannpy.train")
    opts = ("--quiet", *GPU, "--set", "runtime.kernels=cudnn")
    if ranks > 1:
        opts += ("--set", "runtime.backend=nccl")
    ref, tag = f"cudnn-eager-{name}", f"cudnn-graph-{name}"
    gpu_run([*run, G.config(work, ref, layers, **common), *opts, "--set", "runtime.cuda_graph=off"])
    p = gpu_run([*run, G.config(work, tag, layers, **common), *opts, "--set", "runtime.cuda_graph=on"])
    assert len(G.lines_with(p.stderr, "step: one CUDA graph per input shape")) == 1, p.stderr
    summary = json.loads((work / tag / "out" / "summary.json").read_text())
    s = summary["cuda_graph"]
    assert s["mode"] == "graph" and s["captures"] == 1 and s["replays"] == G.STEPS - 3, s
    convs = [lay["name"] for lay in layers if lay["type"] in ("conv", "conv_transpose")]
    assert convs and all(summary["layers"][c]["kernels"] == "cudnn" for c in convs), summary["layers"]
    G.assert_bitwise_same_run(work, tag, ref, f"captured step with cudnn kernels, {name}")


def test_a_replayed_unlogged_step_with_cudnn_makes_no_host_synchronisation(work, gpu_launch):
    if REAL:
        pytest.skip("host synchronisations are counted by the CUDA stand-in only")
    cfg = G.config(work, "cudnn-graph-syncs", G.BN_NET, steps=8, output={"log_every": 8})
    rows = gpu_launch(G.HERE, "syncs", 2, cfg, "--set", "runtime.backend=nccl", "--set",
                      "runtime.kernels=cudnn", "--set", "runtime.cuda_graph=on", timeout=240)
    for row in rows:
        assert row["rc"] == 0 and row["modes"][3:] == ["replayed"] * 5, row
        print(f"rank {row['rank']}: host synchronisations per step {row['per_step']}")
        assert row["per_step"][3:7] == [0, 0, 0, 0], row


def _auto_run(work, gpu_run, tag, *cmd, check=True):
    cfg = G.config(work, tag, G.BN_NET, steps=4)
    return gpu_run(["mpiexec", "-n", 2, PY, *cmd, cfg, "--quiet", *GPU, "--set", "runtime.backend=nccl"],
                   timeout=240, check=check)


def _layer_kernels(work, tag) -> dict:
    layers = json.loads((work / tag / "out" / "summary.json").read_text())["layers"]
    return {name: v["kernels"] for name, v in layers.items() if "kernels" in v}  # not the buckets' times


def test_auto_picks_cudnn_on_a_gpu_and_captures(work, gpu_run):
    """Where ``cudnn`` imports, ``runtime.kernels: auto`` (the default) takes it, for the convolutions and
    the batch-norm (:mod:`lbannpy.layers.kernels.cudnn_bn`), and ``cuda_graph: auto`` (the default)
    captures the step; summary.json names every layer's kernels."""
    p = _auto_run(work, gpu_run, "auto-cudnn", "-m", "lbannpy.train")
    assert len(G.lines_with(p.stderr, "step: one CUDA graph per input shape, captured after 2 eager steps "
                                      "(runtime.cuda_graph auto)")) == 1, p.stderr
    assert "not capturable" not in p.stderr
    assert _layer_kernels(work, "auto-cudnn") == {"c1": "cudnn", "b1": "cudnn", "r1": "own", "p1": "own",
                                                   "f1": "own"}


@pytest.mark.parametrize("missing", ["frontend", "library"])
def test_auto_without_cudnn_keeps_the_own_kernels_and_captures(work, gpu_run, missing):
    """Without cuDNN Frontend, or with it but not the cuDNN library it loads (and with no CUDA torch, as on
    the stand-in), ``auto`` is lbannpy's own kernels as before, and the step is captured with the same
    line."""
    p = _auto_run(work, gpu_run, f"auto-own-{missing}", *(NO_CUDNN if missing == "frontend" else NO_LIBRARY))
    assert len(G.lines_with(p.stderr, "step: one CUDA graph per input shape, captured after 2 eager steps "
                                      "(runtime.cuda_graph auto)")) == 1, p.stderr
    assert _layer_kernels(work, f"auto-own-{missing}")["c1"] == "own"


@pytest.mark.parametrize("where", ["cpu", "gpu-without-cudnn", "gpu-without-its-library"])
def test_cudnn_where_it_cannot_run_is_one_line(work, gpu_run, where):
    cfg = G.config(work, f"cudnn-refused-{where}", G.BN_NET, steps=2, parallel={})
    cmd = ([PY, "-m", "lbannpy.train", cfg] if where == "cpu"
           else [PY, *(NO_CUDNN if where == "gpu-without-cudnn" else NO_LIBRARY), cfg, *GPU])
    p = gpu_run([*cmd, "--quiet", "--set", "runtime.kernels=cudnn"], check=False)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    said = G.lines_with(p.stderr, "error")
    assert len(said) == 1 and "error: runtime.kernels: cudnn needs " in said[0], p.stderr
    why = {"cpu": "runtime.device: gpu", "gpu-without-cudnn": "cuDNN Frontend is not installed",
           "gpu-without-its-library": "cannot load the cuDNN library (Unable to dlopen libcudnn.so.9)"}[where]
    assert why in said[0] and (where == "cpu" or "nvidia-cudnn-frontend" in said[0]), said
    assert "Traceback" not in p.stderr


def test_a_cpu_run_never_imports_cudnn_and_names_its_kernels(work, gpu_run):
    """``cudnn`` importable (the stand-in on the path): a CPU run with ``auto`` does not import it, and
    its summary names the host kernels (ATen's where torch is installed, ``c`` compiled, ``numpy``)."""
    cfg = G.config(work, "cpu-kernels", G.BN_NET, steps=2, parallel={})
    code = ("import sys; from lbannpy.train import main; rc = main(sys.argv[1:]); "
            "print('CUDNN IMPORTED' if 'cudnn' in sys.modules else 'CUDNN NOT IMPORTED'); sys.exit(rc)")
    p = gpu_run([PY, "-c", code, cfg, "--quiet"])
    assert "CUDNN NOT IMPORTED" in p.stdout, p.stdout
    got = _layer_kernels(work, "cpu-kernels")
    assert set(got) == {"c1", "b1", "r1", "p1", "f1"} and got["c1"] in ("aten", "c", "numpy"), got
    assert {got[k] for k in ("b1", "r1", "p1")} <= {"c", "numpy"} and got["f1"] == "numpy", got


# ----------------------------------------------------------------------------------------------- worker
def _cudnn_set():
    from lbannpy.layers.kernels import select

    return select.conv_kernels("cudnn", "gpu")


def _conv_cases(size: int) -> list:
    """The layer tests' cases holding a convolution or a transposed convolution, and grouped convolutions
    (whole groups, and a filter split cutting groups: one call per group segment)."""
    from case_sets.transpose import cases as transpose_cases
    from layer_cases import Case
    from test_layers import conv, layer_cases, splits, windowless_cases

    def convolves(case):
        return any(lay["type"] in ("conv", "conv_transpose") for lay in case.layers)

    cases = [c for c in layer_cases(size) + transpose_cases(size) if convolves(c)]
    for par in splits(size, ("n", "h", "w")):
        cases.append(Case("conv-groups", (conv(kernel=3, padding=1, groups=2, filters=4),), (5, 6, 9, 11),
                          {"default": par}))
        cases.append(Case("conv-groups-dilated", (conv(kernel=3, stride=2, dilation=2, groups=3,
                                                       filters=6, padding="same"),), (5, 6, 9, 11),
                          {"default": par}))
    # kernel-padded convolutions whose input gradients meet at a sum: each its own array, none the shared
    # window-gradient workspace the next one writes
    res = (conv("c1", kernel=3, padding=1, filters=4), {"name": "r1", "type": "relu"},
           conv("c2", kernel=3, padding=1, filters=4), {"name": "r2", "type": "relu"},
           {"name": "s", "type": "sum", "parents": ["r2", "r1"]}, conv("c3", kernel=1, filters=2))
    for par in splits(size, ("n", "h")):
        cases.append(Case("conv-padded-residual", res, (4, 5, 8, 8), {"default": par}))
    for par in splits(size, ("c",)):
        cases.append(Case("conv-groups-filters", (conv(kernel=3, padding=1, groups=3, filters=6),),
                          (5, 6, 9, 11), {"default": par}))
    return cases, windowless_cases(size)


def _case_tier(comm, cupy, out):
    from layer_cases import compare
    from test_layers import _windowless
    from lbannpy.layers import conv as conv_layer
    from lbannpy.layers.kernels import cudnn

    conv_layer.WINDOWLESS_MAX_BOUNDARY = 1.0  # these small blocks are all boundary
    kern = _cudnn_set()
    cases, windowless = _conv_cases(comm.size)
    bad, others, taken = [], set(), 0
    for case in cases + windowless:
        models = []
        try:
            bad += compare(case, comm, xp=cupy, kernels=kern, out=models)
        except Exception as exc:  # one broken case must not hide the others; the rank reports it
            bad.append(f"{case.id}: {type(exc).__name__}: {exc}")
            continue
        others |= {f"{case.id}:{lay.name}:{lay.kern.name}" for lay in models[0].layers
                   if hasattr(lay, "kern") and lay.kern.name != "cudnn"}
        if case in windowless:
            taken += len(_windowless(models[0]))
    plans = cudnn.planned()
    for case in cases[:6]:  # the same shapes again: every plan is there already
        compare(case, comm, xp=cupy, kernels=kern)
    out.update(cases=len(cases) + len(windowless), bad=bad, other_sets=sorted(others), taken=taken,
               plans=plans, new_plans=cudnn.planned() - plans)


#: (x shape, w shape, stride, dilation, padding, bias) of the kernel-level checks
GEOMETRIES = [
    ((2, 4, 9, 11), (6, 4, 3, 3), 1, 1, 1, True),
    ((2, 4, 9, 11), (6, 4, 3, 5), (2, 1), (1, 2), (0, 2), False),
    ((2, 6, 8, 7), (4, 3, 3, 3), 2, 1, 1, True),          # 2 groups
    ((3, 6, 7, 9), (6, 2, 1, 3), (1, 2), 1, (0, 1), True),  # 3 groups
    ((2, 3, 13), (5, 3, 4), 2, 2, 1, True),                 # a line
    ((2, 4, 12), (4, 2, 3), 1, 1, 0, False),                # a line, 2 groups
    ((2, 2, 5, 6, 7), (3, 2, 3, 3, 2), (1, 2, 1), 1, 1, True),
    ((1, 2, 6, 5, 4), (2, 2, 2, 2, 2), 2, (1, 1, 2), 0, False),
]


def _case_kernels(comm, cupy, out):
    import numpy as np

    from lbannpy.layers.kernels import conv as own

    kern = _cudnn_set()
    rng = np.random.default_rng(3)
    bad, checked = [], 0
    for xs, ws, s, d, p, bias in GEOMETRIES:
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        b = rng.standard_normal(ws[0]) if bias else None
        y = own.conv_forward(x, w, b, s, d, padding=p)
        dy = rng.standard_normal(y.shape)
        ref = {"y": y, "dx": own.conv_backward_data(dy, w, x.shape, s, d, padding=p),
               "dw": own.conv_backward_filter(x, dy, w.shape, s, d, padding=p)}
        if bias:
            ref["db"] = own.conv_backward_bias(dy)
        for dtype, tol in (("float64", 1e-10), ("float32", 2e-5)):
            def dev(a):
                return None if a is None else cupy.asarray(a.astype(dtype))
            got = {"y": kern.conv_forward(dev(x), dev(w), dev(b), s, d, padding=p),
                   "dx": kern.conv_backward_input(dev(dy), dev(w), dev(x), s, d, padding=p)}
            got["dw"], db = kern.conv_backward_params(dev(x), dev(dy), dev(w), bias, s, d, padding=p)
            if bias:
                got["db"] = db
            for k, r in ref.items():
                g = cupy.asnumpy(got[k])
                err = float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)) if g.shape == r.shape else 1e9
                checked += 1
                if g.dtype != np.dtype(dtype) or not err <= tol:
                    bad.append(f"{xs} {ws} s{s} d{d} p{p} {dtype} {k}: {g.dtype}, relative error {err:.3g}")
    out.update(bad=bad, checked=checked)


if __name__ == "__main__":
    from gpu_worker import run_worker

    run_worker({"tier": _case_tier, "kernels": _case_kernels})
