"""Batch-norm through cuDNN Frontend (:mod:`lbannpy.layers.kernels.cudnn_bn`, the batch-norm layer of a run
whose kernel set is ``cudnn``) on GPUs: the NumPy reference's numbers, inside the captured step, named in
``summary.json``, and refused by the stand-in where cuDNN would refuse it.

On the CUDA/CuPy/NCCL stand-in with its cuDNN Frontend stand-in (``tests/gpu_standin/cudnn``) in every test
run; on real CuPy, NCCL and cuDNN Frontend with ``LBANNPY_GPU=real`` (see conftest.py).

- forward, input gradient, scale and bias gradients and running statistics of the layer on the cudnn set
  equal a float64 NumPy reference (float64 to 1e-10, float32 to its round-off) at 1, 2 and 4 ranks, under
  sample, spatial and channel splits with uneven blocks, ``sync`` global and group, with and without a fused
  ReLU, a 3-D block and a block of one value per channel; cuDNN's fused pass where the statistics are one
  rank's block, its normalisation from the allreduced sums elsewhere; evaluation from the running statistics;
  a second pass over the same shapes plans nothing new;
- the step captured with cudnn batch-norm trains as the eager step bit for bit, and a replayed unlogged step
  makes no host synchronisation, on both paths; ``summary.json`` names the layer's kernels ``cudnn``;
- a plan run on another stream than the handle's, with a workspace smaller than it asks, built during a
  capture, or given a buffer that is not a live allocation, is refused (and goes through with the rule off).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]
import test_graph_gpu as G  # noqa: E402
from train_util import PY, make_data  # noqa: E402

REAL = os.environ.get("LBANNPY_GPU", "") == "real"
GPU = ("--set", "runtime.device=gpu")
EPS, MOMENTUM = 1e-5, 0.1
TOL = {"float64": 1e-10, "float32": 2e-5}


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_cudnn_batchnorm_matches_the_numpy_reference(gpu_launch, ranks):
    rows = gpu_launch(HERE, "tier", ranks, timeout=600)
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["bad"] == [], "\n".join(row["bad"])
        assert row["cases"] >= 6 and row["named"] == ["cudnn"], row
        assert row["fused"] > 0 and row["plans"] > 0 and row["new_plans"] == 0, row
        assert ranks == 1 or row["reduced"] > 0, row
        print(f"rank {row['rank']}: {row['cases']} cases, {row['fused']} fused, {row['reduced']} from "
              f"reduced sums, {row['plans']} plans")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("gpu-cudnn-bn"), blobs_size=8, blobs_samples=16, mesh_size=8,
                     mesh_samples=4)


BN_GROUP_NET = [dict(lay, sync="group") if lay["type"] == "batchnorm" else lay for lay in G.BN_NET]
CAPTURED_RUNS = [  # (ranks, parallel, layers, name): cuDNN fused, then normalising reduced sums
    (1, {}, G.BN_NET, "one-gpu-fused"),
    (2, {"default": {"n": 2}}, BN_GROUP_NET, "sample-group-fused"),
    (2, {"default": {"h": 2}}, G.BN_NET, "spatial-reduced"),
]


@pytest.mark.parametrize("ranks,parallel,layers,name", CAPTURED_RUNS, ids=[r[-1] for r in CAPTURED_RUNS])
def test_the_captured_step_with_cudnn_batchnorm_trains_as_the_eager_one_bit_for_bit(work, gpu_run, ranks,
                                                                                    parallel, layers, name):
    """float64, ``runtime.kernels: cudnn``: the captured run ends with the eager run's every checkpoint tensor
    (batch-norm running statistics included), logged value and validation metric, bit for bit; the
    batch-norm layer computed with cuDNN Frontend."""
    common = dict(steps=G.STEPS, parallel=parallel, data={"validation": {"fraction": 0.25}},
                  trainer={"eval_every": 3}, output={"log_every": 2}, checkpoint={"every_steps": 3})
    run = ("mpiexec", "-n", ranks, PY, "-m", "lbannpy.train")
    opts = ("--quiet", *GPU, "--set", "runtime.kernels=cudnn")
    if ranks > 1:
        opts += ("--set", "runtime.backend=nccl")
    ref, tag = f"bn-eager-{name}", f"bn-graph-{name}"
    gpu_run([*run, G.config(work, ref, layers, **common), *opts, "--set", "runtime.cuda_graph=off"])
    p = gpu_run([*run, G.config(work, tag, layers, **common), *opts, "--set", "runtime.cuda_graph=on"])
    assert len(G.lines_with(p.stderr, "step: one CUDA graph per input shape")) == 1, p.stderr
    summary = json.loads((work / tag / "out" / "summary.json").read_text())
    s = summary["cuda_graph"]
    assert s["mode"] == "graph" and s["captures"] == 1 and s["replays"] == G.STEPS - 3, s
    assert summary["layers"]["b1"]["kernels"] == "cudnn", summary["layers"]
    eager = json.loads((work / ref / "out" / "summary.json").read_text())
    assert eager["layers"]["b1"]["kernels"] == "cudnn", eager["layers"]
    G.assert_bitwise_same_run(work, tag, ref, f"captured step with cudnn batch-norm, {name}")


@pytest.mark.parametrize("layers,parallel,name", [(BN_GROUP_NET, {"default": {"n": 2}}, "fused"),
                                                  (G.BN_NET, {"default": {"h": 2}}, "reduced")])
def test_a_replayed_unlogged_step_with_cudnn_batchnorm_makes_no_host_synchronisation(work, gpu_launch, layers,
                                                                                     parallel, name):
    if REAL:
        pytest.skip("host synchronisations are counted by the CUDA stand-in only")
    cfg = G.config(work, f"bn-syncs-{name}", layers, steps=8, parallel=parallel, output={"log_every": 8})
    rows = gpu_launch(G.HERE, "syncs", 2, cfg, "--set", "runtime.backend=nccl", "--set",
                      "runtime.kernels=cudnn", "--set", "runtime.cuda_graph=on", timeout=240)
    for row in rows:
        assert row["rc"] == 0 and row["modes"][3:] == ["replayed"] * 5, row
        print(f"rank {row['rank']}: host synchronisations per step {row['per_step']}")
        assert row["per_step"][3:7] == [0, 0, 0, 0], row
    summary = json.loads((work / f"bn-syncs-{name}" / "out" / "summary.json").read_text())
    assert summary["layers"]["b1"]["kernels"] == "cudnn", summary["layers"]


@pytest.fixture(scope="module")
def refusals(request):
    """The refusal worker's rows, run once for the tests below (one launch, 1 rank)."""
    if REAL:
        pytest.skip("the refusals are the stand-in's")
    from conftest import results, worker_env

    import subprocess

    p = subprocess.run(["mpiexec", "-n", "1", sys.executable, str(HERE), "refusals"], capture_output=True,
                       text=True, timeout=240, env=worker_env(), cwd=str(HERE.parents[2]))
    (row,) = results(p, 1)
    assert row["error"] is None, row["error"]
    return row["rules"]


