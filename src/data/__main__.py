"""``python -m lbannpy.data {mesh,mesh3d,blobs} ... -o FILE.h5``: synthetic data sets;
``python -m lbannpy.data check FILE [--spec SPEC]``: scan a data file for values a run would stop on."""
from __future__ import annotations

import argparse
import sys
import time

from lbannpy import outputs


def build_parser() -> argparse.ArgumentParser:
    """The command's parser (its subcommands' parsers: :func:`subcommands`)."""
    return _parsers()[0]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name (the docs generator renders their help)."""
    return dict(_parsers()[1].choices)


def _parsers():
    fmt = argparse.ArgumentDefaultsHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m lbannpy.data", formatter_class=fmt,
                                 description="Write a synthetic data set (inputs and labels) into an HDF5 "
                                             "file that lbannpy.train reads, or check one. See each "
                                             "command's --help.")
    sub = ap.add_subparsers(dest="kind", required=True, metavar="{mesh,mesh3d,blobs,check}")
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
    _mesh3d_parser(sub, fmt)
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
    _check_parser(sub)
    return ap, sub


def _mesh3d_parser(sub, fmt) -> None:
    v = sub.add_parser("mesh3d", help="synthetic 3-D mesh-tangling volumes (14 channels, voxel labels)",
                       description="Synthetic 3-D mesh-tangling segmentation data: per-cell quantities of a "
                                   "deformed hexahedral mesh as input channels, cells about to tangle as "
                                   "labels (one per voxel).", formatter_class=fmt)
    v.add_argument("--size", type=int, required=True, help="cells per side of a slice (N)")
    v.add_argument("--depth", type=int, default=0, help="cells in depth (D; 0: N, a cube); a sample is D×N×N")
    v.add_argument("--samples", type=int, required=True, help="number of samples (M)")
    v.add_argument("-o", "--output", required=True, help="HDF5 file to write")
    v.add_argument("--seed", type=int, default=0, help="random seed")
    v.add_argument("--channels", type=int, default=14, help="keep the first C of the 14 channels")
    v.add_argument("--steps", type=int, default=4, help="Euler steps of the mesh motion")
    v.add_argument("--threshold", type=float, default=0.25,
                   help="label cells whose min corner Jacobian (relative to the initial one) is below this "
                        "and decreasing; tangled cells are always labelled")
    v.add_argument("-q", "--quiet", action="store_true", help="no per-sample lines")


def _mesh3d(args, sink) -> str:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from .mesh3d import Mesh3DParams, write_mesh3d

    params = Mesh3DParams(size=args.size, depth=args.depth, samples=args.samples, seed=args.seed,
                          channels=args.channels, steps=args.steps, threshold=args.threshold)

    def progress(i, frac):
        if not args.quiet:
            print(f"sample {i + 1}/{params.samples}: positive fraction {frac:.4f}", flush=True)

    info = write_mesh3d(sink, params, progress)
    return (f"inputs {info['samples']}×{info['channels']}×{'×'.join(map(str, info['shape']))} float32, "
            f"labels uint8; positive fraction {info['positive_fraction']:.4f} (per sample "
            f"{info['positive_fraction_min']:.4f}..{info['positive_fraction_max']:.4f})")


def _check_parser(sub) -> None:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from .check import CHUNK_BYTES

    c = sub.add_parser("check", help="scan a data file: non-finite inputs, labels out of range, shapes",
                       description="Read the whole file in chunks of bounded size and report non-finite "
                                   "inputs, labels outside [0, classes) and shapes or types that do not fit "
                                   "the model of a spec. Exit 0 with one 'ok:' line when clean, 1 with one "
                                   "line per kind of problem, 2 on a bad spec or usage.")
    c.add_argument("file", help="HDF5 data file to check")
    c.add_argument("--spec", metavar="SPEC",
                   help="a YAML spec or config.h5: the model's input shape, classes and loss, and "
                        "data.train's dataset names, are checked")
    c.add_argument("--inputs", help="input dataset name (default: the spec's data.train.inputs, else "
                                    "'inputs')")
    c.add_argument("--labels", help="label dataset name (default: the spec's data.train.labels, else "
                                    "'labels')")
    c.add_argument("--classes", type=int, help="number of classes; labels must lie in 0..K-1 (default: the "
                                               "output channels of the spec's model; without either, only "
                                               "negative labels are reported)")
    c.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                   help="bytes of inputs and labels read at a time (at least one sample; default 64 MiB)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def _check(args) -> int:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from .check import Expect, check_file, spec_expectations

    if args.classes is not None and args.classes < 1:
        print(f"python -m lbannpy.data check: error: --classes must be at least 1, got {args.classes}",
              file=sys.stderr)
        return 2
    if args.chunk_bytes < 1:
        print(f"python -m lbannpy.data check: error: --chunk-bytes must be positive, got {args.chunk_bytes}",
              file=sys.stderr)
        return 2
    if args.spec:
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.config import ConfigError

        try:
            want = spec_expectations(args.spec)
        except (ConfigError, OSError) as exc:
            print(f"python -m lbannpy.data check: error: {args.spec}: {exc}", file=sys.stderr)
            return 2
    else:
        want = Expect()
    want.inputs = args.inputs or want.inputs
    want.labels = args.labels or want.labels
    if args.classes is not None:
        want.classes = args.classes
    return check_file(args.file, want, args.chunk_bytes, args.quiet)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "check":
        return _check(args)
    t0 = time.perf_counter()
    try:
        # -o is no checkpoint and lies in no checkpoint directory; written under a temporary name (HDF5
        # through a sink that reports a full disk), renamed when complete, removed on any error or signal
        outputs.check([("-o", args.output)], [])
        with outputs.interrupt_on_signals(), outputs.atomic(args.output, "-o", sink=True) as sink:
            done = _generate(args, sink)
    except (ValueError, OSError) as exc:
        print(f"python -m lbannpy.data {args.kind}: error: {exc}", file=sys.stderr)
        return 2
    except outputs.Interrupted as exc:
        print(f"python -m lbannpy.data {args.kind}: {exc}; {args.output} not written (no temporary left)",
              file=sys.stderr)
        return outputs.EXIT_SIGNAL
    print(f"wrote {args.output}: {done}; {time.perf_counter() - t0:.1f} s")
    return 0


def _generate(args, sink) -> str:
    """The data set into ``sink`` (the temporary of ``args.output``); what was written, in words."""
    if args.kind == "mesh":
        # late: loaded when the command runs, so its --help and argument errors come without it
        from .mesh import MeshParams, write_mesh

        params = MeshParams(size=args.size, samples=args.samples, seed=args.seed, channels=args.channels,
                            steps=args.steps, threshold=args.threshold)

        def progress(i, frac):
            if not args.quiet:
                print(f"sample {i + 1}/{params.samples}: positive fraction {frac:.4f}", flush=True)

        info = write_mesh(sink, params, progress)
        return (f"inputs {info['samples']}×{info['channels']}×{info['size']}×{info['size']} float32, labels "
                f"uint8; positive fraction {info['positive_fraction']:.4f} (per sample "
                f"{info['positive_fraction_min']:.4f}..{info['positive_fraction_max']:.4f})")
    if args.kind == "mesh3d":
        return _mesh3d(args, sink)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from .blobs import write_blobs

    info = write_blobs(sink, size=args.size, samples=args.samples, classes=args.classes,
                       channels=args.channels, noise=args.noise, seed=args.seed)
    return (f"inputs {info['samples']}×{info['channels']}×{info['size']}×{info['size']} float32, labels "
            f"int64 over {info['classes']} classes (counts {info['class_counts']})")


if __name__ == "__main__":
    sys.exit(main())
