"""``python -m lbannpy.bench memory``: peak memory of training one sample, lbannpy against PyTorch, 1 rank
against a split sample.

Three training runs of a zoo model (default: the full mesh-tangling 1K model, 18 × 1024², batch 1,
float32, SGD with momentum, ``--steps`` steps), one after the other, each process on one BLAS thread:

- ``python -m lbannpy.train`` on 1 rank;
- the same network in PyTorch, one process (the module ``lbannpy.export --torch-module`` writes, as in
  ``bench peer``; NCHW);
- ``mpiexec -n P python -m lbannpy.train`` with every sample split P ways: by default (``--split auto``) each
  layer split as the strategy selector chooses for P ranks (``python -m lbannpy.strategy --ranks P``; on the
  full mesh1k model and two ranks: the height of the first four blocks, whose activations dominate, and the
  filters of the last two, which hold 77 % of the parameters), or (``--split h``) every layer's height.

lbannpy's runs use ``--kernels`` (``runtime.kernels``, default ``auto``: ATen where torch imports) and, with
``--shard-state``, ``optimizer.shard_state`` (the split run then keeps its share of the replicated
parameters' momentum only). The
kernel set moves the ratio: ATen's runs carry torch's process image (~185 MiB a process, ~260 MiB with
Python, NumPy and MPI) on every rank, a fixed cost that the split does not halve; lbannpy's own kernels
import no torch.

Each process reports its own peak resident set (``VmHWM`` of ``/proc/self/status``: a fresh address space
starts its own high-water mark, whereas ``ru_maxrss`` inherits a forking parent's). The report gives
lbannpy's 1-rank peak against PyTorch's (target: at most 1×) and the largest per-rank peak of the split
run against the 1-rank peak (target: at most ``--target``×, 0.55 by default).
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import json
import os
import sys
import tempfile

from . import peer
from .peer import (Case, PeerError, launcher, launcher_rank, run_checked, lbannpy_config, network,
                   write_data)

# issue #18: lbannpy's 1-rank peak at most PyTorch's, a 2-way split at most 0.55x of 1 rank
TORCH_TARGET = 1.0
SPLIT_TARGET = 0.55


def peak_rss_mib() -> float:
    """This process's peak resident set (MiB), from ``VmHWM``."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024.0


