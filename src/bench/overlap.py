"""``python -m lbannpy.bench overlap``: blocking against overlapped gradient reduction at 2 ranks.

A VGG-like net whose gradients are large (three fully-connected layers after a small conv stack) is run
through the real layers and the overlap engine, sample-parallel over 2 ranks, in two honest cases:

* **CPU compute**: forward and backward are the real NumPy layers. While both cores compute,
  shared-memory MPI has no core left to progress the background reductions, so little is hidden.
* **GPU-like stand-in** (labelled as such): each layer's backward is replaced by a sleep of the same
  measured duration, which leaves the core free as a GPU kernel would; the reductions are the real ones.

For each it prints the step time with blocking sync and with the overlap engine, the communication time,
and ``hidden_comm_fraction`` from the measured intervals. Finally it prints the communication volume of
replicated fully-connected gradients (allgather of activations and errors) against allreducing their
weight gradients for VGG-A's FC layers at batch 256 (Lee et al.: 28.5 MB against 392 MB).

With ``--device gpu`` it also reduces the same gradients as device arrays, in the overlap engine's buckets,
over the run's GPU backend (NCCL where every rank has its own GPU) and over the host-staged MPI path
(pinned host buffers, comm/hoststaged.py) on the same ranks, so that what staging costs is seen;
``--share-gpu`` lets the 2 ranks share one GPU (NCCL cannot run there).
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

VGG_A_FC = [(25088, 4096), (4096, 4096), (4096, 1000)]  # (inputs, outputs) of fc6, fc7, fc8


def fc_volumes(batch: int, layers=VGG_A_FC, itemsize: int = 4) -> list[tuple[float, float]]:
    """Bytes per step and layer: (allgather of its activations and errors, allreduce of its weight gradients).

    Allreduce moves the weight gradients (inputs × outputs, the payload of a ring allreduce per rank);
    replicated FC gathers the input activations (batch × inputs) in the forward and the errors
    (batch × outputs) in the backward (Lee et al. §III-C: (K_b + K_c)·N against K_b·K_c).
    """
    return [(batch * (i + o) * itemsize, i * o * itemsize) for i, o in layers]


def _spec(units: int, size: int = 64):
    return {"input": {"channels": 3, "spatial": [size, size]},
            "layers": [{"name": "c1", "type": "conv", "filters": 32, "kernel": 3, "padding": 1},
                       {"name": "r1", "type": "relu"},
                       {"name": "p1", "type": "pool", "kernel": 2},
                       {"name": "c2", "type": "conv", "filters": 64, "kernel": 3, "padding": 1},
                       {"name": "r2", "type": "relu"},
                       {"name": "p2", "type": "pool", "kernel": 2},
                       {"name": "fc6", "type": "fc", "units": units},
                       {"name": "r6", "type": "relu"},
                       {"name": "fc7", "type": "fc", "units": units},
                       {"name": "r7", "type": "relu"},
                       {"name": "fc8", "type": "fc", "units": 10}]}


def worker(units: int, batch: int, steps: int) -> dict:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import Runtime
    from lbannpy.comm.overlap import OverlapEngine, hidden_fraction
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    out = {}
    with Runtime(backend="auto") as rt:
        comm = rt.world
        ctx = LayerContext(comm, np, "float32", seed=1)
        model = Model(_spec(units), batch, ctx, {"default": {"n": comm.size}})
        params = model.params
        comms = [ctx.block_comm(p.dist, p.reduce_dims) for p in params]
        shape = model.input_shape
        box = model.input_dist.box(shape, comm.rank)
        x = DistTensor(np.random.default_rng(comm.rank).standard_normal([b - a for a, b in box])
                       .astype(np.float32), shape, model.input_dist, comm.rank)
        grad_bytes = sum(p.grad.nbytes for p in params)
        out["grad_mib"] = grad_bytes / 2**20
        out["grad_sizes"] = [int(p.grad.size) for p in params]
        # per-layer backward durations of the real computation, for the stand-in: the median of warm
        # passes (a single cold pass pays first-touch page faults, which vary from run to run)
        y = model.forward(x)
        dy = DistTensor(np.ones_like(y.local), y.global_shape, y.dist, comm.rank)
        samples: dict[str, list[float]] = {}
        for rep in range(4):
            model.forward(x)
            last = [time.perf_counter()]

            def timed(name):
                now = time.perf_counter()
                samples.setdefault(name, []).append(now - last[0])
                last[0] = now
            model.backward(dy, on_layer=timed)
            if rep == 0:  # warm-up
                samples.clear()
        # identical devices: every rank sleeps rank 0's durations (each rank's own measurement differs by
        # a few ms, which would skew the ranks by construction)
        bp_times = comm.bcast_obj({name: float(np.median(v)) for name, v in samples.items()}, root=0)
        for case in ("cpu", "standin"):
            for overlap in (False, True):
                eng = OverlapEngine(params, comms, bucket_bytes=25 << 20, first_bucket_bytes=1 << 20,
                                    overlap=overlap, thread_multiple=rt.thread_multiple)
                steps_t, comm_t, hidden = [], [], []
                for s in range(steps + 1):
                    comm.barrier()
                    t0 = time.perf_counter()
                    eng.start_step()
                    n0 = len(eng.records)
                    if case == "cpu":
                        model.forward(x)
                        tb = time.perf_counter()
                        model.backward(dy, on_layer=eng.layer_done)
                    else:  # the core sleeps as it would while a GPU computes
                        time.sleep(sum(v for k, v in bp_times.items()) * 0.5)  # forward ≈ half of backward
                        tb = time.perf_counter()
                        for layer in reversed(model.layers):
                            time.sleep(bp_times.get(layer.name, 0.0))
                            eng.layer_done(layer.name)
                    te = time.perf_counter()
                    eng.finish()
                    t1 = time.perf_counter()
                    recs = eng.records[n0:]
                    iv = [(a, b) for _, _, _, a, b in recs]
                    if s:  # the first step warms up
                        steps_t.append(t1 - t0)
                        comm_t.append(sum(b - a for a, b in iv))
                        hidden.append(hidden_fraction(iv, [(tb, te)]))
                eng.close()
                out[f"{case}-{'overlap' if overlap else 'blocking'}"] = {
                    "step_s": float(np.median(steps_t)), "comm_s": float(np.median(comm_t)),
                    "hidden": float(np.mean(hidden)), "compute_s": float(np.median(steps_t)) - (
                        0.0 if overlap else float(np.median(comm_t)))}
    return out


def gpu_allreduce(sizes: list[int], steps: int, share_gpu: bool) -> dict:
    """Median seconds of one step's blocking bucket reductions of float32 gradients of ``sizes`` elements
    (the engine's bucket plan: 25 MiB, the first 1 MiB) on device arrays, over the run's GPU backend and
    over a host-staged MPI communicator on the same ranks."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import Runtime
    from lbannpy.comm.overlap import plan_buckets

    class P:  # only the gradient's size matters to the plan
        def __init__(self, n):
            self.grad = np.empty(n, dtype=np.float32)

    params = [P(n) for n in sizes]
    with Runtime(backend="auto", device="gpu", share_gpu=share_gpu) as rt:
        cupy, world = rt.xp, rt.world
        plan = plan_buckets(params, [world] * len(params), 25 << 20, 1 << 20)
        bufs = [cupy.ones(sum(sizes[i] for i in b), dtype=cupy.float32) for b in plan]
        staged = world.host.dup()  # the same ranks, forced through pinned host memory
        staged.host_staged = True
        out = {"buckets": len(bufs), "backend": f"{rt.backend}{' (host-staged)' if rt.host_staged else ''}"}
        for name, comm in (("native", world), ("staged", staged)):
            times = []
            for s in range(steps + 1):
                world.barrier()
                t0 = time.perf_counter()
                for b in bufs:
                    comm.allreduce(b, out=b)
                cupy.cuda.get_current_stream().synchronize()
                if s:  # the first step warms up
                    times.append(time.perf_counter() - t0)
            out[name] = world.host.allreduce_obj(float(np.median(times)), "max")
        staged.free()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench overlap", description=describe(__doc__))
    ap.add_argument("--units", type=int, default=1024, help="width of fc6/fc7 (default 1024: 64 + 4 MiB)")
    ap.add_argument("--batch", type=int, default=32, help="mini-batch size (default 32)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (default 5)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                    help="gpu: also reduce the gradients as device arrays, the run's GPU backend beside "
                         "host-staged MPI")
    ap.add_argument("--share-gpu", action="store_true",
                    help="gpu: let the 2 ranks share devices (runtime.share_gpu; NCCL cannot run there)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        res = worker(args.units, args.batch, args.steps)
        if args.device == "gpu":
            res["gpu"] = gpu_allreduce(res.pop("grad_sizes"), args.steps, args.share_gpu)
        res.pop("grad_sizes", None)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("lbannpy.bench overlap: needs mpiexec (pip install mpich)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "lbannpy.bench", "overlap", "--worker",
           "--units", str(args.units), "--batch", str(args.batch), "--steps", str(args.steps),
           "--device", args.device] + (["--share-gpu"] if args.share_gpu else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        print(run.stdout[-3000:] + run.stderr[-3000:], file=sys.stderr)
        return run.returncode
    res = json.loads([ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    print(f"VGG-like net, {res['grad_mib']:.0f} MiB of gradients, batch {args.batch}, 2 ranks "
          f"sample-parallel, one thread per rank, median of {args.steps} steps")
    print(f"{'case':<34} {'blocking ms':>11} {'overlap ms':>10} {'comm ms':>8} {'hidden':>7} "
          f"{'max(comp,comm) ms':>17} {'overlap/max':>11}")
    for case, label in (("cpu", "CPU compute (real NumPy layers)"),
                        ("standin", "GPU-like stand-in (sleep, core free)")):
        b, o = res[f"{case}-blocking"], res[f"{case}-overlap"]
        compute = b["step_s"] - b["comm_s"]
        bound = max(compute, o["comm_s"])
        print(f"{label:<34} {b['step_s'] * 1e3:11.1f} {o['step_s'] * 1e3:10.1f} {o['comm_s'] * 1e3:8.1f} "
              f"{o['hidden']:7.2f} {bound * 1e3:17.1f} {o['step_s'] / bound:11.2f}")
    if "gpu" in res:
        g = res["gpu"]
        print(f"\nthe same gradients as device arrays (float32, {g['buckets']} buckets), blocking reductions "
              f"per step: {g['backend']} {g['native'] * 1e3:.1f} ms, host-staged MPI {g['staged'] * 1e3:.1f} "
              f"ms ({g['staged'] / g['native']:.2f}x)")
    print("\nVGG-A fully-connected layers at batch 256, float32, per step: replicated FC (allgather of "
          "activations and errors) vs allreduce of the weight gradients")
    vols = fc_volumes(256)
    for name, (i, o), (ag, ar) in zip(("fc6", "fc7", "fc8"), VGG_A_FC, vols):
        paper = "   (Lee et al. for the first FC layer: 28.5 MB vs 392 MB)" if name == "fc6" else ""
        print(f"  {name} {i:>5d} -> {o:<4d}  allgather {ag / 2**20:6.1f} MiB   "
              f"allreduce {ar / 2**20:6.1f} MiB{paper}")
    print(f"  all three          allgather {sum(a for a, _ in vols) / 2**20:6.1f} MiB   "
          f"allreduce {sum(r for _, r in vols) / 2**20:6.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