@pytest.mark.parametrize("rule", ["stream", "workspace", "capture", "pointer"])
def test_a_batchnorm_plan_is_refused_as_cudnn_would_refuse_it(refusals, rule):
    """With the rule on, the bad call raises what cuDNN (or the CUDA stand-in's race checker) raises; with
    the rule off (``cudnn._bind.RULES``) the same call goes through: the refusal is the rule's."""
    got = refusals[rule]
    assert got["on"] is not None and got["off"] is None, got
    want = {"stream": "handle's stream is", "workspace": "workspace has",
            "capture": "cudaErrorStreamCaptureUnsupported", "pointer": "is not a live allocation"}[rule]
    assert want in got["on"], got


# ----------------------------------------------------------------------------------------------- worker
N, C, H, W = 5, 5, 7, 9


def _splits(size: int) -> list:
    if size == 1:
        return [{}]
    out = [{"n": size}, {"h": size}, {"c": size}]
    if size == 4:
        out += [{"n": 2, "h": 2}, {"h": 2, "w": 2}]
    return out


def _cases(size: int) -> list:
    """(name, layers, input shape, parallel default) of the checked models."""
    cases = []
    for par in _splits(size):
        for sync in ("global", "group"):
            bn = {"name": "b", "type": "batchnorm", "sync": sync, "eps": EPS, "momentum": MOMENTUM}
            cases.append((f"bn-{sync}", (bn,), (N, C, H, W), par))
            cases.append((f"bn-relu-{sync}", (bn, {"name": "r", "type": "relu"}), (N, C, H, W), par))
    bn = {"name": "b", "type": "batchnorm", "sync": "group"}
    cases.append(("bn-3d", (bn,), (5, 2, 5, 4, 3), {"n": size} if size > 1 else {}))
    cases.append(("bn-one-value", (bn,), (size, 2, 1, 1), {"n": size} if size > 1 else {}))
    return cases


