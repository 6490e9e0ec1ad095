"""The layer tier on GPUs: every layer against PyTorch, and the loss, batch norm and pooling without host
synchronisation, on CuPy + NCCL, rank r on device r.

Each case runs this file under ``mpiexec -n P`` (see ``conftest.launch``): on the CUDA/CuPy/NCCL stand-in
(tests/gpu_standin, first on ``PYTHONPATH``) in every test run, on real CuPy/NCCL with
``LBANNPY_GPU=real``. The worker (``__main__`` below) prints one ``RESULT {json}`` line per rank.

- every case of tests/mpi/test_layers.py (tests/layer_cases.py) on CuPy arrays and an NCCL communicator
  equals PyTorch CPU (float64, 1e-10) at 1, 2 and 4 ranks;
- row 1 (every loss: cross-entropy per sample and per pixel, mse, l1, bce_with_logits, dice): the loss's
  metrics on CuPy logits (CuPy refuses ``numpy.asarray`` of a device array);
- row 2: the loss statistics are reduced by NCCL on the device (NCCL refuses host arrays) and equal the
  NumPy path's;
- row 8: the loss (forward statistics and backward), batch norm and max/avg pooling forward and backward
  make no host synchronisation; the metrics of a logged step make exactly one;
- split convolutions without a window (the block's own convolution plus the ghost rows' terms, ghosts
  moved by NCCL): every windowless case of tests/mpi/test_layers.py equals PyTorch, and a windowless
  forward and backward make no host synchronisation. On a GPU only a kernel set that pads the block itself
  takes this path (ATen's cuDNN; lbannpy's own pads on the host only), so the worker makes the own set pad
  every convolution, and on a real GPU with torch's CUDA also runs ATen.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
N, C, H, W = 5, 5, 17, 23


# ------------------------------------------------------------------------------------------------ tests
# host-staged: the ranks share one device over MPI through pinned host memory (conftest.host_staged)
STAGED = [(2, True), (4, True)]


def _ids(cases):
    return [f"{r}-{'host-staged' if staged else 'own-gpus'}" for r, staged in cases]


@pytest.mark.parametrize("ranks,staged", [(1, False), (2, False), (4, False)] + STAGED,
                         ids=_ids([(1, False), (2, False), (4, False)] + STAGED))
def test_layers_match_pytorch_on_gpus(gpu_launch, ranks, staged):
    rows = gpu_launch(HERE, "tier", ranks, timeout=400, staged=staged)
    assert len(rows) == ranks
    for row in rows:
        assert row["device"] == row["rank"] % row["devices"], row  # rank r on device r (or shared)
        assert row["cases"] >= 20, row
        for msg in row["excused"]:
            print(f"rank {row['rank']}: stand-in race report on disjoint parts of one buffer: {msg[:160]}")
        assert row["bad"] == [], "\n".join(row["bad"])


@pytest.mark.parametrize("ranks,staged", [(1, False), (2, False), (2, True)],
                         ids=_ids([(1, False), (2, False), (2, True)]))
def test_loss_metrics_on_gpus_equal_the_numpy_path_without_host_syncs(gpu_launch, ranks, staged):
    rows = gpu_launch(HERE, "loss", ranks, staged=staged)
    for row in rows:
        assert row["device"] == row["rank"] % row["devices"], row
        for kind, r in row["kinds"].items():
            assert r["error"] is None, f"{kind}: {r['error']}"
            assert r["metrics_gpu"].keys() == r["metrics_cpu"].keys(), (kind, r)
            for k, v in r["metrics_cpu"].items():
                assert abs(r["metrics_gpu"][k] - v) <= 1e-12 * max(1.0, abs(v)), (kind, k, r)
            assert r["grad_err"] <= 1e-12, (kind, r)
            assert r["public_gpu"] == r["metrics_gpu"] and r["public_cpu"] == r["metrics_cpu"], (kind, r)
            print(f"rank {row['rank']} {kind}: host syncs in the loss's step path {r['step_syncs']}, "
                  f"in the logged metrics {r['metric_syncs']}")
            assert r["step_syncs"] == 0 or row["staged_real"], (kind, r["step_sites"])
            assert r["metric_syncs"] == 1, (kind, r["metric_sites"])


@pytest.mark.parametrize("ranks,staged", [(1, False), (2, False), (2, True)],
                         ids=_ids([(1, False), (2, False), (2, True)]))
def test_batchnorm_and_pooling_make_no_host_sync(gpu_launch, ranks, staged):
    rows = gpu_launch(HERE, "syncs", ranks, staged=staged)
    for row in rows:
        assert row["device"] == row["rank"] % row["devices"], row
        for name, r in row["layers"].items():
            assert r["error"] is None, f"{name}: {r['error']}"
            print(f"rank {row['rank']} {name}: host syncs in forward+backward {r['syncs']}")
            assert r["syncs"] == 0 or row["staged_real"], (name, r["sites"])
            assert r["err"] <= 1e-10, (name, r)


@pytest.mark.parametrize("ranks,staged", [(2, False), (4, False)] + STAGED,
                         ids=_ids([(2, False), (4, False)] + STAGED))
def test_split_convolutions_without_a_window_on_gpus(gpu_launch, ranks, staged):
    rows = gpu_launch(HERE, "windowless", ranks, timeout=400, staged=staged)
    for row in rows:
        assert row["device"] == row["rank"] % row["devices"], row
        assert row["error"] is None, row["error"]
        assert row["bad"] == [], "\n".join(row["bad"])
        print(f"rank {row['rank']}: kernel sets {row['sets']}, {row['taken']} windowless convolutions in "
              f"{row['cases']} cases; host syncs in a windowless forward+backward {row['syncs']}")
        assert row["taken"] > 0 and row["cases"] >= 20, row
        assert row["syncs"] == 0 or row["staged_real"], row["sites"]


# ----------------------------------------------------------------------------------------------- worker
def _device_id(cupy) -> int:
    return int(cupy.cuda.Device().id)


def _case_tier(comm, host, cupy, out):
    from case_sets import all_cases
    from layer_cases import compare
    from test_layers import layer_cases

    bad, excused, cases = [], [], layer_cases(comm.size) + all_cases(comm.size)
    for case in cases:
        try:
            bad += compare(case, comm, xp=cupy)
        except Exception as exc:  # one broken case must not hide the others; the rank reports it
            msg = f"{case.id}: {type(exc).__name__}: {exc}"
            # the stand-in's race checker works per allocation: a redistribution that receives straight
            # into part of its output block (NCCL stream) while the compute stream copies the rank's own
            # piece into another, disjoint part is not a race on a GPU; it is listed, not hidden
            if type(exc).__name__ == "RaceError" and "setitem" in str(exc) and case.name == "chain":
                excused.append(msg)
            else:
                bad.append(msg)
    out.update(cases=len(cases), bad=bad, excused=excused)


def _logits_and_labels(kind, comm, xp, ctx):
    """A one-layer model's output (fc logits or 1x1-conv per-pixel logits) split over the ranks, and the
    global host labels."""
    import numpy as np

    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    rng = np.random.default_rng(11)
    if kind == "cross_entropy":
        spec = {"input": {"channels": 3, "spatial": [4, 4]}, "layers": [{"name": "f", "type": "fc",
                                                                          "units": 4}]}
        par = {"default": {"n": comm.size}}
        shape = (8, 3, 4, 4)
        labels = rng.integers(0, 4, size=8)
    else:
        spec = {"input": {"channels": 3, "spatial": [8, 6]},
                "layers": [{"name": "p", "type": "conv", "filters": 2, "kernel": 1, "stride": 2}]}
        par = {"default": {"h": comm.size}}
        shape = (4, 3, 8, 6)
        labels = rng.integers(0, 2, size=(4, 8, 6))
        if kind in ("mse", "l1", "bce_with_logits"):  # float targets of the output's shape (4, 2, 4, 3)
            labels = rng.random((4, 2, 4, 3))
        elif kind == "dice":  # classes at the output's resolution
            labels = rng.integers(0, 2, size=(4, 4, 3))
    model = Model(spec, shape[0], ctx, par)
    x = DistTensor.scatter(xp.asarray(rng.standard_normal(shape)), model.input_dist, comm)
    return model, model.forward(x), labels


def _case_loss(comm, host, cupy, out):
    import numpy as np

    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.loss import Loss

    probe = _sync_probe(cupy)

    out["kinds"] = {}
    for kind in ("cross_entropy", "pixel_cross_entropy", "mse", "l1", "bce_with_logits", "dice"):
        r = {"error": None}
        out["kinds"][kind] = r
        try:
            got = {}
            for name, xp in (("cpu", np), ("gpu", cupy)):
                ctx = LayerContext(comm if xp is cupy else host, xp, "float64", seed=5)
                model, logits, labels = _logits_and_labels(kind, ctx.comm, xp, ctx)
                lshape = (labels.shape[0],) + labels.shape[1:] if labels.ndim > 1 else None
                loss = Loss(kind, ctx, model.output.out_shape, model.output.out_dist, lshape)
                box = loss.label_box()
                mine = labels[tuple(slice(a, b) for a, b in box)]
                # the trainer's labels reach the loss on the device, uploaded a step ahead from page-locked
                # memory (DeviceUploader): an upload from pageable memory here would wait for the device
                step_labels = xp.asarray(mine)
                loss.forward_stats(logits, step_labels)  # first pass: kernels compiled (set-up)
                loss.backward()
                probe.reset_host_syncs()
                stats = loss.forward_stats(logits, step_labels)
                g = loss.backward()
                sites = probe.host_syncs()
                probe.reset_host_syncs()
                _, m = loss.metrics(stats)
                msites = probe.host_syncs()
                if xp is cupy:
                    r.update(step_syncs=_total(sites), step_sites=_named(sites), metric_syncs=_total(msites),
                             metric_sites=_named(msites))
                # the public forward as the trainer's evaluation calls it: CuPy refuses numpy.asarray of
                # a device array (row 1) and NCCL refuses host arrays (row 2)
                _, m_public = loss.forward(logits, mine)
                loss.backward()
                r[f"public_{name}"] = m_public
                got[name] = (m, g.gather(ctx.comm))
            r["metrics_cpu"], r["metrics_gpu"] = got["cpu"][0], got["gpu"][0]
            gc, gg = np.asarray(got["cpu"][1]), cupy.asnumpy(got["gpu"][1])
            r["grad_err"] = float(np.abs(gc - gg).max() / max(np.abs(gc).max(), 1e-30))
        except Exception as exc:
            import traceback

            r["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"


def _case_syncs(comm, host, cupy, out):
    import numpy as np

    from layer_cases import Case, global_data
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    probe = _sync_probe(cupy)
    p = comm.size
    layers = {
        "batchnorm-group": ({"name": "b", "type": "batchnorm"}, {"default": {"h": p}}),
        "batchnorm-global": ({"name": "b", "type": "batchnorm", "sync": "global"}, {"default": {"n": p}}),
        "maxpool": ({"name": "m", "type": "pool", "mode": "max", "kernel": 3, "stride": 2, "padding": 1},
                    {"default": {"h": p}}),
        "avgpool": ({"name": "a", "type": "pool", "mode": "avg", "kernel": 2, "stride": 2},
                    {"default": {"w": p}}),
    }
    out["layers"] = {}
    for name, (layer, par) in layers.items():
        r = {"error": None}
        out["layers"][name] = r
        try:
            case = Case(name, (layer,), (N, C, H, W), par)
            res = {}
            for dev, xp in (("cpu", np), ("gpu", cupy)):
                ctx = LayerContext(comm if xp is cupy else host, xp, "float64", seed=3)
                model = Model(case.spec(), N, ctx, par)
                x, dy = global_data(case, model.output.out_shape)
                xt = DistTensor.scatter(xp.asarray(x), model.input_dist, ctx.comm)
                dyt = DistTensor.scatter(xp.asarray(dy), model.output.out_dist, ctx.comm)
                model.forward(xt)  # first pass: plans, buffers, communicators (set-up, not the step path)
                model.backward(dyt)
                probe.reset_host_syncs()
                y = model.forward(xt)
                dx = model.backward(dyt)
                if xp is cupy:
                    sites = probe.host_syncs()
                    r.update(syncs=_total(sites), sites=_named(sites))
                res[dev] = [y.gather(ctx.comm), dx.gather(ctx.comm)]
            r["err"] = max(float(np.abs(np.asarray(a) - cupy.asnumpy(b)).max() / max(np.abs(a).max(), 1e-30))
                           for a, b in zip(res["cpu"], res["gpu"]))
        except Exception as exc:
            import traceback

            r["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"


def _case_windowless(comm, host, cupy, out):
    import dataclasses

    from layer_cases import Case, compare, global_data
    from test_layers import _windowless, conv, windowless_cases
    from lbannpy.layers import conv as conv_layer
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels import select
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    conv_layer.WINDOWLESS_MAX_BOUNDARY = 1.0  # these small blocks are all boundary
    sets = {"own": dataclasses.replace(select.own(), pads=True, plan=None)}  # pads every convolution
    try:
        sets["aten"] = select.conv_kernels("aten", "gpu")  # a real GPU with torch's CUDA
    except select.KernelChoiceError:
        pass
    out.update(sets=sorted(sets), bad=[], taken=0, cases=0, error=None, syncs=None, sites={})
    try:
        for name in sets:
            for case in windowless_cases(comm.size):
                models = []
                out["bad"] += [f"{name}: {m}" for m in compare(case, comm, xp=cupy, kernels=sets[name],
                                                               out=models)]
                out["taken"] += len(_windowless(models[0]))
                out["cases"] += 1
        # host synchronisations of one windowless forward and backward (after a first, set-up pass)
        probe = _sync_probe(cupy)
        relu = {"name": "r0", "type": "relu"}
        case = Case("syncs", (relu, conv(kernel=3, padding=1)), (2, 3, 16 * comm.size, 12),
                    {"default": {"h": comm.size}})
        ctx = LayerContext(comm, cupy, "float64", seed=3)
        ctx.conv_kernels = sets["own"]
        model = Model(case.spec(), 2, ctx, case.parallel)
        assert _windowless(model), "the sync case must run windowless"
        x, dy = global_data(case, model.output.out_shape)
        xt = DistTensor.scatter(cupy.asarray(x), model.input_dist, comm)
        dyt = DistTensor.scatter(cupy.asarray(dy), model.output.out_dist, comm)
        model.forward(xt)
        model.backward(dyt)
        probe.reset_host_syncs()
        model.forward(xt)
        model.backward(dyt)
        sites = probe.host_syncs()
        out.update(syncs=_total(sites), sites=_named(sites))
    except Exception as exc:
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"


def _sync_probe(cupy):
    """The host-synchronisation counter: the stand-in's (every call site that waits for the device), or on
    real CuPy :class:`_SpinProbe`."""
    try:
        from cupy import _standin
    except ImportError:
        return _SpinProbe(cupy)
    return _standin


class _SpinProbe:
    """Host synchronisations on a real GPU, by timing: ``reset_host_syncs`` queues a kernel that spins for
    ``SPIN`` seconds on the current stream, then the code under test runs; if the spin is still running
    when it returns, the host never waited for the device (any wait, a copy to the host, a stream, event or
    device synchronisation, would have waited for the spin). ``host_syncs`` is then empty, else one entry
    (which cannot tell how many waits there were, only that there was one)."""

    SPIN = 2.0
    SOURCE = r"""extern "C" __global__ void spin(unsigned long long ns) {
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
    }"""

    def __init__(self, cupy):
        self.cp = cupy
        self.kernel = cupy.RawKernel(self.SOURCE, "spin")
        self.done = self.t0 = None

    def reset_host_syncs(self):
        import time

        stream = self.cp.cuda.get_current_stream()
        stream.synchronize()
        self.kernel((1,), (1,), (self.cp.uint64(int(self.SPIN * 1e9)),))
        self.done = self.cp.cuda.Event(disable_timing=True)
        self.done.record(stream)
        self.t0 = time.perf_counter()

    def host_syncs(self):
        import time

        waited, took = self.done.done, time.perf_counter() - self.t0
        self.done.synchronize()
        if not waited:
            return {}
        return {f"the device's work had finished when the host returned after {took:.2f} s (spin "
                f"{self.SPIN} s): the host waited for it": 1}


def _total(syncs) -> int:
    """The stand-in's host-sync count (a number, or counts by call site)."""
    return int(sum(syncs.values())) if isinstance(syncs, dict) else int(syncs)


