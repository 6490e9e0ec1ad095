"""``python -m lbannpy.bench data``: I/O wait of the HDF5 reader per training step, with and without prefetch.

What it measures, on a synthetic mesh data set (generated into a temporary directory unless ``--file``):

1. **I/O wait per step.** A loop of ``next batch -> compute step`` on one rank, with ``prefetch`` off (the
   wait is the whole read) and on (the wait is what the background read did not hide). The compute step is
   a real 3×3 convolution layer forward + backward on the batch just read (NumPy: im2col strips + BLAS
   GEMMs for forward, weight gradient and input gradient, col2im), ``--filters`` output channels, same
   padding, stride 2 (the first layer of a block of the mesh model); its time is measured alone and printed.
   ``paper`` is a fixed sleep of 0.4 s per local sample: the 1K mesh model's mini-batch time at one V100
   per sample (Table I of Dryden et al. 2019), labelled as a sleep in the output; ``sleep:S`` a sleep of S
   seconds. ``--compute`` takes a comma list (default ``paper,conv``). The wait is printed as a percentage
   of the step; the first step (empty queue) is reported separately from the steady state.
2. **GIL.** h5py holds the GIL for the whole of one ``H5Dread``; the bench measures the longest stall of a
   pure-Python thread while the reader reads, per read piece (``piece_bytes``), and the slowdown of the
   compute step while prefetch runs beside it. Both are printed, not assumed.
3. **1 rank vs 2 ranks.** The time to read one mini-batch's hyperslab by one rank (the whole batch) and by
   two ranks at once, each its half (split over ``h``: contiguous rows of every channel), launched with
   ``mpiexec -n 2`` over :mod:`lbannpy.comm` when ``mpiexec`` runs, else as two processes.

4. **A training run's wait.** ``--summary run/summary.json`` (one or more) prints, for each run, the share of
   its step time spent waiting for data (``io_wait_fraction``: the summed ``io_wait_s`` over the summed
   step times of its logged steps) and whether it meets the :data:`IO_WAIT_TARGET` (2 %), then exits: e.g.
   ``python -m lbannpy.data mesh --size 1024 --samples 4 -o m.h5``, a few mesh1k steps on 1024² with
   ``data.train.path: m.h5``, then ``python -m lbannpy.bench data --summary run/summary.json``.

Reads come from the page cache when the file was just written (it is, unless ``--file`` names an old one);
the numbers are those of HDF5 and the memory system, not of a parallel file system.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ..dist import Distribution


# --------------------------------------------------------------------------------------------------------
# the compute step: a conv layer forward + backward on the block


class ConvStep:
    """3×3 convolution, ``C -> F`` channels, padding 1, given stride: forward, weight and input gradients.

    im2col is done in strips of output rows so the column buffer stays near ``strip_bytes``; the three
    GEMMs per strip run in BLAS (the GIL is released there). The upstream gradient is the output itself
    (the gradient of ``0.5 * ||y||²``).
    """

    def __init__(self, channels: int, filters: int, stride: int = 2, seed: int = 0,
                 strip_bytes: int = 32 << 20):
        self.stride = stride
        rng = np.random.default_rng(seed)
        self.w = (rng.standard_normal((filters, channels * 9)) / np.sqrt(channels * 9)).astype(np.float32)
        self.strip_bytes = strip_bytes

    def __call__(self, x: np.ndarray) -> float:
        n, c, h, w = x.shape
        st = self.stride
        ho, wo = (h - 1) // st + 1, (w - 1) // st + 1
        xp = np.zeros((n, c, h + 2, w + 2), dtype=np.float32)
        xp[:, :, 1:-1, 1:-1] = x
        dxp = np.zeros_like(xp)
        dw = np.zeros_like(self.w)
        rows = max(1, self.strip_bytes // (c * 9 * wo * 4))
        for i in range(n):
            for r0 in range(0, ho, rows):
                r1 = min(ho, r0 + rows)
                cols = np.empty((c, 9, r1 - r0, wo), dtype=np.float32)
                for k in range(9):
                    dy, dx = divmod(k, 3)
                    rows_k = slice(r0 * st + dy, (r1 - 1) * st + dy + 1, st)
                    cols[:, k] = xp[i, :, rows_k, dx:dx + (wo - 1) * st + 1:st]
                cols = cols.reshape(c * 9, -1)
                y = self.w @ cols                    # forward
                dw += y @ cols.T                     # weight gradient (upstream gradient = y)
                dcols = (self.w.T @ y).reshape(c, 9, r1 - r0, wo)   # input gradient, columns
                for k in range(9):                   # col2im
                    dy, dx = divmod(k, 3)
                    rows_k = slice(r0 * st + dy, (r1 - 1) * st + dy + 1, st)
                    dxp[i, :, rows_k, dx:dx + (wo - 1) * st + 1:st] += dcols[:, k]
        return float(dw[0, 0] + dxp[0, 0, 1, 1])


IO_WAIT_TARGET = 0.02   # the step's share spent waiting for data that a run must stay under
PAPER_STEP_S = 0.4   # seconds per sample: 1K mesh model, 1 GPU/sample, Table I of Dryden et al. 2019


def make_compute(spec: str, channels: int, filters: int):
    """(callable(batch inputs) -> None, label)."""
    if spec == "conv":
        conv = ConvStep(channels, filters)
        return (lambda x: conv(x)), f"conv 3×3/2 {channels}->{filters} forward+backward (NumPy/BLAS)"
    if spec == "paper":
        return ((lambda x: time.sleep(PAPER_STEP_S * x.shape[0])),
                f"sleep {PAPER_STEP_S:g} s/sample (1K mesh step on a V100, paper Table I; not a real layer)")
    if spec.startswith("sleep:"):
        seconds = float(spec.split(":", 1)[1])
        return (lambda x: time.sleep(seconds)), f"fixed sleep of {seconds * 1e3:.0f} ms (not a real layer)"
    raise SystemExit(f"--compute entries must be 'paper', 'conv' or 'sleep:SECONDS', got {spec!r}")


# --------------------------------------------------------------------------------------------------------
# measurements


def run_loop(path: str, batch: int, steps: int, prefetch: bool, compute, piece_bytes: int, seed: int = 0):
    """Per-step (wait, compute, step) seconds of ``steps`` steps of ``next -> compute`` on one rank."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..data.reader import HDF5Reader

    waits, comps, totals = [], [], []
    with HDF5Reader(path, batch_size=batch, seed=seed, prefetch=prefetch, piece_bytes=piece_bytes) as r:
        for _ in range(steps):
            t0 = time.perf_counter()
            b = r.next()
            t1 = time.perf_counter()
            compute(b.inputs)
            t2 = time.perf_counter()
            waits.append(b.wait_s)
            comps.append(t2 - t1)
            totals.append(t2 - t0)
        stats = r.io_stats()
    return np.array(waits), np.array(comps), np.array(totals), stats


