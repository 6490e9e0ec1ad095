"""``python -m lbannpy.data {mesh,blobs} ... -o FILE.h5``: synthetic data sets."""
from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m lbannpy.data", formatter_class=fmt,
                                 description="Write a synthetic data set (inputs and labels) into an HDF5 "
                                             "file that lbannpy.train reads. See each kind's --help.")
    sub = ap.add_subparsers(dest="kind", required=True, metavar="{mesh,blobs}")
    m = sub.add_parser("mesh", help="synthetic mesh-tangling segmentation data (18 channels, cell labels)",
                       description="Synthetic mesh-tangling segmentation data: per-cell mesh quantities as "
                                   "input channels, cells about to tangle as labels.", formatter_class=fmt)
    m.add_argument("--size", type=int, required=True, help="cells per side (N; the sample is N×N)")
    m.add_argument("--samples", type=int, required=True, help="number of samples (M)")
    m.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    m.add_argument("--seed", type=int, default=0, help="random seed")
    m.add_argument("--channels", type=int, default=18, help="keep the first C of the 18 channels")
    m.add_argument("--steps", type=int, default=4, help="Euler steps of the mesh motion")
    m.add_argument("--threshold", type=float, default=0.25,
                   help="label cells whose min corner Jacobian (relative to the initial one) is below this "
                        "and decreasing; tangled cells are always labelled")
    m.add_argument("-q", "--quiet", action="store_true", help="no per-sample lines")
    b = sub.add_parser("blobs", help="small learnable classification images (oriented gratings + noise)",
                       description="Small learnable classification images: one oriented grating per class "
                                   "plus noise.", formatter_class=fmt)
    b.add_argument("--size", type=int, default=32, help="image height and width in pixels")
    b.add_argument("--samples", type=int, default=256, help="number of samples")
    b.add_argument("--classes", type=int, default=4, help="number of classes")
    b.add_argument("--channels", type=int, default=3, help="input channels")
    b.add_argument("--noise", type=float, default=0.3, help="Gaussian noise std (signal amplitude ~1)")
    b.add_argument("--seed", type=int, default=0, help="random seed")
    b.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.kind == "mesh":
            from .mesh import MeshParams, write_mesh

            params = MeshParams(size=args.size, samples=args.samples, seed=args.seed, channels=args.channels,
                                steps=args.steps, threshold=args.threshold)

            def progress(i, frac):
                if not args.quiet:
                    print(f"sample {i + 1}/{params.samples}: positive fraction {frac:.4f}", flush=True)

            info = write_mesh(args.output, params, progress)
            print(f"wrote {info['path']}: inputs {info['samples']}×{info['channels']}×{info['size']}×"
                  f"{info['size']} float32, labels uint8; positive fraction {info['positive_fraction']:.4f} "
                  f"(per sample {info['positive_fraction_min']:.4f}..{info['positive_fraction_max']:.4f}); "
                  f"{time.perf_counter() - t0:.1f} s")
        else:
            from .blobs import write_blobs

            info = write_blobs(args.output, size=args.size, samples=args.samples, classes=args.classes,
                               channels=args.channels, noise=args.noise, seed=args.seed)
            print(f"wrote {info['path']}: inputs {info['samples']}×{info['channels']}×{info['size']}×"
                  f"{info['size']} float32, labels int64 over {info['classes']} classes "
                  f"(counts {info['class_counts']}); {time.perf_counter() - t0:.1f} s")
    except (ValueError, OSError) as exc:
        print(f"python -m lbannpy.data {args.kind}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
