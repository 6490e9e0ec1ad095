"""``python -m lbannpy.bench.calibrate_priority NICE CMD...``: run ``CMD`` at scheduling priority ``NICE``,
for measurements on a box others load (``bench calibrate --priority``, ``calibrate_steps --priority``).

Linux schedules sessions against each other (autogroups), not processes: ``nice`` alone leaves a process
sharing the cores with every other session's, and ``mpiexec`` starts each rank in a session of its own.
So each rank raises its own session's priority (``/proc/self/autogroup``) and its own niceness; a negative
``NICE`` needs root (CAP_SYS_NICE), and where either is refused the measurement runs as it would.
"""
from __future__ import annotations

import os
import sys


def raise_priority(nice: int) -> list[str]:
    """Set this process's session (autogroup) and process niceness to ``nice``; returns what was refused
    (an empty list when both took)."""
    refused = []
    try:
        with open("/proc/self/autogroup", "w", encoding="ascii") as f:
            f.write(str(int(nice)))
    except OSError as exc:
        refused.append(f"session priority: {exc.strerror or exc}")
    try:
        os.nice(int(nice) - os.nice(0))
    except OSError as exc:
        refused.append(f"niceness: {exc.strerror or exc}")
    return refused


def prioritized(cmd: list[str], nice: int | None) -> list[str]:
    """``cmd`` run through this module at ``nice`` (unchanged when ``nice`` is None)."""
    if nice is None:
        return list(cmd)
    return [sys.executable, "-m", "lbannpy.bench.calibrate_priority", str(int(nice)), *cmd]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or not argv[0].lstrip("-").isdigit():
        print("usage: python -m lbannpy.bench.calibrate_priority NICE CMD [ARGS...]", file=sys.stderr)
        return 2
    for what in raise_priority(int(argv[0])):
        print(f"lbannpy.bench.calibrate_priority: {what}; running at the usual priority", file=sys.stderr)
    os.execvp(argv[1], argv[1:])
    return 0  # not reached: the process is CMD now


if __name__ == "__main__":
    sys.exit(main())