def gil_stall(path: str, piece_bytes: int, reads: int = 6) -> tuple[float, float]:
    """(longest stall of a pure-Python thread while a reader thread reads, mean read time per sample)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..data.reader import HDF5Reader

    with HDF5Reader(path, batch_size=1, seed=0, shuffle=False, prefetch=False,
                    piece_bytes=piece_bytes) as r:
        r.read_batch(0, 0)
        done = threading.Event()
        times = []

        def reader():
            for i in range(reads):
                t = time.perf_counter()
                r.read_batch(0, i % r.steps_per_epoch)
                times.append(time.perf_counter() - t)
            done.set()

        th = threading.Thread(target=reader)
        last = time.perf_counter()
        worst = 0.0
        th.start()
        while not done.is_set():
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now
        th.join()
    return worst, float(np.mean(times))


def hyperslab_read(path: str, dist: Distribution, rank: int, batch: int, steps: int) -> list[float]:
    """Seconds per ``read_batch`` of ``rank``'s block for ``steps`` steps (no prefetch)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..data.reader import HDF5Reader

    out = []
    with HDF5Reader(path, dist=dist, rank=rank, batch_size=batch, seed=1, prefetch=False) as r:
        for s in range(steps):
            t = time.perf_counter()
            r.read_batch(s // r.steps_per_epoch, s % r.steps_per_epoch)
            out.append(time.perf_counter() - t)
    return out


def _worker_mpi(args) -> int:
    """Under mpiexec: every rank reads its hyperslab at the same time; rank 0 prints JSON."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..comm import Runtime

    with Runtime(backend="auto", device="cpu") as rt:
        comm = rt.world
        dist = Distribution.make(4, ranks=comm.size, **{args.split: comm.size})
        comm.barrier()
        times = hyperslab_read(args.file, dist, comm.rank, args.batch, args.steps)
        every = comm.allgather_obj(times)
        if comm.rank == 0:
            res = {"launcher": f"mpiexec ({comm.backend})", "times": every}
            print("RESULT " + json.dumps(res), flush=True)
    return 0


def _worker_process(path, split, ranks, rank, batch, steps, barrier, out):
    dist = Distribution.make(4, ranks=ranks, **{split: ranks})
    barrier.wait()
    out.put((rank, hyperslab_read(path, dist, rank, batch, steps)))


def two_rank_read(path: str, batch: int, steps: int, split: str,
                  launcher: str) -> tuple[str, list[list[float]]]:
    """Per-rank read times of 2 ranks reading their halves of the same batches at once."""
    if launcher in ("auto", "mpiexec") and shutil.which("mpiexec"):
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "lbannpy.bench.data", "--hyperslab-worker",
               "--file", path, "--batch", str(batch), "--steps", str(steps), "--split", split]
        env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                return res["launcher"], res["times"]
        if launcher == "mpiexec":
            raise SystemExit(f"mpiexec run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        note = f"two processes (mpiexec failed: exit {proc.returncode})"
    else:
        note = "two processes"
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker_process, args=(path, split, 2, r, batch, steps, barrier, out))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return note, [results[0], results[1]]


def summary_wait(paths) -> int:
    """Print each run's I/O wait share against :data:`IO_WAIT_TARGET`; 0 when every file was read (the
    verdict is printed, not the exit status), 2 when one is missing or lacks the figures."""
    status = 0
    for path in paths:
        try:
            with open(path) as fh:
                s = json.load(fh)
            frac, wait, step = s["io_wait_fraction"], s["io_wait_s"], s["median_step_s"]
            if frac is None or wait is None or step is None:
                raise KeyError("io_wait_fraction (no timed step)")
        except (OSError, ValueError, KeyError) as exc:
            print(f"{path}: no I/O wait figures ({type(exc).__name__}: {exc})", file=sys.stderr)
            status = 2
            continue
        verdict = "met" if frac <= IO_WAIT_TARGET else "NOT met"
        print(f"{path}: {s.get('steps')} steps, median step {step * 1e3:.1f} ms, median io_wait "
              f"{wait * 1e3:.2f} ms; io_wait is {100 * frac:.2f} % of the step time (target <= "
              f"{IO_WAIT_TARGET:.0%}: {verdict})")
    return status


# --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench data", description=describe(__doc__))
    ap.add_argument("--file", help="existing HDF5 file (inputs/labels); default: generate one in a temp dir")
    ap.add_argument("--size", type=int, default=1024, help="generated samples are SIZE×SIZE (default 1024)")
    ap.add_argument("--samples", type=int, default=8, help="generated samples (default 8)")
    ap.add_argument("--batch", type=int, default=2, help="mini-batch size (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="steps per measurement (default 6)")
    ap.add_argument("--compute", default="paper,conv",
                    help="comma list of 'paper', 'conv', 'sleep:SECONDS' (default paper,conv)")
    ap.add_argument("--filters", type=int, default=4, help="output channels of the conv step (default 4)")
    ap.add_argument("--piece-mb", type=float, default=4.0, help="bytes per HDF5 read call, MiB (default 4)")
    ap.add_argument("--launcher", choices=("auto", "mpiexec", "processes"), default="auto",
                    help="how the 2-rank reads start: mpiexec, plain processes, or auto (default auto)")
    ap.add_argument("--split", choices=("h", "w", "n"), default="h", help="2-rank split (default h)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--summary", nargs="+", metavar="SUMMARY_JSON",
                    help="print the I/O wait share of these training runs (their summary.json) against the "
                         f"{IO_WAIT_TARGET * 100:g}%% target, and nothing else")
    ap.add_argument("--hyperslab-worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.hyperslab_worker:
        return _worker_mpi(args)
    if args.summary:
        return summary_wait(args.summary)
    tmp = None
    try:
        if args.file:
            path = args.file
        else:
            # late: loaded when the command runs, so its --help and argument errors come without it
            from ..data.mesh import MeshParams, write_mesh

            tmp = tempfile.mkdtemp(prefix="lbannpy-bench-data-")
            path = os.path.join(tmp, "mesh.h5")
            t = time.perf_counter()
            info = write_mesh(path, MeshParams(size=args.size, samples=args.samples, seed=0))
            print(f"generated {args.samples} mesh samples of {args.size}² × 18 channels "
                  f"({os.path.getsize(path) / 2**20:.0f} MiB, positive fraction "
                  f"{info['positive_fraction']:.3f}) in {time.perf_counter() - t:.1f} s")
        return _bench(args, path)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _bench(args, path: str) -> int:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..data.dataset import validate_dataset

    info = validate_dataset(path)
    piece = int(args.piece_mb * 2**20)
    batch_mib = args.batch * int(np.prod(info.sample_shape)) * info.input_dtype.itemsize / 2**20
    print(f"file {path}: {info.num_samples} samples of {info.sample_shape}, batch {args.batch} "
          f"({batch_mib:.0f} MiB of inputs per step), {args.steps} steps")
    results = {"file": path, "batch": args.batch, "steps": args.steps, "loops": []}
    for spec in [c.strip() for c in args.compute.split(",") if c.strip()]:
        compute, label = make_compute(spec, info.channels, args.filters)
        # the compute step alone (after one warm-up)
        x = np.zeros((args.batch,) + info.sample_shape, dtype=info.input_dtype)
        compute(x)
        t = time.perf_counter()
        compute(x)
        t_compute = time.perf_counter() - t
        del x
        print(f"\ncompute step: {label}: {t_compute * 1e3:.0f} ms alone")
        rows = []
        for prefetch in (False, True):
            waits, comps, totals, stats = run_loop(path, args.batch, args.steps, prefetch, compute, piece)
            steady = slice(1, None) if len(waits) > 1 else slice(None)
            rows.append({"compute": label, "compute_alone_s": t_compute, "prefetch": prefetch,
                         "wait_first_s": float(waits[0]), "wait_mean_s": float(waits[steady].mean()),
                         "step_mean_s": float(totals[steady].mean()),
                         "compute_mean_s": float(comps[steady].mean()), "read_mean_s": stats["read_s_mean"],
                         "wait_pct": float(100 * waits[steady].sum() / totals[steady].sum())})
        results["loops"] += rows
        print("I/O wait per step (steady state: steps 2..N; the first step waits for an empty queue)")
        print(f"  {'prefetch':9s} {'read':>9s} {'wait':>9s} {'compute':>9s} {'step':>9s} {'wait/step':>10s} "
              f"{'first wait':>11s}")
        for r in rows:
            print(f"  {'on' if r['prefetch'] else 'off':9s} {r['read_mean_s'] * 1e3:7.1f}ms "
                  f"{r['wait_mean_s'] * 1e3:7.1f}ms {r['compute_mean_s'] * 1e3:7.1f}ms "
                  f"{r['step_mean_s'] * 1e3:7.1f}ms {r['wait_pct']:8.1f} % {r['wait_first_s'] * 1e3:9.1f}ms")
        off, on = rows
        verdict = "met" if on["wait_pct"] <= 100 * IO_WAIT_TARGET else "NOT met"
        print(f"  with prefetch the I/O wait is {on['wait_pct']:.1f} % of the step (target <= "
              f"{IO_WAIT_TARGET:.0%}: {verdict}; {off['wait_pct']:.1f} % without); compute step "
              f"{on['compute_mean_s'] * 1e3:.0f} ms with the reader thread beside it vs "
              f"{off['compute_mean_s'] * 1e3:.0f} ms without")

    stall_big, read_big = gil_stall(path, 1 << 40)
    stall_piece, _ = gil_stall(path, piece)
    results["gil"] = {"stall_whole_sample_s": stall_big, "read_sample_s": read_big,
                      "stall_pieces_s": stall_piece, "piece_bytes": piece}
    print(f"\nGIL: a pure-Python thread stalls up to {stall_big * 1e3:.1f} ms while one "
          f"{read_big * 1e3:.1f} ms whole-sample H5Dread runs (h5py holds the GIL during the read); "
          f"with {args.piece_mb:g} MiB pieces the longest stall is {stall_piece * 1e3:.1f} ms")

    one = hyperslab_read(path, Distribution.make(4, ranks=1), 0, args.batch, args.steps)
    launcher, two = two_rank_read(path, args.batch, args.steps, args.split, args.launcher)
    t1 = float(np.mean(one[1:] if len(one) > 1 else one))
    per_rank = [float(np.mean(t[1:] if len(t) > 1 else t)) for t in two]
    t2 = max(per_rank)
    results["hyperslab"] = {"one_rank_s": t1, "two_rank_s": per_rank, "launcher": launcher,
                            "split": args.split}
    print(f"\nhyperslab read of one mini-batch ({batch_mib:.0f} MiB), mean of steps 2..N:")
    print(f"  1 rank, whole batch:                 {t1 * 1e3:7.1f} ms  ({batch_mib / t1 / 1024:.2f} GiB/s)")
    print(f"  2 ranks at once, {args.split}-halves ({launcher}): "
          f"{' / '.join(f'{p * 1e3:.1f}' for p in per_rank)} ms  (slowest {t2 * 1e3:.1f} ms, "
          f"{batch_mib / t2 / 1024:.2f} GiB/s together; speed-up {t1 / t2:.2f}×)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
