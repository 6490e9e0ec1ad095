"""``python -m lbannpy.bench peer``: lbannpy against PyTorch on the same networks, measured side by side.

For each model (a zoo spec at a given input size and batch) the benchmark writes one random float32 data set,
then in every round runs, one after the other:

- ``python -m lbannpy.train`` (one rank, one BLAS thread, SGD with momentum, float32) and reads the median
  step of its ``summary.json``;
- the same network in PyTorch (the ``torch.nn`` module that ``lbannpy.export --torch-module`` writes for the
  spec, its parameter count checked equal to lbannpy's), in NCHW and in channels-last, one thread, the same
  optimizer and loss, median step; the faster layout is PyTorch's figure.

The ratio printed is lbannpy's step over PyTorch's, per round (rounds interleave the two, so a noisy machine
slows both); the median over rounds is the result, with its range. Two further tables compare 2 ranks:
lbannpy data parallel against PyTorch DDP (gloo) at the same global batch, and lbannpy splitting every
sample's height over 2 ranks against 1-process PyTorch. Torch is an optional dependency of this benchmark
only (``pip install torch``).

``--device gpu`` runs both sides on the node's GPU (lbannpy with ``runtime.device: gpu``, PyTorch CUDA), one
process each, step times from CUDA events on both sides, float32 convolutions in float32 on both (PyTorch's
TF32 default is switched off, as lbannpy's ``runtime.tf32`` is by default); the 2-rank tables are left out
(they would need two GPUs). PyTorch runs twice there: eagerly, and with its whole step (forward, loss,
backward, optimizer) captured once as a CUDA graph and replayed (``torch.cuda.graph``, warmed up on a side
stream), in the faster eager layout; lbannpy's ratio to each is printed. Each round's times are printed as
the round ends.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from .costmodel.builders import OPTIMIZER as _COST_OPTIMIZER
from .costmodel.runs import thread_env


# SGD with momentum as the cost model's runs, at a tenth of their learning rate: the peer runs train on
# random data from a fresh initialisation, where AlexNet's loss starts near 45 and at lr 0.01 swings to
# 1e3 within six steps; one 2-rank run crossed into NaN (and lbannpy's health check stopped it). The step's
# arithmetic, and so its time, does not depend on the rate.
OPTIMIZER = {**_COST_OPTIMIZER, "lr": _COST_OPTIMIZER["lr"] / 10}


class PeerError(RuntimeError):
    """The peer benchmark cannot compare (missing launcher, a run failed, the networks differ)."""


@dataclass(frozen=True)
class Case:
    """One network: zoo spec ``zoo`` at ``size``² input, ``batch`` samples per step (global)."""

    name: str
    zoo: str
    size: int
    batch: int
    #: runs take ``steps * steps_scale`` steps: a network whose step is a few milliseconds gets more of them,
    #: so its median is taken over about as long a stretch of the machine's noise as a big network's
    steps_scale: int = 1

    @property
    def label(self) -> str:
        return f"{self.name} {self.size}², batch {self.batch}"


# the networks of the performance table (1 process), and the 2-rank comparisons
CASES = (Case("lenet5", "lenet5", 32, 32, 5), Case("mesh_tiny", "mesh_tiny", 64, 8, 5),
         Case("alexnet", "alexnet", 128, 32), Case("mesh1k", "mesh1k", 256, 2),
         Case("mesh_unet", "mesh_unet", 256, 2))
BIG = Case("mesh1k-1024", "mesh1k", 1024, 1)
QUICK = (Case("lenet5", "lenet5", 32, 8), Case("mesh_tiny", "mesh_tiny", 32, 2))


# --------------------------------------------------------------------------------------------------------
# the two sides


def network(case: Case) -> tuple[dict, int, tuple[int, ...]]:
    """The case's model spec, lbannpy's parameter count and its output shape (N, classes, ...)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.zoo import get_spec

    spec = get_spec(case.zoo, batch_size=case.batch, input_size=case.size)
    model = Model(spec["model"], case.batch, LayerContext(SingleCommunicator(), np, "float32", seed=0), {})
    params = sum(int(np.prod(p.global_shape)) for p in model.params)
    return spec, params, tuple(model.output.out_shape)


