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
import csv
import json
import os
import sys
import threading
import time
import traceback

import numpy as np

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix (config, data, distribution); reported without a traceback."""


# --------------------------------------------------------------------------------------------------------
# watchdog


class Watchdog:
    """Aborts the job when no progress is reported for ``timeout`` seconds, naming what each rank waits in.

    Every rank runs one; all ranks stuck in the same collective fire at about the same time and each
    prints its own operation before the abort takes the job down.
    """

    def __init__(self, timeout: float, rank: int, abort):
        self.timeout = float(timeout)
        self.rank = rank
        self.abort = abort
        self.op = "start-up"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def progress(self, op: str) -> None:
        self.op = op
        self.last = time.monotonic()

    def start(self):
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._run, name="lbannpy-watchdog", daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                sys.stderr.write(f"lbannpy: rank {self.rank}: no progress for {idle:.0f} s (watchdog "
                                 f"{self.timeout:g} s); waiting in: {self.op}\n")
                sys.stderr.flush()
                time.sleep(1.0)  # let the other ranks' watchdogs print theirs
                self.abort(3)
                return

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# --------------------------------------------------------------------------------------------------------
# outputs


def write_plot(path: str, rows: list[dict], evals: list[dict]) -> None:
    evals = [e for e in evals if "loss" in e]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2 if evals else 1, figsize=(10 if evals else 6, 4), squeeze=False)
    ax[0, 0].plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    if evals:
        ax[0, 0].plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="validation loss")
        keys = [k for k in ("iou", "miou", "accuracy") if k in evals[0]]
        for k in keys:
            ax[0, 1].plot([e["step"] for e in evals], [e[k] for e in evals], "o-", label=f"validation {k}")
        ax[0, 1].set_xlabel("step")
        ax[0, 1].legend()
        ax[0, 1].grid(alpha=0.3)
    ax[0, 0].set_xlabel("step")
    ax[0, 0].set_ylabel("loss")
    ax[0, 0].legend()
    ax[0, 0].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m lbannpy.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="config.h5 (from `python -m lbannpy.config build`) or a YAML spec")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set trainer.steps=3 (repeatable)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    ap.add_argument("--trace", action="store_true", help="write one Chrome-trace JSON per rank")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from lbannpy.comm import Runtime
    from lbannpy.checkpoint import CheckpointError
    from lbannpy.config import ConfigError, apply_overrides, load_config
    from lbannpy.data.reader import DataError
    from lbannpy.dist import DistributionError
    from lbannpy.layers.base import LayerError

    # the config decides the backend; reading it needs no communicator (every rank reads the same file)
    try:
        cfg = load_config(args.config)
        cfg = apply_overrides(cfg, args.overrides)
    except ConfigError as exc:
        cfg, early = None, exc
    else:
        early = None
    rt_cfg = (cfg or {}).get("runtime", {}) if cfg else {}
    with Runtime(backend=rt_cfg.get("backend", "auto"), device=rt_cfg.get("device", "cpu")) as rt:
        world = rt.world
        if early is not None:
            return _user_error(world, f"{args.config}: {early}")
        try:
            trainer = Trainer(cfg, rt, trace=args.trace or bool(cfg["output"].get("trace", False)),
                              quiet=args.quiet)
            trainer.setup(resume=args.resume)
            err = None
        except (UserError, ConfigError, DataError, LayerError, DistributionError, CheckpointError,
                OSError) as exc:
            err = f"{exc}"
        # every rank agrees before anyone trains: a problem on any rank stops all of them cleanly
        errors = world.allgather_obj(err)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            if world.rank == 0:
                r, e = bad[0]
                where = "" if all(x == e for _, x in bad) else f" (rank {r})"
                sys.stderr.write(f"lbannpy.train: error{where}: {e}\n")
                sys.stderr.flush()
            return EXIT_USER_ERROR
        trainer.run()
    return 0


def _user_error(world, msg: str) -> int:
    if world.rank == 0:
        sys.stderr.write(f"lbannpy.train: error: {msg}\n")
        sys.stderr.flush()
    return EXIT_USER_ERROR


class Trainer:
    def __init__(self, cfg: dict, rt, trace: bool = False, quiet: bool = False):
        self.cfg = cfg
        self.rt = rt
        self.world = rt.world
        self.trace = trace
        self.quiet = quiet

    # -- set-up ------------------------------------------------------------------------------------------
    def setup(self, resume: bool = False) -> None:
        from lbannpy.config import validate
        from lbannpy.data.reader import HDF5Reader, split_indices, validate_dataset
        from lbannpy.layers.base import LayerContext, Timer
        from lbannpy.layers.loss import Loss
        from lbannpy.model import Model
        from lbannpy.optim import make_optimizer

        cfg, world = self.cfg, self.world
        cfg = self.cfg = validate(cfg, ranks=world.size)
        tr = cfg["trainer"]
        self.batch_size = int(tr["batch_size"])
        self.seed = int(tr.get("seed", 0))
        self.dtype = tr.get("dtype", "float32")
        out = cfg["output"]
        self.out_dir = out.get("dir", "run")
        self.log_every = int(out.get("log_every", 1))
        self.timer = Timer(events=[])  # cleared every step unless tracing
        self.ctx = LayerContext(world, self.rt.xp, self.dtype, self.seed,
                                overlap=bool(cfg["comm"].get("overlap", True)), timer=self.timer)
        self.watchdog = Watchdog(float(tr.get("watchdog_s", 0) or 0), world.rank, world.abort)
        self.ctx.progress = self.watchdog.progress

        mspec = cfg["model"]
        data = cfg["data"]
        train = data["train"]
        if cfg["parallel"].get("strategy") == "auto":
            cfg["parallel"] = self._auto_strategy(cfg)
        self.model = Model(mspec, self.batch_size, self.ctx, cfg.get("parallel"))
        in_shape = self.model.input_shape
        loss_kind = mspec.get("loss", "cross_entropy")
        label_shape = (self.batch_size,) + tuple(in_shape[2:]) if loss_kind == "pixel_cross_entropy" else None
        self.loss = Loss(loss_kind, self.ctx, self.model.output.out_shape, self.model.output.out_dist,
                         label_shape)
        info = validate_dataset(train["path"], train["inputs"], train["labels"],
                                expected_channels=in_shape[1], expected_spatial=in_shape[2:])
        # train/validation split: a fraction of the file (same on every rank), or a file of its own
        val = data.get("validation") or {}
        if val.get("fraction"):
            train_idx, val_idx = split_indices(info.num_samples, float(val["fraction"]), self.seed)
        else:
            train_idx, val_idx = np.arange(info.num_samples), None
        if len(train_idx) < self.batch_size:
            raise UserError(f"data.train: {len(train_idx)} training samples in {train['path']} are fewer than "
                            f"trainer.batch_size {self.batch_size}; lower the batch size")
        common = dict(inputs=train["inputs"], labels=train["labels"], dist=self.model.input_dist,
                      rank=world.rank, batch_size=self.batch_size, label_dist=self.loss.label_dist,
                      comm=world, expected_channels=in_shape[1], expected_spatial=in_shape[2:])
        depth = int(data.get("prefetch", 2))
        self.reader = HDF5Reader(train["path"], seed=self.seed, shuffle=True, indices=train_idx,
                                 prefetch=depth > 0, depth=max(depth, 1), **common)
        self.val_reader = None
        if val.get("path"):
            self.val_reader = HDF5Reader(val["path"], seed=self.seed, shuffle=False, prefetch=False, **common)
        elif val_idx is not None and len(val_idx) >= self.batch_size:
            self.val_reader = HDF5Reader(train["path"], seed=self.seed, shuffle=False, indices=val_idx,
                                         prefetch=False, **common)
        elif val_idx is not None:
            raise UserError(f"data.validation.fraction holds out {len(val_idx)} samples, fewer than "
                            f"trainer.batch_size {self.batch_size}; raise the fraction or lower the batch size")
        train_idx = self.reader.indices
        steps_per_epoch = len(train_idx) // self.batch_size
        if tr.get("steps"):
            self.total_steps = int(tr["steps"])
        else:
            self.total_steps = int(tr.get("epochs", 1)) * steps_per_epoch
        self.steps_per_epoch = steps_per_epoch
        self.eval_every = int(tr.get("eval_every", 0) or 0) or steps_per_epoch
        self.optimizer = make_optimizer(cfg["optimizer"], self.model.params, self.total_steps)
        # gradient reduction groups (collective: created in parameter order on every rank), and the
        # overlap engine that reduces them in fixed-order buckets during backprop
        from lbannpy.comm.overlap import OverlapEngine

        cc = cfg["comm"]
        # replicated gradients (Lee et al.'s f) for the first replicate_fc fully-connected layers: their
        # weights are not in the buckets; each is updated just before its next forward
        fcs = [layer for layer in self.model.layers if layer.type == "fc"]
        f = int(cc.get("replicate_fc", 0) or 0)
        if f > len(fcs):
            raise UserError(f"comm.replicate_fc = {f} but the model has {len(fcs)} fully-connected layer(s) "
                            f"({', '.join(l.name for l in fcs) or 'none'}); use at most {len(fcs)}")
        self.replicated = fcs[:f]
        for layer in self.replicated:  # collective: the same layers in the same order on every rank
            layer.replicate_gradients()
        self._pending_t: dict[str, int] = {}  # replicated layer -> optimizer step its gradients belong to
        skip = {id(p) for layer in self.replicated for p in layer.params}
        synced = [p for p in self.model.params if id(p) not in skip]
        self.grad_comms = [self.ctx.block_comm(p.dist, p.reduce_dims) for p in synced]
        k = int((cc.get("chunks") or {}).get("k", 0) or 0)
        self.engine = OverlapEngine(
            synced, self.grad_comms, bucket_bytes=int(float(cc["bucket_mb"]) * 2**20),
            first_bucket_bytes=int(float(cc["first_bucket_mb"]) * 2**20), overlap=bool(cc["overlap"]),
            chunk_layers=k or None, thread_multiple=getattr(self.rt, "thread_multiple", True), xp=self.rt.xp)
        ck = cfg.get("checkpoint") or {}
        self.ckpt_dir = ck.get("dir", "ckpt")
        self.ckpt_every = int(ck.get("every_steps", 0) or 0)
        self.step = 0
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        if resume:
            self._resume()
        if world.rank == 0:
            os.makedirs(self.out_dir, exist_ok=True)

    def _auto_strategy(self, cfg: dict) -> dict:
        """``parallel.strategy: auto``: rank 0 runs the selector (its search has a time budget, so ranks
        could disagree if each ran it) and broadcasts the per-layer degrees to every rank."""
        world = self.world
        par = cfg["parallel"]
        layers, err = None, None
        if world.rank == 0:
            from lbannpy.strategy.planner import PlanError, plan

            try:
                chosen = plan(cfg, world.size, par.get("machine") or "lassen", memory_gib=par.get("memory_gib"),
                              batch_size=self.batch_size, compare=False)
                layers = chosen.parallel_layers()
                sys.stderr.write(f"lbannpy.train: strategy auto on {world.size} rank(s), machine "
                                 f"{par.get('machine')}: predicted step {chosen.chosen.step_s * 1e3:.1f} ms\n")
            except (PlanError, ValueError, OSError) as exc:
                err = f"parallel.strategy auto: {exc}"
        layers, err = world.bcast_obj((layers, err))
        if err:
            raise UserError(err)
        return dict(par, layers=layers, strategy="manual")

    def _resume(self) -> None:
        from lbannpy import checkpoint

        # collective: parameters, optimizer state and layer state, each rank reading its own hyperslabs
        path, data = checkpoint.resume(self.world, self.ckpt_dir, self.model.params, self.optimizer,
                                       self.model.layers, self.rt.xp)
        if path is None:
            raise UserError(f"--resume: no checkpoint in {self.ckpt_dir}/ (checkpoint.dir); run without "
                            f"--resume to start from scratch")
        self.step = data["step"]
        meta = data["meta"]
        self.reader.load_state(meta["reader"])
        self.rows = meta.get("rows", [])
        self.evals = meta.get("evals", [])
        self.resumed_from = path

    # -- one step --------------------------------------------------------------------------------------
    def _batch_tensors(self, batch):
        from lbannpy.tensor import DistTensor

        xp = self.rt.xp
        x = DistTensor(xp.asarray(batch.inputs, dtype=self.ctx.dtype), self.model.input_shape,
                       self.model.input_dist, self.world.rank)
        return x, batch.labels

    def train_step(self):
        wd = self.watchdog
        t0 = time.perf_counter()
        wd.progress("waiting for data")
        batch = self.reader.next()
        t_io = time.perf_counter() - t0
        x, labels = self._batch_tensors(batch)
        self.model.set_train(True)
        self.optimizer.zero_grad()
        wd.progress("forward")
        logits = self.model.forward(x, before_layer=self._apply_replicated)
        wd.progress("loss")
        loss, metrics = self.loss.forward(logits, labels)
        wd.progress("backward")
        engine = self.engine
        engine.start_step()
        nrec = len(engine.records)
        t_bp = time.perf_counter()
        self.model.backward(self.loss.backward(), on_layer=engine.layer_done, input_grad=False)
        t_bp_end = time.perf_counter()
        wd.progress("gradient reduction and optimizer")
        lr = self.optimizer.lr
        engine.finish(on_bucket=self.optimizer.step_params)  # each bucket updated as soon as it is reduced
        for layer in self.replicated:  # their errors are still being gathered: updated before next forward
            self._pending_t[layer.name] = self.optimizer.t
        self.optimizer.finish_step()
        recs = engine.records[nrec:]
        comm_iv = [(s, e) for _, _, _, s, e in recs]
        t_comm = sum(e - s for s, e in comm_iv)
        from lbannpy.comm.overlap import hidden_fraction

        hidden = hidden_fraction(comm_iv, [(t_bp, t_bp_end)])
        # the span the hidden fraction is measured against, on the trace's layer track (the per-layer
        # backward events nest inside it)
        self.timer.span(("backward",), t_bp, t_bp_end, "compute")
        for b, nbytes, _, s, e in recs:
            self.timer.add(("bucket", f"{b}"), s, e, "gradcomm")
        self.step += 1
        dt = time.perf_counter() - t0
        wd.progress(f"step {self.step} done")
        row = {"step": self.step, "epoch": (self.step - 1) // max(self.steps_per_epoch, 1), **metrics,
               "lr": lr, "step_time_s": dt, "io_wait_s": t_io, "comm_time_s": t_comm,
               "hidden_comm_fraction": hidden, "hidden_comm_s": hidden * t_comm,
               "samples_per_s": self.batch_size / dt}
        if not self.trace and self.timer.events is not None:
            self.timer.events.clear()
        return row

    def _apply_replicated(self, layer) -> None:
        """Apply the late update of a replicated fully-connected layer (Lee et al., Algorithm 2, line 7)."""
        t = self._pending_t.pop(layer.name, None)
        if t is None:
            return
        self.watchdog.progress(f"replicated gradients of {layer.name}")
        t0 = time.perf_counter()
        params = layer.replicated_grads()
        self.timer.add((layer.name, "replicated_grad"), t0, time.perf_counter())
        self.optimizer.step_params(params, t=t)

    def flush_replicated(self) -> None:
        """Apply every pending replicated update now (before evaluation, checkpoints and the end of the
        run, which must see the weights of the steps taken so far)."""
        for layer in self.replicated:
            self._apply_replicated(layer)

    def _untimed(self, fn):
        """Run ``fn()`` with what it adds to the per-layer timer totals set aside: ``summary.json``'s per-layer
        times are means over the timed training steps only (no evaluation passes, no warm-up step)."""
        before = dict(self.timer.totals)
        try:
            return fn()
        finally:
            for k, v in self.timer.totals.items():
                d = v - before.get(k, 0.0)
                if d:
                    self._untimed_totals[k] = self._untimed_totals.get(k, 0.0) + d

    def evaluate(self) -> dict:
        if self.val_reader is None:
            return {}
        self.flush_replicated()
        self.model.set_train(False)
        totals, n = {}, 0
        for _ in range(self.val_reader.steps_per_epoch):  # unshuffled: every pass reads the same batches
            self.watchdog.progress("evaluation")
            batch = self.val_reader.next()
            x, labels = self._batch_tensors(batch)
            _, m = self.loss.forward(self.model.forward(x), labels)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
            n += 1
        self.model.set_train(True)
        return {k: v / max(n, 1) for k, v in totals.items()}

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        self.watchdog.start()
        rank0 = self.world.rank == 0
        bar = None
        if rank0 and not self.quiet:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True,
                       mininterval=0.5, file=sys.stderr)
        t_start = time.perf_counter()
        first = self.step
        self._untimed_totals: dict = {}
        # the run's first step allocates buffers and workspaces: left out of the per-layer means when others
        # follow it (summary.json "layers")
        self._warmup_steps = 1 if self.total_steps - first > 1 else 0
        try:
            while self.step < self.total_steps:
                row = self._untimed(self.train_step) if self.step < first + self._warmup_steps \
                    else self.train_step()
                if self.step % self.log_every == 0 or self.step == self.total_steps:
                    self.rows.append(row)
                if (self.val_reader is not None and self.eval_every and self.step % self.eval_every == 0
                        and self.step < self.total_steps):
                    self.evals.append({"step": self.step, **self._untimed(self.evaluate)})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", sps=f"{row['samples_per_s']:.1f}")
                if self.ckpt_every and self.step % self.ckpt_every == 0 and self.step < self.total_steps:
                    self.save_checkpoint()
            self.flush_replicated()
            final_eval = self._untimed(self.evaluate)
            if final_eval:
                self.evals.append({"step": self.step, **final_eval})
            if self.ckpt_every or self.cfg.get("checkpoint", {}).get("dir"):
                self.save_checkpoint()
        finally:
            if bar is not None:
                bar.close()
            self.watchdog.stop()
            self.engine.close()
            self.reader.close()
            if self.val_reader is not None:
                self.val_reader.close()
        wall = time.perf_counter() - t_start
        self.write_outputs(wall, self.step - first, final_eval)

    def save_checkpoint(self) -> None:
        from lbannpy import checkpoint

        self.flush_replicated()
        self.watchdog.progress("checkpoint")
        meta = {"reader": self.reader.state(), "rows": self.rows, "evals": self.evals}
        # collective: each unique block of the parameters, optimizer and layer state written once
        checkpoint.save(self.world, self.ckpt_dir, self.step, self.model.params, self.optimizer, meta,
                        self.model.layers)

    def write_outputs(self, wall: float, steps_run: int, final_eval: dict) -> None:
        world = self.world
        per_layer = {}
        timed_steps = max(steps_run - getattr(self, "_warmup_steps", 0), 1)
        untimed = getattr(self, "_untimed_totals", {})
        for (name, phase), t in self.timer.totals.items():
            t -= untimed.get((name, phase), 0.0)
            if t > 0:
                per_layer.setdefault(name, {})[phase] = t / timed_steps
        # per-layer and communication times: the slowest rank's (what bounds the step)
        gathered = world.allgather_obj(per_layer)
        if self.trace:
            self.write_trace()
        if world.rank != 0:
            return
        merged: dict = {}
        for d in gathered:
            for name, phases in d.items():
                for ph, t in phases.items():
                    merged.setdefault(name, {})[ph] = max(merged.get(name, {}).get(ph, 0.0), t)
        times = [r["step_time_s"] for r in self.rows[-max(steps_run, 0):]] if steps_run else []
        io = [r["io_wait_s"] for r in self.rows[-max(steps_run, 0):]] if steps_run else []
        comm = [r["comm_time_s"] for r in self.rows[-max(steps_run, 0):]] if steps_run else []
        hidden = [r["hidden_comm_s"] for r in self.rows[-max(steps_run, 0):]] if steps_run else []
        last = self.rows[-1] if self.rows else {}
        summary = {
            "steps": self.step,
            "ranks": world.size,
            "batch_size": self.batch_size,
            "dtype": self.dtype,
            "final": {k: v for k, v in last.items() if k not in ("step_time_s", "io_wait_s", "comm_time_s",
                                                               "hidden_comm_s", "samples_per_s")},
            "validation": final_eval,
            "median_step_s": float(np.median(times)) if times else None,
            "io_wait_s": float(np.median(io)) if io else None,
            "io_wait_fraction": float(np.sum(io) / np.sum(times)) if times else None,
            "comm_time_s": float(np.median(comm)) if comm else None,
            # over the whole run, weighted by time: the hidden part of all gradient communication
            "hidden_comm_fraction": (float(np.sum(hidden) / np.sum(comm)) if comm and np.sum(comm) > 0
                                     else (0.0 if comm else None)),
            "buckets": _bucket_summary(self.engine),
            "wall_s": wall,
            "layers": merged,
            "distributions": {l.name: str(l.out_dist) for l in self.model.layers},
        }
        os.makedirs(self.out_dir, exist_ok=True)
        keys = []
        for r in self.rows:
            for k in r:
                if k not in keys:
                    keys.append(k)
        with open(os.path.join(self.out_dir, "metrics.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in self.rows:
                w.writerow(r)
        with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        write_plot(os.path.join(self.out_dir, "loss.png"), self.rows, self.evals)
        fin = summary["final"]
        shown = ", ".join(f"{k} {fin[k]:.4f}" for k in ("loss", "accuracy", "iou", "miou") if k in fin)
        val = ", ".join(f"{k} {v:.4f}" for k, v in final_eval.items())
        sys.stdout.write(f"lbannpy.train: {self.step} steps on {world.size} rank(s); {shown}"
                         + (f"; validation {val}" if val else "")
                         + (f"; median step {summary['median_step_s'] * 1e3:.1f} ms" if times else "")
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


def _bucket_summary(engine) -> list[dict]:
    out = []
    for b in engine.buckets:
        times = [e - s for i, _, _, s, e in engine.records if i == b.index]
        out.append({"index": b.index, "bytes": int(b.nbytes), "params": [p.name for p in b.params],
                    "median_s": float(np.median(times)) if times else None})
    return out


if __name__ == "__main__":
    sys.exit(main())
