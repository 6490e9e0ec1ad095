"""``python -m lbannpy.from_torch MODEL --input-shape C,H,W[,D] -o SPEC.yaml --weights W.safetensors``

``MODEL`` is ``path/to/file.py:NAME`` or ``package.module:NAME``; ``NAME`` is an ``nn.Module`` class (built
with ``--kwargs``) or a function returning a module. Exit status 0, or 2 with one line on stderr naming what
is not supported (nothing is written then).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys

from lbannpy.training.errors import UserError

PROG = "python -m lbannpy.from_torch"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Import a PyTorch nn.Module (captured with torch.export) as an lbannpy spec and its "
                    "state_dict as initial weights (train --init, or the spec's model.init). Unsupported ops "
                    "or arguments are refused by name before anything is written (docs/from_torch.md lists "
                    "the supported ones).")
    ap.add_argument("model", help="path/to/file.py:NAME or package.module:NAME; NAME is an nn.Module class "
                                  "or a function returning a module")
    ap.add_argument("--input-shape", required=True, metavar="C,H,W[,D]",
                    help="one sample's shape: channels, then the spatial sizes (C,W / C,H,W / C,D,H,W as the "
                         "module's convolutions expect them)")
    ap.add_argument("-o", "--output", required=True, metavar="SPEC.yaml", help="the spec to write")
    ap.add_argument("--weights", required=True, metavar="W.safetensors",
                    help="the module's state_dict (parameters and buffers) to write")
    ap.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments of NAME, a JSON object")
    ap.add_argument("--batch-size", type=int, default=2, help="trainer.batch_size (and the captured batch)")
    ap.add_argument("--loss", help="model.loss; default: pixel_cross_entropy for an (N, K, spatial...) "
                                   "output, cross_entropy for (N, K)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="the module's and the run's floating-point type")
    ap.add_argument("--data", help="data.train.path of the spec (default: <model name>.h5)")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def load_model(ref: str, kwargs: dict):
    """The module ``ref`` names (a file or an importable module, then ``:NAME``), built with ``kwargs``."""
    import torch

    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise UserError(f"MODEL {ref!r}: expected path/to/file.py:NAME or package.module:NAME")
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise UserError(f"MODEL {ref!r}: no such file {where}")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses and pickling look their module up by name
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    obj = getattr(mod, name, None)
    if obj is None:
        raise UserError(f"MODEL {ref!r}: {where} has no {name!r}")
    try:
        module = obj(**kwargs)
    except Exception as exc:  # the user's constructor: its error, in one line
        raise UserError(f"MODEL {ref!r}: {name}(**{kwargs}) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"MODEL {ref!r}: {name}(**kwargs) gave a {type(module).__name__}, not an nn.Module")
    return module


def _paths(args) -> None:
    """No output overwrites the model's file or the other output."""
    model_file = args.model.rpartition(":")[0]
    outs = [os.path.realpath(args.output), os.path.realpath(args.weights)]
    if outs[0] == outs[1]:
        raise UserError(f"-o and --weights name the same file {args.output}")
    if os.path.isfile(model_file) and os.path.realpath(model_file) in outs:
        raise UserError(f"an output would overwrite the model's source {model_file}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        try:
            shape = tuple(int(s) for s in args.input_shape.split(","))
            kwargs = json.loads(args.kwargs)
        except ValueError as exc:
            raise UserError(f"--input-shape {args.input_shape!r} / --kwargs {args.kwargs!r}: {exc}") from None
        if not isinstance(kwargs, dict) or not 2 <= len(shape) <= 4 or min(shape) < 1 or args.batch_size < 1:
            raise UserError("--kwargs must be a JSON object, --input-shape 2 to 4 positive sizes, "
                            "--batch-size >= 1")
        _paths(args)
        import torch  # the one command that needs it

        from . import import_module  # late: --help and argument errors come without the importer's modules

        dtype = getattr(torch, args.dtype)
        with torch.no_grad():
            module = load_model(args.model, kwargs).to(dtype)
        example = torch.zeros((args.batch_size,) + shape, dtype=dtype)
        imported = import_module(module, example, loss=args.loss, name=args.model.rpartition(":")[2],
                                 weights=args.weights, data=args.data)
        for path in (args.output, args.weights):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        imported.write(args.output, args.weights)
    except (UserError, OSError) as exc:
        sys.stderr.write(f"lbannpy.from_torch: error: {exc}\n")
        return 2
    layers = imported.config["model"]["layers"]
    print(f"lbannpy.from_torch: {len(layers)} layers -> {args.output}; {len(imported.tensors)} tensors -> "
          f"{args.weights}; loss {imported.config['model']['loss']}; train with python -m lbannpy.train "
          f"{args.output} (model.init names the weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
