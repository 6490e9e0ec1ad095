"""``python -m lbannpy.bench.calibrate_steps --machine machine.yaml -o measured-steps.yaml``: the training
steps a calibration's predictions are checked against (``tests/test_local_machine.py``).

For each zoo model (its spec, batch size and the data ``config zoo`` prints) and each rank count, the plans
recorded are: the one ``python -m lbannpy.strategy --ranks P --machine MACHINE`` chooses (``strategy``)
and, at P > 1, every layer split P ways along one dimension (``n``, ``h``, ``c``: the dimension where the
layer's type may split it and its blocks stay valid, else the samples). Each is trained ``--steps`` steps
by ``python -m lbannpy.train`` (under ``mpiexec -n P`` for P > 1, one BLAS thread per rank, the machine
file as ``parallel.machine`` so that ``runtime.kernels: auto`` runs the kernels it timed), ``--repeats``
times; a run's step is the median ``step_time_s`` of ``metrics.csv`` past the first ``WARMUP`` steps, and
the recorded step the median over the runs. Before each run it waits (up to ``--quiet-s`` in all) until
other processes keep fewer than a quarter of a core busy, and records the other load during the run.

On a shared box give it ``--priority -15`` (as root: every rank's session runs at that priority, see
:mod:`.calibrate_priority`), as ``bench calibrate --priority -15`` beside it.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from typing import Mapping

import yaml

from lbannpy.dist import Distribution
from lbannpy.layers.registry import layer_spec
from lbannpy.strategy.graph import ModelGraph, build_graph
from lbannpy.strategy.planner import filter_reason, plan
from lbannpy.zoo import get_spec, spec_data_command

from .calibrate_priority import prioritized
from .costmodel.runs import THREAD_VARS, OtherLoad, Quiet

MODELS = ("lenet5", "mesh_tiny")
FORCED = ("n", "h", "c")  # the one-dimension plans recorded at P > 1 besides the strategy's
WARMUP = 5  # steps left out of a run's median: allocation, first-touch pages, kernel plans


def layers_of(graph: ModelGraph, ranks: int, dim: str) -> dict[str, dict[str, int]]:
    """``parallel.layers`` splitting every layer ``ranks`` ways along ``dim`` where its type may split that
    dimension and its blocks pass the planner's checks (:func:`lbannpy.strategy.planner.filter_reason`),
    else along the samples (else whole)."""
    out = {}
    for node in graph:
        nd = len(node.out_shape)
        allowed = layer_spec(node.type).split_dims
        chosen = Distribution.whole(nd, ranks)
        for d in (dim, "n"):
            if d not in allowed or d not in Distribution.whole(nd, ranks).dim_names:
                continue
            cand = Distribution.make(nd, ranks, **{d: ranks})
            if filter_reason(node, cand, 0.25) is None:
                chosen = cand
                break
        deg = chosen.degrees()
        out[node.name] = {"n": deg.pop("n", 1), **deg}
    return out


def dists_of(graph: ModelGraph, ranks: int, layers: Mapping[str, Mapping[str, int]]
             ) -> dict[str, Distribution]:
    """The distributions of a recorded ``parallel.layers`` block (what the cost model prices)."""
    return {node.name: Distribution.make(len(node.out_shape), ranks, **dict(layers[node.name]))
            for node in graph}


def cases(model: str, ranks: int, machine: str) -> list[tuple[str, dict]]:
    """``[(plan name, parallel.layers)]`` of ``model`` at ``ranks``: the strategy's plan on ``machine`` and
    the one-dimension plans, each distinct plan once under the first name that gives it."""
    spec = get_spec(model)
    graph = build_graph(spec["model"], int(spec["trainer"]["batch_size"]))
    found = [("strategy", plan(spec, ranks, machine, compare=False).parallel_layers())]
    if ranks > 1:
        found += [(f"{d}{ranks}", layers_of(graph, ranks, d)) for d in FORCED]
    out, seen = [], set()
    for name, layers in found:
        key = json.dumps(layers, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((name, layers))
    return out


def prepare(model: str, work: str) -> tuple[str, int]:
    """The zoo spec of ``model`` with its data written under ``work``; returns the spec path and batch."""
    spec = get_spec(model)
    data = os.path.join(work, f"{model}.h5")
    spec["data"]["train"]["path"] = data
    cmd = spec_data_command(spec).split()
    subprocess.run([sys.executable, *cmd[1:]], check=True, capture_output=True, timeout=600)
    path = os.path.join(work, f"{model}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path, int(spec["trainer"]["batch_size"])


def train_step(spec: str, ranks: int, layers: Mapping, machine: str, steps: int, out: str,
               priority: int | None = None) -> float:
    """Median step of one training run (``metrics.csv`` past :data:`WARMUP`), seconds; every rank at
    scheduling priority ``priority`` (:mod:`.calibrate_priority`) where given."""
    env = dict(os.environ, **{v: "1" for v in THREAD_VARS})
    cmd = [sys.executable, "-m", "lbannpy.train", spec, "--quiet", "--set", f"trainer.steps={steps}",
           "--set", "parallel.layers=" + json.dumps(dict(layers)), "--set", f"parallel.machine={machine}",
           "--set", f"output.dir={out}", "--set", f"checkpoint.dir={out}/ckpt"]
    cmd = prioritized(cmd, priority)
    if ranks > 1:
        cmd = [shutil.which("mpiexec") or "mpiexec", "-n", str(ranks), *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"lbannpy.bench.calibrate_steps: `{' '.join(cmd)}` exited {p.returncode}:\n"
                         f"{p.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.csv"), encoding="utf-8") as f:
        times = [float(row["step_time_s"]) for row in csv.DictReader(f)]
    return statistics.median(times[WARMUP:] or times)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench.calibrate_steps",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", required=True, help="the calibration (machine file) the plans are priced on")
    ap.add_argument("-o", "--output", required=True, help="measured-steps YAML to write")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="zoo models (default: %(default)s)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2], help="rank counts (default: 1 2)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per plan, median kept (default 3)")
    ap.add_argument("--quiet-s", type=float, default=300.0,
                    help="seconds in all to wait for other load to go before runs (default 300; 0: none)")
    ap.add_argument("--priority", type=int, default=None, metavar="NICE",
                    help="run every rank at this scheduling priority, e.g. -15 on a box others load (root; "
                         "default: as started)")
    ap.add_argument("--only", nargs="+", default=None, help="plan names to record (default: all)")
    return ap


def measure(args, work: str) -> list[dict]:
    quiet = Quiet(budget_s=args.quiet_s)
    rows = []
    for model in args.models:
        spec, batch = prepare(model, work)
        for ranks in args.ranks:
            for name, layers in cases(model, ranks, args.machine):
                if args.only and name not in args.only:
                    continue
                steps, loads = [], []
                for i in range(args.repeats):
                    quiet.wait()
                    with OtherLoad() as load:
                        steps.append(train_step(spec, ranks, layers, args.machine, args.steps,
                                                os.path.join(work, f"{model}-{ranks}-{name}-{i}"),
                                                args.priority))
                    loads.append(round(load.cores, 2))
                row = {"model": model, "batch_size": batch, "ranks": ranks, "plan": name,
                       "median_step_s": round(statistics.median(steps), 6),
                       "runs_s": [round(s, 6) for s in steps], "other_load_cores": loads, "layers": layers}
                print(f"{model:<10} {ranks} {name:<9} {row['median_step_s'] * 1e3:8.2f} ms  runs "
                      f"{[round(s * 1e3, 2) for s in steps]}  other load {loads}", flush=True)
                rows.append(row)
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    work = tempfile.mkdtemp(prefix="lbannpy-steps-")
    try:
        rows = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    head = (f"# Written by `python -m lbannpy.bench.calibrate_steps --machine {args.machine} --steps "
            f"{args.steps} --repeats {args.repeats} --priority {args.priority}` on {socket.gethostname()} "
            f"({now}):\n# median step_time_s of metrics.csv past the first {WARMUP} steps, median "
            f"over the runs; other_load_cores: what other processes kept busy during each run.\n")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(head)
        yaml.safe_dump({"cases": rows}, f, sort_keys=False, default_flow_style=None, width=110)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
