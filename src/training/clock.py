"""The one clock the step loop reads its timings from.

Every step-level timing (step time, I/O wait, the backward span, replicated-gradient waits) goes through
:meth:`Clock.now`, so a device clock (CUDA events recorded on the compute stream) replaces the host clock
in this one place.
"""
from __future__ import annotations

import time


class Clock:
    """Host wall clock in seconds (``time.perf_counter``)."""

    def now(self) -> float:
        return time.perf_counter()
