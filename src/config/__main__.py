"""Command line of lbannpy.config.

    python -m lbannpy.config build SPEC.yaml -o CONFIG.h5 [--set key=value ...]
    python -m lbannpy.config show CONFIG.h5 [--set key=value ...]
    python -m lbannpy.config validate CONFIG.h5 [--ranks P] [--no-data] [--set key=value ...]
        (also prints the estimated peak memory per rank; refuses one over runtime.memory_gib)
    python -m lbannpy.config zoo NAME -o SPEC.yaml [--batch-size B] [--input-size S]
    python -m lbannpy.config schema

Exit status 0 on success; on bad input 2 (as the trainer's user errors) and one line
``lbannpy.config: error: <key>: <message> (hint: ...)``
on stderr, without a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from lbannpy import outputs

PROG = "python -m lbannpy.config"
EXIT_USER_ERROR = 2  # as lbannpy.train's: a problem the user can fix


def build_parser() -> argparse.ArgumentParser:
    """The command's parser (its subcommands' parsers: :func:`subcommands`)."""
    return _parsers()[0]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name (the docs generator renders their help)."""
    return dict(_parsers()[1].choices)


def _parsers():
    ap = argparse.ArgumentParser(prog=PROG, description="Build, show and check lbannpy run configurations.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def overrides(p):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key, e.g. --set trainer.steps=3 (repeatable)")

    p = sub.add_parser("build", help="check a YAML spec and write config.h5")
    p.add_argument("spec", help="YAML spec (or a config.h5 to rewrite)")
    p.add_argument("-o", "--output", required=True, help="config.h5 to write (a .yaml name writes YAML)")
    p.add_argument("--ranks", type=int, help="also check the parallel degrees against this rank count")
    overrides(p)

    p = sub.add_parser("show", help="print a config (or spec) as normalized YAML")
    p.add_argument("config")
    overrides(p)

    p = sub.add_parser("validate", help="all checks: schema, shapes, rank count, data files")
    p.add_argument("config")
    p.add_argument("--ranks", type=int, help="rank count the parallel degrees must fit")
    p.add_argument("--no-data", action="store_true", help="skip the dataset checks")
    overrides(p)

    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..zoo import names as zoo_names

    p = sub.add_parser("zoo", help="write the spec of a zoo model")
    p.add_argument("name", help=f"one of {', '.join(zoo_names())}; the command prints the lbannpy.data "
                                f"command that makes data of the spec's shape")
    p.add_argument("-o", "--output", required=True, help="YAML spec to write")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--input-size", type=int, nargs="+", metavar="S",
                   help="spatial input size: one number for every dimension, or one per dimension")

    sub.add_parser("schema", help="print every section, key, default and layer type")
    return ap, sub


def _load(path: str, sets: list[str]) -> dict:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from . import apply_overrides, load_config

    cfg = load_config(path)
    return apply_overrides(cfg, sets) if sets else cfg


def run(args) -> int:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from . import ConfigError, check_graph, check_ranks, save_config, schema_text, to_yaml, validate
    from ..strategy.memory import memory_limit

    if args.command == "schema":
        sys.stdout.write(schema_text())
    elif args.command == "build":
        cfg = _load(args.spec, args.overrides)
        # before anything is written: -o is not the spec, nor what the config reads or keeps
        outputs.check([("-o", args.output)], [("the spec", args.spec)] + outputs.config_inputs(cfg))
        graph = check_graph(cfg)
        if args.ranks is not None:
            check_ranks(cfg, args.ranks, graph)
        data = cfg.get("data") or {}
        paths = [d["path"] for d in (data.get("train"), data.get("validation")) if d and d.get("path")]
        if paths and all(os.path.exists(p) for p in paths):  # data written later is checked by validate/train
            # late: loaded when the command runs, so its --help and argument errors come without it
            from . import check_data

            check_data(cfg)
        with outputs.writing(args.output, "-o"):  # save_config: a temporary, renamed or removed
            save_config(cfg, args.output)
        print(f"wrote {args.output}: model {cfg['model']['name']!r}, {len(cfg['model']['layers'])} layers")
    elif args.command == "show":
        sys.stdout.write(to_yaml(_load(args.config, args.overrides)))
    elif args.command == "validate":
        # late, as above; train's own start-up checks and set-up, for --ranks ranks without them
        from ..training.build import check_run

        cfg, est = check_run(_load(args.config, args.overrides), args.ranks, data=not args.no_data)
        ranks = f" on {args.ranks} ranks" if args.ranks is not None else ""
        model = cfg["model"]
        print(f"{args.config}: ok{ranks} (model {model['name']!r}, {len(model['layers'])} layers)")
        print(f"memory: {est.text()}; limit: {memory_limit(cfg)[1]}")
    elif args.command == "zoo":
        # late: loaded when the command runs, so its --help and argument errors come without it
        from .. import zoo

        size = args.input_size
        if size is not None and len(size) == 1:
            size = size[0]
        try:
            spec = zoo.get_spec(args.name, batch_size=args.batch_size, input_size=size)
        except zoo.ZooError as e:
            # late: loaded when the command runs, so its --help and argument errors come without it
            from ..config_errors import did_you_mean

            hint = did_you_mean(args.name, zoo.names(), "models") if args.name not in zoo.names() else \
                "see python -m lbannpy.config zoo --help"
            raise ConfigError(f"zoo {args.name}", str(e), hint) from None
        cfg = validate(spec, data=False, memory=False)  # a spec to edit: sized where it runs
        outputs.check([("-o", args.output)], outputs.config_inputs(cfg))
        with outputs.writing(args.output, "-o"):
            save_config(cfg, args.output)
        print(f"wrote {args.output}: zoo model {args.name!r}, {len(cfg['model']['layers'])} layers")
        data = zoo.spec_data_command(spec)
        if data:
            print(f"its data ({spec['data']['train']['path']}): {data}")
    return 0


def main(argv=None) -> int:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from ..config_errors import ConfigError

    args = build_parser().parse_args(argv)
    try:
        with outputs.interrupt_on_signals():
            return run(args)
    except ConfigError as e:
        sys.stderr.write(f"lbannpy.config: error: {e.line()}\n")
        return EXIT_USER_ERROR
    except outputs.WriteError as e:
        sys.stderr.write(f"lbannpy.config: error: {e}\n")
        return EXIT_USER_ERROR
    except OSError as e:  # e.g. an output directory that does not exist
        sys.stderr.write(f"lbannpy.config: error: {e.filename or ''}: {e.strerror or e}\n")
        return EXIT_USER_ERROR
    except outputs.Interrupted as e:
        sys.stderr.write(f"lbannpy.config: {e}; nothing more written (no temporary left)\n")
        return outputs.EXIT_SIGNAL


if __name__ == "__main__":
    sys.exit(main())
