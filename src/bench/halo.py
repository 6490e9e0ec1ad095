"""``python -m lbannpy.bench halo``: halo exchange and allreduce against the α-β model, and how much of a
halo exchange hides behind interior work.

* halo: an ``N×C×H×W`` float32 tensor split ``h`` ways over the ranks (default 1×18×1024×1024 on 2
  ranks), stencils of kernel 3, 5, 7 ('same' padding). Time of ``plan.start(...).wait()`` (pack, send,
  receive, unpack) against the model ``α + β·bytes`` of the largest message a rank sends (messages to
  different peers travel at once);
* allreduce of a few sizes against the ring model ``2(p-1)α + 2(p-1)/p·n·β``;
* overlap: exchange alone (``t_exch``), the interior work alone (``t_comp``: a k×k box filter over the
  outputs that need no halo, standing in for the convolution), and start → interior work → wait
  (``t_overlap``); hidden = (t_exch + t_comp − t_overlap) / t_exch, clipped to [0, 1]. Measured twice: with
  the interior work in one piece, and cut in ``--pokes`` pieces with a ``test()`` of the exchange between
  them (an MPI without a progress thread moves large messages only inside MPI calls).

The model comes from ``--machine`` (a file or preset name; default ``./machine.yaml`` when it exists), or
else from a quick ping-pong/allreduce fit made at start. Every time is the median of the calls (each
timed alone), slowest rank.

With ``--device gpu`` a last table puts the host-staged MPI path (device arrays through pinned host memory,
comm/hoststaged.py) beside the run's backend (NCCL where every rank has its own GPU) on the same ranks: the
exchange of each kernel and the allreduces, so that what staging costs is seen. ``--share-gpu`` lets more
ranks than GPUs share the devices (``runtime.share_gpu``); NCCL cannot run there, and the run's backend is
MPI.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from lbannpy.comm import Runtime

from lbannpy.machine import Link, load_machine, ring_allreduce_time, ring_from_fit

from .calibrate import allreduce_times, fit_alpha_beta, message_sizes, pingpong
from .launch import relaunch_if_needed


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench halo", description=describe(__doc__))
    ap.add_argument("--shape", default="1,18,1024,1024", help="global N,C,H,W (default 1,18,1024,1024)")
    ap.add_argument("--kernels", default="3,5,7", help="stencil sizes (default 3,5,7)")
    ap.add_argument("--allreduce-mib", default="1,8,32", help="allreduce sizes in MiB (default 1,8,32)")
    ap.add_argument("--machine", default=None, help="machine file or preset for the model")
    ap.add_argument("--reps", type=int, default=20, help="timed calls per measurement (default 20)")
    ap.add_argument("--pokes", type=int, default=8, help="pieces of interior work with test() between")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="array backend (default cpu)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="gpu: let ranks share devices (runtime.share_gpu; the host-staged MPI backend)")
    ap.add_argument("-n", "--ranks", type=int, default=2, help="ranks to relaunch with when started alone")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def _sync(xp):
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def median_time(comm, fn, reps: int, xp) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after one warm-up), slowest rank."""
    fn()
    _sync(xp)
    times = []
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(xp)
        times.append(time.perf_counter() - t0)
    return comm.allreduce_obj(float(np.median(times)), "max")


@dataclass(frozen=True)
class Model:
    """The links the exchange and the allreduce are compared against (priced by :mod:`lbannpy.machine`'s
    α-β functions), and where their numbers come from."""

    p2p: Link  # the intra-node link: the bench's ranks share a node
    allreduce: Link  # the ring allreduce's link
    source: str


def get_model(args, comm, xp) -> Model:
    path = args.machine or ("machine.yaml" if os.path.exists("machine.yaml") else None)
    if path is not None:
        m = load_machine(path)
        return Model(m.intra, m.ring_link, f"machine {path} ({m.name})")
    sizes = message_sizes(16 << 20, factor=8)
    a, b, _ = fit_alpha_beta(pingpong(comm, xp, 1, sizes, 0.01, 3))
    ra, rb, _ = fit_alpha_beta(allreduce_times(comm, xp, sizes, 0.01, 3))
    return Model(Link(a, b), Link(*ring_from_fit(ra, rb, comm.size)), "quick fit made now (8 B .. 16 MiB); "
                 "run `python -m lbannpy.bench calibrate` for a better one")


def box_filter(window, k: int, out):
    """out = sum of the k×k shifted copies of ``window`` over the last two dims (a stand-in for the
    interior convolution: k² multiply-adds per output element)."""
    h, w = out.shape[-2:]
    out[...] = window[..., 0:h, 0:w]
    for i in range(k):
        for j in range(k):
            if i or j:
                out += window[..., i:i + h, j:j + w]
    return out


