"""Interleaved timing of the layer benchmarks' contenders (:mod:`lbannpy.bench.layers` and
:mod:`lbannpy.bench.layers_new`): every contender called in turn, rounds rotated so that none always runs
first, wall and CPU seconds of each call."""
from __future__ import annotations

import time

MIN_TIMED_S = 0.3  # per contender: short calls are repeated more, up to MAX_REPEATS, for a steadier median
MAX_REPEATS = 60


def measure_fns(fns: dict, repeats: int, adaptive: bool = True) -> dict[str, float]:
    """Median seconds per call of every callable of ``fns``, timed interleaved (see :func:`measure`)."""
    import statistics

    calls = time_calls(fns, repeats, adaptive)
    return {name: statistics.median(w for w, _ in ts) for name, ts in calls.items()}


def time_calls(fns: dict, repeats: int, adaptive: bool = True) -> dict[str, list[tuple[float, float]]]:
    """``(wall, CPU)`` seconds of every timed call of every callable of ``fns``, timed interleaved (see
    :func:`measure`). The CPU time is the process's (``time.process_time``): with one thread on both sides
    it is the call's own work, which other processes sharing the cores do not lengthen as they do its wall
    time (they still share its caches and memory bandwidth)."""
    names = list(fns)
    longest = 0.0
    for name in names:  # warm-up: first-touch allocations, torch's primitive caches
        t0 = time.perf_counter()
        fns[name]()
        longest = max(longest, time.perf_counter() - t0)
    if adaptive:
        repeats = max(repeats, min(MAX_REPEATS, int(MIN_TIMED_S / max(longest, 1e-6))))
    times = {name: [] for name in names}
    wall, cpu = time.perf_counter, time.process_time
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0, c0 = wall(), cpu()
            fns[name]()
            c1, t1 = cpu(), wall()
            times[name].append((t1 - t0, c1 - c0))
    return times