def write_data(path: str, spec: dict, out_shape: tuple[int, ...], samples: int, seed: int = 0) -> None:
    """Random inputs (normal, float32) and labels in ``range(classes)``: per sample for a classifier, per
    pixel at the input resolution for a segmenter (what the trainer reads; the contents do not change the
    step time)."""
    import h5py

    inp = spec["model"]["input"]
    shape = (samples, int(inp["channels"]), *(int(s) for s in inp["spatial"]))
    classes = int(out_shape[1])
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("inputs", shape=shape, dtype=np.float32, chunks=(1,) + shape[1:])
        for i in range(samples):
            x[i] = rng.standard_normal(shape[1:], dtype=np.float32)
        per_pixel = len(out_shape) > 2
        lshape = (samples, *shape[2:]) if per_pixel else (samples,)
        f.create_dataset("labels", data=rng.integers(0, classes, size=lshape).astype(np.int64))


KERNELS = ["auto"]  # runtime.kernels of lbannpy's runs (--kernels)
DEVICE = ["cpu"]  # runtime.device of lbannpy's runs and PyTorch's device (--device)
SHARD_STATE = [False]  # optimizer.shard_state of lbannpy's runs (bench memory --shard-state)
CUDA_GRAPH = [None]  # runtime.cuda_graph of lbannpy's runs (--cuda-graph; None: the config's default)


