"""``python -m lbannpy.strategy CONFIG --ranks P [--machine M] [--memory GiB] [--write] [--explain]
[--compare]``

CONFIG is a YAML spec (``*.yaml``/``*.yml``) or a ``config.h5`` (read and written through
:mod:`lbannpy.config`). ``--write`` stores the chosen split degrees in ``parallel.layers`` of CONFIG.
Exit status: 0 on success, 2 on a usage or input error (with a message saying what to change), 141 when
the reader of its output left (``| head -1``).
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from lbannpy import yamlsafe

from .graph import ShapeError
from ..local_machine import LOCAL, local_source
from ..machine import MachineError, preset_names
from .planner import PlanError, plan
from .report import compare, explain, strategy_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lbannpy.strategy",
                                description="Choose a per-layer parallel strategy (sample/channel/spatial "
                                            "splits) from a cost model (Dryden et al. 2019; Jia et al. "
                                            "2018).")
    p.add_argument("config", help="spec (.yaml) or config (.h5)")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks (GPUs or processes)")
    p.add_argument("--machine", default=LOCAL,
                   help=f"machine file (.yaml, e.g. from `python -m lbannpy.bench calibrate`), preset name "
                        f"({', '.join(preset_names())}) or {LOCAL} (the default): this host, as `bench "
                        f"calibrate` measured it, else a described CPU model (the output says which)")
    p.add_argument("--memory", type=float, default=None,
                   help="memory per rank in GiB (default: the machine's)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="mini-batch size (default: trainer.batch_size)")
    p.add_argument("--search", default="auto",
                   choices=("auto", "elimination", "shortest-path", "longest-path"))
    p.add_argument("--time-budget", type=float, default=10.0,
                   help="seconds for the search (best so far after)")
    p.add_argument("--max-candidates", type=int, default=12, help="candidates kept per layer (default 12)")
    p.add_argument("--write", action="store_true",
                   help="write the chosen splits into parallel.layers of CONFIG")
    p.add_argument("--explain", action="store_true",
                   help="per-layer costs and why candidates were dropped")
    p.add_argument("--compare", action="store_true",
                   help="step time of data-parallel, model-parallel, OWT and the chosen strategy")
    return p


def _is_h5(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".h5", ".hdf5", ".hdf")


def _config_module():
    try:
        # late: loaded when the command runs, so its --help and argument errors come without it
        import lbannpy.config as cfgmod
    except ImportError as exc:
        raise PlanError(f"reading or writing a config.h5 needs the lbannpy.config module, which is not "
                        f"available here ({exc}); pass the YAML spec instead") from None
    return cfgmod


def read_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise PlanError(f"{path}: no such file")
    if _is_h5(path):
        return _config_module().read_raw(path)
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        raise PlanError(f"{path}: CONFIG must be a YAML spec (.yaml, .yml) or a config (.h5)")
    try:
        tree = yamlsafe.load(open(path, encoding="utf-8").read())
    except yamlsafe.YamlLimitError as exc:
        raise PlanError(f"{path}:{exc}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(tree, dict) or "model" not in tree:
        raise PlanError(f"{path}: a spec needs a top-level 'model:' mapping (see DESIGN.md)")
    return tree


def write_config(path: str, tree: dict, layers: dict) -> None:
    par = tree.get("parallel") or {}
    par = dict(par)
    par["layers"] = layers
    par.pop("strategy", None)
    tree = {**tree, "parallel": par}
    if _is_h5(path):
        _config_module().save_config(tree, path)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(tree, f, sort_keys=False, default_flow_style=None, width=110)
    os.replace(tmp, path)


def run(args) -> int:
    tree = read_config(args.config)
    machine = local_source() if args.machine == LOCAL else args.machine
    pl = plan(tree, args.ranks, machine, memory_gib=args.memory, batch_size=args.batch_size,
              search=args.search, time_budget_s=args.time_budget, max_candidates=args.max_candidates,
              compare=args.compare or args.explain, heuristic=args.compare)
    print(strategy_table(pl))
    if args.explain:
        print()
        print(explain(pl))
    if args.compare:
        print()
        print(compare(pl))
    if args.write:
        write_config(args.config, tree, pl.parallel_layers())
        print(f"\nwrote parallel.layers ({len(pl.choice)} layers) to {args.config}")
    return 0


def main(argv=None) -> int:
    """Exit status: 0 done; 2 a usage or input error, or a standard output that could not be written (a
    full device: named); 141 when the reader of its output left (``| head``), as any program a shell runs
    reports when SIGPIPE ends it, so a pipeline under ``set -o pipefail`` tells a cut-short table from a
    complete one. ``--write`` still writes the config in both cases."""
    args = build_parser().parse_args(argv)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.training.errors import EXIT_READER_GONE, GuardedStdout

    out = GuardedStdout("python -m lbannpy.strategy").install()
    try:
        code = run(args)
    except (PlanError, ShapeError, MachineError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.flush()
    if out.reader_gone:
        return EXIT_READER_GONE
    return 2 if out.failed is not None else code


if __name__ == "__main__":
    sys.exit(main())