def time_kernel(comm, xp, dist, shape: tuple[int, ...], k: int, args, model: Model) -> tuple:
    """One row of the halo table: a k×k 'same' stencil's exchange alone, its local part, the interior work
    alone and overlapped with the exchange (in one piece and in ``args.pokes`` pieces). Collective over
    ``comm``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.stencil import Stencil
    from lbannpy.halo import HaloPlan

    me = comm.rank
    stencil = Stencil.conv(len(shape), k, stride=1, padding="same")
    plan = HaloPlan(dist, shape, stencil, me)
    rng = np.random.default_rng(me)
    local = xp.asarray(rng.standard_normal(plan.local_shape, dtype=np.float32))
    window = xp.empty(plan.window_shape, dtype=xp.float32)
    out_int = xp.empty(tuple(s.stop - s.start for s in plan.interior_slices), dtype=xp.float32)
    win_int = plan.interior_window_slices
    itemsize = 4
    msg_bytes = max([s.size for s in plan.sends], default=0) * itemsize
    sent = plan.send_size * itemsize
    sent_max = comm.allreduce_obj(sent, "max")
    msg_max = comm.allreduce_obj(msg_bytes, "max")

    def exchange():
        plan.start(comm, local, out=window).wait()

    def compute():
        box_filter(window[win_int], k, out_int)

    pieces = max(1, min(args.pokes, out_int.shape[-2]))
    bounds = np.linspace(0, out_int.shape[-2], pieces + 1).astype(int)

    def local_part():  # what start() does besides messages: owned copy into the window, padding
        for sl in plan.padding_slices:
            window[sl] = 0
        if plan.owned_box is not None:
            window[plan.owned_window_slices] = local[plan.owned_local_slices]

    def compute_pieces():
        src = window[win_int]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            box_filter(src[..., lo:hi + k - 1, :], k, out_int[..., lo:hi, :])

    def overlapped():
        h = plan.start(comm, local, out=window)
        compute()
        h.wait()

    def overlapped_poked():
        h = plan.start(comm, local, out=window)
        src = window[win_int]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            box_filter(src[..., lo:hi + k - 1, :], k, out_int[..., lo:hi, :])
            h.test()
        h.wait()

    t_exch = median_time(comm, exchange, args.reps, xp)
    t_comp = median_time(comm, compute, max(3, args.reps // 4), xp)
    t_ovl = median_time(comm, overlapped, max(3, args.reps // 4), xp)
    t_comp_p = median_time(comm, compute_pieces, max(3, args.reps // 4), xp)
    t_ovl_p = median_time(comm, overlapped_poked, max(3, args.reps // 4), xp)
    t_local = median_time(comm, local_part, args.reps, xp)
    hidden = float(np.clip((t_exch + t_comp - t_ovl) / t_exch, 0, 1))
    hidden_p = float(np.clip((t_exch + t_comp_p - t_ovl_p) / t_exch, 0, 1))
    t_model = model.p2p.time(msg_max)
    return (k, sent_max, t_exch, t_local, sent_max / t_exch, t_model, sent_max / t_model, t_comp,
            t_ovl, hidden, t_comp_p, t_ovl_p, hidden_p)


def print_halo_table(say, rows, pokes: int) -> None:
    """The rows of :func:`time_kernel` with a legend (``say`` prints on rank 0)."""
    say("t_exch: start()+wait() of the plan; t_local: its local part alone (owned block copied into the "
        "window, padding zeroed);\nGB/s: halo bytes sent per rank / t_exch; model: alpha + beta * largest "
        "message. t_comp/t_ovl: interior work alone / overlapped\nwith the exchange; '+poke': the work in "
        f"{pokes} pieces with test() between them (t_comp measured in pieces too).")
    say(f"{'kernel':>6} {'bytes/rank':>10} {'t_exch us':>10} {'t_local us':>10} {'GB/s':>7} {'model us':>9} "
        f"{'model GB/s':>10} {'t_comp ms':>9} {'t_ovl ms':>8} {'hidden':>6} {'t_comp ms':>9} "
        f"{'t_ovl ms':>8} {'hidden':>6}")
    say(f"{'':>94}{'+poke':>10}{'+poke':>9}{'+poke':>7}")
    for k, nb, te, tl, bw, tm, bwm, tc, to, hid, tcp, top, hidp in rows:
        say(f"{k:>6} {nb:>10} {te * 1e6:>10.1f} {tl * 1e6:>10.1f} {bw / 1e9:>7.3f} {tm * 1e6:>9.1f} "
            f"{bwm / 1e9:>10.3f} {tc * 1e3:>9.2f} {to * 1e3:>8.2f} {hid:>6.0%} {tcp * 1e3:>9.2f} "
            f"{top * 1e3:>8.2f} {hidp:>6.0%}")


def allreduce_table(comm, xp, args, model: Model, say) -> None:
    """Allreduce times of ``args.allreduce_mib`` against the ring model. Collective over ``comm``."""
    p = comm.size
    say(f"\nallreduce over {p} ranks (float32)")
    say(f"{'MiB':>6} {'time ms':>9} {'GB/s':>7} {'model ms':>9} {'model GB/s':>10}")
    for mib in [float(x) for x in args.allreduce_mib.split(",")]:
        n = int(mib * (1 << 20)) // 4
        buf = xp.ones(n, dtype=xp.float32)
        res = xp.empty_like(buf)
        t = median_time(comm, lambda: comm.allreduce(buf, "sum", out=res), max(3, args.reps // 4), xp)
        tm = ring_allreduce_time(n * 4, p, model.allreduce)
        say(f"{mib:>6g} {t * 1e3:>9.3f} {n * 4 / t / 1e9:>7.3f} {tm * 1e3:>9.3f} {n * 4 / tm / 1e9:>10.3f}")


def staged_table(rt, dist, shape, kernels, args, say) -> None:
    """Host-staged MPI beside the run's backend (NCCL where it can run) on the same ranks: the halo exchange
    of each kernel and the allreduces. Collective over ``rt.world``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.stencil import Stencil
    from lbannpy.halo import HaloPlan

    comm, xp, me = rt.world, rt.xp, rt.rank
    staged = comm.host.dup()  # an MPI communicator over the same ranks, forced through pinned host memory
    staged.host_staged = True
    native = f"{rt.backend}{' (host-staged)' if rt.host_staged else ''}"
    reps = max(3, args.reps // 2)
    say(f"\nhost-staged MPI (pinned host buffers, copy streams, a staging thread) beside {native}, same "
        f"ranks; median of {reps} calls, slowest rank")
    say(f"{'exchange':>12} {'bytes/rank':>10} {native + ' us':>22} {'host-staged us':>15} {'ratio':>6}")
    try:
        rng = np.random.default_rng(me)
        for k in kernels:
            plan = HaloPlan(dist, shape, Stencil.conv(len(shape), k, stride=1, padding="same"), me)
            local = xp.asarray(rng.standard_normal(plan.local_shape, dtype=np.float32))
            window = xp.empty(plan.window_shape, dtype=xp.float32)
            t = [median_time(comm, lambda c=c: plan.start(c, local, out=window).wait(), reps, xp)
                 for c in (comm, staged)]
            sent = comm.allreduce_obj(plan.send_size * 4, "max")
            say(f"{f'kernel {k}':>12} {sent:>10} {t[0] * 1e6:>22.1f} {t[1] * 1e6:>15.1f} {t[1] / t[0]:>6.2f}")
        say(f"{'allreduce':>12} {'MiB':>10} {native + ' ms':>22} {'host-staged ms':>15} {'ratio':>6}")
        for mib in [float(x) for x in args.allreduce_mib.split(",")]:
            buf = xp.ones(int(mib * (1 << 20)) // 4, dtype=xp.float32)
            res = xp.empty_like(buf)
            t = [median_time(comm, lambda c=c: c.allreduce(buf, "sum", out=res), reps, xp)
                 for c in (comm, staged)]
            say(f"{'':>12} {mib:>10g} {t[0] * 1e3:>22.3f} {t[1] * 1e3:>15.3f} {t[1] / t[0]:>6.2f}")
    finally:
        staged.free()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    code = relaunch_if_needed("halo", argv, args.ranks)
    if code is not None:
        return code
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.dist import Distribution

    shape = tuple(int(s) for s in args.shape.split(","))
    kernels = [int(k) for k in args.kernels.split(",")]
    backend = "mpi" if args.device == "cpu" else "auto"
    with Runtime(backend=backend, device=args.device, share_gpu=args.share_gpu) as rt:
        comm, xp, p, me = rt.world, rt.xp, rt.size, rt.rank
        if p < 2:
            raise SystemExit("lbannpy.bench halo needs at least 2 ranks (mpiexec -n 2 ...)")
        say = (lambda *a: print(*a, flush=True)) if me == 0 else (lambda *a: None)
        model = get_model(args, comm, xp)
        dist = Distribution.make(len(shape), ranks=p, h=p)
        say(f"halo exchange of a {'x'.join(map(str, shape))} float32 tensor split {dist} over {p} ranks "
            f"(backend {rt.backend}, device {rt.device}); model: {model.source}")
        say(f"p2p alpha {model.p2p.alpha_s:.3e} s, beta {model.p2p.beta_s_per_byte:.3e} s/B; allreduce "
            f"alpha {model.allreduce.alpha_s:.3e} s, beta {model.allreduce.beta_s_per_byte:.3e} s/B; "
            f"median of {args.reps} calls, slowest rank\n")

        rows = [time_kernel(comm, xp, dist, shape, k, args, model) for k in kernels]
        print_halo_table(say, rows, args.pokes)
        allreduce_table(comm, xp, args, model, say)
        if rt.device == "gpu":
            staged_table(rt, dist, shape, kernels, args, say)
        comm.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
