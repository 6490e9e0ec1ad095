"""``python -m lbannpy.demo``: the mesh-tangling prototype end to end on a workstation.

1. generates synthetic mesh-tangling data (``python -m lbannpy.data mesh``),
2. writes the scaled-down mesh model's spec from the zoo and builds ``config.h5``
   (``python -m lbannpy.config zoo mesh_tiny`` + ``build``) with the height split over the ranks,
3. trains it under ``mpiexec -n RANKS python -m lbannpy.train config.h5``,
4. prints the final and validation metrics and where ``metrics.csv``, ``summary.json`` and ``loss.png`` are.

Every step is an ordinary lbannpy command; this module only strings them together (and prints them, so
they can be rerun by hand).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys


def run(cmd: list[str], env=None, timeout: float = 3600) -> None:
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, timeout=timeout)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="demo", help="working directory (default ./demo)")
    ap.add_argument("--ranks", type=int, default=2, help="MPI ranks; the image height is split over them")
    ap.add_argument("--size", type=int, default=128, help="image side in cells (default 128)")
    ap.add_argument("--samples", type=int, default=None,
                    help="samples to generate (default: the count `config zoo mesh_tiny` prints, 32)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    ap.add_argument("--batch-size", type=int, default=4)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)

    os.makedirs(args.dir, exist_ok=True)
    py = sys.executable
    data = os.path.join(args.dir, f"mesh{args.size}.h5")
    spec = os.path.join(args.dir, "mesh_tiny.yaml")
    config = os.path.join(args.dir, "config.h5")
    out = os.path.join(args.dir, "run")
    run([py, "-m", "lbannpy.config", "zoo", "mesh_tiny", "--input-size", str(args.size), "-o", spec])
    if not os.path.exists(data):
        # the data command `config zoo` printed (the same sizes and sample count), writing into --dir
        from lbannpy import zoo

        zspec = zoo.get_spec("mesh_tiny", input_size=args.size)
        zspec["data"]["train"]["path"] = data
        cmd = shlex.split(zoo.spec_data_command(zspec))
        if args.samples is not None:
            cmd[cmd.index("--samples") + 1] = str(args.samples)
        run([py] + cmd[1:] + ["-q"])
    run([py, "-m", "lbannpy.config", "build", spec, "-o", config,
         "--set", f"data.train.path={data}", "--set", "data.validation.fraction=0.25",
         "--set", f"parallel.default.h={args.ranks}", "--set", f"trainer.steps={args.steps}",
         "--set", f"trainer.batch_size={args.batch_size}", "--set", "trainer.eval_every=20",
         "--set", "optimizer.type=adam", "--set", "optimizer.lr=0.003",
         "--set", f"output.dir={out}", "--set", f"checkpoint.dir={os.path.join(args.dir, 'ckpt')}"])
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        sys.stderr.write("lbannpy.demo: mpiexec not found; install an MPI (pip install mpich) or run with "
                         "--ranks 1\n")
        if args.ranks > 1:
            return 2
    # no thread settings here: lbannpy.train gives each rank the node's cores / its ranks (and prints it), so
    # the printed command, rerun by hand, runs as fast as it does here
    # a demo run again (or its printed command rerun by hand) is a new run: the earlier run's checkpoints are
    # moved aside in the checkpoint directory, not refused
    cmd = [py, "-m", "lbannpy.train", config, "--quiet", "--force-new-run"]
    if args.ranks > 1 or mpiexec:
        cmd = [mpiexec, "-n", str(args.ranks)] + cmd
    run(cmd)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    print(f"\nmesh-tangling demo on {args.ranks} rank(s), {args.size}×{args.size} images, distributions "
          f"{sorted(set(summary['distributions'].values()))}:")
    print("  final training batch: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items()
                                                  if k in ("loss", "accuracy", "iou")))
    print("  validation:           " + ", ".join(f"{k} {v:.4f}" for k, v in summary["validation"].items()))
    print(f"  median step {summary['median_step_s'] * 1e3:.0f} ms; outputs: {out}/metrics.csv, "
          f"{out}/summary.json, {out}/loss.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
