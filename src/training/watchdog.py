"""The no-progress watchdog: a step that makes no progress becomes an abort naming what each rank waits in."""
from __future__ import annotations

import sys
import threading
import time

from .signals import every_thread_speaks, only_this_thread_speaks


class Watchdog:
    """Aborts the job when no progress is reported for ``timeout`` seconds, naming what each rank waits in.

    Every rank runs one; all ranks stuck in the same collective fire at about the same time and each
    prints its own operation before the abort takes the job down.
    """

    def __init__(self, timeout: float, rank: int, abort):
        self.timeout = float(timeout)
        self.rank = rank
        self.abort = abort
        self.op = "start-up"
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None

    def progress(self, op: str) -> None:
        self.op = op
        self.last = time.monotonic()

    def start(self):
        if self.timeout > 0 and self._thread is None:  # started by set-up; run() calls it again
            self._thread = threading.Thread(target=self._run, name="lbannpy-watchdog", daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                sys.stderr.write(f"lbannpy: rank {self.rank}: no progress for {idle:.0f} s (watchdog "
                                 f"{self.timeout:g} s); waiting in: {self.op}\n")
                sys.stderr.flush()
                time.sleep(1.0)  # let the other ranks' watchdogs print theirs
                # the abort fails the operation the main thread waits in: that is not the cause
                only_this_thread_speaks()
                try:
                    self.abort(3)
                finally:
                    every_thread_speaks()
                return

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
