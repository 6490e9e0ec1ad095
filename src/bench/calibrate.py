"""``python -m lbannpy.bench calibrate [-o machine.yaml]``: measure this machine for the cost model.

* point to point: ping-pong between rank 0 and one partner on the same node (``intra``) and, when the job
  spans nodes, one on another node (``inter``); one-way time = round trip / 2;
* allreduce of float32 buffers over all ranks;
* compute: a float32 GEMM on every rank at once (the rate a rank gets while the others compute too); for
  the roofline of memory-bound layers, a streaming ``c = a + b`` on every rank at once (seconds per byte
  moved) and the fixed cost of one call of a layer on a one-element tensor (seconds per local kernel);
* compute slots of a node (``cores_per_node``): the CPU cores its ranks may run on (SLURM's allocation, else
  the union of the ranks' CPU affinity), or its GPUs; more ranks than slots share them by time slicing;
* per-type rates (``compute.rates``) of the layer types neither γ nor the streaming rate price (activations,
  norms, upsampling, padding, pooling, mul per element of the larger of input and output: exp/erf/tanh cost
  tens of cycles an element; the transposed convolution per FLOP): the registered layer on a block of every
  rank at once, forward and backward, less the fixed cost of a call, over the block's work.

Fits (least squares on relative error, so that 8-byte and 64-MiB messages weigh alike): point to point
``t = α + β n``; allreduce with the ring model ``t = 2(p-1) α + 2(p-1)/p · n β``
(:func:`lbannpy.machine.ring_allreduce_time`) whatever algorithm the MPI picks (small allreduces are
usually recursive doubling: the fitted α is an effective per-step latency). γ = GEMM time / (2 m n k) s/FLOP.

Needs at least 2 ranks; started alone it relaunches itself under ``mpiexec -n 2``.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import datetime
import math
import os
import socket
import sys
import time

import numpy as np

from lbannpy.comm import Runtime
from lbannpy.local_machine import calibration_path
from lbannpy.machine import machine_from_dict, machines_dir, ring_from_fit

from .calibrate_layers import measure_split_layers
from .calibrate_node import compute_slots, measure_sharing, memory_gib
from .calibrate_priority import raise_priority
from .kernel_choice import conv_shapes, measure_kernels
from .launch import relaunch_if_needed

DEFAULT_MAX_BYTES = 64 << 20


# timing


def message_sizes(max_bytes: int, min_bytes: int = 8, factor: int = 4) -> list[int]:
    out, n = [], min_bytes
    while n < max_bytes:
        out.append(n)
        n *= factor
    out.append(max_bytes)
    return out


def _sync(xp) -> None:
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def timed_calls(comm, op, target_s: float, batches: int, participants=None) -> float:
    """Seconds per call of ``op()``: every call is timed on its own, each rank keeps the median of its
    calls (robust to the process being descheduled now and then on a shared machine), and the slowest
    participant's median is returned. Rank 0 picks the number of calls (about ``target_s * batches`` in
    all) and every rank makes that many (``participants``: ranks that call ``op``; the others only join
    the agreement)."""
    me_in = participants is None or comm.rank in participants
    if me_in:
        op()  # warm-up (connections, allocations)
    comm.barrier()
    t0 = time.perf_counter()
    if me_in:
        op()
    single = comm.allreduce_obj(time.perf_counter() - t0, "max")
    reps = int(min(max(target_s * batches / max(single, 1e-7), 5), 20000))
    reps = comm.bcast_obj(reps, root=0)
    times = np.empty(reps)
    comm.barrier()
    if me_in:
        clock = time.perf_counter
        for i in range(reps):
            t0 = clock()
            op()
            times[i] = clock() - t0
    return comm.allreduce_obj(float(np.median(times)) if me_in else 0.0, "max")


def pingpong(comm, xp, peer_of_0: int, sizes, target_s, batches) -> list[tuple[int, float]]:
    """One-way seconds per message size between rank 0 and ``peer_of_0``."""
    out = []
    me = comm.rank
    for n in sizes:
        sbuf = xp.ones(n, dtype=xp.uint8)
        rbuf = xp.empty(n, dtype=xp.uint8)
        if me == 0:
            def op():
                comm.isend(sbuf, peer_of_0, tag=11).wait()
                comm.irecv(rbuf, peer_of_0, tag=12).wait()
        elif me == peer_of_0:
            def op():
                comm.irecv(rbuf, 0, tag=11).wait()
                comm.isend(sbuf, 0, tag=12).wait()
        else:
            def op():
                return None
        t = timed_calls(comm, op, target_s, batches, participants=(0, peer_of_0))
        out.append((n, t / 2))
    return out


def allreduce_times(comm, xp, sizes, target_s, batches) -> list[tuple[int, float]]:
    out = []
    for n in sizes:
        count = max(n // 4, 1)
        buf = xp.ones(count, dtype=xp.float32)
        res = xp.empty_like(buf)

        def op():
            comm.allreduce(buf, "sum", out=res)
            _sync(xp)

        out.append((count * 4, timed_calls(comm, op, target_s, batches)))
    return out


REDISTRIBUTION_SAMPLES = 8  # samples of the gathered tensor: each rank's piece lands in 8 separate runs


def redistribution_times(comm, xp, sizes, target_s, batches) -> list[tuple[int, float]]:
    """Seconds of lbannpy's own redistribution (:class:`~lbannpy.shuffle.ShufflePlan`, packing, copies
    and buffers included) against the bytes each rank receives: the gather a channel-split layer makes of
    its input, ``(8, P, 1, m)`` split over the channels to every rank holding it whole. ``sizes`` are
    the bytes of one rank's piece."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.dist import Distribution
    from lbannpy.shuffle import shuffle_plan

    p = comm.size
    src = Distribution.make(4, p, c=p)
    dst = Distribution.make(4, p, replicate=["c"], c=p)
    out = []
    for n in sizes:
        m = max(n // (4 * REDISTRIBUTION_SAMPLES), 1)
        shape = (REDISTRIBUTION_SAMPLES, p, 1, m)
        plan = shuffle_plan(src, dst, shape, comm.rank)
        local = xp.ones(plan.src_local_shape, dtype=xp.float32)

        def op():
            plan.start(comm, local).wait()
            _sync(xp)

        received = (p - 1) * REDISTRIBUTION_SAMPLES * m * 4
        out.append((received, timed_calls(comm, op, target_s, batches)))
    return out


def gemm_gamma(comm, xp, n: int, reps: int = 5) -> tuple[float, list[float]]:
    """Seconds per FLOP of an n×n×n float32 GEMM, median over ranks (all ranks compute at once)."""
    rng = np.random.default_rng(comm.rank)
    a = xp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    b = xp.asarray(rng.standard_normal((n, n), dtype=np.float32))
    c = a @ b  # warm-up
    _sync(xp)
    times = []
    comm.barrier()
    for _ in range(reps):
        t0 = time.perf_counter()
        c = a @ b
        _sync(xp)
        times.append(time.perf_counter() - t0)
    del c
    mine = float(np.median(times)) / (2.0 * n ** 3)
    every = comm.allgather_obj(mine)
    return float(np.median(every)), every


def stream_rate(comm, xp, nbytes: int, reps: int = 5) -> float:
    """Seconds per byte moved by ``c = a + b`` on float32 arrays of ``nbytes`` (3 ``nbytes`` of traffic),
    every rank at once, median over ranks: the memory bandwidth a rank gets while the others stream too."""
    n = max(nbytes // 4, 1)
    a = xp.ones(n, dtype=xp.float32)
    b = xp.ones(n, dtype=xp.float32)
    c = xp.empty_like(a)
    xp.add(a, b, out=c)  # warm-up: touch every page
    _sync(xp)
    times = []
    comm.barrier()
    for _ in range(reps):
        t0 = time.perf_counter()
        xp.add(a, b, out=c)
        _sync(xp)
        times.append(time.perf_counter() - t0)
    mine = float(np.median(times)) / (3.0 * n * 4)
    return float(np.median(comm.allgather_obj(mine)))


def layer_call_overhead(comm, xp, reps: int = 200) -> float:
    """Seconds of fixed cost per local kernel: one forward plus one backward of a ReLU layer on a one-element
    tensor (the layer template's bookkeeping and the array calls, no arithmetic to speak of) over two calls,
    median over ``reps`` and over ranks."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.simple import ReLU
    from lbannpy.tensor import DistTensor

    ctx = LayerContext(SingleCommunicator(), xp, "float32")
    layer = ReLU("overhead")
    d = Distribution.make(4, 1)
    layer.configure(ctx, [(1, 1, 1, 1)], [d], d)
    x = DistTensor(xp.ones((1, 1, 1, 1), dtype=xp.float32), (1, 1, 1, 1), d, 0)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        layer.backward(layer.forward([x]))
        _sync(xp)
        if i:
            times.append((time.perf_counter() - t0) / 2)
        ctx.timer.totals.clear()
    return float(np.median(comm.allgather_obj(float(np.median(times)))))


# layer type, the parameters that select the rate row (written into it), the other parameters of the timed
# layer, its inputs (in units of the block: channels, spatial rank), and what the rate is per
RATE_CASES: tuple[tuple[str, dict, dict, int, str], ...] = (
    ("conv_transpose", {}, {"filters": 16, "kernel": 2, "stride": 2}, 1, "flop"),
    ("upsample", {"mode": "nearest"}, {"scale": 2}, 1, "element"),
    ("upsample", {"mode": "linear"}, {"scale": 2}, 1, "element"),
    ("instancenorm", {}, {"affine": True}, 1, "element"),
    ("groupnorm", {}, {"groups": 4}, 1, "element"),
    ("layernorm", {}, {}, 1, "element"),
    ("sigmoid", {}, {}, 1, "element"),
    ("tanh", {}, {}, 1, "element"),
    ("silu", {}, {}, 1, "element"),
    ("gelu", {"approximate": "none"}, {}, 1, "element"),
    ("gelu", {"approximate": "tanh"}, {}, 1, "element"),
    ("elu", {}, {}, 1, "element"),
    ("prelu", {}, {}, 1, "element"),
    ("softmax", {}, {}, 1, "element"),
    ("mul", {}, {}, 2, "element"),
    ("pad", {}, {"padding": 1}, 1, "element"),
    ("global_pool", {"mode": "avg"}, {}, 1, "element"),
    ("global_pool", {"mode": "max"}, {}, 1, "element"),
    ("batchnorm", {}, {}, 1, "element"),  # the small models' other layers: measured, not the roofline
    ("relu", {}, {}, 1, "element"),
    ("pool", {"mode": "max"}, {"kernel": 2, "stride": 2}, 1, "element"),
)
RATE_CHANNELS = 16


def layer_rates(comm, xp, device: str, elements: int, reps: int = 5) -> tuple[list[dict], list[str]]:
    """Rate rows (:class:`lbannpy.machine.Rate`) of :data:`RATE_CASES` whose type is registered, each timed
    on a ``(1, 16, S, S)`` block of about ``elements`` elements on every rank at once (the median of
    ``reps`` forward and backward calls after one warm-up, median over ranks), less the fixed cost of a
    call; and the table lines. Backward: of a layer that reduces over input channels half is dL/dx and
    half dL/dw (two GEMMs of the forward's size), of the others all is dL/dx. Collective over ``comm``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels.select import conv_kernels
    from lbannpy.layers.registry import LayerArgs, layer_classes, layer_specs
    from lbannpy.tensor import DistTensor

    overhead = layer_call_overhead(comm, xp)
    side = max(2, int(round(math.sqrt(elements / RATE_CHANNELS))) // 2 * 2)
    shape = (1, RATE_CHANNELS, side, side)
    specs, classes = layer_specs(), layer_classes()
    rows, lines = [], [f"per-type rates on a {'x'.join(map(str, shape))} block on every rank, fixed cost "
                       f"{overhead * 1e6:.1f} us a call taken off"]
    rng = np.random.default_rng(comm.rank)
    for typ, select, extra, n_in, per in RATE_CASES:
        if typ not in specs:
            what = "".join(f" {k}={v}" for k, v in select.items())
            lines.append(f"  {typ}{what}: not registered, no rate")
            continue
        params = {**extra, **select}
        spec = specs[typ]
        ctx = LayerContext(SingleCommunicator(), xp, "float32", seed=0)
        ctx.conv_kernels = conv_kernels("own", device)
        layer = classes[typ]("rate", **params)
        d = Distribution.make(4, 1)
        layer.configure(ctx, [shape] * n_in, [d] * n_in, d)
        xs = [DistTensor(xp.asarray(rng.standard_normal(shape, dtype=np.float32)), shape, d, 0)
              for _ in range(n_in)]
        dy = DistTensor(xp.asarray(rng.standard_normal(layer.out_shape, dtype=np.float32)), layer.out_shape,
                        layer.out_dist, 0)
        fwd, bwd = [], []
        comm.barrier()
        for i in range(reps + 1):
            t0 = time.perf_counter()
            layer.forward(xs)
            _sync(xp)
            t1 = time.perf_counter()
            layer.backward(dy)
            _sync(xp)
            t2 = time.perf_counter()
            ctx.timer.totals.clear()
            if i:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        t_f, t_b = (float(np.median(comm.allgather_obj(float(np.median(t))))) for t in (fwd, bwd))
        if per == "flop":
            units = spec.infer(LayerArgs("rate", typ, spec.resolve(params), ("x",) * n_in,
                                         (shape,) * n_in)).flops
        else:
            units = max(math.prod(shape), math.prod(layer.out_shape))
        rate_f, rate_b = (max(t - overhead, 0.0) / units for t in (t_f, t_b))
        split = 0.5 if spec.reduces_channels else 0.0
        row = {"type": typ, **({"params": dict(select)} if select else {}), "per": per, "fwd_s": rate_f,
               "bwd_data_s": rate_b * (1 - split), "bwd_weights_s": rate_b * split}
        rows.append(row)
        what = " ".join(f"{k}={v}" for k, v in select.items())
        lines.append(f"  {typ + (' ' + what if what else ''):<28} forward {t_f * 1e3:8.3f} ms, backward "
                     f"{t_b * 1e3:8.3f} ms: {rate_f:.3e} + {rate_b:.3e} s per {per}")
    return rows, lines


# fitting


def fit_alpha_beta(points) -> tuple[float, float, float]:
    """Least squares of ``t = a + b n`` on relative residuals; ``a, b >= 0``. Returns (a, b, max relative
    error of the fit over the points)."""
    n = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    A = np.stack([1 / t, n / t], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a < 0:  # latency below resolution: fit bandwidth alone
        a = 0.0
        b = float(np.linalg.lstsq((n / t)[:, None], np.ones_like(t), rcond=None)[0][0])
    if b <= 0:  # bandwidth term lost in noise (sizes too small): fit latency alone
        b = 1e-15
        a = float(np.median(t))
    err = float(np.max(np.abs(a + b * n - t) / t))
    return float(a), float(b), err


# machine file


def _package_machines_dir() -> str:
    return os.path.realpath(str(machines_dir()))


def check_output(path: str) -> None:
    """Refuse to overwrite the presets shipped in the package, and unwritable places, before measuring."""
    target = os.path.realpath(os.path.abspath(path))
    if os.path.dirname(target) == _package_machines_dir():
        raise SystemExit(f"lbannpy.bench calibrate: refusing to write {path} into the package's machine "
                         f"presets; write to another -o path")
    if not os.access(os.path.dirname(target), os.W_OK):
        raise SystemExit(f"lbannpy.bench calibrate: cannot write {path}: directory not writable")


def write_machine(path: str, data: dict, header: str) -> None:
    import yaml
    target = os.path.realpath(os.path.abspath(path))
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(header)
        yaml.safe_dump(data, f, sort_keys=False, default_flow_style=None, width=100)
    os.replace(tmp, target)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench calibrate",
                                 description=describe(__doc__))
    ap.add_argument("-o", "--output", default=None,
                    help="machine file to write (default: this host's calibration, which the default "
                         "parallel.machine, local, reads: ~/.config/lbannpy/machines/HOST.yaml, "
                         "LBANNPY_MACHINE_DIR moves it)")
    ap.add_argument("--name", default=None, help="machine name in the file (default: the host name)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="array backend (default cpu)")
    ap.add_argument("--backend", choices=("auto", "mpi", "nccl"), default="auto",
                    help="communication backend (default auto: nccl on gpu under MPI, else mpi)")
    ap.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                    help="largest message (default 64 MiB)")
    ap.add_argument("--gemm", type=int, default=1024, help="GEMM size n for gamma (n x n x n, default 1024)")
    ap.add_argument("--target-ms", type=float, default=20.0, help="length of one timed batch (default 20 ms)")
    ap.add_argument("--batches", type=int, default=5,
                    help="the calls per size last about batches x target-ms")
    ap.add_argument("--quick", action="store_true", help="messages up to 4 MiB, 3 batches, GEMM 512")
    ap.add_argument("-n", "--ranks", type=int, default=2, help="ranks to relaunch with when started alone")
    ap.add_argument("--rate-elements", type=int, default=1 << 20,
                    help="elements of the block the per-type layer rates are timed on (default 2^20, 2^18 "
                         "with --quick; 0: no rates)")
    ap.add_argument("--kernels", nargs="+", metavar="MODEL", default=[],
                    help="also time lbannpy's own and PyTorch's ATen conv kernels at every conv shape of "
                         "these models (zoo names, NAME:SIZE:BATCH, or spec/config files) and write the "
                         "faster set per shape (runtime.kernels: auto takes it; CPU only; default: none), "
                         "and every layer of theirs on the block one rank computes under each split up to "
                         "the ranks calibrated")
    ap.add_argument("--priority", type=int, default=None, metavar="NICE",
                    help="every rank measures at this scheduling priority, its session's and its own, e.g. "
                         "-15 on a box others load (root; default: as started)")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def _us(s: float) -> str:
    return f"{s * 1e6:10.2f}"


def _table(title: str, rows, model) -> str:
    lines = [title, f"{'bytes':>10} {'time (us)':>10} {'model (us)':>10} {'GB/s':>8}"]
    for n, t in rows:
        lines.append(f"{n:>10} {_us(t)} {_us(model(n))} {n / t / 1e9:8.3f}")
    return "\n".join(lines)


def measure_links(comm, xp, hosts: list[str], sizes, target: float, batches: int
                  ) -> tuple[dict, dict, list[str], str]:
    """Ping-pong of rank 0 with a partner on its node (``intra``) and one on another node (``inter``), each
    fitted ``α + β n``; a kind no partner exists for copies the other. Returns the links, the fits, the
    tables and a note on copied links. Collective over ``comm``."""
    p = comm.size
    intra_peer = next((r for r in range(1, p) if hosts[r] == hosts[0]), None)
    inter_peer = next((r for r in range(1, p) if hosts[r] != hosts[0]), None)
    links, fits, tables = {}, {}, []
    for kind, peer in (("intra", intra_peer), ("inter", inter_peer)):
        if peer is None:
            continue
        pts = pingpong(comm, xp, peer, sizes, target, batches)
        a, b, err = fit_alpha_beta(pts)
        links[kind] = {"alpha_s": a, "beta_s_per_byte": b}
        fits[kind] = {"max_relative_error": round(err, 3), "ranks": [0, peer]}
        tables.append(_table(f"point to point, rank 0 <-> rank {peer} ({kind}-node), one way; "
                             f"fit alpha {a:.3e} s, beta {b:.3e} s/B", pts, lambda n, a=a, b=b: a + b * n))
    note = ""
    if "inter" not in links:
        links["inter"] = dict(links["intra"])
        note = "inter copied from intra: all ranks ran on one node. "
    if "intra" not in links:
        links["intra"] = dict(links["inter"])
        note = "intra copied from inter: one rank per node. "
    return links, fits, tables, note


def measure_collectives(comm, xp, sizes, max_bytes: int, target: float, batches: int
                        ) -> tuple[dict, dict, dict, list[str]]:
    """The allreduce (ring model, :func:`lbannpy.machine.ring_from_fit`) and lbannpy's redistribution
    (``⌈log2 p⌉·α + received bytes·β``, the cost model's shuffle_times). Returns the allreduce and
    redistribution links, their fits and tables. Collective over ``comm``."""
    p = comm.size
    fits, tables = {}, []
    pts = allreduce_times(comm, xp, sizes, target, batches)
    a, b, err = fit_alpha_beta(pts)
    ar_alpha, ar_beta = ring_from_fit(a, b, p)
    fits["allreduce"] = {"max_relative_error": round(err, 3), "ranks": p,
                         "model": "ring: 2(p-1)*alpha + 2(p-1)/p*n*beta"}
    tables.append(_table(f"allreduce over {p} ranks (float32), ring model alpha {ar_alpha:.3e} s, "
                         f"beta {ar_beta:.3e} s/B", pts, lambda n: a + b * n))

    rd_sizes = [n for n in sizes if 4096 <= n <= min(max_bytes, 16 << 20)]
    if len(rd_sizes) < 2:  # a fit needs two sizes at least
        rd_sizes = [4096, 16384]
    pts = redistribution_times(comm, xp, rd_sizes, target, batches)
    ra, rb, err = fit_alpha_beta(pts)
    msgs = math.ceil(math.log2(max(p, 2)))  # the cost model's messages per redistribution (shuffle_times)
    rd_alpha, rd_beta = ra / msgs, rb
    fits["redistribution"] = {"max_relative_error": round(err, 3), "ranks": p,
                              "model": "ceil(log2 p)*alpha + received bytes*beta"}
    tables.append(_table(f"redistribution (lbannpy shuffle, a channel-split block gathered) over {p} ranks, "
                         f"by bytes received per rank: alpha {rd_alpha:.3e} s, beta {rd_beta:.3e} s/B", pts,
                         lambda n: ra + rb * n))
    ar_link = {"alpha_s": ar_alpha, "beta_s_per_byte": ar_beta}
    return ar_link, {"alpha_s": rd_alpha, "beta_s_per_byte": rd_beta}, fits, tables


def measure_compute(comm, xp, hosts: list[str], gemm: int, quick: bool, local_size: int
                    ) -> tuple[dict, int, list[str]]:
    """γ (GEMM), the streaming rate and the fixed cost of a layer call on every rank at once, and the
    compute slots of rank 0's node. Returns the ``compute`` section, the slots and the tables. Collective
    over ``comm``."""
    gamma, per_rank = gemm_gamma(comm, xp, gemm)
    mem = stream_rate(comm, xp, 16 << 20 if quick else 64 << 20)
    overhead = layer_call_overhead(comm, xp)
    slots = compute_slots(comm, xp, hosts)
    shared, shared_lines = measure_sharing(comm, xp) if xp.__name__ != "cupy" else ([], [])
    kind = "GPUs" if xp.__name__ == "cupy" else "CPU cores"
    tables = [f"GEMM float32 {gemm}^3 on every rank: gamma {gamma:.3e} s/FLOP ({1 / gamma / 1e9:.2f} "
              f"GFLOP/s per rank; ranks {[f'{1 / g / 1e9:.1f}' for g in per_rank]})",
              f"streaming c = a + b on every rank: {mem:.3e} s/B ({1 / mem / 1e9:.2f} GB/s per rank); fixed "
              f"cost of a layer call {overhead * 1e6:.1f} us",
              f"compute slots on {hosts[0]}: {slots} ({kind}; {local_size} rank(s) ran there)", *shared_lines]
    compute = {"gamma_s_per_flop": gamma, "mem_s_per_byte": mem, "kernel_overhead_s": overhead}
    return {**compute, **({"shared": shared} if shared else {})}, slots, tables


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.output is None:  # this host's calibration: what parallel.machine: local (the default) reads
        args.output = str(calibration_path())
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
    check_output(args.output)
    try:
        conv_shapes(args.kernels, args.quick)  # a model that cannot be read fails now, not after the links
    except Exception as exc:  # the zoo's, the spec reader's and the graph's errors: all one line
        raise SystemExit(f"lbannpy.bench calibrate: --kernels: {exc}") from None
    code = relaunch_if_needed("calibrate", argv, args.ranks)
    if code is not None:
        return code
    if args.quick:
        args.max_bytes = min(args.max_bytes, 4 << 20)
        args.batches = min(args.batches, 3)
        args.gemm = min(args.gemm, 512)
    refused = [] if args.priority is None else raise_priority(args.priority)
    backend = "mpi" if args.device == "cpu" and args.backend == "auto" else args.backend
    with Runtime(backend=backend, device=args.device) as rt:
        comm, xp, p = rt.world, rt.xp, rt.size
        if p < 2:
            raise SystemExit("lbannpy.bench calibrate needs at least 2 ranks (mpiexec -n 2 ...)")
        hosts = comm.allgather_obj(socket.gethostname())
        sizes = message_sizes(args.max_bytes)
        target = args.target_ms / 1e3
        if comm.rank == 0:
            print("".join(f"priority {args.priority}: {r}\n" for r in refused), end="")
            print(f"calibrating on {p} ranks ({len(set(hosts))} node(s)), backend {rt.backend}, device "
                  f"{rt.device}, messages {sizes[0]} B .. {sizes[-1]} B", flush=True)
        links, fits, tables, note = measure_links(comm, xp, hosts, sizes, target, args.batches)
        ar, rd, more_fits, more_tables = measure_collectives(comm, xp, sizes, args.max_bytes, target,
                                                             args.batches)
        compute, slots, compute_tables = measure_compute(comm, xp, hosts, args.gemm, args.quick,
                                                         rt.local_size)
        if args.rate_elements > 0:
            elements = min(args.rate_elements, 1 << 18) if args.quick else args.rate_elements
            rates, lines = layer_rates(comm, xp, rt.device, elements)
            compute_tables.append("\n".join(lines))
            if rates:
                compute["rates"] = rates
        if args.kernels:
            rows, lines = (measure_kernels(comm, args.kernels, args.quick) if rt.device == "cpu" else
                           ([], ["conv kernels: timed on the CPU only (a GPU run takes cuDNN through ATen "
                                 "where torch sees the GPU)"]))
            if rt.device == "cpu":
                more, more_lines = measure_split_layers(comm, xp, args.kernels, args.quick)
                rows, lines = rows + more, lines + more_lines
            compute_tables.append("\n".join(lines))
            if rows:
                compute["measured"] = rows
        if comm.rank == 0:
            now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            data = {
                "name": args.name or hosts[0],
                "source": (f"measured by `python -m lbannpy.bench calibrate` on {p} ranks, backend "
                           f"{rt.backend}, device {rt.device}. {note}").strip(),
                "ranks_per_node": rt.local_size,
                "cores_per_node": slots,
                "memory_per_device_gib": memory_gib(xp, rt.local_size),
                "intra": links["intra"],
                "inter": links["inter"],
                "allreduce": ar,
                "redistribution": rd,
                "compute": compute,
                "measured_on": {"date": now, "host": ",".join(sorted(set(hosts))), "ranks": str(p),
                                "device": rt.device, "backend": rt.backend},
                "fit": {**fits, **more_fits},
            }
            header = (f"# Machine file written by `python -m lbannpy.bench calibrate` ({now}).\n"
                      f"# alpha in seconds, beta in seconds per byte, gamma in seconds per FLOP, mem in\n"
                      f"# seconds per byte of memory traffic, kernel overhead in seconds per kernel call.\n")
            print("\n\n".join(tables + more_tables + compute_tables), flush=True)
            # checked by the parser the planner reads it with: never write a file `strategy --machine` refuses
            machine_from_dict(data, args.output)
            write_machine(args.output, data, header)
            print(f"\nwrote {args.output}", flush=True)
        comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
