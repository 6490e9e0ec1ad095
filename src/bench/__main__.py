"""``python -m lbannpy.bench SUBCOMMAND [args]``: calibration and performance benchmarks.

Each subcommand is a module with ``main(argv) -> int``. To add one, add a line to ``SUBCOMMANDS`` (or
call :func:`register` from a plugin); its module is imported only when it runs.
"""
from __future__ import annotations

import importlib
import sys

# name -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "calibrate": ("lbannpy.bench.calibrate",
                  "measure point-to-point and allreduce alpha-beta and GEMM gamma; write a machine YAML"),
    "halo": ("lbannpy.bench.halo",
             "halo exchange and allreduce bandwidth against the alpha-beta model; overlap fraction"),
    "layers": ("lbannpy.bench.layers", "local conv/pool/batch-norm kernels against PyTorch CPU"),
    "overlap": ("lbannpy.bench.overlap",
                "blocking vs overlapped gradient reduction (CPU and GPU-like stand-in)"),
    "memory": ("lbannpy.bench.memory", "per-rank peak memory of one sample of a zoo model, 1 rank against P"),
    "scaling": ("lbannpy.bench.scaling",
                "one mesh conv layer fwd+bwd: 1 rank against 2 ranks splitting height"),
    "strategy": ("lbannpy.bench.strategy",
                 "strategy search time, Jia et al. VGG-16 structure, speedups, mesh2k"),
    "data": ("lbannpy.bench.data", "I/O wait with and without prefetch; 1- and 2-rank hyperslab reads"),
    "scale": ("lbannpy.bench.scale",
              "rank simulator: per-rank set-up and per-step index cost at 64 to 4096 ranks"),
    "overhead": ("lbannpy.bench.overhead",
                 "fixed Python cost per layer and step (tiny inputs), by layer type, against 60 us"),
    "peer": ("lbannpy.bench.peer", "training steps against PyTorch: 1 process, DDP, spatial split"),
    "checkpoint": ("lbannpy.bench.checkpoint",
                   "checkpoint write and read time with and without verification (mesh1k 1024²)"),
    "costmodel": ("lbannpy.bench.costmodel",
                  "cost model against measured training steps: 3 models x 3 strategies at 1, 2, 4 ranks"),
}


# name -> typical wall time of the subcommand with its defaults on a 2-core CPU machine, one BLAS thread per
# rank (timed on a 2-core box shared with other work, so an idle one is faster)
RUN_TIMES: dict[str, str] = {
    "calibrate": "2 min", "halo": "1 min", "layers": "5 min", "overlap": "30 s", "memory": "10 min",
    "scaling": "1.5 min", "strategy": "30 s", "data": "3 min", "scale": "2.5 min", "overhead": "15 s",
    "peer": "60 min", "checkpoint": "20 s", "costmodel": "60 min",
}


def register(name: str, module: str, description: str, run_time: str = "") -> None:
    """Add a subcommand: ``module`` must define ``main(argv) -> int``; ``run_time``: its typical wall time
    on a 2-core machine (shown by --help)."""
    SUBCOMMANDS[name] = (module, description)
    if run_time:
        RUN_TIMES[name] = run_time


def usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    twidth = max(len(t) for t in RUN_TIMES.values())
    lines = ["usage: python -m lbannpy.bench SUBCOMMAND [args]   (SUBCOMMAND -h for its options)", "",
             "subcommands, with their typical run time on a 2-core machine (defaults, one thread per rank):"]
    lines += [f"  {name:<{width}}  {RUN_TIMES.get(name, '?'):>{twidth}}  {desc}"
              for name, (_, desc) in sorted(SUBCOMMANDS.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"lbannpy.bench: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
