"""Time per (layer, phase) on the host's clock or a device's, and the intervals of a trace."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timer:
    """Accumulates time per (layer, phase) and, when tracing, the intervals themselves.

    The time points come from :meth:`now`: the host's ``perf_counter`` seconds, or with a device ``clock``
    (CUDA events recorded on the compute stream: on a GPU the host only *launches* kernels, so host time
    measures launches) marks that become seconds in :meth:`settle`, which reads them all with one host
    synchronisation; ``totals`` and ``events`` hold what has been settled."""

    totals: dict = field(default_factory=dict)
    events: list | None = None
    clock: Any = None            # None: the host clock; else an object with now(), settle() and seconds(mark)
    _pending: list = field(default_factory=list)

    def now(self):
        return time.perf_counter() if self.clock is None else self.clock.now()

    @contextmanager
    def host_marks(self):
        """``with timer.host_marks():`` the marks of the work inside on the host's clock, whatever the
        timer's own (a captured or replayed CUDA-graph step: a timing event recorded in a capture is never
        recorded at a replay). The device clock is back when the block ends, also on an error."""
        clock, self.clock = self.clock, None
        try:
            yield self
        finally:
            self.clock = clock

    def add(self, key: tuple, t0, t1, track: str = "compute") -> None:
        if self.clock is not None:
            self._pending.append((key, t0, t1, track, True))
            return
        self.totals[key] = self.totals.get(key, 0.0) + (t1 - t0)
        self.span(key, t0, t1, track)

    def span(self, key: tuple, t0, t1, track: str = "compute") -> None:
        """An interval for the trace only (e.g. a span enclosing per-layer events), not counted in totals."""
        if self.clock is not None:
            self._pending.append((key, t0, t1, track, False))
        elif self.events is not None:
            self.events.append((track, key, t0, t1))

    def settle(self) -> None:
        """Turn the device marks recorded so far into seconds (one host synchronisation when any are
        pending; nothing with the host clock)."""
        if self.clock is None or not self._pending:
            return
        self.clock.settle()
        sec = self.clock.seconds
        for key, a, b, track, counted in self._pending:
            t0, t1 = sec(a), sec(b)
            if counted:
                self.totals[key] = self.totals.get(key, 0.0) + (t1 - t0)
            if self.events is not None:
                self.events.append((track, key, t0, t1))
        self._pending.clear()

