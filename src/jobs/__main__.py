"""python -m lbannpy.jobs: render SLURM batch scripts, and the helper steps those scripts run.

  render TEMPLATE [--site S | --site-file SITE.yaml] [--nodes N --tasks-per-node T --gpus-per-node G
                   --cpus-per-task C --time T --partition P --account A --env-setup LINES --config PATH
                   --run-dir DIR --drop-points] [-o FILE]
  render-all [--dir jobs] [--check]     the committed jobs/*.sbatch (local site)
  list                                  templates and sites
  adapt-spec ZOO.yaml -o SPEC.yaml [--size N --data F.h5 --samples M --steps S --batch-size B]
  synth-images --like SPEC.yaml --samples M -o F.h5
  config-value CONFIG.h5 KEY
  scaling RUN_DIR [-o scaling.csv]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lbannpy import outputs

from . import helpers
from .render import JobSpec, JobSpecError, render, render_all, site_of
from .sites import SITE_DIR, SITES, SiteError, load_site
from .templates import TEMPLATES


def build_parser() -> argparse.ArgumentParser:
    """The command's parser (its subcommands' parsers: :func:`subcommands`)."""
    return _parsers()[0]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name (the docs generator renders their help)."""
    return dict(_parsers()[1].choices)


def _parsers():
    p = argparse.ArgumentParser(prog="python -m lbannpy.jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("render", help="render one batch script")
    r.add_argument("template", choices=sorted(TEMPLATES))
    r.add_argument("--site", default="local", help=f"one of {', '.join(SITES)} (default local)")
    r.add_argument("--site-file", metavar="SITE.yaml",
                   help="a site described in a file (copy a built-in site: src/jobs/sites/*.yaml, "
                        "`python -m lbannpy.jobs list` prints where they are installed)")
    r.add_argument("--nodes", type=int)
    r.add_argument("--tasks-per-node", type=int)
    r.add_argument("--gpus-per-node", type=int)
    r.add_argument("--cpus-per-task", type=int)
    r.add_argument("--time", help="HH:MM:SS or D-HH:MM:SS")
    r.add_argument("--partition")
    r.add_argument("--account")
    r.add_argument("--env-setup", help="shell lines that set up the environment (newline-separated), in "
                                       "place of the site's env_setup (module load, conda activate); '' "
                                       "for none. The site's comm_setup (NCCL, UCX variables) stays")
    r.add_argument("--config", help="default config path baked in (the script's first argument still wins)")
    r.add_argument("--run-dir", help="where the job's run directory DIR/TEMPLATE-JOBID goes (default: run/ "
                                     "in the submit directory; LBANNPY_RUN_DIR at submit time wins)")
    r.add_argument("--drop-points", action="store_true",
                   help="sweeps: leave out, with a note in the script, the rank counts at which the config "
                        "cannot run (default: refuse to render)")
    r.add_argument("-o", "--output", help="file to write (default: stdout)")

    ra = sub.add_parser("render-all", help="render the committed jobs/*.sbatch")
    ra.add_argument("--dir", default="jobs", help="output directory (default: jobs)")
    ra.add_argument("--check", action="store_true", help="only compare; exit 1 when a file differs")

    sub.add_parser("list", help="templates and sites")

    a = sub.add_parser("adapt-spec", help="resize a zoo spec for a job's default config")
    a.add_argument("src")
    a.add_argument("-o", "--output", required=True)
    a.add_argument("--size", type=int)
    a.add_argument("--data")
    a.add_argument("--samples", type=int)
    a.add_argument("--steps", type=int)
    a.add_argument("--batch-size", type=int)

    s = sub.add_parser("synth-images", help="random images + labels shaped like a spec's input")
    s.add_argument("--like", required=True)
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("-o", "--output", required=True)

    c = sub.add_parser("config-value", help="print one dotted key of a config.h5")
    c.add_argument("config")
    c.add_argument("key")

    sc = sub.add_parser("scaling", help="scaling table from RUN_DIR/{strong,weak}-P/summary.json")
    sc.add_argument("run_dir")
    sc.add_argument("-o", "--output", help="CSV file to write")
    return p, sub


def _say_env_replaced(spec: JobSpec) -> None:
    """One line on stderr: which of the site's lines --env-setup replaced, and which it kept."""
    site = site_of(spec)
    replaced = "; ".join(site.env_setup) or "none"
    kept = "; ".join(site.comm_setup) or "none"
    print(f"--env-setup replaced site {site.name}'s environment lines ({replaced}); its communication "
          f"settings stay ({kept})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "render":
            site = load_site(args.site_file) if args.site_file else args.site
            spec = JobSpec.for_site(
                args.template, site=site, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                partition=args.partition, account=args.account, env_setup=args.env_setup, config=args.config,
                run_dir=args.run_dir, drop_points=args.drop_points)
            text = render(spec)
            if args.env_setup is not None:
                _say_env_replaced(spec)
            if args.output:
                _write_script(args, text)
                print(f"wrote {args.output}", file=sys.stderr)
            else:
                sys.stdout.write(text)
        elif args.cmd == "render-all":
            paths = render_all(Path(args.dir), check=args.check)
            if args.check:
                for path in paths:
                    print(f"differs from a fresh render: {path}", file=sys.stderr)
                return 1 if paths else 0
            for path in paths:
                print(f"wrote {path}")
        elif args.cmd == "list":
            for t in TEMPLATES.values():
                print(f"template {t.name:<10} {t.description}")
            for s in SITES.values():
                print(f"site     {s.name:<13} gpus/node={s.gpus_per_node} mpi={s.mpi} "
                      f"partition={s.partition or '(default)'}: {s.description}")
            print(f"sites are files: {SITE_DIR}/*.yaml; copy one for a new cluster and render with "
                  f"--site-file SITE.yaml")
        elif args.cmd == "adapt-spec":
            helpers.adapt_spec(Path(args.src), Path(args.output), size=args.size, data=args.data,
                               samples=args.samples, steps=args.steps, batch_size=args.batch_size)
        elif args.cmd == "synth-images":
            shape, classes = helpers.synth_images(Path(args.like), Path(args.output), args.samples, args.seed)
            print(f"wrote {args.output}: inputs {shape} float32, labels over {classes} classes")
        elif args.cmd == "config-value":
            value = helpers.config_value(Path(args.config), args.key)
            print(value)
        elif args.cmd == "scaling":
            rows = helpers.scaling_table(Path(args.run_dir))
            csv_text, table = helpers.format_scaling(rows)
            if args.output:
                helpers.write_atomic(Path(args.output), csv_text)
                from lbannpy.bench.scaling import plot_scaling  # scaling.png beside scaling.csv

                plot_scaling(rows, str(Path(args.output).with_suffix(".png")))
            sys.stdout.write(table)
    except (JobSpecError, SiteError, helpers.JobHelperError, outputs.OutputError, outputs.WriteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except outputs.Interrupted as exc:
        print(f"{exc}; {args.output} not written (no temporary left)", file=sys.stderr)
        return outputs.EXIT_SIGNAL
    return 0


def _write_script(args, text: str) -> None:
    """``render -o``: not the config or site file it names, nor in a checkpoint directory; written under a
    temporary name and renamed (removed on any error or signal)."""
    outputs.check([("-o", args.output)], [("--config", args.config), ("--site-file", args.site_file)])
    with outputs.interrupt_on_signals(), outputs.atomic(args.output, "-o") as tmp:
        Path(tmp).write_text(text)
        os.chmod(tmp, 0o755)


if __name__ == "__main__":
    sys.exit(main())
