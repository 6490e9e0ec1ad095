"""Reporting: the metrics rows, ``metrics.csv``, ``summary.json``, ``loss.png`` and the Chrome trace.

:class:`Report` owns what is reported: the rows and evaluations (restored on resume, saved in
checkpoints), and which per-layer timer totals are left out of ``summary.json`` (warm-up step and
evaluation passes). ``metrics.csv`` is appended and flushed row by row (:meth:`Report.add_row`); at the end
of the run, and when a signal or a non-finite loss stops it, :meth:`Report.write` replaces ``metrics.csv``,
``summary.json`` and ``loss.png`` atomically.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time

import numpy as np

from .health import json_safe

class _atomic:
    """``with _atomic(path, mode) as f``: written to a temporary name, renamed over ``path`` when the block
    ends without an error (a reader or a later failure never sees half a file)."""

    def __init__(self, path: str, mode: str, **kw):
        self.path, self.tmp = path, f"{path}.tmp{os.getpid()}"
        self.f = open(self.tmp, mode, **kw)

    def __enter__(self):
        return self.f

    def __exit__(self, exc_type, exc, tb):
        try:
            self.f.close()  # a full disk fails here, at the last flush
        except OSError:
            os.unlink(self.tmp)
            raise
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)
        return False


def _name_kernels(merged: dict, per_rank: list) -> None:
    """Each layer's kernel set into ``merged[name]["kernels"]``: rank 0's, and where ranks differ (a set
    chosen by the shape of a rank's block) every rank's in ``kernels_by_rank``."""
    for name, first in per_rank[0].items():
        entry = merged.setdefault(name, {})
        entry["kernels"] = first
        each = [k.get(name) for k in per_rank]
        if any(k != first for k in each):
            entry["kernels_by_rank"] = each


# metrics-row columns that are timings (left out of summary.json's "final")
TIMING_COLUMNS = ("step_time_s", "io_wait_s", "comm_time_s", "hidden_comm_s", "samples_per_s")


class Report:
    def __init__(self, world, out_dir: str, timer, trace: bool, clock: str = "host"):
        self.world = world
        self.clock = clock  # the clock of the per-layer and step times: "host" or "cuda-events"
        # the clock of the bucket times and the hidden fraction (the overlap engine's; the trainer sets it)
        self.bucket_clock = "host"
        self.out_dir = out_dir
        self.timer = timer
        self.trace = trace
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.untimed_totals: dict = {}  # per-layer timer totals of untimed work (warm-up, evaluation)
        self.warmup_steps = 0
        # rank 0: why appending to metrics.csv failed (a full disk), from the first row it failed on; the
        # rows stay in memory (and in checkpoints) and the end of the run writes them again
        self.append_failed: str | None = None

    def restore(self, meta: dict) -> None:
        self.rows = meta.get("rows", [])
        self.evals = meta.get("evals", [])

    def start_metrics(self) -> None:
        """Rank 0, at the start of a run: ``metrics.csv`` holds the rows so far (none, or those restored from
        the checkpoint); :meth:`add_row` appends each new one."""
        self.write_metrics()

    def add_row(self, row: dict) -> None:
        """Rank 0 appends the row to ``metrics.csv`` and flushes it: a run that dies keeps its rows. The
        columns are fixed by the first row (every row has the same keys)."""
        self.rows.append(row)
        if self.world.rank != 0 or self.append_failed:
            return
        path = os.path.join(self.out_dir, "metrics.csv")
        keys = self._columns()
        try:
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                if f.tell() == 0:
                    w.writeheader()
                w.writerow(row)
                f.flush()
        except OSError as exc:  # the stop vote after this step stops every rank (Trainer.run)
            self.append_failed = f"from step {row.get('step')}: {exc.strerror or exc}"

    def add_eval(self, step: int, metrics: dict) -> None:
        self.evals.append({"step": step, **metrics})

    def untimed(self, fn):
        """Run ``fn()`` with what it adds to the per-layer timer totals set aside: ``summary.json``'s
        per-layer times are means over the timed training steps only (no evaluation passes, no warm-up
        step)."""
        self.timer.settle()  # a device clock's marks count where they were recorded
        before = dict(self.timer.totals)
        try:
            return fn()
        finally:
            self.timer.settle()
            for k, v in self.timer.totals.items():
                d = v - before.get(k, 0.0)
                if d:
                    self.untimed_totals[k] = self.untimed_totals.get(k, 0.0) + d

    def end_step(self) -> None:
        """The per-layer intervals are kept only when tracing."""
        if not self.trace and self.timer.events is not None:
            self.timer.events.clear()

    # -- files ---------------------------------------------------------------------------------------------
    def per_layer(self, steps_run: int) -> dict:
        timed_steps = max(steps_run - self.warmup_steps, 1)
        out = {}
        for (name, phase), t in self.timer.totals.items():
            t -= self.untimed_totals.get((name, phase), 0.0)
            if t > 0:
                out.setdefault(name, {})[phase] = t / timed_steps
        return out

    def write(self, run: dict, steps_run: int, final_eval: dict, buckets: list, distributions: dict
              ) -> str | None:
        """Who calls: every rank (an allgather of the per-layer times, a broadcast of the outcome).
        ``run``: steps, ranks, batch_size, dtype, wall_s. Returns, on every rank, why an output file could
        not be written (a full or vanished output directory), or None."""
        err = None
        try:
            self._write(run, steps_run, final_eval, buckets, distributions)
        except OSError as exc:  # mostly rank 0's files: every rank learns it from the allgather
            err = f"{getattr(exc, 'filename', None) or self.out_dir}: {exc.strerror or exc}"
        if self.world.rank == 0 and err is None and self.append_failed:
            sys.stderr.write(f"lbannpy.train: note: appending to metrics.csv failed {self.append_failed}; "
                             f"written in full at the end\n")
        return next((e for e in self.world.allgather_obj(err) if e), None)

    def _write(self, run: dict, steps_run: int, final_eval: dict, buckets: list, distributions: dict) -> None:
        # per-layer and communication times: the slowest rank's (what bounds the step)
        self.timer.settle()
        gathered = self.world.allgather_obj((self.per_layer(steps_run), run.get("kernels") or {}))
        if self.trace:
            self.write_trace()
        if self.world.rank != 0:
            return
        merged: dict = {}
        for d, _ in gathered:
            for name, phases in d.items():
                for ph, t in phases.items():
                    merged.setdefault(name, {})[ph] = max(merged.get(name, {}).get(ph, 0.0), t)
        _name_kernels(merged, [k for _, k in gathered])
        summary = self.summary(run, steps_run, final_eval, buckets, merged, distributions)
        os.makedirs(self.out_dir, exist_ok=True)
        self.write_metrics()
        with _atomic(os.path.join(self.out_dir, "summary.json"), "w") as f:
            json.dump(json_safe(summary), f, indent=2, sort_keys=True, allow_nan=False)  # NaN is not JSON
        split = ", ".join(sorted(set(distributions.values())))
        write_plot(os.path.join(self.out_dir, "loss.png"), self.rows, self.evals,
                   title=f"{run['model']} on {run['ranks']} rank(s), split {split}")
        self.print_summary(summary, final_eval)

    def summary(self, run, steps_run, final_eval, buckets, merged, distributions) -> dict:
        """``layers``: per layer its mean phase times (the slowest rank's) and ``kernels``, the kernel set
        it computed with (:func:`lbannpy.layers.kernels.select.layer_set`)."""
        recent = self.rows[-max(steps_run, 0):] if steps_run else []
        times = [r["step_time_s"] for r in recent]
        io = [r["io_wait_s"] for r in recent]
        # communication is measured by eager steps only (a captured or replayed step marks nothing on the
        # device): the medians and the fraction are over the steps that measured it, null when none did
        measured = [r for r in recent if r.get("comm_time_s") is not None]
        comm = [r["comm_time_s"] for r in measured]
        hidden = [r["hidden_comm_s"] for r in measured]
        last = self.rows[-1] if self.rows else {}
        return {
            "steps": run["steps"],
            "ranks": run["ranks"],
            "batch_size": run["batch_size"],
            "dtype": run["dtype"],
            "final": {k: v for k, v in last.items() if k not in TIMING_COLUMNS},
            "validation": final_eval,
            "median_step_s": float(np.median(times)) if times else None,
            "io_wait_s": float(np.median(io)) if io else None,
            "io_wait_fraction": float(np.sum(io) / np.sum(times)) if times else None,
            "comm_time_s": float(np.median(comm)) if comm else None,
            # over the whole run, weighted by time: the hidden part of all gradient communication
            "hidden_comm_fraction": (float(np.sum(hidden) / np.sum(comm)) if comm and np.sum(comm) > 0
                                     else (0.0 if comm else None)),
            "buckets": buckets,
            # which clock timed what: on a GPU, CUDA events for the layers, halos and steps (host time
            # there measures launches); "buckets" covers the bucket times, comm_time_s and the hidden
            # fraction (CUDA events on NCCL; MPI reductions block the host, so host times are theirs)
            "clock": {"layers": self.clock, "step": self.clock, "buckets": self.bucket_clock,
                      "io_wait": "host"},
            "wall_s": run["wall_s"],
            "memory_estimate": run.get("memory_estimate"),  # bytes per rank, checked at set-up
            "cuda_graph": run.get("cuda_graph"),  # the step mode (runtime.cuda_graph) and why
            "layers": merged,
            "distributions": distributions,
        }

    def _columns(self) -> list:
        # a fixed order: rows restored on resume come back with their keys sorted (the checkpoint's JSON)
        seen = {k for r in self.rows for k in r}
        return [k for k in METRICS_ORDER if k in seen] + sorted(seen - set(METRICS_ORDER))

    def write_metrics(self) -> None:
        """``metrics.csv`` from all rows, replaced atomically."""
        keys = self._columns()
        path = os.path.join(self.out_dir, "metrics.csv")
        with _atomic(path, "w", newline="") as f:
            if keys:
                w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                w.writeheader()
                for r in self.rows:
                    w.writerow(r)

    def print_summary(self, summary: dict, final_eval: dict) -> None:
        fin = summary["final"]
        shown = ", ".join(f"{k} {fin[k]:.4f}" for k in ("loss", "accuracy", "iou", "miou") if k in fin)
        val = ", ".join(f"{k} {v:.4f}" for k, v in final_eval.items())
        n = summary["steps"]
        sys.stdout.write(f"lbannpy.train: {n} step{'' if n == 1 else 's'} on {summary['ranks']} rank(s); "
                         f"{shown}"
                         + (f"; validation {val}" if val else "")
                         + (f"; median step {summary['median_step_s'] * 1e3:.1f} ms"
                            if summary["median_step_s"] is not None else "")
                         + f"; outputs in {self.out_dir}/\n")
        sys.stdout.flush()

    def write_trace(self) -> None:
        events = []
        pid = self.world.rank
        for track, key, t0, t1 in self.timer.events or []:
            tid = {"compute": 0, "comm": 1, "gradcomm": 2}.get(track, 1)
            events.append({"name": "/".join(map(str, key)), "ph": "X", "pid": pid, "tid": tid,
                           "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6})
        for tid, name in ((0, "main: layers"), (1, "main: halo and shuffles"), (2, "gradient communication")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"trace-rank{pid}.json"), "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


METRICS_ORDER = ("step", "epoch", "loss", "accuracy", "iou", "miou", "lr", "grad_norm", "step_time_s",
                 "io_wait_s", "comm_time_s", "hidden_comm_fraction", "hidden_comm_s", "samples_per_s")


def progress_bar(total: int, initial: int):
    """Rank 0's progress: tqdm on a terminal, :class:`PlainProgress` lines in a log file (no carriage
    returns there)."""
    if not sys.stderr.isatty():
        return PlainProgress(total, initial)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5,
                file=sys.stderr)


class PlainProgress:
    """Progress for logs (stderr not a terminal: a SLURM log, a pipe): one plain line every ``every_steps``
    steps or ``every_s`` seconds, whichever comes first, and at the end; the tqdm calls the loop makes."""

    def __init__(self, total: int, initial: int = 0, every_steps: int | None = None, every_s: float = 30.0,
                 file=None, clock=time.monotonic):
        self.total, self.n = int(total), int(initial)
        self.every_steps = every_steps or max(1, self.total // 10)
        self.every_s, self.file, self.clock = float(every_s), file or sys.stderr, clock
        self.t0 = self.t_last = clock()
        self.n_last = self.n
        self.postfix: dict = {}
        self.due = None  # a line is due: written by the set_postfix that follows update (the step's metrics)

    def set_postfix(self, **kw) -> None:
        self.postfix = kw
        if self.due is not None:
            self._line(self.due)

    def update(self, k: int = 1) -> None:
        self.n += k
        now = self.clock()
        if (self.n - self.n_last >= self.every_steps or now - self.t_last >= self.every_s
                or self.n >= self.total):
            self.due = now

    def _line(self, now: float) -> None:
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        self.file.write(f"lbannpy.train: step {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%), "
                        f"{now - self.t0:.0f} s{extra}\n")
        self.file.flush()
        self.t_last, self.n_last, self.due = now, self.n, None

    def close(self) -> None:
        if self.n != self.n_last:
            self._line(self.clock())


def write_plot(path: str, rows: list[dict], evals: list[dict], title: str = "") -> None:
    evals = [e for e in evals if "loss" in e]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(1, 2 if evals else 1, figsize=(10 if evals else 6, 4), squeeze=False)
    ax[0, 0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    if evals:
        ax[0, 0].plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="validation loss")
        keys = [k for k in ("iou", "miou", "accuracy") if k in evals[0]]
        for k in keys:
            ax[0, 1].plot([e["step"] for e in evals], [e[k] for e in evals], "o-", label=f"validation {k}")
        ax[0, 1].set_xlabel("step")
        ax[0, 1].set_ylabel("validation metric")
        ax[0, 1].set_xlim(ax[0, 0].get_xlim())  # the same steps as the loss panel, even for one evaluation
        ax[0, 1].xaxis.set_major_locator(MaxNLocator(integer=True))
        ax[0, 1].legend()
        ax[0, 1].grid(alpha=0.3)
    ax[0, 0].set_xlabel("step")
    ax[0, 0].set_ylabel("loss")
    ax[0, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax[0, 0].legend()
    ax[0, 0].grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}"
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, path)  # readers never see half a plot
