"""``python -m lbannpy.bench scaling``: one mesh-model conv layer, 1 rank against 2 ranks splitting height.

The layer is the first convolution of the mesh-tangling model (18 → 16 channels, 3×3, padding 1) on a
1024×1024 sample (batch 1, float32). Forward + backward (data and filter gradients, halo exchange and
halo accumulation included) is timed through the distributed layer itself, under ``mpiexec -n 1`` and
``mpiexec -n 2`` with one BLAS/OpenMP thread per rank, and the speedup is printed. Both runs happen in
this one invocation, back to back, so they see the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np


def measure(size: int, channels: int, filters: int, batch: int, repeats: int) -> dict:
    from lbannpy.comm import Runtime
    from lbannpy.layers.base import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    with Runtime(backend="auto") as rt:
        comm = rt.world
        spec = {"input": {"channels": channels, "spatial": [size, size]},
                "layers": [{"name": "conv", "type": "conv", "filters": filters, "kernel": 3, "padding": 1}]}
        ctx = LayerContext(comm, np, "float32", seed=1)
        model = Model(spec, batch, ctx, {"default": {"h": comm.size}})
        rng = np.random.default_rng(0)
        shape = model.input_shape
        box = model.input_dist.box(shape, comm.rank)
        x = DistTensor(rng.standard_normal([b - a for a, b in box]).astype(np.float32), shape,
                       model.input_dist, comm.rank)
        oshape = model.output.out_shape
        obox = model.output.out_dist.box(oshape, comm.rank)
        dy = DistTensor(rng.standard_normal([b - a for a, b in obox]).astype(np.float32), oshape,
                        model.output.out_dist, comm.rank)
        times = []
        for i in range(repeats + 1):
            comm.barrier()
            t0 = time.perf_counter()
            model.forward(x)
            model.backward(dy)
            comm.barrier()
            if i:  # the first round warms caches and allocators
                times.append(time.perf_counter() - t0)
        return {"ranks": comm.size, "median_s": float(np.median(times)), "min_s": float(np.min(times))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--channels", type=int, default=18)
    ap.add_argument("--filters", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        res = measure(args.size, args.channels, args.filters, args.batch, args.repeats)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("lbannpy.bench scaling: needs mpiexec (pip install mpich)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results = {}
    for ranks in (1, 2):
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.bench", "scaling", "--worker",
               "--size", str(args.size), "--channels", str(args.channels), "--filters", str(args.filters),
               "--batch", str(args.batch), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return out.returncode
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results[ranks] = json.loads(line[7:])
    one, two = results[1]["median_s"], results[2]["median_s"]
    print(f"conv {args.channels}->{args.filters} 3x3, {args.batch}x{args.size}x{args.size} float32, "
          f"forward+backward, one thread per rank (median of {args.repeats}):")
    print(f"  1 rank            {one * 1e3:9.1f} ms")
    print(f"  2 ranks (h split) {two * 1e3:9.1f} ms")
    print(f"  speedup           {one / two:9.2f}x   (target >= 1.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
