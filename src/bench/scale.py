"""``python -m lbannpy.bench scale``: per-rank set-up and per-step index cost at 64 to 4096 ranks.

The rank simulator runs, in one process, rank ``r``'s complete set-up of a P-rank job against a
:class:`~lbannpy.comm.recording.RecordingCommunicator` of size P (no data moves): model build (layer
configuration, halo and shuffle plans, group colours and splits, parameter initialisation), the loss
(label blocks, metrics group), one group communicator per synchronised parameter (as the trainer asks
for them), the overlap engine's bucket plan and the reader's hyperslab plan (an HDF5 file of the model's
shape whose datasets are never written: only metadata is read at set-up). Checkpoint plans are not part
of it here.

Per step it runs the *index and plan work* of a training step, not the kernels: for every layer, in the
template's order, the input shuffle plan's segments, the halo plans' segments (forward exchange and
backward accumulation), the wrapping of the output and of the input gradients as ``DistTensor`` (the
cached block-shape check), the gradient sums of tensors read twice, and the gradient buckets. The local
arrays are zero-strided views of the right shape, so nothing proportional to the data is touched. Why not
the real step: at P = 64 a rank's block of mesh1k is gigaflops of convolution on each layer, which is
per-rank data work that the strategy cost model prices, and would hide the index work we measure here.
The tests run the real step (real kernels, recording communicator) at small P and count the calls of the
O(P) helpers, which must not grow with P.

Printed per P: set-up seconds of one rank (CPU time of the process, best of two, compared in the
acceptance lines because on a shared machine the wall time, printed beside it, mostly measures the
other processes; the set-up is single-threaded, so the two agree on an idle machine), per-step index
overhead per layer, memory of the plans, and the bytes this rank puts on the network per step according
to its plans (halo sends, shuffle sends, gradient allreduce on the ring).

``--real`` (under ``mpiexec -n P``): the same set-up and per-step index work on every real rank with the
MPI communicator, a few real training steps of a small model (samples and space split) whose per-step
overhead outside the kernels is measured, and the simulator's prediction for the same P beside them.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import gc
import math
import os
import sys
import tempfile
import time

import numpy as np

DEFAULT_RANKS = (64, 256, 1024, 4096)


# --------------------------------------------------------------------------------------------------------
# splits and specs


def _first(v, default):
    """A per-dimension spec's first entry (scalar specs as they are, None as `default`)."""
    return v[0] if isinstance(v, list) else (default if v is None else v)


