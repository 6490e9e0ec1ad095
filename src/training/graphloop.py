"""The trainer's side of ``runtime.cuda_graph``: the run's step mode at set-up (:func:`choose`) and the
device part of a captured run's steps (:class:`GraphRun`), which
:meth:`lbannpy.training.loop.Trainer.train_step` runs instead of an eager body. What may be captured and
how a graph is made: :mod:`.graphstep`; what differs between an eager step and a captured one: :mod:`.step`.
"""
from __future__ import annotations

import sys

from .errors import UserError
from .graphstep import CaptureFailed, CaptureRefused, Decision, StepGraphs, agreed, decide
from .step import CAPTURED, EAGER


def choose(run, rt, world, model, optimizer, trace: bool) -> Decision:
    """Who calls: every rank, at set-up, before the gradient synchronisation is built (collective on a GPU:
    the ranks agree on one reason). Rank 0 prints the decision's line on a GPU. ``on`` for a step that
    cannot be captured raises a :class:`UserError` naming why."""
    try:
        mode = decide(run, rt.device, getattr(rt, "backend", ""), rt.xp, model, optimizer, trace, world=world)
    except CaptureRefused as exc:
        raise UserError(str(exc)) from None
    if rt.device == "gpu" and world.rank == 0:
        sys.stderr.write(f"lbannpy.train: {mode.line()}\n")
        sys.stderr.flush()
    return mode


class GraphRun:
    """The device part of a captured run's steps: every step on a non-blocking stream of the run's own
    (current from set-up on: the legacy default stream cannot be captured), eager while an input shape warms
    up, then captured once and replayed. A logged step reads the loss statistics and gradient norm the graph
    left on the device (one small transfer); an unlogged one makes no host synchronisation.

    Made after the gradient synchronisation, which a captured run builds with ``captured=True`` (no bucket
    timing events; replicated updates inside the step)."""

    def __init__(self, trainer):
        self.trainer = t = trainer
        xp = t.rt.xp
        stream = xp.cuda.Stream(non_blocking=True)
        ready = xp.cuda.Event(disable_timing=True)  # the set-up's work (weights, communicators) first
        ready.record(xp.cuda.get_current_stream())
        stream.wait_event(ready)
        stream.use()
        self.graphs = StepGraphs(xp, stream, agree=lambda err: agreed(t.world, err))
        table = t.optimizer.steps
        self._generation = None if table is None else table.generation

    def run(self, x_local, labels, logged: bool):
        """The device part of one step: ``(StepOut, how)``, ``how`` one of ``eager`` (a warm-up step, timed
        as any eager step), ``captured`` or ``replayed``. Raises :class:`~.graphstep.CaptureFailed` (every
        rank alike) with the optimizer's count back where it was: nothing of the step ran on the device."""
        t = self.trainer
        opt = t.optimizer
        if self.graphs.next(x_local, labels) == "eager":
            out, how = self.graphs.step(x_local, labels, lambda x, y: t.step_body(x, y, EAGER, logged))
        else:
            out, how = self._untimed(x_local, labels)
        if how == "replayed":  # the host's share of a replayed step: its count of the steps taken
            opt.count_replayed_step()
        table = opt.steps
        if table is not None and table.generation != self._generation:
            # the optimizer's step table was made anew (the run outgrew it): graphs read the old one
            self._generation = table.generation
            self.graphs.reset()
        return out, how

    def _untimed(self, x_local, labels):
        """A capture or a replay, with per-layer marks on the host's clock and set aside: a replay runs no
        layer's Python, and a capture's would be host times of launches."""
        t = self.trainer
        t_opt = t.optimizer.t
        try:
            with t.timer.host_marks():
                return t.report.untimed(
                    lambda: self.graphs.step(x_local, labels, lambda x, y: t.step_body(x, y, CAPTURED, True)))
        except CaptureFailed:
            t.optimizer.rewind(t_opt)  # the failed capture's body ran on the host only
            raise

    @property
    def captures(self) -> int:
        return self.graphs.captures

    @property
    def replays(self) -> int:
        return self.graphs.replays