def _named(syncs):
    return {str(k): int(v) for k, v in syncs.items()} if isinstance(syncs, dict) else syncs


if __name__ == "__main__":
    sys.path[:0] = [str(HERE.parent), str(HERE.parents[1]), str(HERE.parents[1] / "mpi")]
    from mpi4py import MPI

    import cupy

    from lbannpy.comm import make_communicator

    case = sys.argv[1]
    backend = os.environ.get("LBANNPY_TEST_BACKEND", "nccl")
    comm = make_communicator(backend, device="gpu",  # the GPU communicator under test
                             share_gpu=os.environ.get("LBANNPY_TEST_SHARE_GPU") == "1")
    host = make_communicator("mpi")                  # the NumPy path's, over the same ranks
    out = {"rank": comm.rank, "device": _device_id(cupy), "devices": cupy.cuda.runtime.getDeviceCount(),
           # host-staged on a real GPU: a collective's wait() blocks the host until MPI is done, and MPI
           # until the copy down is, so the spin probe sees the host wait for the device; the stand-in
           # counts the explicit synchronisations, of which there must be none (tested there)
           "staged_real": os.environ.get("LBANNPY_CUDA_AWARE_MPI") == "0" and backend == "mpi"
           and not hasattr(cupy, "_standin")}
    {"tier": _case_tier, "loss": _case_loss, "syncs": _case_syncs,
     "windowless": _case_windowless}[case](comm, host, cupy, out)
    print("RESULT " + json.dumps(out), flush=True)
    host.free()
    comm.free()
    MPI.COMM_WORLD.Barrier()