def spatial_sizes(spec: dict) -> dict:
    """Output spatial extent (smallest dimension) of every layer of ``spec``; ``None`` for layers without
    spatial dimensions (fully connected, flatten)."""
    n = min(int(s) for s in spec["model"]["input"]["spatial"])
    sizes = {"x": n, "input": n}
    prev = "x"
    for layer in spec["model"]["layers"]:
        parents = layer.get("parents") or [prev]
        parents = [parents] if isinstance(parents, str) else parents
        known = [sizes[p] for p in parents if sizes[p] is not None]
        m = min(known) if known else None
        if layer["type"] in ("fc", "flatten"):
            m = None
        elif layer["type"] == "pool" and layer.get("global"):
            m = 1
        elif layer["type"] in ("conv", "pool") and m is not None:
            k, st = int(_first(layer.get("kernel"), 1)), int(_first(layer.get("stride"), 1))
            pad = _first(layer.get("padding"), 0)
            if pad == "same":
                m = -(-m // st)
            else:
                m = (m + 2 * (0 if pad == "valid" else int(pad)) - k) // st + 1
        sizes[layer["name"]] = m
        prev = layer["name"]
    return sizes


def _deepest(spec: dict) -> int:
    """Smallest spatial extent of a layer that keeps its spatial split (global pools take samples only)."""
    sizes = spatial_sizes(spec)
    glob = {layer["name"] for layer in spec["model"]["layers"] if layer.get("global")}
    return max(1, min(v for k, v in sizes.items() if v is not None and k not in glob))


def layer_overrides(spec: dict, degrees: dict) -> dict:
    """Per-layer degrees for layers whose output is smaller than the spatial split (a global pool): they
    keep the sample split only."""
    sizes = spatial_sizes(spec)
    sp = max(degrees.get("h", 1), degrees.get("w", 1), degrees.get("d", 1))
    return {k: {"n": degrees.get("n", 1)} for k, v in sizes.items()
            if v is not None and v < sp and k not in ("x", "input")}


def nhw_split(ranks: int, deepest: int, min_n: int = 4) -> dict:
    """Samples and both spatial dimensions split: ``h = w = s`` the largest power of two with ``s <= deepest``
    and ``s * s * min_n <= ranks``; ``n = ranks / s^2``."""
    s = 1
    while 2 * s <= deepest and (2 * s) ** 2 * min_n <= ranks and ranks % ((2 * s) ** 2) == 0:
        s *= 2
    return {"n": ranks // (s * s), "h": s, "w": s}


def parse_split(text: str) -> dict | None:
    """``nhw`` (automatic, per P) or explicit degrees ``n=4,h=2,w=2``."""
    if text in ("nhw", "auto"):
        return None
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in ("n", "c", "d", "h", "w") or not v.strip().isdigit():
            raise SystemExit(f"bench scale: --split {text!r}: use nhw or degrees like n=4,h=2,w=2")
        out[k.strip()] = int(v)
    return out


def model_spec(name: str, input_size: int | None = None) -> dict:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.zoo import get_spec

    return get_spec(name, input_size=input_size) if input_size else get_spec(name)


# --------------------------------------------------------------------------------------------------------
# the data file the reader plans against (metadata only)


def dataset_file(directory: str, input_shape: tuple, per_pixel: bool, classes: int) -> str:
    """An HDF5 file with datasets of the model's input shape whose chunks are never written (so it is a
    few KiB at any size); the reader reads only its metadata at set-up."""
    import h5py

    path = os.path.join(directory, f"scale_{'x'.join(map(str, input_shape))}.h5")
    if os.path.exists(path):
        return path
    m = input_shape[0]
    with h5py.File(path, "w") as fh:
        fh.create_dataset("inputs", shape=input_shape, dtype="float32", chunks=(1,) + input_shape[1:])
        if per_pixel:
            fh.create_dataset("labels", shape=(m,) + input_shape[2:], dtype="int32",
                              chunks=(1,) + input_shape[2:])
        else:
            fh.create_dataset("labels", data=np.arange(m, dtype=np.int32) % max(classes, 1))
    return path


# --------------------------------------------------------------------------------------------------------
# one rank's set-up


class RankSetup:
    """Rank ``comm.rank``'s complete set-up of a training job on ``comm`` (collective over ``comm`` when it
    is a real communicator: model build, group splits, bucket duplicates), with the time of each phase."""

    def __init__(self, spec: dict, batch: int, degrees: dict, comm, data_dir: str, reader: bool = True):
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.comm.overlap import OverlapEngine
        from lbannpy.layers.context import LayerContext
        from lbannpy.layers.loss import Loss
        from lbannpy.model import Model

        self.times = {}
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.ctx = ctx = LayerContext(comm, np, "float32", seed=0, overlap=False)
        parallel = {"default": dict(degrees), "layers": layer_overrides(spec, degrees)}
        self.model = model = Model(spec["model"], batch, ctx, parallel)
        t1 = time.perf_counter()
        kind = spec["model"].get("loss", "cross_entropy")
        in_shape = model.input_shape
        label_shape = (batch,) + tuple(in_shape[2:]) if kind == "pixel_cross_entropy" else None
        self.loss = Loss(kind, ctx, model.output.out_shape, model.output.out_dist, label_shape)
        t2 = time.perf_counter()
        self.params = model.params
        self.grad_comms = [ctx.block_comm(p.dist, p.reduce_dims) for p in self.params]
        t3 = time.perf_counter()
        self.engine = OverlapEngine(self.params, self.grad_comms, bucket_bytes=25 << 20,
                                    first_bucket_bytes=1 << 20, overlap=False, xp=np)
        t4 = time.perf_counter()
        self.reader = None
        if reader:
            # late: loaded when the command runs, so its --help and argument errors come without it
            from lbannpy.data.reader import HDF5Reader

            path = dataset_file(data_dir, in_shape, label_shape is not None, model.output.out_shape[1])
            self.reader = HDF5Reader(path, dist=model.input_dist, rank=comm.rank, batch_size=batch,
                                     label_dist=self.loss.label_dist, comm=comm, prefetch=False,
                                     expected_channels=in_shape[1], expected_spatial=in_shape[2:],
                                     metadata_only=True)
        t5 = time.perf_counter()
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.checkpoint import rank_pieces, save_plan

        # the checkpoint plan: this rank's pieces (parameters, one momentum slot each, layer state) and
        # what it writes; the index rows rank 0 reads are not counted (one per unique block, O(blocks))
        self.ckpt = save_plan(rank_pieces(self.params, None, model.layers, comm.rank), comm.rank)
        t6 = time.perf_counter()
        self.cpu_seconds = time.process_time() - c0
        self.times = {"model": t1 - t0, "loss": t2 - t1, "groups": t3 - t2, "buckets": t4 - t3,
                      "reader": t5 - t4, "checkpoint": t6 - t5}
        self.halos = {layer.name: _halo_plans(layer) for layer in model.layers}

    @property
    def seconds(self) -> float:
        return sum(self.times.values())

    def close(self) -> None:
        self.engine.close()
        if self.reader is not None:
            self.reader.close()


def _halo_plans(layer) -> list:
    """The halo plans a layer built at set-up (attributes holding :class:`HaloPlan` objects)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.halo import HaloPlan

    out = []
    for v in vars(layer).values():
        items = v if isinstance(v, (list, tuple)) else [v]
        out += [x for x in items if isinstance(x, HaloPlan)]
    return out


# --------------------------------------------------------------------------------------------------------
# one step's index and plan work


def _zeros(shape, dtype=np.float32):
    """A read-only zero array of ``shape`` that occupies one element (index work, no data)."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


def index_step(setup: RankSetup) -> dict:
    """The index and plan work of one training step of ``setup``'s rank (module docstring), returning the
    bytes this rank sends per step by kind, from the plans."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.tensor import DistTensor, block_shape

    model, rank, itemsize = setup.model, setup.ctx.rank, 4
    sent = {"halo": 0, "shuffle": 0, "allreduce": 0, "metrics": 0}
    scratch = np.empty(0, dtype=np.float32)
    acts = {}
    x = DistTensor.wrap(_zeros(block_shape(model.input_dist, model.input_shape, rank)),
                        model.input_shape, model.input_dist, rank)
    for n in ("x", "input"):
        acts[n] = x
    for layer in model.layers:
        for i, plan in enumerate(layer.in_plans):
            if plan is not None:
                for s in plan.send_segments:
                    scratch[0:0]
                for s in plan.recv_segments:
                    scratch[0:0]
                sent["shuffle"] += sum(s.size for s in plan.send_segments) * itemsize
        for hp in setup.halos[layer.name]:
            for s in hp.sends:
                scratch[s.offset:s.offset]
            for s in hp.recvs:
                scratch[s.offset:s.offset]
            sent["halo"] += hp.send_size * itemsize
        y = DistTensor.wrap(_zeros(block_shape(layer.out_dist, layer.out_shape, rank)), layer.out_shape,
                            layer.out_dist, rank)
        acts[layer.name] = y
    sent["metrics"] += (2 + 3 * setup.loss.num_classes) * 8
    grads = {model.output.name: acts[model.output.name]}
    for layer in reversed(model.layers):
        g = grads.pop(layer.name)
        for hp in setup.halos[layer.name]:  # the adjoint exchange sends what the forward received
            for s in hp.recvs:
                scratch[s.offset:s.offset]
            sent["halo"] += hp.recv_size * itemsize
        for i, p in enumerate(model.parents[layer.name]):
            plan = layer.in_plans[i]
            dist = layer.parent_dists[i] if plan is None else plan.src_dist
            if plan is not None:
                sent["shuffle"] += sum(s.size for s in plan.reverse().send_segments) * itemsize
            dx = DistTensor.wrap(g.local if layer.in_shapes[i] == g.global_shape and dist == g.dist
                                 else _zeros(block_shape(dist, layer.in_shapes[i], rank)),
                                 layer.in_shapes[i], dist, rank)
            key = "x" if p in ("x", "input") else p
            if key in grads:
                grads[key] = DistTensor.wrap(grads[key].local, dx.global_shape, dx.dist, dx.rank)
            else:
                grads[key] = dx
    for bucket in setup.engine.buckets:
        p = bucket.comm.size
        sent["allreduce"] += 2 * (p - 1) * bucket.nbytes // p if p > 1 else 0
    return sent


def time_index_step(setup: RankSetup, repeats: int = 7) -> tuple[float, dict]:
    """Best time of ``repeats`` index steps (seconds) and the bytes sent per step."""
    sent = index_step(setup)  # warm the caches, as the first real step does
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        index_step(setup)
        best = min(best, time.perf_counter() - t0)
    return best, sent


# --------------------------------------------------------------------------------------------------------
# memory of the plans


def plan_bytes(setup: RankSetup) -> int:
    """Bytes of Python objects held by the plans of ``setup`` (halo and shuffle plans, group
    communicator descriptions, bucket bookkeeping), NumPy buffers excluded."""
    seen: set[int] = set()
    total = 0
    roots = []
    for layer in setup.model.layers:
        roots += setup.halos[layer.name]
        roots += [p for p in layer.in_plans if p is not None]
    roots += [setup.loss.plan] if setup.loss.plan is not None else []
    groups, partitions = setup.ctx.group_keys()
    roots += [{k: None for k in partitions}, {k: None for k in groups}]
    roots += [[(b.index, list(b.offsets)) for b in setup.engine.buckets]]
    stack = list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (np.ndarray, type)) or callable(o) and not hasattr(o, "__dict__"):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack += list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif hasattr(o, "__dict__"):
            stack += [v for k, v in vars(o).items() if k not in ("comm",)]
        elif hasattr(o, "__slots__"):
            stack += [getattr(o, k) for k in o.__slots__ if hasattr(o, k)]
    return total


# --------------------------------------------------------------------------------------------------------
# the simulator


def simulate(model: str, ranks: int, degrees: dict, batch: int, rank: int, data_dir: str,
             input_size: int | None = None, repeats: int = 2) -> dict:
    """Rank ``rank``'s set-up and one step's index work of a ``ranks``-rank job, in this process."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm.recording import RecordingCommunicator
    from lbannpy.halo import halo_plan
    from lbannpy.shuffle import local_only, same_layout, shuffle_plan
    from lbannpy.tensor import clear_caches

    spec = model_spec(model, input_size)
    setup, comm = None, None
    for _ in range(max(1, repeats)):  # best of ``repeats`` set-ups: the machine may be shared
        for cached in (halo_plan, shuffle_plan, local_only, same_layout):
            cached.cache_clear()  # each P pays its own set-up, as a fresh process would
        clear_caches()
        if setup is not None:
            setup.close()
        gc.collect()
        c = RecordingCommunicator(ranks, rank)
        s = RankSetup(spec, batch, degrees, c, data_dir)
        if setup is None or s.cpu_seconds < setup.cpu_seconds:
            setup, comm = s, c
    step_s, sent = time_index_step(setup)
    nlayers = len(setup.model.layers)
    out = {"model": model, "ranks": ranks, "rank": rank, "split": degrees, "batch": batch,
           "layers": nlayers, "setup_s": setup.cpu_seconds, "setup_wall_s": setup.seconds,
           "phases": dict(setup.times),
           "index_us_per_layer": step_s / nlayers * 1e6, "plan_bytes": plan_bytes(setup),
           "sent": sent, "groups": len(comm.recorder.groups),
           "ckpt_held": setup.ckpt.held_bytes, "ckpt_written": setup.ckpt.written_bytes,
           "ckpt_peak": setup.ckpt.peak_extra_bytes}
    setup.close()
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def split_str(degrees: dict) -> str:
    return "·".join(f"{k}{v}" for k, v in degrees.items() if v > 1) or "1"


def print_table(rows: list[dict], out=sys.stdout, header: bool = True) -> None:
    if header:
        out.write(f"{'model':<9} {'P':>5} {'split':<12} {'batch':>5} {'set-up s':>9} {'(wall)':>7} "
                  f"{'index µs/layer':>15} "
                  f"{'plans':>10} {'halo/step':>11} {'shuffle/step':>13} {'allreduce/step':>15} "
                  f"{'groups':>6} {'ckpt held/writes':>22}\n")
    for r in rows:
        s = r["sent"]
        out.write(f"{r['model']:<9} {r['ranks']:>5} {split_str(r['split']):<12} {r['batch']:>5} "
                  f"{r['setup_s']:>9.2f} {r['setup_wall_s']:>7.2f} {r['index_us_per_layer']:>15.1f} "
                  f"{_fmt_bytes(r['plan_bytes']):>10} "
                  f"{_fmt_bytes(s['halo']):>11} {_fmt_bytes(s['shuffle']):>13} "
                  f"{_fmt_bytes(s['allreduce']):>15} {r['groups']:>6} "
                  f"{_fmt_bytes(r.get('ckpt_held', 0)) + ' / ' + _fmt_bytes(r.get('ckpt_written', 0)):>22}\n")


def acceptance(rows: list[dict], out=sys.stdout) -> bool:
    """Set-up under 5 s and index overhead under 1 ms per layer at the largest P, each within 2x of the
    smallest P's figure (per model)."""
    ok = True
    for model in sorted({r["model"] for r in rows}):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["ranks"])
        lo, hi = mine[0], mine[-1]
        checks = [
            (f"set-up at P={hi['ranks']} under 5 s", hi["setup_s"] < 5.0, f"{hi['setup_s']:.2f} s"),
            (f"index overhead at P={hi['ranks']} under 1 ms per layer", hi["index_us_per_layer"] < 1000.0,
             f"{hi['index_us_per_layer']:.1f} µs"),
            (f"set-up within 2x of P={lo['ranks']}", hi["setup_s"] <= 2 * lo["setup_s"],
             f"{hi['setup_s']:.2f} s vs {lo['setup_s']:.2f} s"),
            (f"index overhead within 2x of P={lo['ranks']}",
             hi["index_us_per_layer"] <= 2 * lo["index_us_per_layer"],
             f"{hi['index_us_per_layer']:.1f} µs vs {lo['index_us_per_layer']:.1f} µs"),
        ]
        for what, good, value in checks:
            ok &= good
            out.write(f"  {model}: {what}: {'holds' if good else 'FAILS'} ({value})\n")
    return ok


# --------------------------------------------------------------------------------------------------------
# real runs under mpiexec


REAL_MODEL = "mesh_tiny"


def real(args) -> int:
    """Under ``mpiexec -n P``: set-up, index step and real training steps of a small model on the real
    communicator, beside the simulator's prediction (computed on rank 0 for rank 0)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm.runtime import Runtime

    with Runtime("mpi", "cpu") as rt:
        world = rt.world
        P = world.size
        spec = model_spec(args.real_model, args.real_input)
        degrees = parse_split(args.split) or nhw_split(P, _deepest(spec), min_n=2)
        batch = args.batch_size or 2 * degrees["n"]
        data_dir = args.data_dir
        if world.rank == 0:
            os.makedirs(data_dir, exist_ok=True)
            dataset_file(data_dir, (batch, spec["model"]["input"]["channels"])
                         + tuple(spec["model"]["input"]["spatial"]), True, 2)
        world.barrier()
        t0 = time.perf_counter()
        setup = RankSetup(spec, batch, degrees, world, data_dir)
        setup_s = time.perf_counter() - t0
        step_s, sent = time_index_step(setup)
        overhead = real_steps(setup, args.steps)
        nl = len(setup.model.layers)
        mine = np.array([setup_s, setup.cpu_seconds, step_s / nl * 1e6, overhead / nl * 1e6])
        worst = world.allreduce(mine, op="max")
        setup.close()
        world.barrier()
        if world.rank == 0:
            sim = simulate(args.real_model, P, degrees, batch, 0, data_dir, args.real_input)
            # late: loaded when the command runs, so its --help and argument errors come without it
            from lbannpy.comm.recording import RecordingCommunicator

            alone = RankSetup(spec, batch, degrees, RecordingCommunicator(P, 0), data_dir)
            sim_over = real_steps(alone, args.steps) / nl * 1e6
            alone.close()
            sys.stdout.write(
                f"real run: {args.real_model} on {P} ranks, split {split_str(degrees)}, batch {batch}, "
                f"{nl} layers, {args.steps} steps (real: slowest rank; simulated: rank 0 alone in one "
                f"process on a recording communicator)\n"
                f"{'':<30} {'real':>10} {'simulated':>10}\n"
                f"{'set-up s (wall)':<30} {worst[0]:>10.3f} {sim['setup_wall_s']:>10.3f}\n"
                f"{'set-up s (CPU)':<30} {worst[1]:>10.3f} {sim['setup_s']:>10.3f}\n"
                f"{'index µs/layer':<30} {worst[2]:>10.1f} {sim['index_us_per_layer']:>10.1f}\n"
                f"{'step overhead µs/layer':<30} {worst[3]:>10.1f} {sim_over:>10.1f}\n"
                f"{'halo bytes/step (rank 0)':<30} {sent['halo']:>10} {sim['sent']['halo']:>10}\n"
                f"{'allreduce bytes/step (rank 0)':<30} {sent['allreduce']:>10} "
                f"{sim['sent']['allreduce']:>10}\n")
            sys.stdout.flush()
    return 0


def real_steps(setup: RankSetup, steps: int) -> float:
    """Run ``steps`` real training steps (forward, loss, backward, gradient allreduce) of ``setup`` on its
    communicator; returns the median per-step time outside the layers' kernels and communication (the
    template's own overhead: step wall time minus the timer's per-layer totals, the loss and the bucket
    reductions, all of which wait for other ranks), after one warm-up step."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.tensor import DistTensor

    model, loss, ctx, rank = setup.model, setup.loss, setup.ctx, setup.ctx.rank
    rng = np.random.default_rng(rank)
    x = DistTensor(rng.standard_normal(model.input_dist.local_shape(model.input_shape, rank))
                   .astype(np.float32), model.input_shape, model.input_dist, rank)
    lbox = loss.label_box()
    labels = rng.integers(0, model.output.out_shape[1], size=tuple(b - a for a, b in lbox)).astype(np.int32)
    over = []
    spent = [0.0]  # time in the loss and the gradient buckets (collectives that wait for other ranks)

    def on_layer(name):
        t = time.perf_counter()
        setup.engine.layer_done(name)
        spent[0] += time.perf_counter() - t

    for step in range(steps + 1):
        ctx.timer.totals.clear()
        spent[0] = 0.0
        setup.engine.start_step()
        t0 = time.perf_counter()
        y = model.forward(x)
        t = time.perf_counter()
        loss.forward(y, labels)
        dy = loss.backward()
        spent[0] += time.perf_counter() - t
        model.backward(dy, on_layer=on_layer, input_grad=False)
        t1 = time.perf_counter()
        setup.engine.finish()
        inside = spent[0] + sum(v for (_, phase), v in ctx.timer.totals.items()
                                if phase in ("fp", "bp", "shuffle", "shuffle_bp"))  # the template's spans
        if step:
            over.append(max(t1 - t0 - inside, 0.0))
    return float(np.median(over))