def lbannpy_config(work: str, case: Case, spec: dict, data: str, ranks: int, split: str, steps: int,
                   tag: str, timeout: float, layers: dict | None = None) -> tuple[str, str]:
    """The training config (``.h5``) of the case on ``ranks`` ranks and its output directory; ``split`` is
    the default distribution's split dimension (``n``: data parallel, ``h``: every sample's height),
    ``layers`` per-layer split degrees over it (``parallel.layers``)."""
    import yaml

    run_dir = os.path.join(work, f"run-{tag}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = dict(spec, data={"train": {"path": data}},
               trainer={"batch_size": case.batch, "steps": steps, "seed": 1, "dtype": "float32"},
               optimizer=dict(OPTIMIZER, shard_state=SHARD_STATE[0]),
               runtime={"threads": 1, "kernels": KERNELS[0], "device": DEVICE[0],
                        **({"cuda_graph": CUDA_GRAPH[0]} if CUDA_GRAPH[0] else {})},
               checkpoint={"dir": os.path.join(run_dir, "ckpt")},
               output={"dir": run_dir, "log_every": 1})
    if ranks > 1:
        cfg["parallel"] = {"default": {split: ranks}}
        if layers:
            cfg["parallel"]["layers"] = layers
    spec_path = os.path.join(work, f"{tag}.yaml")
    with open(spec_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    config = os.path.join(work, f"{tag}.h5")
    run_checked([sys.executable, "-m", "lbannpy.config", "build", spec_path, "-o", config], timeout,
                "config build")
    return config, run_dir


def lbannpy_step(work: str, case: Case, spec: dict, data: str, ranks: int, split: str, steps: int,
                 tag: str, timeout: float) -> float:
    """Median step (s) of ``[mpiexec -n ranks] python -m lbannpy.train`` on the case (see
    :func:`lbannpy_config`)."""
    config, run_dir = lbannpy_config(work, case, spec, data, ranks, split, steps, tag, timeout)
    run_checked(launcher(ranks) + [sys.executable, "-m", "lbannpy.train", config, "--quiet"], timeout,
         f"lbannpy {case.label} on {ranks} rank(s)")
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        t = json.load(f).get("median_step_s")
    if not isinstance(t, (int, float)) or not t > 0:
        raise PeerError(f"{run_dir}/summary.json has no usable median_step_s: {t!r}")
    return float(t)


def torch_step(work: str, case: Case, ranks: int, layout: str, steps: int, params: int,
               timeout: float, graph: bool = False) -> float:
    """Median step (s) of the case in PyTorch: one process, or DDP (gloo) over ``ranks`` processes sharing
    the global batch; ``graph``: the step captured as a CUDA graph and replayed (one process on a GPU). The
    worker checks the parameter count against lbannpy's ``params``."""
    tag = os.path.join(work, f"torch-{time.time_ns()}")
    cmd = launcher(ranks) + [sys.executable, "-m", "lbannpy.bench", "peer", "--torch-worker",
                              json.dumps({"zoo": case.zoo, "size": case.size, "batch": case.batch,
                                          "layout": layout, "steps": steps, "params": params,
                                          "device": DEVICE[0], "graph": graph,
                                          "rendezvous": tag + ".gloo", "result": tag})]
    how = f"{layout}, CUDA graph" if graph else layout
    run_checked(cmd, timeout, f"PyTorch {case.label} ({how}, {ranks} process(es))")
    times = []
    for rank in range(ranks):
        try:
            with open(f"{tag}.{rank}.json", encoding="utf-8") as f:
                times.append(float(json.load(f)["median_step_s"]))
        except (OSError, ValueError, KeyError) as e:
            raise PeerError(f"PyTorch worker {rank} left no result ({e})") from None
    return max(times)  # a DDP step ends when its slowest rank does


def torch_worker(args: dict) -> int:
    """One PyTorch process of :func:`torch_step` (under mpiexec for DDP: rank from the launcher's env)."""
    import torch
    import torch.nn.functional as F

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.export import torch_module_source
    from lbannpy.zoo import get_spec

    torch.set_num_threads(1)
    rank, size = launcher_rank()
    spec = get_spec(args["zoo"], batch_size=args["batch"], input_size=args["size"])
    space: dict = {}
    exec(compile(torch_module_source(spec["model"]), "<peer network>", "exec"), space)  # our own source
    torch.manual_seed(0)
    net = space["Net"]()
    got = sum(p.numel() for p in net.parameters())
    if got != args["params"]:
        raise PeerError(f"{args['zoo']}: PyTorch network has {got} parameters, lbannpy's {args['params']}; "
                        f"the two are not the same network")
    fmt = torch.channels_last if args["layout"] == "channels_last" else torch.contiguous_format
    gpu = args.get("device", "cpu") == "gpu"
    dev = torch.device("cuda") if gpu else torch.device("cpu")
    if gpu:  # the same arithmetic as lbannpy's default (runtime.tf32: false): float32 convolutions in float32
        torch.backends.cudnn.allow_tf32 = False
    net = net.to(device=dev, memory_format=fmt)
    if size > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{args['rendezvous']}", rank=rank,
                                world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(net)
    inp = spec["model"]["input"]
    local = args["batch"] // size
    x = torch.randn(local, int(inp["channels"]), *(int(s) for s in inp["spatial"]))
    x = x.to(dev).to(memory_format=fmt)
    with torch.no_grad():
        out_shape = net(x).shape
    labels = torch.randint(0, out_shape[1], (local, *out_shape[2:])).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=OPTIMIZER["lr"], momentum=OPTIMIZER["momentum"])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), labels)
        loss.backward()
        opt.step()

    if args.get("graph"):
        step = _graphed_step(torch, F, net, opt, x, labels)
    times = _step_times(torch, step, args["steps"], gpu)
    with open(f"{args['result']}.{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "median_step_s": statistics.median(times)}, f)
    if size > 1:
        import torch.distributed as dist
        dist.barrier()
        # gloo's threads can abort the process while the interpreter tears down ("terminate called without
        # an active exception", about 1 run in 5 here): the result is written, so leave without teardown
        sys.stdout.flush()
        os._exit(0)
    return 0


def _graphed_step(torch, F, net, opt, x, labels):
    """The whole training step captured once as a CUDA graph, as PyTorch's documentation does it: a few
    warm-up steps on a side stream (so the caching allocator and cuDNN settle outside the capture), then
    forward, loss, backward and the optimizer step captured with gradients left allocated (the graph keeps
    writing the same gradient buffers); the returned callable replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), labels).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(net(x), labels).backward()
        opt.step()
    return graph.replay


def _step_times(torch, step, steps: int, gpu: bool) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step``: host clock on the CPU; on a GPU, CUDA events recorded
    between the steps and read after the last (the host never waits inside the loop)."""
    if not gpu:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        step()
        marks[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def launcher(ranks: int) -> list[str]:
    """The command prefix that starts ``ranks`` processes (none for one)."""
    if ranks == 1:
        return []
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise PeerError("the 2-rank comparisons need mpiexec (pip install mpich), or pass --no-two-ranks")
    return [mpiexec, "-n", str(ranks)]


def launcher_rank() -> tuple[int, int]:
    """``(rank, size)`` of this process as its launcher's environment gives it (``(0, 1)`` alone)."""
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def run_checked(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` with the benchmark's thread settings; a :class:`PeerError` naming ``what`` on failure."""
    try:
        p = subprocess.run(cmd, env=thread_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerError(f"{what}: no result within {timeout:g} s") from None
    if p.returncode != 0:
        raise PeerError(f"{what}: `{' '.join(cmd[:6])} ...` exited {p.returncode}\n{p.stdout[-1500:]}\n"
                        f"{p.stderr[-1500:]}")
    return p


# --------------------------------------------------------------------------------------------------------
# rounds and the report


@dataclass
class Row:
    """One comparison: per-round seconds of lbannpy and of its peer."""

    what: str
    ours: list
    peer: list
    peer_note: list

    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.ours, self.peer)]

    def line(self) -> str:
        r = self.ratios()
        med = statistics.median(r)
        note = max(set(self.peer_note), key=self.peer_note.count) if self.peer_note else ""
        return (f"  {self.what:<34} lbannpy {statistics.median(self.ours) * 1e3:9.1f} ms   peer "
                f"{statistics.median(self.peer) * 1e3:9.1f} ms {note:<15} ratio {med:5.2f}x "
                f"(rounds {min(r):.2f}-{max(r):.2f})")


def compare(cases, rounds: int, steps: int, two_ranks: bool, work: str, timeout: float) -> list[tuple]:
    """Run the interleaved rounds; returns ``[(table title, [Row])]``."""
    prepared = []
    for case in cases:
        spec, params, out_shape = network(case)
        data = os.path.join(work, f"{case.name}.h5")
        write_data(data, spec, out_shape, case.batch * steps * case.steps_scale)
        prepared.append((case, spec, params, data))
    one = {c.name: Row(c.label, [], [], []) for c, *_ in prepared}
    ddp = {c.name: Row(c.label, [], [], []) for c, *_ in prepared}
    split = {c.name: Row(c.label, [], [], []) for c, *_ in prepared}
    scale = {c.name: Row(c.label, [], [], []) for c, *_ in prepared}
    graphed = {c.name: Row(c.label, [], [], []) for c, *_ in prepared}
    for r in range(rounds):
        for case, spec, params, data in prepared:
            n = steps * case.steps_scale
            ours = lbannpy_step(work, case, spec, data, 1, "n", n, f"{case.name}-1", timeout)
            layouts = {lay: torch_step(work, case, 1, lay, n, params, timeout)
                       for lay in ("nchw", "channels_last")}
            best = min(layouts, key=layouts.get)
            one[case.name].ours.append(ours)
            one[case.name].peer.append(layouts[best])
            one[case.name].peer_note.append(f"({best})")
            if DEVICE[0] == "gpu":
                layouts[f"{best} graphed"] = torch_step(work, case, 1, best, n, params, timeout, graph=True)
                graphed[case.name].ours.append(ours)
                graphed[case.name].peer.append(layouts[f"{best} graphed"])
                graphed[case.name].peer_note.append("(CUDA graph)")
            print(f"  round {r + 1}: {case.label}: lbannpy {ours * 1e3:.2f} ms, PyTorch "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in layouts.items()), flush=True)
            if not two_ranks:
                continue
            if case.batch % 2 == 0:
                row = ddp[case.name]
                row.ours.append(lbannpy_step(work, case, spec, data, 2, "n", n, f"{case.name}-n2",
                                             timeout))
                row.peer.append(torch_step(work, case, 2, best, n, params, timeout))
                row.peer_note.append("(DDP gloo)")
                scale[case.name].ours.append(row.ours[-1])
                scale[case.name].peer.append(ours)
                scale[case.name].peer_note.append("(lbannpy 1 rank)")
            row = split[case.name]
            row.ours.append(lbannpy_step(work, case, spec, data, 2, "h", n, f"{case.name}-h2", timeout))
            row.peer.append(layouts[best])
            row.peer_note.append("(1 process)")
    tables = [("1 process: lbannpy / PyTorch (best of NCHW and channels-last)", list(one.values()))]
    if DEVICE[0] == "gpu":
        tables.append(("1 process: lbannpy / PyTorch with its whole step as a CUDA graph",
                       list(graphed.values())))
    if two_ranks:
        tables.append(("2 ranks data parallel: lbannpy / PyTorch DDP (gloo), same global batch",
                       [r for r in ddp.values() if r.ours]))
        tables.append(("2 ranks data parallel against 1 rank: lbannpy 2 ranks / lbannpy 1 rank",
                       [r for r in scale.values() if r.ours]))
        tables.append(("2 ranks splitting each sample's height: lbannpy / 1-process PyTorch",
                       list(split.values())))
    return tables


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lbannpy.bench peer",
        description="lbannpy's training step against PyTorch's on the same networks (lenet5, mesh_tiny, "
                    "alexnet, mesh1k, mesh_unet), interleaved rounds, one BLAS thread per process; ratios "
                    "below 1 mean lbannpy is faster.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[c.name for c in CASES],
                    help=f"which networks ({', '.join(c.name for c in CASES + (BIG,))})")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=12,
                    help="training steps per run (the median is taken); lenet5 and mesh_tiny run 5x as many")
    ap.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank comparisons")
    ap.add_argument("--quick", action="store_true", help="small networks (lenet5 batch 8, mesh_tiny 32²)")
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed for each run")
    ap.add_argument("--kernels", choices=("auto", "own", "aten", "cudnn"), default="auto",
                    help="lbannpy's runtime.kernels for its runs (auto on a GPU: cuDNN Frontend's where it "
                         "is installed; cudnn: with --device gpu)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                    help="gpu: lbannpy (runtime.device gpu, CuPy) against PyTorch CUDA on this node's first "
                         "GPU, one process each (the 2-rank tables need 2 GPUs and are left out); step times "
                         "from CUDA events on both sides. Without a GPU: one line saying why, exit 0")
    ap.add_argument("--cuda-graph", choices=("auto", "on", "off"), default=None,
                    help="lbannpy's runtime.cuda_graph for its runs (default: the config's default)")
    ap.add_argument("--torch-worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    KERNELS[0] = args.kernels
    CUDA_GRAPH[0] = args.cuda_graph
    DEVICE[0] = args.device
    if args.torch_worker is not None:
        return torch_worker(json.loads(args.torch_worker))
    if args.kernels == "cudnn" and args.device != "gpu":
        print("lbannpy.bench peer: --kernels cudnn runs on a GPU only; add --device gpu", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401  (the peer)
    except ImportError:
        print("lbannpy.bench peer: needs PyTorch (pip install torch)", file=sys.stderr)
        return 2
    if args.device == "gpu":
        # late: loaded when the command runs, so its --help and argument errors come without it
        from .layers import gpu_missing

        why = gpu_missing()
        if why:
            print(f"lbannpy.bench peer --device gpu: skipped, {why}")
            return 0
        args.no_two_ranks = True
    known = {c.name: c for c in CASES + (BIG,)}
    if args.quick:
        cases = QUICK
    else:
        unknown = [m for m in args.models if m not in known]
        if unknown:
            print(f"lbannpy.bench peer: unknown model(s) {unknown}; choose from {sorted(known)}",
                  file=sys.stderr)
            return 2
        cases = tuple(known[m] for m in args.models)
    if args.rounds < 1 or args.steps < 2:
        print("lbannpy.bench peer: --rounds must be >= 1 and --steps >= 2", file=sys.stderr)
        return 2
    work = args.dir or tempfile.mkdtemp(prefix="lbannpy-peer-")
    os.makedirs(work, exist_ok=True)
    more = {args.steps * c.steps_scale: [] for c in cases if c.steps_scale > 1}
    for c in cases:
        if c.steps_scale > 1:
            more[args.steps * c.steps_scale].append(c.name)
    scaled = "".join(f" ({n} for {', '.join(names)})" for n, names in more.items())
    print(f"lbannpy.bench peer: {args.rounds} round(s) of {args.steps} steps{scaled}, one BLAS thread per "
          f"process, {'on the GPU (CUDA events), ' if args.device == 'gpu' else ''}"
          f"float32, SGD lr {OPTIMIZER['lr']:g} momentum {OPTIMIZER['momentum']}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    try:
        tables = compare(cases, args.rounds, args.steps, not args.no_two_ranks, work, args.timeout)
    except PeerError as e:
        print(f"lbannpy.bench peer: {e}", file=sys.stderr)
        return 1
    for title, rows in tables:
        print(f"\n{title}")
        for row in rows:
            print(row.line())
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; work files in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
