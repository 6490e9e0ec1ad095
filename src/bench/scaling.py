"""``python -m lbannpy.bench scaling``: one mesh-model conv layer, 1 rank against 2 ranks splitting height.

The layer is the first convolution of the mesh-tangling model (18 → 16 channels, 3×3, padding 1) on a
1024×1024 sample (batch 1, float32). Forward + backward (data and filter gradients, halo exchange and
halo accumulation included) is timed through the distributed layer itself, under ``mpiexec -n 1`` and
``mpiexec -n 2`` with one BLAS/OpenMP thread per rank, and the speedup is printed.

A third configuration measures what this machine allows: the two ranks of ``mpiexec -n 2`` each run *its
own* single-rank layer on a half-height image (the same local work, with zero padding instead of a halo,
and no communication at all), at the same time. Its speedup over one rank is the ceiling that two
processes reach on these two cores (shared memory bandwidth and caches, hypervisor scheduling); the
distributed layer's speedup is also reported as a fraction of it, which isolates what the halo exchange and
the distributed bookkeeping cost.

The three configurations run in rounds, one after another within each round, so that drift in the load
of a shared machine hits them alike; each reports the median over rounds of its per-round median.
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


def measure(size: int, channels: int, filters: int, batch: int, repeats: int, independent: bool) -> dict:
    """Forward+backward of the conv layer: distributed over the world (``h`` = ranks), or, with
    ``independent``, each rank alone on its own half of the height (no communication)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import Runtime
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    with Runtime(backend="auto") as rt:
        world = rt.world
        comm = world.split(world.rank) if independent else world
        height = -(-size // world.size) if independent else size
        spec = {"input": {"channels": channels, "spatial": [height, size]},
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
            world.barrier()
            t0 = time.perf_counter()
            model.forward(x)
            model.backward(dy)
            world.barrier()  # the slower rank bounds the step
            if i:  # the first round warms caches and allocators
                times.append(time.perf_counter() - t0)
        return {"ranks": world.size, "median_s": float(np.median(times)), "min_s": float(np.min(times))}


CONFIGS = (("1 rank", 1, False), ("2 ranks, h split", 2, False), ("2 ranks, independent halves", 2, True))


def plot_scaling(rows, path: str) -> None:
    """``scaling.png``: speedup and parallel efficiency against ranks per sweep (strong, weak), with the
    ideal line (speedup = ranks, efficiency = 1). ``rows``: objects with sweep, ranks, speedup, efficiency
    (:class:`lbannpy.jobs.helpers.ScalingRow`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for sweep in sorted({r.sweep for r in rows}):
        pts = sorted((r.ranks, r.speedup, r.efficiency) for r in rows if r.sweep == sweep)
        p = [x[0] for x in pts]
        a.plot(p, [x[1] for x in pts], "o-", label=f"{sweep} scaling")
        b.plot(p, [x[2] for x in pts], "o-", label=f"{sweep} scaling")
    ranks = sorted({r.ranks for r in rows})
    a.plot(ranks, [p / ranks[0] for p in ranks], "k--", label="ideal")
    b.plot(ranks, [1.0] * len(ranks), "k--", label="ideal")
    for ax, ylabel in ((a, "speedup over the smallest run"), (b, "parallel efficiency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ranks, [str(p) for p in ranks])
        ax.set_xlabel("ranks per sample")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    b.set_ylim(0, max(1.1, max(r.efficiency for r in rows) * 1.1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lbannpy.bench scaling",
        description="Time one mesh-model convolution layer (forward and backward) on 1 rank and on 2 ranks "
                    "splitting the height, next to two independent half-height layers (what two processes "
                    "reach on this machine), and print the speedups.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", type=int, default=1024, help="image height and width in pixels")
    ap.add_argument("--channels", type=int, default=18, help="input channels")
    ap.add_argument("--filters", type=int, default=16, help="output channels (filters)")
    ap.add_argument("--batch", type=int, default=1, help="samples per call")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per configuration and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the three configurations")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        res = measure(args.size, args.channels, args.filters, args.batch, args.repeats, args.independent)
        if int(os.environ.get("PMI_RANK", "0")) == 0:
            print("RESULT " + json.dumps(res), flush=True)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("lbannpy.bench scaling: needs mpiexec (pip install mpich)", file=sys.stderr)
        return 2
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    per_round: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
    for _ in range(args.rounds):
        for name, ranks, independent in CONFIGS:
            cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.bench", "scaling", "--worker",
                   "--size", str(args.size), "--channels", str(args.channels), "--filters", str(args.filters),
                   "--batch", str(args.batch), "--repeats", str(args.repeats)]
            out = subprocess.run(cmd + (["--independent"] if independent else []), env=env,
                                 capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                print(out.stdout + out.stderr, file=sys.stderr)
                return out.returncode
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
            per_round[name].append(json.loads(line[7:])["median_s"])
    t = {name: float(np.median(v)) for name, v in per_round.items()}
    one, two, ceil = (t[name] for name, _, _ in CONFIGS)
    print(f"conv {args.channels}->{args.filters} 3x3, {args.batch}x{args.size}x{args.size} float32, "
          f"forward+backward, one thread per rank (median of {args.rounds} rounds x {args.repeats} calls):")
    for name, _, _ in CONFIGS:
        runs = " ".join(f"{v * 1e3:.0f}" for v in per_round[name])
        print(f"  {name:<28} {t[name] * 1e3:9.1f} ms   (rounds: {runs})")
    print(f"  speedup, h split            {one / two:9.2f}x   (target >= 1.8x)")
    print(f"  speedup, independent halves {one / ceil:9.2f}x   "
          f"(what two processes get here, no communication)")
    print(f"  h split / independent       {ceil / two:9.2f}    (1.00: the distribution costs nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
