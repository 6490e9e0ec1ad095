"""What one training step computes, and the policy that says how it is run (eagerly, or captured into a
CUDA graph and replayed): :meth:`lbannpy.training.loop.Trainer.train_step` is the one step of both loops;
:meth:`~lbannpy.training.loop.Trainer.step_body` its device part, which a capture records.

The differences between the two ways are here and nowhere else:

* the timing source: an eager step marks its backward pass (the span the hidden fraction is measured
  against), its bucket intervals and its layers on the timer's clock; a captured or replayed step marks
  nothing on the device (a timing event recorded in a capture is never recorded at a replay), so its
  ``comm_time_s``, ``hidden_comm_fraction`` and ``hidden_comm_s`` are not measured (``None``: empty in
  ``metrics.csv``, ``null`` in ``summary.json``);
* what is read back: an eager step computes the squared gradient norm on logged steps only; a captured
  step computes it every step (the graph is the same for every step), and a logged one reads it;
* which counters advance: an eager step's Python advances the optimizer's host step count; a replayed
  step's runs no Python, so :class:`~lbannpy.training.graphloop.GraphRun` counts it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepPolicy:
    """``timed``: the step marks its backward pass and bucket intervals (eager); ``norm_every_step``: the
    squared gradient norm is computed on every step, not only on logged ones (a captured step)."""

    name: str
    timed: bool
    norm_every_step: bool

    def wants_norm(self, logged: bool) -> bool:
        return self.norm_every_step or logged


EAGER = StepPolicy("eager", timed=True, norm_every_step=False)
CAPTURED = StepPolicy("captured", timed=False, norm_every_step=True)


@dataclass(frozen=True)
class Backprop:
    """An eager step's marks: the backward pass on the step clock (``t0``, ``t1``) and the host's
    (``h0``, ``h1``), the engine's record index before it (``mark``) and the step's bucket records."""

    mark: int
    t0: Any
    t1: Any
    h0: float
    h1: float
    records: list


@dataclass(frozen=True)
class StepOut:
    """What the device part of a step leaves: the loss statistics and the squared gradient norm (device
    arrays; ``grad_sq`` None when not computed) and, for a timed step, its :class:`Backprop` marks."""

    stats: Any
    grad_sq: Any
    backprop: Backprop | None = None
