"""The step loop: :class:`Trainer` wires the parts together and runs steps, evaluations and checkpoints.

Where things go: the data checks of a batch (labels in range, the file unchanged: in the reader) are agreed
on by every rank in :meth:`Trainer.next_batch`; a per-step check (non-finite loss) at the end of
:meth:`Trainer.train_step`; a stop request (SIGTERM, SIGUSR1: :mod:`.signals`) is voted on by all ranks
after each step in :meth:`Trainer.run` (then checkpoint, metrics, :class:`~.errors.Stopped`); initial
weights (``--init``) or a step-0 checkpoint in :meth:`Trainer.setup` after ``_resume``; the batch upload to
the device in :meth:`Trainer.upload`.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from . import ckpt
from .build import build, start_checks
from .clock import Clock, make_clock
from .gradsync import GradSync
from .graphloop import GraphRun, choose
from .graphstep import CaptureFailed, Decision
from .step import EAGER, Backprop, StepOut, StepPolicy
from . import health, kernels, outdirs
from .errors import DataStop, NonFinite, Stopped, UserError, WriteFailed, agree_on_data, user_errors
from .report import Report
from .signals import StopReason, StopVote, signal_name
from .watchdog import Watchdog
from lbannpy.config.run import run_config
from lbannpy.layers.context import LayerContext
from lbannpy.layers.timer import Timer
from lbannpy.data.upload import stage_batches
from lbannpy.export import init_from
from lbannpy.tensor import DistTensor
from lbannpy.backend import is_gpu_array
from lbannpy.comm.overlap import hidden_fraction
from lbannpy.backend import to_numpy
from lbannpy.checkpoint import CheckpointError, candidates
from .report import progress_bar


# a checkpoint of at least this estimated size is announced and timed on stderr (rank 0, not --quiet): a
# write of hundreds of MiB takes seconds to minutes on a parallel file system
CKPT_PROGRESS_BYTES = 64 << 20


class Trainer:
    def __init__(self, cfg: dict, rt, trace: bool = False, quiet: bool = False):
        self.cfg = cfg
        self.rt = rt
        self.world = rt.world
        self.trace = trace
        self.quiet = quiet
        self.clock = Clock()
        self.step = 0
        self.resumed_from = None  # the checkpoint path --resume started from
        self.signals = None  # a SignalWatch (set by the entry point): stop requests end the loop
        self.graphs = None  # a graphloop.GraphRun when the training step is captured
        self.graph_untimed_steps = 0  # captured or replayed steps: no per-layer times
        self.step_mode = None  # the graphstep.Decision of set-up

    # -- set-up ------------------------------------------------------------------------------------------
    def setup(self, resume: bool = False, force: bool = False, force_new_run: bool = False) -> None:
        """Who calls: every rank (builds group communicators: collective). ``force``: resume from a
        checkpoint of another computation (``--resume --force``); ``force_new_run``: a fresh run moves
        another run's checkpoints in its checkpoint directory aside instead of refusing."""
        world = self.world
        # the memory estimate is checked in build(), under the distributions the run uses (strategy auto's
        # choice included), before the model or a reader allocates anything
        cfg = self.cfg = start_checks(self.cfg, world.size)  # what check_run (validate) checks first
        # the settings as one typed value, built once: nothing below reads the tree for a setting
        run = self.run_cfg = run_config(cfg)
        # overflow and invalid operations are found by the health checks (one line naming the step and
        # place), not by NumPy warnings on stderr from every rank
        import numpy as np

        np.seterr(over="ignore", invalid="ignore", divide="ignore")
        tr = run.trainer
        # per-layer, halo and step times on the device's clock (CUDA events on a GPU: host time there
        # measures kernel launches)
        self.clock = make_clock(self.rt.device, self.rt.xp)
        self.timer = Timer(events=[], clock=None if self.clock.name == "host" else self.clock)
        self.ctx = LayerContext(world, self.rt.xp, tr.dtype, tr.seed, overlap=run.comm.overlap,
                                timer=self.timer)
        # set-up reads files and builds communicators: a rank stuck there must not hang the others
        self.watchdog = Watchdog(tr.watchdog_s, world.rank, world.abort).start()
        self.watchdog.progress("set-up: model, data and communicators")
        self._kernel_machine = kernels.choose(run, self.ctx, self.rt.device)
        parts = build(run, self.ctx, world)
        self.settings = s = parts.settings
        self.model, self.loss, self.optimizer = parts.model, parts.loss, parts.optimizer
        self.reader, self.val_reader = parts.reader, parts.val_reader
        self.memory = parts.memory
        if world.rank == 0 and not self.quiet:
            kernels.say(self.model, self.ctx, self._kernel_machine)
        self._bar = None  # the progress bar (or plain lines) of rank 0 while run() goes on
        if world.rank == 0 and not self.quiet and self.memory is not None:
            print(f"lbannpy.train: memory: {self.memory.text()}", flush=True)
        # batches converted to the compute dtype in the reader's thread; on a GPU also staged in pinned
        # memory there and uploaded one ahead, asynchronously
        self.reader = stage_batches(self.reader, self.rt.xp, self.ctx.dtype, self.loss.num_classes,
                                    gpu=self.rt.device == "gpu")
        # the step mode first: a captured run's gradient synchronisation records no timing events
        self.step_mode = choose(run, self.rt, world, self.model, self.optimizer, self.trace)
        self.sync = GradSync(run.comm, self.model, self.ctx, self.rt, self.optimizer, self.timer,
                             self.clock, self.watchdog.progress, shard_state=run.optimizer.shard_state,
                             captured=self.step_mode.mode == "graph")
        self.graphs = GraphRun(self) if self.step_mode.mode == "graph" else None
        self.report = Report(world, s.out_dir, self.timer, self.trace, clock=self.clock.name)
        self.record = ckpt.computation(cfg)
        if resume:
            self.watchdog.progress("set-up: reading the checkpoint (--resume)")
            self._resume(force)
        elif run.model.init:
            init_from(run.model.init, self.model, self.rt.xp)
        self.watchdog.progress("set-up done")
        if world.rank == 0:  # no collective after this: the entry point gathers every rank's set-up error
            owner = outdirs.this_run(run.model.name)
            outdirs.check_dir(s.out_dir, "output.dir")
            outdirs.lock_dir(s.out_dir, "output.dir", owner)
            outdirs.check_dir(s.ckpt_dir, "checkpoint.dir", outdirs.checkpoint_bytes(self.model))
            outdirs.lock_dir(s.ckpt_dir, "checkpoint.dir", owner)
            if not resume:  # a fresh run owns its checkpoint directory, before a metrics row is written
                outdirs.claim_checkpoint_dir(s.ckpt_dir, "checkpoint.dir", force_new_run)
            self.report.start_metrics()

    def _resume(self, force: bool) -> None:
        path, self.step, meta = ckpt.resume(self.world, self.settings.ckpt_dir, self.model, self.optimizer,
                                            self.reader, self.rt.xp, self.record, force)
        self.report.restore(meta)
        self.resumed_from = path

    # -- one step ----------------------------------------------------------------------------------------
    def next_batch(self, reader):
        """Who calls: every rank (collective). The reader's next batch; a data problem on any rank (a label
        out of range, the data file changed) raises :class:`~.errors.DataStop` on every rank, before any
        rank computes with the batch."""
        err = None
        try:
            batch = reader.next()
        except user_errors() as exc:
            batch, err = None, f"{exc}" or type(exc).__name__
        agree_on_data(self.world, err)
        return batch

    def upload(self, batch):
        """The batch's input as a distributed tensor on the device, and its labels."""

        inputs = batch.inputs  # already on the device from a DeviceUploader
        if not is_gpu_array(inputs):
            inputs = self.rt.xp.asarray(inputs, dtype=self.ctx.dtype)
        x = DistTensor(inputs, self.model.input_shape, self.model.input_dist, self.world.rank)
        return x, batch.labels

    def train_step(self) -> dict:
        """One optimizer step, eager or captured (the step's device part: :meth:`step_body`, run directly
        or by the :class:`~.graphloop.GraphRun`; what differs: :mod:`.step`); returns its metrics row."""
        wd, clock, sync, st = self.watchdog, self.clock, self.sync, self.settings
        t0 = clock.now()
        h0 = time.perf_counter()
        wd.progress("waiting for data")
        batch = self.next_batch(self.reader)
        t_io = time.perf_counter() - h0  # the host's wait for data, whatever the clock
        x, labels = self.upload(batch)
        lr = self.optimizer.lr
        self.model.set_train(True)
        logged = (self.step + 1) % st.log_every == 0 or self.step + 1 == st.total_steps
        out, how = self._step_device(x.local, labels, logged)
        if how != "eager":
            self.graph_untimed_steps += 1  # captured or replayed: no per-layer times
        bp = out.backprop
        # bucket intervals: host times measured against the host's backward, or (GPU + NCCL) CUDA events
        # that are read below on logged steps only, against the backward's marks on the same clock; a step
        # that marked nothing (captured, replayed) measured no communication
        device_buckets = sync.bucket_clock != "host"
        t_comm = hidden = None
        if bp is not None and not device_buckets:
            comm_iv = [(s, e) for _, _, _, s, e in bp.records]
            t_comm = sum(e - s for s, e in comm_iv)
            hidden = hidden_fraction(comm_iv, [(bp.h0, bp.h1)])
        self.step += 1
        t_end = clock.now()
        wd.progress(f"step {self.step} done")
        metrics, timing = {}, {}
        if logged:
            # a logged step: the device's marks and the reduced loss statistics come to the host here, and
            # only here (an unlogged step makes no host synchronisation)
            self.timer.settle()
            clock.settle()
            dt = clock.seconds(t_end) - clock.seconds(t0)
            if bp is not None and device_buckets:  # the marks are settled: the step's bucket events too
                comm_iv = sync.bucket_intervals(bp.mark, clock.seconds)
                t_comm = sum(e - s for s, e in comm_iv)
                hidden = hidden_fraction(comm_iv, [(clock.seconds(bp.t0), clock.seconds(bp.t1))])
            metrics, timing = self.logged_metrics(out.stats, out.grad_sq, x, dt,
                                                  check_loss=self.rt.xp is not np)
        self.report.end_step()
        return self.metrics_row(lr, metrics, timing, t_io, t_comm, hidden)

    def _step_device(self, x_local, labels, logged: bool):
        """The step's device part, ``(StepOut, how)``: eager, or by the captured run. A capture that failed
        (every rank alike): ``on`` stops the run; ``auto`` says so in one line and runs this step (the same
        batch) and every later one eagerly."""
        if self.graphs is None:
            return self.step_body(x_local, labels, EAGER, logged), "eager"
        try:
            return self.graphs.run(x_local, labels, logged)
        except CaptureFailed as exc:
            asked = self.step_mode.asked
            if asked == "on":
                raise UserError(f"runtime.cuda_graph on: the capture of step {self.step + 1} failed: {exc}")
            self.step_mode = Decision("eager", asked, f"the capture of step {self.step + 1} failed: {exc}")
            self.graphs = None
            if self.world.rank == 0:
                self.say(self.step_mode.line())
            return self.step_body(x_local, labels, EAGER, logged), "eager"

    def step_body(self, x_local, labels, policy: StepPolicy, logged: bool) -> StepOut:
        """What a step does on the device, and what a capture records: forward, loss statistics,
        backward, gradient reduction, optimizer update, and (``policy.wants_norm``) the squared gradient
        norm. ``policy.timed``: the backward pass and the buckets are marked (:class:`~.step.Backprop`)."""
        wd, clock, sync, model = self.watchdog, self.clock, self.sync, self.model
        x = DistTensor(x_local, model.input_shape, model.input_dist, self.world.rank)
        self.optimizer.zero_grad()
        wd.progress("forward")
        logits = model.forward(x, before_layer=sync.before_forward)
        wd.progress("loss")
        stats = self.loss.forward_stats(logits, labels)  # stays on the device, reduced there
        if self.rt.xp is np:
            # before backward and the update, so the parameters stay those of the last good step; the
            # statistics are already host numbers here. On a GPU the check runs where the loss reaches the
            # host anyway (logged steps), so an unlogged step makes no host synchronisation
            health.check_loss(self.world, self.step + 1, self.loss.metrics(stats)[0], model, x_local,
                              self.rt.xp)
        wd.progress("backward")
        mark = sync.start_backward()
        if policy.timed:
            t_bp, h_bp = clock.now(), time.perf_counter()
        model.backward(self.loss.backward(), on_layer=sync.on_layer, input_grad=False)
        if policy.timed:
            t_bp_end, h_bp_end = clock.now(), time.perf_counter()
        wd.progress("gradient reduction and optimizer")
        recs = sync.finish(mark)
        bp = None
        if policy.timed:
            bp = Backprop(mark, t_bp, t_bp_end, h_bp, h_bp_end, recs)
            # the span the hidden fraction is measured against, on the trace's layer track (the per-layer
            # backward events nest inside it)
            self.timer.span(("backward",), t_bp, t_bp_end, "compute")
            if self.timer.clock is None:  # the trace has one clock: buckets join it when it is the host's
                for b, _, _, s, e in recs:
                    self.timer.add(("bucket", f"{b}"), s, e, "gradcomm")
        # stays on the device until the host reads the statistics
        grad_sq = sync.grad_norm_sq() if policy.wants_norm(logged) else None
        return StepOut(stats, grad_sq, bp)

    def logged_metrics(self, stats, grad_sq, x, dt: float, check_loss: bool = True) -> tuple[dict, dict]:
        """A logged step's metrics (loss statistics and gradient norm, read in one transfer and checked
        for non-finite values on every rank) and timing columns."""
        loss, metrics, grad_norm = self.read_stats(stats, grad_sq)
        if check_loss:
            health.check_loss(self.world, self.step, loss, self.model, x.local, self.rt.xp)
        health.check_grad_norm(self.world, self.step, grad_norm, self.model, self.rt.xp)
        metrics["grad_norm"] = grad_norm
        return metrics, {"step_time_s": dt, "samples_per_s": self.settings.batch_size / dt}

    def metrics_row(self, lr: float, metrics: dict, timing: dict, t_io: float, t_comm: float | None,
                    hidden: float | None) -> dict:
        """One metrics row of the step just taken, in the columns' order. ``t_comm`` and ``hidden`` are
        None when the step did not measure them (captured and replayed steps): null, not zero."""
        st = self.settings
        row = {"step": self.step, "epoch": (self.step - 1) // max(st.steps_per_epoch, 1), **metrics,
               "lr": lr, **timing, "io_wait_s": t_io, "comm_time_s": t_comm, "hidden_comm_fraction": hidden,
               "hidden_comm_s": None if t_comm is None else hidden * t_comm}
        if timing:
            row["samples_per_s"] = row.pop("samples_per_s")  # the last column, as before
        return row

    def read_stats(self, stats, grad_sq) -> tuple[float, dict, float]:
        """The loss statistics and the squared gradient norm to the host in one transfer (the one host
        synchronisation of a logged step): ``(loss, metrics, gradient norm)``."""
        host = to_numpy(self.rt.xp.concatenate([stats.reshape(-1), grad_sq]))
        loss, metrics = self.loss.metrics(host[:-1])
        return loss, metrics, float(np.sqrt(host[-1]))

    def evaluate(self) -> dict:
        if self.val_reader is None:
            return {}
        self.sync.flush()
        self.model.set_train(False)
        totals, n = {}, 0
        for _ in range(self.val_reader.steps_per_epoch):  # unshuffled: every pass reads the same batches
            self.watchdog.progress("evaluation")
            x, labels = self.upload(self.next_batch(self.val_reader))
            _, m = self.loss.forward(self.model.forward(x), labels)
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
            n += 1
        self.model.set_train(True)
        return {k: v / max(n, 1) for k, v in totals.items()}

    def save_checkpoint(self) -> None:
        self.sync.flush()
        self.watchdog.progress("checkpoint")
        health.check_params(self.world, self.step, self.model, self.rt.xp)
        s = self.settings
        size = outdirs.checkpoint_bytes(self.model)
        # every rank looks at its own file system (node-local or shared), and all agree before writing
        short = [w for w in self.world.allgather_obj(outdirs.free_space_problem(s.ckpt_dir, size)) if w]
        if short:
            newest = candidates(s.ckpt_dir)[:1]
            raise WriteFailed(f"the checkpoint of step {self.step} was not written: {short[0]}; the newest "
                              f"complete checkpoint is {newest[0] if newest else 'none'}")
        loud = size >= CKPT_PROGRESS_BYTES and self.world.rank == 0 and not self.quiet
        if loud:
            self.say(f"step {self.step}: writing a checkpoint of about {size / 2**20:.0f} MiB into "
                      f"{s.ckpt_dir}/")
        t0 = time.perf_counter()
        try:
            ckpt.save(self.world, s.ckpt_dir, self.step, self.model, self.optimizer, self.reader,
                      self.report.rows, self.report.evals, self.record, s.ckpt_keep)
        except CheckpointError as exc:  # raised on every rank alike
            newest = candidates(s.ckpt_dir)[:1]
            raise WriteFailed(f"the checkpoint of step {self.step} could not be written ({exc}); the newest "
                              f"complete checkpoint is {newest[0] if newest else 'none'}") from None
        if loud:
            dt = time.perf_counter() - t0
            rate = size / 2**20 / max(dt, 1e-9)
            self.say(f"step {self.step}: checkpoint written in {dt:.1f} s ({rate:.0f} MiB/s)")

    def say(self, msg: str) -> None:
        """One line on stderr that leaves a terminal's progress bar intact."""
        bar = self._bar
        if bar is not None and hasattr(bar, "write"):
            bar.write(f"lbannpy.train: {msg}", file=sys.stderr)
        else:
            sys.stderr.write(f"lbannpy.train: {msg}\n")
            sys.stderr.flush()

    # -- the loop ----------------------------------------------------------------------------------------
    def _after_step(self, row: dict, bar) -> None:
        s, rep = self.settings, self.report
        if self.step % s.log_every == 0 or self.step == s.total_steps:
            rep.add_row(row)
        if (self.val_reader is not None and s.eval_every and self.step % s.eval_every == 0
                and self.step < s.total_steps):
            rep.add_eval(self.step, rep.untimed(self.evaluate))
        if bar is not None:
            bar.update(1)
            if "loss" in row:  # a logged step
                bar.set_postfix(loss=f"{row['loss']:.4f}", sps=f"{row['samples_per_s']:.1f}")
        if s.ckpt_every and self.step % s.ckpt_every == 0 and self.step < s.total_steps:
            self.save_checkpoint()

    def _progress_bar(self):
        if self.world.rank != 0 or self.quiet:
            return None
        return progress_bar(self.settings.total_steps, self.step)

    def run(self) -> None:
        s, rep = self.settings, self.report
        self.watchdog.start()
        bar = self._bar = self._progress_bar()
        t_start = time.perf_counter()  # the run's wall time is the host's
        first = self.step
        # the run's first step allocates buffers and workspaces: left out of the per-layer means when others
        # follow it (summary.json "layers")
        rep.warmup_steps = 1 if s.total_steps - first > 1 else 0
        sig = self.signals
        vote = StopVote(self.world)
        stop = 0
        # a NonFinite, DataStop or WriteFailed (every rank alike): the run stops at that step after writing
        # the metrics
        bad = None
        final_eval: dict = {}
        try:
            if sig is not None:
                sig.graceful = True
            # a step-0 checkpoint on request: here, not in set-up, whose errors are agreed on before any
            # collective that follows it
            if self.run_cfg.checkpoint.at_start and self.step == 0:
                self.save_checkpoint()
            while self.step < s.total_steps:
                try:
                    row = rep.untimed(self.train_step) if self.step < first + rep.warmup_steps \
                        else self.train_step()
                    self._after_step(row, bar)
                except (NonFinite, DataStop, WriteFailed) as exc:  # every rank alike: metrics, then stop
                    bad = exc
                    break
                signum = sig.requested if sig is not None else 0
                mine = StopReason.SIGNAL if signum else StopReason.GO_ON
                if rep.append_failed:  # rank 0 could not append to metrics.csv: every rank stops
                    mine = StopReason.METRICS_WRITE_FAILED
                agreed = vote.post(mine, signum)
                if agreed.reason is StopReason.METRICS_WRITE_FAILED:
                    failed = rep.append_failed or "on rank 0"
                    newest = candidates(s.ckpt_dir)[:1]
                    bad = WriteFailed(f"{s.out_dir}/metrics.csv could not be written ({failed}); the run "
                                      f"stopped at step {self.step}; the newest complete checkpoint is "
                                      f"{newest[0] if newest else 'none'}")
                    break
                if agreed.reason is StopReason.SIGNAL:
                    stop = agreed.signum
                    break
            vote.drain()  # a request during the last step: the run is complete anyway
            self.sync.flush()
            if not stop and bad is None:
                try:
                    final_eval = rep.untimed(self.evaluate)
                except DataStop as exc:  # a bad validation batch: the training outputs are still written
                    bad = exc
                if final_eval:
                    rep.add_eval(self.step, final_eval)
            if bad is None and (s.ckpt_at_end or stop):
                try:
                    self.save_checkpoint()
                except (NonFinite, WriteFailed) as exc:
                    bad = exc
        finally:
            if bar is not None:
                bar.close()
            self.watchdog.stop()
            self.sync.close()
            self.reader.close()
            if self.val_reader is not None:
                self.val_reader.close()
        failed = self.write_outputs(time.perf_counter() - t_start, self.step - first, final_eval)
        if failed:
            failed = f"{self.settings.out_dir}/ outputs could not be written ({failed})"
            bad = WriteFailed(f"{bad}; {failed}" if isinstance(bad, WriteFailed) else failed) \
                if not isinstance(bad, (NonFinite, DataStop)) else bad
        if sig is not None:
            sig.finished()
        if bad is not None:
            raise bad
        if stop:
            raise Stopped(signal_name(stop), self.step, self.settings.ckpt_dir, self.settings.out_dir)

    def write_outputs(self, wall: float, steps_run: int, final_eval: dict) -> str | None:
        """Who calls: every rank (collective). Returns why an output could not be written, or None."""
        s = self.settings
        run = {"steps": self.step, "ranks": self.world.size, "batch_size": s.batch_size, "dtype": s.dtype,
               "wall_s": wall, "model": self.run_cfg.model.name}
        if self.memory is not None:
            run["memory_estimate"] = self.memory.as_dict()
        run["kernels"] = kernels.layer_sets(self.model)  # summary.json's layers.<name>.kernels
        if self.step_mode is not None:
            g = self.graphs
            run["cuda_graph"] = dict(self.step_mode.as_dict(), captures=g.captures if g else 0,
                                     replays=g.replays if g else 0)
        self.report.bucket_clock = self.sync.bucket_clock
        # per-layer means over the steps that timed their layers (a replayed step runs no layer's Python)
        self.report.warmup_steps += self.graph_untimed_steps
        return self.report.write(run, steps_run, final_eval, self.sync.bucket_summary(),
                                 {lay.name: str(lay.out_dist) for lay in self.model.layers})
