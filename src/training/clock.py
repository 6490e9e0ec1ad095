"""The one clock the step loop reads its timings from.

Every step-level timing (step time, I/O wait, the backward span, replicated-gradient waits) goes through
:meth:`Clock.now`, so a device clock (CUDA events recorded on the compute stream) replaces the host clock
in this one place.
"""
from __future__ import annotations

import time


class Clock:
    """Host wall clock in seconds (``time.perf_counter``)."""

    name = "host"

    def now(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        """Nothing to wait for: host times are seconds already."""

    def seconds(self, mark: float) -> float:
        return mark


def make_clock(device: str, xp):
    """The step clock of a run: CUDA events on a GPU, the host clock on a CPU."""
    return EventClock(xp) if device == "gpu" else Clock()


class EventClock:
    """Device time on a GPU: :meth:`now` records a timing event on the current stream of the current device
    (the compute stream) and returns it as a mark; marks become seconds since the clock was made with
    :meth:`seconds`, valid after :meth:`settle` (one host synchronisation, on the newest mark: the events
    of one stream complete in order). On a GPU the host only launches kernels, so host time between two
    points of a step measures launches; the events measure the work."""

    name = "cuda-events"

    def __init__(self, xp):
        self._cuda = xp.cuda
        self._origin = self._newest = self._record()
        self._settled = None

    def _record(self):
        ev = self._cuda.Event()  # timing enabled: CuPy's default
        ev.record()
        return ev

    def now(self):
        self._newest = self._record()
        return self._newest

    def settle(self) -> None:
        if self._newest is not self._settled:  # once per newest mark
            self._newest.synchronize()
            self._settled = self._newest

    def seconds(self, mark) -> float:
        return self._cuda.get_elapsed_time(self._origin, mark) / 1e3
