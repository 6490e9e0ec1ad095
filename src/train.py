"""``python -m lbannpy.train CONFIG.h5 [--set key=value ...] [--resume] [--trace]``

Under ``srun``/``mpiexec`` or alone. Reads the config, builds the model with each layer's distribution,
reads every rank's hyperslab of the data, trains, checkpoints, and writes ``metrics.csv``,
``summary.json`` and ``loss.png`` into ``output.dir``. Exit status 0 on success, non-zero on every rank on
any failure: user errors (config, data, distributions) are found before training, agreed on by all ranks
and reported once without a traceback; internal errors abort every rank with the failing rank's
traceback; a watchdog turns a step that makes no progress into an abort that names the operation each
rank was waiting in.
"""
from __future__ import annotations

import argparse
import sys

from lbannpy import outputs
from lbannpy.training.errors import EXIT_USER_ERROR, UserError  # noqa: F401  (the entry point's API)
from lbannpy.training.loop import Trainer  # noqa: F401
from lbannpy.training.report import write_plot  # noqa: F401
from lbannpy.training.watchdog import Watchdog  # noqa: F401


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lbannpy.train",
        description="Train a model described by a config (from python -m lbannpy.config build, or a YAML "
                    "spec) on one process or under mpiexec/srun, each rank reading and computing its part. "
                    "Writes metrics.csv, summary.json and loss.png into output.dir and checkpoints into "
                    "checkpoint.dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("config", help="config.h5 (from `python -m lbannpy.config build`) or a YAML spec")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set trainer.steps=3 (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (refused "
                    "when the model, optimizer or dtype differ from the run that wrote it)")
    ap.add_argument("--force", action="store_true", help="with --resume: continue even when the model, "
                    "optimizer or dtype changed (the weights must still fit: same parameter names and "
                    "shapes)")
    ap.add_argument("--force-new-run", action="store_true", help="start a new run even though checkpoint.dir "
                    "holds another run's checkpoints: they are moved aside into a subdirectory of it (never "
                    "deleted); without it such a run is refused")
    ap.add_argument("--init", metavar="FILE", help="initial weights (sets model.init): an lbannpy checkpoint "
                    "or a safetensors file from python -m lbannpy.export")
    ap.add_argument("--trace", action="store_true", help="write one Chrome-trace JSON per rank")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """Exit status: 0 done; 2 a user error (one line); 4 stopped by SIGTERM/SIGUSR1 after writing a checkpoint
    and the metrics (resubmit with ``--resume``); 5 aborted by a signal; 6 a non-finite loss; 7 a checkpoint
    or output file could not be written (a full disk); 3 the watchdog; 1 any other failure (one line naming
    ``run-dir/failure-rankR.log``, which holds the traceback)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm.runtime import set_failure_log_dir
    from lbannpy.training.errors import GuardedStdout

    # a closed stdout, a reader that left or a full device: the run goes on and keeps its work
    GuardedStdout("lbannpy.train").install()
    set_failure_log_dir("")  # a failure before the config names the run directory: a temporary file
    try:
        return _main(args)
    except SystemExit:
        raise
    except BaseException as exc:  # one rank alone (with more, Runtime aborted the job and never returns)
        if not getattr(exc, "lbannpy_reported", False):
            # late: loaded when the command runs, so its --help and argument errors come without it
            from lbannpy.comm.runtime import report_and_abort
            report_and_abort(type(exc), exc, exc.__traceback__)
        return 1


def _main(args) -> int:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import Runtime
    from lbannpy.comm.runtime import set_failure_log_dir
    from lbannpy.training.errors import (EXIT_NONFINITE, EXIT_WRITE_FAILED, DataStop, NonFinite, Stopped,
                                         WriteFailed, agree_on_error, user_errors)
    from lbannpy.training.signals import EXIT_STOPPED, SignalWatch
    from lbannpy.config.run import launch_sections
    from lbannpy.hostmem import keep_freed_blocks

    keep_freed_blocks()  # freed step buffers are reused without page faults (see lbannpy.hostmem)
    cfg, early = _read_config(args)  # the config decides the backend
    runtime, output = launch_sections(cfg)
    # tracebacks go to the run directory, named in the one line on stderr (from the Runtime's set-up on:
    # a missing CuPy or GPU fails there)
    set_failure_log_dir(output.dir)
    with Runtime(backend=runtime.backend, device=runtime.device, share_gpu=runtime.share_gpu) as rt:
        world = rt.world
        # from here a signal on any rank ends every rank within seconds (SIGTERM/SIGUSR1 after a checkpoint)
        signals = SignalWatch(rt.rank, rt.size, world.abort).install()
        if early is not None:
            # a config error names its file already
            msg = f"{early}" if f"{early}".startswith(args.config) else f"{args.config}: {early}"
            return _user_error(world, msg)
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.threads import set_threads

        set_threads(world, runtime.threads, "lbannpy.train")
        try:
            outputs.check_trainer_outputs(cfg, args.config)  # none onto an input or another run's checkpoints
            trainer = Trainer(cfg, rt, trace=args.trace or output.trace,
                              quiet=args.quiet)
            if args.force and not args.resume:
                raise UserError("--force only goes with --resume (it accepts a checkpoint of a changed model "
                                "or optimizer)")
            trainer.setup(resume=args.resume, force=args.force, force_new_run=_new_run(args))
            err = None
        except user_errors() as exc:
            err = f"{exc}"
        # every rank agrees before anyone trains: a problem on any rank stops all of them cleanly
        if agree_on_error(world, err, "lbannpy.train"):
            return EXIT_USER_ERROR
        if args.resume and _resumed(trainer, world.rank):  # already finished: nothing to train or write
            return 0
        trainer.signals = signals
        try:
            trainer.run()
        except Stopped as exc:
            if world.rank == 0:
                sys.stderr.write(f"lbannpy.train: {exc}\n")
                sys.stderr.flush()
            return EXIT_STOPPED
        except NonFinite as exc:
            if world.rank == 0:
                # late: loaded when the command runs, so its --help and argument errors come without it
                from lbannpy.checkpoint import newest_sound

                # named only once it has been read back: its checksums verify and its values are finite
                good = newest_sound(trainer.settings.ckpt_dir)
                where = (f"the newest checkpoint that verifies with finite values is {good} (--resume "
                         f"starts there)" if good else f"no checkpoint in {trainer.settings.ckpt_dir}/ "
                                                       f"verifies with finite values")
                sys.stderr.write(f"lbannpy.train: error: {exc}; metrics so far in "
                                 f"{trainer.settings.out_dir}/; {where}\n")
                sys.stderr.flush()
            return EXIT_NONFINITE
        except (WriteFailed, DataStop) as exc:  # agreed on by every rank: one line, no traceback
            if world.rank == 0:
                sys.stderr.write(f"lbannpy.train: error: {exc}\n")
                sys.stderr.flush()
            return EXIT_WRITE_FAILED if isinstance(exc, WriteFailed) else EXIT_USER_ERROR
    return 0


def _new_run(args) -> bool:
    """``--force-new-run``, refused with ``--resume`` (one starts a new run, the other continues one)."""
    if args.force_new_run and args.resume:
        raise UserError("--force-new-run starts a new run and --resume continues one: choose one")
    return args.force_new_run


def _read_config(args):
    """``(cfg, None)``, or ``(None, the ConfigError)`` to report once the ranks can agree. Reading it needs no
    communicator (every rank reads the same file); a config this machine cannot run (the device, backend,
    GPUs or threads: the same on every rank of a node) ends every rank here with exit status 2, before MPI
    starts."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.backend import device_problem, launched_ranks_on_node
    from lbannpy.config import ConfigError, apply_overrides, load_config
    from lbannpy.config.run import launch_sections
    from lbannpy.threads import threads_problem
    from lbannpy.training.errors import refuse_before_mpi

    try:
        cfg = load_config(args.config)
        cfg = apply_overrides(cfg, args.overrides + ([f"model.init={args.init}"] if args.init else []))
    except ConfigError as exc:
        return None, exc
    runtime = launch_sections(cfg)[0]
    problem = device_problem(runtime.device, runtime.backend, runtime.share_gpu, launched_ranks_on_node()) \
        or threads_problem(runtime.threads)
    if problem is not None:
        raise SystemExit(refuse_before_mpi("lbannpy.train", f"{args.config}: {problem}"))
    return cfg, None


def _resumed(trainer, rank: int) -> bool:
    """``--resume``: rank 0 says the step it resumed from; True (one line, nothing else done) when that
    checkpoint is already the run's last step."""
    step, total = trainer.step, trainer.settings.total_steps
    if rank == 0:
        if step >= total:
            print(f"lbannpy.train: already finished: {trainer.resumed_from} is step {step} of {total} "
                  f"(trainer.steps); nothing to do", flush=True)
        else:
            print(f"lbannpy.train: resumed from step {step} ({trainer.resumed_from}); training to step "
                  f"{total}", flush=True)
    return step >= total


def _user_error(world, msg: str) -> int:
    if world.rank == 0:
        sys.stderr.write(f"lbannpy.train: error: {msg}\n")
        sys.stderr.flush()
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
