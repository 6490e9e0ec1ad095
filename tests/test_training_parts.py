"""The trainer's parts on their own (no MPI): reporting's per-layer means and the set-up's settings."""
from __future__ import annotations

import types

import pytest

from lbannpy.config.run import section_config
from lbannpy.layers.timer import Timer
from lbannpy.training.build import settings
from lbannpy.training.report import Report


class World:
    rank, size = 0, 1


def test_per_layer_means_leave_out_untimed_work():
    timer = Timer(events=[])
    rep = Report(World(), "unused", timer, trace=False)
    rep.warmup_steps = 1

    def work(dt):
        timer.add(("c1", "fp"), 0.0, dt)

    rep.untimed(lambda: work(100.0))  # the warm-up step
    for _ in range(3):
        work(2.0)  # three timed steps
    rep.untimed(lambda: work(1000.0))  # an evaluation pass
    assert rep.per_layer(steps_run=4) == {"c1": {"fp": pytest.approx(2.0)}}
    # control: without the bookkeeping the injected time would show
    assert timer.totals[("c1", "fp")] / 3 > 300


def test_untimed_keeps_its_bookkeeping_when_the_work_raises():
    timer = Timer()
    rep = Report(World(), "unused", timer, trace=False)

    def fail():
        timer.add(("c1", "bp"), 0.0, 5.0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        rep.untimed(fail)
    assert rep.per_layer(steps_run=1) == {}


def test_end_step_keeps_trace_events_only_when_tracing():
    for trace, kept in ((False, 0), (True, 1)):
        timer = Timer(events=[])
        rep = Report(World(), "unused", timer, trace=trace)
        timer.add(("c1", "fp"), 0.0, 1.0)
        rep.end_step()
        assert len(timer.events) == kept


@pytest.mark.parametrize("trainer,ck,expect", [
    # every run ends with a checkpoint, by default under the output directory, the newest 3 kept
    ({"batch_size": 4, "steps": 7}, {}, dict(total_steps=7, steps_per_epoch=5, eval_every=5,
                                             ckpt_at_end=True, ckpt_dir="run/ckpt", ckpt_keep=3)),
    ({"batch_size": 4, "epochs": 3, "eval_every": 2}, {"every_steps": 3},
     dict(total_steps=15, steps_per_epoch=5, eval_every=2, ckpt_every=3, ckpt_at_end=True)),
    ({"batch_size": 4}, {"dir": "c", "keep": 0}, dict(total_steps=5, ckpt_dir="c", ckpt_at_end=True,
                                                      ckpt_keep=0)),
])
def test_settings_from_the_config(trainer, ck, expect):
    sec = section_config
    run = types.SimpleNamespace(trainer=sec("trainer", trainer), output=sec("output", {}),
                                checkpoint=sec("checkpoint", ck))
    st = settings(run, train_samples=22)  # 22 // 4 = 5 steps per epoch
    for k, v in expect.items():
        assert getattr(st, k) == v, k


def test_the_stop_vote_agrees_on_a_named_reason_and_the_signal():
    """A failed metrics append outranks a signal; the signal's number travels beside the reason, not as a
    reason of its own (no fake signal number for a write failure)."""
    import numpy as np

    from lbannpy.training.signals import StopReason, StopVote, Vote

    class Other:  # the other rank posts SIGTERM (15) every step
        host = None

        def __init__(self):
            self.host = self

        def iallreduce(self, buf, op):
            assert op == "max"
            return types.SimpleNamespace(wait=lambda: np.maximum(buf, [int(StopReason.SIGNAL), 15]))

    vote = StopVote(Other())
    assert vote.post(StopReason.GO_ON) == Vote()  # nothing in flight yet
    assert vote.post(StopReason.METRICS_WRITE_FAILED) == Vote(StopReason.SIGNAL, 15)
    agreed = vote.drain()
    assert agreed.reason is StopReason.METRICS_WRITE_FAILED and agreed.reason.name == "METRICS_WRITE_FAILED"
    assert vote.drain() == Vote()
