"""``python -m lbannpy.bench checkpoint``: what checkpoint verification costs.

One rank builds a zoo model (default: mesh1k at 1024², its momentum state filled), writes one checkpoint
and reads it back, each ``--repeat`` times; it prints the write time and, within it, the time of the CRC32
of every block written (the checksums are the only work verification adds to a write), and the read time
with and without verification (the CRC32 of every block read). The target is checksums at most 5 % of the
write. Run it on the file system checkpoints go to (``--dir``)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mesh1k", help="zoo model")
    ap.add_argument("--size", type=int, default=1024, help="input height and width")
    ap.add_argument("--repeat", type=int, default=3, help="writes and reads timed (the best is reported)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def _model(name: str, size: int, world, xp):
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy import zoo
    from lbannpy.config import normalize, validate
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.timer import Timer
    from lbannpy.training.build import build_model

    cfg = normalize(zoo.get_spec(name, batch_size=1, input_size=size))
    cfg["optimizer"] = {"type": "sgd", "lr": 0.01, "momentum": 0.9}
    cfg = validate(cfg, ranks=world.size, data=False, memory=False)  # the model alone: no data read
    ctx = LayerContext(world, xp, cfg["trainer"]["dtype"], 0, overlap=False,
                       timer=Timer(events=[]))
    model, _ = build_model(cfg, ctx, world)
    return model


class _Momentum:
    """The optimizer state a checkpoint holds for SGD with momentum: one buffer per parameter."""

    def __init__(self, params, xp):
        self.state = {p.name: {"momentum": xp.ones_like(p.value)} for p in params}
        self.t = 1


def run(args) -> int:
    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy import checkpoint
    from lbannpy.checkpoint import write as ckwrite
    from lbannpy.comm import Runtime

    with Runtime(backend="auto", device="cpu") as rt:
        world = rt.world
        model = _model(args.model, args.size, world, np)
        opt = _Momentum(model.params, np)
        root = args.dir or tempfile.mkdtemp(prefix="lbannpy-bench-ckpt-")
        os.makedirs(root, exist_ok=True)
        crc_s = [0.0]
        plain = ckwrite.crc32

        def timed_crc(arr):  # the checksums' share of the write, timed where the write computes them
            t0 = time.perf_counter()
            try:
                return plain(arr)
            finally:
                crc_s[0] += time.perf_counter() - t0

        writes, crcs, reads_v, reads_p = [], [], [], []
        ckwrite.crc32 = timed_crc
        try:
            for i in range(args.repeat):
                crc_s[0] = 0.0
                t0 = time.perf_counter()
                path = checkpoint.save(world, root, i + 1, model.params, opt, {"bench": True}, model.layers,
                                       run_id="bench")
                writes.append(time.perf_counter() - t0)
                crcs.append(crc_s[0])
                for verify, out in ((True, reads_v), (False, reads_p)):
                    ck = checkpoint.Checkpoint(path, verify=verify)
                    t0 = time.perf_counter()
                    try:
                        ck.read_global()
                    finally:
                        ck.close()
                    out.append(time.perf_counter() - t0)
                if world.rank == 0:
                    checkpoint.prune(root, 1, run_id="bench", newest=path)
        finally:
            ckwrite.crc32 = plain
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        w, c = min(writes), crcs[int(np.argmin(writes))]
        rv, rp = min(reads_v), min(reads_p)
        print(f"lbannpy.bench checkpoint: {args.model} {args.size}² ({size / 2**20:.1f} MiB, "
              f"{len(model.params)} parameters with momentum), 1 rank, best of {args.repeat}: "
              f"write {w:.3f} s with checksums, {w - c:.3f} s without (checksums {c:.4f} s = "
              f"{100 * c / w:.2f} % of the write; target <= 5 %); read {rv:.3f} s verified, {rp:.3f} s "
              f"unverified ({100 * (rv - rp) / max(rp, 1e-12):+.1f} %)", flush=True)
    return 0


def main(argv=None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
