"""The reader's prefetch thread: batches read ahead into a bounded queue while the caller computes (see
:mod:`lbannpy.data.reader`, section Prefetch).

A reader with a stage (:meth:`~lbannpy.data.reader.HDF5Reader.set_stage`) hands each batch to it in this
thread, after the read: the dtype conversion and the copy into pinned staging memory then happen here too,
off the step's thread. ``stage(batch, stop)`` returns the staged batch, or ``None`` when ``stop`` was set
while it waited (for a free staging buffer)."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

from .dataset import DataError


class BatchSource(Protocol):
    """What the prefetch thread needs of a reader (:class:`lbannpy.data.reader.HDF5Reader` is one)."""

    rank: int
    path: str

    def read_batch(self, epoch: int, step: int): ...

    def advance(self, epoch: int, step: int) -> tuple[int, int]: ...


class Failure:
    """An exception raised on the prefetch thread, queued for the consumer to re-raise."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


STOP = object()   # sentinel: the producer has stopped


@dataclass
class Prefetcher:
    """Background thread that reads batches from a start position into a bounded queue."""

    reader: BatchSource
    epoch: int
    step: int
    depth: int
    stage: Callable | None = None
    q: queue.Queue = field(init=False)
    stop: threading.Event = field(init=False)
    thread: threading.Thread = field(init=False)

    def __post_init__(self):
        self.q = queue.Queue(maxsize=self.depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"lbannpy-prefetch-r{self.reader.rank}",
                                       daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self):
        epoch, step = self.epoch, self.step
        try:
            while not self.stop.is_set():
                batch = self.reader.read_batch(epoch, step)
                if self.stage is not None:
                    batch = self.stage(batch, self.stop)
                    if batch is None:  # stopped while waiting for a staging buffer
                        return
                if not self._put(batch):
                    return
                epoch, step = self.reader.advance(epoch, step)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(Failure(exc))
            return
        finally:
            # wake a consumer that is waiting; never blocks (the queue may be full and nobody reading)
            try:
                self.q.put_nowait(STOP)
            except queue.Full:
                pass

    def get(self):
        while True:
            try:
                return self.q.get(timeout=0.05)
            except queue.Empty:
                if not self.thread.is_alive() and self.q.empty():
                    return Failure(DataError(f"rank {self.reader.rank}: the prefetch thread of "
                                              f"{self.reader.path} ended without a batch"))

    def close(self, timeout: float = 30.0):
        self.stop.set()
        while self.thread.is_alive():
            try:  # drain so a put in progress returns at once
                while True:
                    self.q.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.05)
            timeout -= 0.05
            if timeout <= 0:
                raise DataError(f"rank {self.reader.rank}: the prefetch thread of {self.reader.path} did not "
                                f"stop (an HDF5 read is stuck)")