# --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench scale", description=describe(__doc__))
    ap.add_argument("--model", nargs="+", default=["mesh1k", "resnet50"],
                    help="zoo models to simulate (mesh1k, mesh2k, resnet50, ...)")
    ap.add_argument("--ranks", nargs="+", type=int, default=list(DEFAULT_RANKS),
                    help=f"simulated rank counts (default {' '.join(map(str, DEFAULT_RANKS))})")
    ap.add_argument("--split", default="nhw", help="nhw (samples and space, chosen per P) or n=4,h=2,w=2")
    ap.add_argument("--rank", type=int, default=None, help="simulated rank (default: the middle rank)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: one sample per sample group")
    ap.add_argument("--input-size", type=int, default=None, help="input spatial size (default: the zoo's)")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "lbannpy-bench-scale"),
                    help="where --real writes its data file (default: lbannpy-bench-scale in the temp dir)")
    ap.add_argument("--no-check", action="store_true", help="print only; exit 0 even if acceptance fails")
    ap.add_argument("--real", action="store_true", help="under mpiexec: real set-up and steps vs simulator")
    ap.add_argument("--real-model", default=REAL_MODEL, help=f"zoo model of --real (default {REAL_MODEL})")
    ap.add_argument("--real-input", type=int, default=64, help="input side of --real (default 64)")
    ap.add_argument("--steps", type=int, default=3, help="real training steps with --real")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.real:
        return real(args)
    os.makedirs(args.data_dir, exist_ok=True)
    fixed = parse_split(args.split)
    rows = []
    # imports, the data file and the allocator warmed once, so the first P is not charged for them
    warm = args.model[0]
    deg = fixed or nhw_split(args.ranks[0], _deepest(model_spec(warm, args.input_size)))
    simulate(warm, args.ranks[0], deg, args.batch_size or deg.get("n", 1), 0, args.data_dir, args.input_size)
    for model in args.model:
        spec = model_spec(model, args.input_size)
        deep = _deepest(spec)
        for P in args.ranks:
            degrees = fixed or nhw_split(P, deep)
            batch = args.batch_size or degrees.get("n", 1)
            rank = P // 2 + (P // 4 if P >= 4 else 0) + 1 if args.rank is None else args.rank
            rows.append(simulate(model, P, degrees, batch, min(rank, P - 1), args.data_dir, args.input_size))
            print_table(rows[-1:], header=len(rows) == 1)
            sys.stdout.flush()
    sys.stdout.write("\nacceptance (largest P against smallest P):\n")
    ok = acceptance(rows)
    return 0 if ok or args.no_check else 1


if __name__ == "__main__":
    sys.exit(main())