def _peak_worker(result: str, argv: list[str]) -> int:
    """Runs ``lbannpy.train argv`` (or, ``argv[0] == "--torch"``, the PyTorch worker of ``bench peer``) in
    this process and writes its peak to ``result.<rank>.json``."""
    if argv[0] == "--torch":
        # late: loaded when the command runs, so its --help and argument errors come without it
        from .peer import torch_worker

        code = torch_worker(json.loads(argv[1]))
    else:
        # late: loaded when the command runs, so its --help and argument errors come without it
        import lbannpy.train

        code = lbannpy.train.main(argv)
    rank, _ = launcher_rank()
    with open(f"{result}.{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "peak_mib": peak_rss_mib(), "code": code}, f)
    return int(code or 0)


def _peaks(result: str, ranks: int) -> list[float]:
    out = []
    for rank in range(ranks):
        with open(f"{result}.{rank}.json", encoding="utf-8") as f:
            out.append(float(json.load(f)["peak_mib"]))
    return out


def _wrapped(work: str, tag: str, ranks: int, inner: list[str]) -> list[str]:
    return launcher(ranks) + [sys.executable, "-m", "lbannpy.bench", "memory", "--peak-worker",
                               os.path.join(work, f"peak-{tag}"), "--", *inner]


RUNS = ("lbannpy", "torch", "split")


def split_layers(spec: dict, case: Case, ranks: int, split: str, machine: str | None) -> dict | None:
    """``parallel.layers`` of the split run: the strategy selector's choice (``split == "auto"``), or None
    (every layer split along ``split``)."""
    if split != "auto":
        return None
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.strategy import planner

    pl = planner.plan(spec, ranks, machine or planner.DEFAULT_MACHINE, batch_size=case.batch)
    return pl.parallel_layers()


def describe_split(layers: dict | None, split: str, ranks: int) -> str:
    """``"h2"`` or, for per-layer splits, ``"h2 x36, c2 x19"`` (distribution and layer count)."""
    if not layers:
        return f"{split}{ranks}"
    counts: dict[str, int] = {}
    for deg in layers.values():
        key = "".join(f"{k}{v}" for k, v in deg.items() if v > 1) or "r"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def measure(case: Case, ranks: int, steps: int, work: str, timeout: float, runs=RUNS,
            layers: dict | None = None, split: str = "h") -> dict:
    """Peak MiB of each process of ``runs``: ``{"lbannpy": [1 rank], "torch": [1 process], "split": [per
    rank]}``; the split run splits every layer along ``split``, or as ``layers`` (``parallel.layers``)."""
    spec, params, out_shape = network(case)
    data = os.path.join(work, f"{case.name}.h5")
    write_data(data, spec, out_shape, case.batch * steps)
    res = {}
    for key, n in (("lbannpy", 1), ("torch", 1), ("split", ranks)):
        if key not in runs:
            continue
        if key == "torch":
            job = {"zoo": case.zoo, "size": case.size, "batch": case.batch, "layout": "nchw",
                   "steps": steps, "params": params, "rendezvous": os.path.join(work, "gloo"),
                   "result": os.path.join(work, "torch")}
            inner, what = ["--torch", json.dumps(job)], "PyTorch"
        else:
            config, _ = lbannpy_config(work, case, spec, data, n, split, steps, key, timeout,
                                       layers if n > 1 else None)
            inner, what = [config, "--quiet"], f"lbannpy on {n} rank(s)"
        run_checked(_wrapped(work, key, n, inner), timeout, f"{what}, {case.label}")
        res[key] = _peaks(os.path.join(work, f"peak-{key}"), n)
    return res


def report(case: Case, ranks: int, res: dict, target: float, how: str = "h",
           kernels: str = "auto") -> list[str]:
    lines = [f"{case.label}, float32, training steps, peak resident set per process (VmHWM); lbannpy's "
             f"kernels: {kernels}"]
    one, torch = res.get("lbannpy", [0.0])[0], res.get("torch", [0.0])[0]
    split = max(res.get("split", [0.0]))
    if one:
        lines.append(f"  lbannpy 1 rank            {one:8.0f} MiB")
    if torch:
        lines.append(f"  PyTorch 1 process         {torch:8.0f} MiB")
    if split:
        per_rank = ", ".join(f"{p:.0f}" for p in res["split"])
        lines.append(f"  lbannpy {ranks} ranks ({how})  {split:8.0f} MiB per rank (ranks: {per_rank})")
    if one and torch:
        lines.append(f"  lbannpy / PyTorch, 1 rank: {one / torch:.3f}x (target <= {TORCH_TARGET:.2f}x: "
                     f"{_verdict(one / torch, TORCH_TARGET)})")
    if one and split:
        lines.append(f"  {ranks} ranks / 1 rank, per rank: {split / one:.3f}x (target <= {target:.2f}x: "
                     f"{_verdict(split / one, target)})")
    return lines


def _verdict(ratio: float, target: float) -> str:
    """Compared unrounded: 0.5524 against 0.55 is not met, though both print as 0.55."""
    return "met" if ratio <= target else "NOT met"



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench memory", description=describe(__doc__),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="mesh1k", help="zoo model")
    ap.add_argument("--size", type=int, default=1024, help="input side")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the split run")
    ap.add_argument("--steps", type=int, default=2, help="training steps of each run")
    ap.add_argument("--split", choices=("auto", "h", "w"), default="auto",
                    help="the split run: each layer as the strategy selector chooses, or every layer's "
                         "h or w")
    ap.add_argument("--machine", default=None,
                    help="machine model of the strategy selector (--split auto; default: its default)")
    ap.add_argument("--target", type=float, default=SPLIT_TARGET, help="the split run's target ratio")
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs")
    ap.add_argument("--kernels", choices=("auto", "own", "aten"), default="auto",
                    help="runtime.kernels of lbannpy's runs")
    ap.add_argument("--shard-state", action="store_true",
                    help="optimizer.shard_state in lbannpy's runs: the split run keeps 1/P of the replicated "
                         "parameters' momentum a rank")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=3000, help="seconds allowed for each run")
    ap.add_argument("--peak-worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if args.peak_worker is not None:
        return _peak_worker(args.peak_worker, rest[1:] if rest[:1] == ["--"] else rest)
    if rest:
        ap.error(f"unrecognised arguments: {' '.join(rest)}")
    try:
        import torch  # noqa: F401  (the peer)
    except ImportError:
        print("lbannpy.bench memory: needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    case = Case(f"{args.model}-{args.size}", args.model, args.size, 1)
    peer.KERNELS[0] = args.kernels
    peer.SHARD_STATE[0] = bool(args.shard_state)
    work = args.dir or tempfile.mkdtemp(prefix="lbannpy-memory-")
    os.makedirs(work, exist_ok=True)
    try:
        spec = network(case)[0]
        layers = (split_layers(spec, case, args.ranks, args.split, args.machine) if "split" in args.runs
                  else None)
        res = measure(case, args.ranks, args.steps, work, args.timeout, args.runs, layers,
                      "h" if args.split == "auto" else args.split)
    except (PeerError, OSError, ValueError) as e:
        print(f"lbannpy.bench memory: {e}", file=sys.stderr)
        return 1
    how = (("strategy selector: " if layers else "every layer: ")
           + describe_split(layers, args.split, args.ranks))
    kernels = args.kernels + ("; optimizer state sharded over replicas" if args.shard_state else "")
    print("\n".join(report(case, args.ranks, res, args.target, how, kernels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
