"""The trainer's side of ``runtime.cuda_graph``: the run's step mode at set-up (:func:`choose`) and the
training step of a captured run (:class:`GraphRun`), which :meth:`lbannpy.training.loop.Trainer.train_step`
hands over to. What may be captured and how a graph is made: :mod:`.graphstep`.
"""
from __future__ import annotations

import sys
import time

from lbannpy.tensor import DistTensor
from .errors import UserError
from .graphstep import CaptureFailed, CaptureRefused, Decision, StepGraphs, agreed, decide


def choose(trainer, cfg: dict):
    """Who calls: every rank, at set-up, after the gradient synchronisation is built (collective on a GPU:
    the ranks agree on one reason). Returns ``(Decision, GraphRun or None)``; rank 0 prints the decision's
    line on a GPU. ``on`` for a step that cannot be captured raises a :class:`UserError` naming why."""
    rt = trainer.rt
    try:
        mode = decide(cfg, rt.device, getattr(rt, "backend", ""), rt.xp, trainer.model, trainer.optimizer,
                      trainer.trace, world=trainer.world)
    except CaptureRefused as exc:
        raise UserError(str(exc)) from None
    if rt.device == "gpu" and trainer.world.rank == 0:
        sys.stderr.write(f"lbannpy.train: {mode.line()}\n")
        sys.stderr.flush()
    return mode, (GraphRun(trainer) if mode.mode == "graph" else None)


class GraphRun:
    """The steps of a captured run: every step on a non-blocking stream of the run's own (current from set-up
    on: the legacy default stream cannot be captured), eager while an input shape warms up, then captured
    once and replayed. A logged step reads the loss statistics and gradient norm the graph left on the device
    (one small transfer); an unlogged one makes no host synchronisation."""

    def __init__(self, trainer):
        t = self.trainer = trainer
        xp = t.rt.xp
        stream = xp.cuda.Stream(non_blocking=True)
        ready = xp.cuda.Event(disable_timing=True)  # the set-up's work (weights, communicators) first
        ready.record(xp.cuda.get_current_stream())
        stream.wait_event(ready)
        stream.use()
        self.graphs = StepGraphs(xp, stream, agree=lambda err: agreed(t.world, err))
        table = getattr(t.optimizer, "steps", None)
        self._generation = None if table is None else table.generation
        # layers that count steps on the host as well (e.g. for checkpoints) count the replayed ones here
        self._counters = [lay for lay in t.model.layers if hasattr(lay, "count_replayed_step")]
        # no bucket timing events: an event recorded during a capture is never recorded at a replay
        for bucket in t.sync.engine.buckets:
            bucket.timed = False
        t.sync.engine.clock = "host"
        # replicated fully-connected layers updated inside the step that gathered their gradients
        t.sync.use_captured_steps()

    def body(self, x_local, labels):
        """What a captured step does, on the device only: forward, loss statistics, backward, gradient
        reduction, optimizer update, the squared gradient norm. Returns ``(stats, grad_sq)``."""
        t = self.trainer
        sync, model = t.sync, t.model
        x = DistTensor(x_local, model.input_shape, model.input_dist, t.world.rank)
        t.optimizer.zero_grad()
        logits = model.forward(x, before_layer=sync.before_forward)
        stats = t.loss.forward_stats(logits, labels)
        mark = sync.start_backward()
        model.backward(t.loss.backward(), on_layer=sync.on_layer, input_grad=False)
        sync.finish(mark)
        return stats, sync.grad_norm_sq()

    def _failed(self, exc, t_opt: int, x_local, labels):
        """A capture that failed on some rank: ``on`` stops the run with the error; ``auto`` says so in one
        line, runs this step eagerly (with the same batch) and every later one too."""
        t = self.trainer
        asked = t.step_mode.asked
        if asked == "on":
            raise UserError(f"runtime.cuda_graph on: the capture of step {t.step + 1} failed: {exc}")
        t.step_mode = Decision("eager", asked, f"the capture of step {t.step + 1} failed: {exc}")
        t.graphs = None
        if t.world.rank == 0:
            t.say(t.step_mode.line())
        t.optimizer.t = t_opt  # the failed capture's body ran on the host only
        return self.body(x_local, labels)

    def _untimed(self, x_local, labels):
        """A capture or a replay: no per-layer times (a replay runs no layer's Python; a capture's would be
        host times of launches, and a timing event recorded in a capture is never recorded at a replay)."""
        t = self.trainer
        t.graph_untimed_steps += 1
        clock, t.timer.clock = t.timer.clock, None
        try:
            return t.report.untimed(lambda: self.graphs.step(x_local, labels, self.body))
        finally:
            t.timer.clock = clock

    def _count_replayed(self) -> None:
        """The host's share of a replayed step: its counts of the steps taken."""
        t = self.trainer
        t.optimizer.count_replayed_step()
        for layer in self._counters:
            layer.count_replayed_step()

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics row (the columns of an eager step's)."""
        t = self.trainer
        wd, clock, st = t.watchdog, t.clock, t.settings
        t0 = clock.now()
        h0 = time.perf_counter()
        wd.progress("waiting for data")
        batch = t.next_batch(t.reader)
        t_io = time.perf_counter() - h0
        x, labels = t.upload(batch)
        lr = t.optimizer.lr
        t.model.set_train(True)
        wd.progress("training step (CUDA graph)")
        t_opt = t.optimizer.t
        try:
            if self.graphs.next(x.local, labels) == "eager":  # per-layer times as any eager step's
                (stats, grad_sq), how = self.graphs.step(x.local, labels, self.body)
            else:
                (stats, grad_sq), how = self._untimed(x.local, labels)
        except CaptureFailed as exc:  # every rank alike, before any of the step ran on the device
            (stats, grad_sq), how = self._failed(exc, t_opt, x.local, labels), "eager"
        if how == "replayed":
            self._count_replayed()
        table = getattr(t.optimizer, "steps", None)
        if table is not None and table.generation != self._generation:
            # the optimizer's step table was made anew (the run outgrew it): graphs read the old one
            self._generation = table.generation
            self.graphs.reset()
        t.step += 1
        logged = t.step % st.log_every == 0 or t.step == st.total_steps
        t_end = clock.now()
        wd.progress(f"step {t.step} done")
        metrics, timing = {}, {}
        if logged:
            t.timer.settle()
            clock.settle()
            dt = clock.seconds(t_end) - clock.seconds(t0)
            metrics, timing = t.logged_metrics(stats, grad_sq, x, dt)
        t.report.end_step()
        return t.metrics_row(lr, metrics, timing, t_io)