def _reference(x, dy, gamma, beta, groups, relu):
    """float64 NumPy: (y, dx, dgamma, dbeta, [(running mean, running var) per sample group]); the
    statistics of each sample range in ``groups`` over its samples and all of space."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y, dx, running = np.empty_like(x), np.empty_like(x), []
    dgamma, dbeta = np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for lo, hi in groups:
        xs, dys = x[lo:hi], dy[lo:hi]
        m = xs.size // xs.shape[1]
        mean, var = xs.mean(axis=axes, keepdims=True), xs.var(axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(var + EPS)
        xhat = (xs - mean) * inv
        ys = xhat * gamma.reshape(shape) + beta.reshape(shape)
        g = dys * (ys > 0) if relu else dys
        y[lo:hi] = np.maximum(ys, 0) if relu else ys
        sg, sgx = g.sum(axis=axes, keepdims=True), (g * xhat).sum(axis=axes, keepdims=True)
        dx[lo:hi] = gamma.reshape(shape) * inv * (g - sg / m - xhat * sgx / m)
        dgamma += sgx.ravel()
        dbeta += sg.ravel()
        unbiased = var.ravel() * (m / max(m - 1, 1))
        running.append((MOMENTUM * mean.ravel(), (1 - MOMENTUM) + MOMENTUM * unbiased))
    return y, dx, dgamma, dbeta, running


def _run_case(comm, cupy, dtype, name, layers, shape, par, seed):
    """Forward, backward and gradient sync of the model on the cudnn set, then an evaluation forward:
    (global y, dx, {grad name: global grad}, this rank's running statistics, evaluation y, the layer)."""
    from lbannpy.checkpoint import assemble
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels import select
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    ctx = LayerContext(comm, cupy, dtype, seed=seed)
    ctx.conv_kernels = select.conv_kernels("cudnn", "gpu")
    spec = {"input": {"channels": shape[1], "spatial": list(shape[2:])},
            "layers": [dict(la) for la in layers]}
    model = Model(spec, shape[0], ctx, {"default": par})
    (bn,) = [lay for lay in model.layers if lay.spec.name == "batchnorm"]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 + 0.5
    gamma, beta = rng.standard_normal(shape[1]) + 1.0, rng.standard_normal(shape[1])
    lo, hi = bn.cbox
    bn.gamma.value[...] = cupy.asarray(gamma[lo:hi], dtype=dtype)
    bn.beta.value[...] = cupy.asarray(beta[lo:hi], dtype=dtype)
    x = x.astype(dtype).astype(np.float64)
    y = model.forward(DistTensor.scatter(cupy.asarray(x.astype(dtype)), model.input_dist, comm))
    dy = rng.standard_normal(model.output.out_shape).astype(dtype).astype(np.float64)
    dx = model.backward(DistTensor.scatter(cupy.asarray(dy.astype(dtype)), y.dist, comm), input_grad=True)
    grads = {}
    for p in (bn.gamma, bn.beta):
        gc = ctx.block_comm(p.dist, p.reduce_dims)
        g = gc.allreduce(p.grad) if gc.size > 1 else p.grad
        grads[p.name] = assemble(comm, p.global_shape, p.box, g)
    run = (cupy.asnumpy(bn.running_mean), cupy.asnumpy(bn.running_var))
    model.set_train(False)
    y_eval = model.forward(DistTensor.scatter(cupy.asarray(x.astype(dtype)), model.input_dist, comm))
    ref_in = (x, dy, gamma, beta)
    return (cupy.asnumpy(y.gather(comm)), cupy.asnumpy(dx.gather(comm)), grads, run,
            cupy.asnumpy(y_eval.gather(comm)), bn, ref_in)


def _check_case(comm, cupy, dtype, case, seed, bad):
    """Compare one case with the reference; returns the layer."""
    name, layers, shape, par = case
    y, dx, grads, run, y_eval, bn, (x, dy, gamma, beta) = _run_case(comm, cupy, dtype, *case, seed)
    relu = len(layers) > 1
    n_lo, n_hi = bn.in_dists[0].box(shape, comm.rank)[0]
    groups = ([(0, shape[0])] if bn.sync == "global" else
              sorted({bn.in_dists[0].box(shape, r)[0] for r in range(comm.size)}))
    ry, rdx, rdg, rdb, running = _reference(x, dy, gamma, beta, groups, relu)
    mine = groups.index((0, shape[0]) if bn.sync == "global" else (n_lo, n_hi))
    lo, hi = bn.cbox
    rm, rv = running[mine][0][lo:hi], running[mine][1][lo:hi]
    # evaluation from the updated running statistics
    axes_shape = (1, -1) + (1,) * (x.ndim - 2)
    e = (x - running[mine][0].reshape(axes_shape)) / np.sqrt(running[mine][1].reshape(axes_shape) + EPS)
    e = e * gamma.reshape(axes_shape) + beta.reshape(axes_shape)
    e = np.maximum(e, 0) if relu else e
    tol = TOL[dtype]
    box = bn.in_dists[0].box(shape, comm.rank)
    own = tuple(slice(a, b) for a, b in box)
    for what, got, ref in (("output", y, ry), ("input gradient", dx, rdx),
                           ("scale gradient", grads[bn.gamma.name], rdg),
                           ("bias gradient", grads[bn.beta.name], rdb), ("running mean", run[0], rm),
                           ("running var", run[1], rv), ("evaluation output", y_eval[own], e[own])):
        scale = max(np.abs(ref).max(), 1.0)  # values of order one: a zero reference (one value) too
        same = np.shape(got) == np.shape(ref)
        err = np.abs(np.asarray(got, np.float64) - ref).max() / scale if same else np.inf
        if not err <= tol:
            bad.append(f"{name} {par} {dtype} {what}: relative error {err:.3g}")
    return bn


def _case_tier(comm, cupy, out):
    from lbannpy.layers.kernels import cudnn_bn

    calls = {"fused": 0, "reduced": 0}
    for method, key in (("forward_local", "fused"), ("forward_reduced", "reduced")):
        orig = getattr(cudnn_bn.LayerPlans, method)

        def counted(self, *a, _orig=orig, _key=key, **k):
            got = _orig(self, *a, **k)
            calls[_key] += got is not None
            return got
        setattr(cudnn_bn.LayerPlans, method, counted)
    bad, named = [], set()
    cases = _cases(comm.size)
    for i, case in enumerate(cases):
        for dtype in ("float64", "float32"):
            try:
                bn = _check_case(comm, cupy, dtype, case, 11 + i, bad)
                named.add(bn.kernel_set)
            except Exception as exc:  # one broken case must not hide the others; the rank reports it
                import traceback
                bad.append(f"{case[0]} {case[3]} {dtype}: {type(exc).__name__}: {exc}\n"
                           f"{traceback.format_exc()[-1500:]}")
    plans = cudnn_bn.planned()
    for i, case in enumerate(cases[:4]):  # the same shapes again: every plan is there already
        _check_case(comm, cupy, "float64", case, 11 + i, [])
    out.update(cases=len(cases), bad=bad, named=sorted(named), plans=plans,
               new_plans=cudnn_bn.planned() - plans, **calls)


def _case_refusals(comm, cupy, out):
    """Each stand-in rule on a batch-norm plan: the message with the rule on, None with it off."""
    import cudnn
    from cudnn import _bind

    from lbannpy.layers.kernels import cudnn as cd
    from lbannpy.layers.kernels import cudnn_bn

    image, dt = (4, 3, 5, 6), np.dtype("float64")
    chan = cudnn_bn.channel_shape(image)
    rng = np.random.default_rng(5)
    x = cupy.asarray(rng.standard_normal(image))
    scale, bias = cupy.ones(chan), cupy.zeros(chan)
    plan = cudnn_bn.plan(cupy, "train", image, dt, EPS)

    def pack(**over):
        arrays = {"x": x, "scale": scale, "bias": bias, "y": cupy.empty(image), "mean": cupy.empty(chan),
                  "inv": cupy.empty(chan)}
        arrays.update(over)
        return {plan.tensors[k]: v for k, v in arrays.items()}

    def execute(**over):
        ws = over.pop("ws", plan.workspace)
        cudnn.set_stream(handle=plan.handle, stream=cupy.cuda.get_current_stream().ptr)
        plan.graph.execute(pack(**over), ws, handle=plan.handle)

    def on_stream():  # the handle on the legacy stream, the buffers' writes ordered, another stream current
        cudnn.set_stream(handle=plan.handle, stream=cupy.cuda.Stream.null.ptr)
        buffers = pack()
        cupy.cuda.Device().synchronize()
        with cupy.cuda.Stream(non_blocking=True):
            plan.graph.execute(buffers, plan.workspace, handle=plan.handle)

    def short():
        execute(ws=cupy.empty(plan.graph.get_workspace_size() - 1, dtype=np.uint8))

    def in_capture():
        s = cupy.cuda.Stream(non_blocking=True)
        layer = cudnn_bn.LayerPlans(EPS, MOMENTUM)
        xs = cupy.asarray(rng.standard_normal((2, 3, 4, 7)))
        rm, rv = cupy.zeros(3), cupy.ones(3)
        with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc), s:
            s.begin_capture()
            try:
                layer.forward_local(xs, cupy.ones(3), cupy.zeros(3), 2 * 4 * 7.0, rm, rv, False)
            finally:
                try:
                    s.end_capture()
                except Exception:  # the refused planning invalidated the capture
                    pass

    def dead():
        gone = cupy.asarray(rng.standard_normal(image))
        ptr = gone.data.ptr
        del gone
        execute(x=ptr)

    rules = {}
    for rule, call in (("stream", on_stream), ("workspace", short), ("capture", in_capture),
                       ("pointer", dead)):
        row = {}
        for state in ("on", "off"):
            _bind.RULES[rule] = state == "on"
            try:
                call()
                row[state] = None
            except Exception as exc:
                row[state] = f"{type(exc).__name__}: {exc}"
            finally:
                _bind.RULES[rule] = True
                cupy.cuda.Device().synchronize()
        rules[rule] = row
    assert cd.planned() == 0  # only batch-norm plans were made
    out.update(rules=rules)


if __name__ == "__main__":
    from gpu_worker import run_worker

    run_worker({"tier": _case_tier, "refusals": _case_refusals})
