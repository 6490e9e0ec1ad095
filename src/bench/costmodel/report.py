"""The comparison: predicted against measured step times per (model, strategy, ranks), the result table and
the command line of ``python -m lbannpy.bench costmodel``."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lbannpy.dist import Distribution
from lbannpy.machine import Machine, MachineError, load_machine
from lbannpy.strategy import build_graph, evaluate_strategy

from .builders import OPTIMIZER, STRATEGIES, BenchModel, default_models, parallel_layers, strategy_dists
from .runs import THREAD_VARS, OtherLoad, Quiet, run_checked, measure_step, prepare, thread_env
from .table import measure_compute_table, time_input_read, with_table

TOLERANCE = 0.15  # the acceptance target: |predicted - measured| / measured


@dataclass
class Case:
    model: str
    strategy: str  # name, or several joined by '=' where they give the same distributions
    ranks: int
    predicted_s: float
    roofline_s: float  # the same prediction from the calibrated roofline, without the table
    measured: list[float]
    layers: dict
    other: list[float] = field(default_factory=list)  # cores other processes kept busy during each run

    @property
    def measured_s(self) -> float:
        return statistics.median(self.measured)

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def ranking(cases: Sequence[Case], attr: str) -> list[str]:
    return [c.strategy for c in sorted(cases, key=lambda c: getattr(c, attr))]


def format_table(cases: Sequence[Case]) -> str:
    """The result table: one row per case, then one ranking line per (model, ranks) with more than one
    distinct strategy, then how many cases are within :data:`TOLERANCE`."""
    w = max([8] + [len(c.strategy) for c in cases])
    head = (f"{'model':6s} {'strategy':{w}s} {'ranks':>5s} {'predicted ms':>12s} {'measured ms':>11s} "
            f"{'error %':>8s} {'roofline ms':>11s} {'other load':>10s}")
    lines = [head, "-" * len(head)]
    for c in cases:
        other = max(c.other) if c.other else math.nan
        lines.append(f"{c.model:6s} {c.strategy:{w}s} {c.ranks:5d} {c.predicted_s * 1e3:12.2f} "
                     f"{c.measured_s * 1e3:11.2f} {100 * c.error:+8.1f} {c.roofline_s * 1e3:11.2f} "
                     f"{other:10.2f}")
    lines.append("")
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault((c.model, c.ranks), []).append(c)
    matched = total = 0
    for (m, p), cs in groups.items():
        if len(cs) < 2:
            lines.append(f"ranking {m:6s} {p} rank(s): one distinct strategy, nothing to rank")
            continue
        pred, meas = ranking(cs, "predicted_s"), ranking(cs, "measured_s")
        ok = pred == meas
        matched += ok
        total += 1
        swapped = ""
        if not ok:  # how far apart the measurements of the pairs the model orders the other way are
            t = {c.strategy: c.measured_s for c in cs}
            pairs = [(a, b) for i, a in enumerate(pred) for b in pred[i + 1:]
                     if meas.index(a) > meas.index(b)]
            apart = [f"{a}/{b} measured {100 * abs(t[a] - t[b]) / min(t[a], t[b]):.1f} % apart"
                     for a, b in pairs]
            swapped = f" ({', '.join(apart)})"
        lines.append(f"ranking {m:6s} {p} rank(s): predicted {' < '.join(pred)}; "
                     f"measured {' < '.join(meas)}; {'match' if ok else 'DIFFERENT'}{swapped}")
    within = sum(abs(c.error) <= TOLERANCE for c in cases)
    lines.append(f"rankings matching: {matched} of {total}")
    lines.append(f"within {100 * TOLERANCE:.0f}%: {within} of {len(cases)} cases")
    return "\n".join(lines)


def run_benchmark(models: Sequence[BenchModel], ranks: Sequence[int], strategies: Sequence[str],
                  machine: Machine, work: str, steps: int, repeats: int, reps: int = 5,
                  overlap: bool = False, quiet: Quiet | None = None, log: Callable[[str], None] = print
                  ) -> tuple[list[Case], list[str]]:
    """Predict and measure every (model, strategy, ranks); returns the cases and notes."""
    quiet = quiet or Quiet(budget_s=0.0)
    cases: list[Case] = []
    notes: list[str] = []
    todo = []
    for bm in models:
        graph = build_graph(bm.model, bm.batch_size)
        per_ranks = {}
        for p in ranks:
            mach_p = machine.with_layout(p)  # mpiexec starts all p ranks on this host
            named: dict[str, dict[str, Distribution]] = {}
            for s in strategies:
                d = strategy_dists(s, graph, p, mach_p)
                same = next((k for k, v in named.items() if v == d), None)
                if same is not None:  # e.g. every strategy on one rank: one case, named by all of them
                    named[f"{same}={s}"] = named.pop(same)
                else:
                    named[s] = d
            per_ranks[p] = named
        all_dists = [d for named in per_ranks.values() for d in named.values()]
        config, data = prepare(bm, work)
        log(f"{bm.name}: timing {len(graph)} layers under every local shape the strategies give them")
        quiet.wait()
        with OtherLoad() as load:
            rows, n = [], []
            for p, named in per_ranks.items():  # timed with as many ranks on the node as the runs have
                r_p, n_p = measure_compute_table(graph, list(named.values()), reps=reps, optimizer=OPTIMIZER,
                                                 log=log, overlap=overlap, procs=p)
                rows += r_p
                n += [x for x in n_p if x not in n]
            inputs = {r.key: r for r in (time_input_read(data, graph, d, reps) for d in all_dists)}
        for r in inputs.values():
            log(f"  {'(input)':8s} {'read':9s} block {str(r.key[1]):19s} {r.fwd_s * 1e3:8.3f} ms")
        rows += list(inputs.values())
        log(f"  (other processes kept {load.cores:.2f} cores busy meanwhile)")
        notes += [f"{bm.name}: {x}" for x in n]
        for p, named in per_ranks.items():
            mach_p = with_table(machine.with_layout(p), rows)
            roof_p = machine.with_layout(p)
            for s, d in named.items():
                pred = evaluate_strategy(graph, d, mach_p).step_s
                roof = evaluate_strategy(graph, d, roof_p).step_s
                c = Case(bm.name, s, p, pred, roof, [], parallel_layers(graph, d))
                cases.append(c)
                todo.append((c, config))
    for r in range(repeats):  # repeats are interleaved so that a burst of load elsewhere hits one of each
        for c, config in todo:
            for attempt in range(quiet.retries + 1):
                quiet.wait()
                out = os.path.join(work, "runs", f"{c.model}-{c.strategy}-{c.ranks}-{r}-{attempt}")
                with OtherLoad() as load:
                    t = measure_step(config, c.ranks, c.layers, steps, out, overlap)
                log(f"  run {r + 1}/{repeats}: {c.model} {c.strategy} on {c.ranks} rank(s): "
                    f"{t * 1e3:.2f} ms per step (predicted {c.predicted_s * 1e3:.2f} ms); other processes "
                    f"kept {load.cores:.2f} cores busy")
                if not load.cores > quiet.threshold or quiet.waited_s >= quiet.budget_s:
                    break
            c.measured.append(t)
            c.other.append(load.cores)
    return cases, notes


# --------------------------------------------------------------------------------------------------------


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def calibrate_here(path: str, quick: bool, timeout: float = 600) -> None:
    """``python -m lbannpy.bench calibrate -o path`` on this machine (2 ranks)."""
    cmd = [sys.executable, "-m", "lbannpy.bench", "calibrate", "-o", path]
    if quick:
        cmd.append("--quick")
    p = run_checked(cmd, timeout, "calibration")
    print(p.stdout.rstrip(), flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench costmodel",
                                 description="the strategy cost model against measured training steps")
    ap.add_argument("--machine", default=None,
                    help="machine file or preset (default: run `python -m lbannpy.bench calibrate` first)")
    ap.add_argument("--ranks", default="1,2,4", help="rank counts, comma-separated (default 1,2,4)")
    ap.add_argument("--strategies", default="data,spatial,model",
                    help=f"comma-separated, from {', '.join(STRATEGIES)} (default data,spatial,model)")
    ap.add_argument("--models", default=None, help="comma-separated subset of cls, mesh, res (default all)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per training run (default 10)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="training runs per case; the median of their median step times is reported")
    ap.add_argument("--reps", type=int, default=5, help="timed calls per layer for the compute table")
    ap.add_argument("--work", default=None,
                    help="directory for data, configs and runs (default: a temporary one)")
    ap.add_argument("--quick", action="store_true",
                    help="one tiny model, 3 steps, 1 repeat, quick calibration: the code path in seconds")
    ap.add_argument("--overlap", action="store_true",
                    help="train with comm.overlap (gradients reduced on a background thread in backprop); "
                         "by default off, as the cost model adds communication to compute (Jia et al. eq. 1)")
    ap.add_argument("--idle-wait", type=float, default=300.0,
                    help="seconds the whole benchmark may wait for other processes to leave the CPUs before "
                         "measuring (default 300; 0: measure at once)")
    ap.add_argument("--other-load", type=float, default=0.25,
                    help="cores of other load above which a training run is repeated, up to twice "
                         "(default 0.25)")
    ap.add_argument("--json", default=None, help="also write the cases to this JSON file")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if any(os.environ.get(var) != "1" for var in THREAD_VARS):
        # this process times layers too, with one BLAS thread as every rank has; the BLAS library read its
        # thread count when NumPy was imported, so start again with the variables set
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "lbannpy.bench", "costmodel", *argv], thread_env())
    ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies or not ranks or min(ranks) < 1:
        raise SystemExit(f"lbannpy.bench costmodel: --strategies from {', '.join(STRATEGIES)} and --ranks "
                         f"positive integers, got {args.strategies!r} and {args.ranks!r}")
    models = default_models(args.quick)
    if args.models:
        want = [m.strip() for m in args.models.split(",")]
        models = [m for m in models if m.name in want]
        if not models:
            raise SystemExit(f"lbannpy.bench costmodel: no model among {want}; models: cls, mesh, res")
    steps, repeats = (3, 1) if args.quick else (args.steps, args.repeats)
    reps = 2 if args.quick else args.reps
    if args.machine is not None:  # a bad machine file is refused before any data is written or run
        try:
            load_machine(args.machine)
        except MachineError as exc:
            raise SystemExit(f"lbannpy.bench costmodel: --machine: {exc}") from None

    with tempfile.TemporaryDirectory(prefix="lbannpy-costmodel-") as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        quiet = Quiet(budget_s=0.0 if args.quick else args.idle_wait, threshold=args.other_load)
        load0 = _loadavg()
        t0 = time.perf_counter()
        machine_path = args.machine
        if machine_path is None:
            machine_path = os.path.join(work, "machine.yaml")
            print(f"calibrating this machine: python -m lbannpy.bench calibrate -o {machine_path}",
                  flush=True)
            quiet.wait()
            with OtherLoad() as load:
                calibrate_here(machine_path, args.quick)
            print(f"(other processes kept {load.cores:.2f} cores busy meanwhile)", flush=True)
        machine = load_machine(machine_path)
        print(f"machine {machine.name}: gamma {machine.gamma_s_per_flop:.3e} s/FLOP, intra alpha "
              f"{machine.intra.alpha_s:.2e} s, beta {machine.intra.beta_s_per_byte:.2e} s/B, "
              f"cores per node {machine.cores_per_node or 'one per rank'}", flush=True)
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.layers.kernels import conv as kconv
        print(f"conv kernels: {kconv.cpu_path()} in the layer table "
              f"and the runs alike", flush=True)
        cases, notes = run_benchmark(models, ranks, strategies, machine, work, steps, repeats, reps,
                                     overlap=args.overlap, quiet=quiet)
        print(f"\npredicted: cost model with the measured layer table; roofline: the same without it. "
              f"measured: median step of lbannpy.train ({steps} steps, comm.overlap "
              f"{'on' if args.overlap else 'off'}), median of {repeats} run(s). "
              f"{time.perf_counter() - t0:.0f} s, {quiet.waited_s:.0f} s of it waiting for other processes "
              f"to leave the CPUs; load average {load0} before, {_loadavg()} after. other load: cores that "
              f"other processes kept busy during the run (the most of its repeats).\n")
        print(format_table(cases))
        for n in notes:
            print(f"note: {n}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump([{"model": c.model, "strategy": c.strategy, "ranks": c.ranks,
                            "predicted_s": c.predicted_s, "roofline_s": c.roofline_s,
                            "measured_s": c.measured,
                            "other_load_cores": [None if math.isnan(x) else x for x in c.other],
                            "error": c.error} for c in cases], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
