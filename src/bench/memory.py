"""``python -m lbannpy.bench memory``: one sample of a zoo model forward+backward, 1 rank against P ranks.

Runs the model (default: the full mesh-tangling 1K model, 18 × 1024², batch 1, float32) through the
distributed layers under ``mpiexec -n 1`` and ``mpiexec -n P`` with the height split P ways, and reports
each rank's peak resident memory (``ru_maxrss``) and the part of it the model added (peak minus the
resident size after start-up), the time of the pass, and the ratio of the per-rank figures to 1 rank's.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # ru_maxrss is in KiB on Linux


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(model_name: str, size: int) -> dict:
    from lbannpy.comm import Runtime
    from lbannpy.layers.base import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor
    from lbannpy.zoo import get_spec

    with Runtime(backend="auto") as rt:
        comm = rt.world
        spec = get_spec(model_name, batch_size=1, input_size=size)["model"]
        base = _current_rss_mib()
        ctx = LayerContext(comm, np, "float32", seed=1)
        model = Model(spec, 1, ctx, {"default": {"h": comm.size}})
        shape = model.input_shape
        box = model.input_dist.box(shape, comm.rank)
        rng = np.random.default_rng(comm.rank)
        x = DistTensor(rng.standard_normal([b - a for a, b in box]).astype(np.float32), shape,
                       model.input_dist, comm.rank)
        comm.barrier()
        t0 = time.perf_counter()
        y = model.forward(x)
        dy = DistTensor(np.ones_like(y.local), y.global_shape, y.dist, comm.rank)
        model.backward(dy)
        comm.barrier()
        dt = time.perf_counter() - t0
        peak = _rss_mib()
        every = comm.allgather_obj({"rank": comm.rank, "peak_mib": peak, "model_mib": peak - base,
                                    "seconds": dt})
        return {"ranks": comm.size, "per_rank": every}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench memory", description=describe(__doc__))
    ap.add_argument("--model", default="mesh1k", help="zoo model (default mesh1k)")
    ap.add_argument("--size", type=int, default=1024, help="input side (default 1024)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the split run (default 2)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = worker(args.model, args.size)
        if res["per_rank"][0]["rank"] == 0 and int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("lbannpy.bench memory: needs mpiexec (pip install mpich)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results = {}
    for ranks in (1, args.ranks):
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.bench", "memory", "--worker",
               "--model", args.model, "--size", str(args.size)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
        if out.returncode != 0:
            print(out.stdout[-3000:] + out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results[ranks] = json.loads(line[7:])
    one = results[1]["per_rank"][0]
    print(f"{args.model}: one sample 18×{args.size}², float32, forward+backward, height split over the ranks")
    print(f"{'ranks':>5} {'rank':>4} {'peak MiB':>9} {'model MiB':>9} {'vs 1 rank':>9} {'seconds':>8}")
    for ranks in (1, args.ranks):
        for r in results[ranks]["per_rank"]:
            print(f"{ranks:5d} {r['rank']:4d} {r['peak_mib']:9.0f} {r['model_mib']:9.0f} "
                  f"{r['model_mib'] / one['model_mib']:9.2f} {r['seconds']:8.1f}")
    worst = max(r["model_mib"] for r in results[args.ranks]["per_rank"]) / one["model_mib"]
    print(f"largest per-rank model memory on {args.ranks} ranks: {worst:.2f}× the 1-rank figure "
          f"(target <= 0.6×)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
