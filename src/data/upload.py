"""Batches prepared off the step's thread: converted to the compute dtype on the host, and on a GPU staged
in a fixed ring of pinned buffers and uploaded one batch ahead of the step that reads them (a copy stream,
events waited on the device)."""
from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dataset import DataError
from .reader import Batch
from lbannpy.layers.kernels.loss import check_label_range

SLOT_WAIT_S = 60.0   # seconds a synchronous stage waits for a staging buffer before it calls it a bug
COPY_POLL_S = 2e-4   # seconds between two queries of a slot's last copy (it is done long before, as a rule)


@dataclass
class StagedBatch(Batch):
    """A batch whose arrays are views of staging buffer ``slot`` (valid until the slot is released)."""

    slot: int = -1


class HostStage:
    """Converts a batch's inputs to the compute dtype (the reader's stage on the CPU: in the prefetch thread,
    so the step's thread takes batches as they are computed with)."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def __call__(self, batch: Batch, stop=None) -> Batch:
        if batch.inputs.dtype != self.dtype:
            batch.inputs = batch.inputs.astype(self.dtype, casting="same_kind")
        return batch


def stage_batches(reader, xp, dtype, num_classes: int | None = None, gpu: bool = False):
    """The reader the trainer steps from: on a GPU a :class:`DeviceUploader` over ``reader``; on the CPU
    ``reader`` itself, converting to ``dtype`` in its prefetch thread where the file's dtype differs."""
    if gpu:
        return DeviceUploader(reader, xp, dtype, num_classes)
    info = getattr(reader, "info", None)
    if info is not None and info.input_dtype != np.dtype(dtype):
        reader.set_stage(HostStage(dtype))
    return reader


class DeviceUploader:
    """Batches of a reader uploaded to the GPU one batch ahead, asynchronously, through a fixed ring of
    pinned buffers.

    The reader's stage (:meth:`stage`, in its prefetch thread) takes a free slot of the ring, waits there
    until the copy that last read the slot is done (its event queried in that thread, never on the step's,
    with the stop flag looked at in between, so a close never waits on the device), checks the labels and
    copies the batch into the slot, converting the inputs to ``dtype``. The
    ring holds ``depth + 2`` slots (the batches queued, the one being filled and the one being copied), so
    the thread runs ahead by ``depth`` batches without allocating.

    :meth:`next` returns the batch uploaded during the previous call and issues the upload of the following
    one: ``ndarray.set(..., stream=copy stream)`` from its slot into one of two device buffers that
    alternate, after the compute stream is done with that buffer (the copy stream waits on an event of the
    compute stream: its use two steps earlier), then gives the slot back with the copy's event. The compute
    stream waits on that event when the batch is handed out, so the first kernel that reads it is ordered
    after its copy. Nothing on the step's thread queries or waits on an event, and no buffer or event is
    made per step (a batch of another shape replaces its buffers).

    Labels are range-checked on the host before the upload (``num_classes``): a check on the device would
    stall every step.

    :meth:`state` is the position of the batch :meth:`next` returns next (the batch uploaded ahead counts
    as not yet read), so checkpoints and resumes see the same batches as without the uploader. Attributes
    it does not define (``steps_per_epoch``, ``indices``, ``io_stats``...) are the reader's.
    """

    def __init__(self, reader, xp, dtype, num_classes: int | None = None):
        self.reader, self.xp = reader, xp
        self.dtype = np.dtype(dtype)
        self.num_classes = num_classes
        cuda = xp.cuda
        self.copy_stream = cuda.Stream(non_blocking=True)
        self._device_id = cuda.Device().id   # the prefetch thread asks its events with it current
        self.slots = int(getattr(reader, "depth", 1)) + 2
        self._host: list[dict] = [{} for _ in range(self.slots)]   # name -> (pinned bytes, capacity)
        self._copied = [cuda.Event(disable_timing=True) for _ in range(self.slots)]
        self._recorded = [False] * self.slots       # whether the slot's event marks a copy from it
        self._free: queue.Queue = queue.Queue()
        self.reset()
        self._device: list[dict] = [{}, {}]          # name -> device array, per alternating buffer
        self._dslot = 0
        self._freed = cuda.Event(disable_timing=True)
        self._ahead = None                           # (Batch with device arrays, copy-done event)
        reader.set_stage(self)

    def __getattr__(self, name):
        if name == "reader":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.reader, name)

    # -- the reader's stage (its prefetch thread, or the caller's without prefetch) ------------------------
    def reset(self) -> None:
        """Every slot free again: the reader dropped the batches it had staged (its thread is joined)."""
        self._free = queue.Queue()
        for i in range(self.slots):
            self._free.put((i, self._copied[i] if self._recorded[i] else None))

    def _take(self, stop):
        """A free slot ``(index, event of its last copy or None)``; ``None`` when ``stop`` is set."""
        waited = 0.0
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    return None
                waited += 0.05
                if stop is None and waited > SLOT_WAIT_S:
                    raise DataError(f"no staging buffer came free in {SLOT_WAIT_S:.0f} s (all {self.slots} "
                                    f"held by batches never uploaded)") from None

    def _pinned(self, slot: int, name: str, shape, dtype) -> np.ndarray:
        """Slot ``slot``'s staging array ``name`` (page-locked), allocated once and grown only for a
        larger batch."""
        dtype = np.dtype(dtype)
        nbytes = max(int(math.prod(shape)) * dtype.itemsize, 1)
        have = self._host[slot].get(name)
        if have is None or have[1] < nbytes:
            alloc = getattr(self.xp.cuda, "alloc_pinned_memory", None)
            if alloc is None:  # an array module without page-locked memory (the test suite's CUDA stand-in)
                mem = np.empty(nbytes, np.uint8)
            else:
                mem = alloc(nbytes)  # as cupyx.empty_pinned does
            have = self._host[slot][name] = (mem, nbytes)
        return np.ndarray(tuple(shape), dtype=dtype, buffer=have[0])

    def __call__(self, batch: Batch, stop=None) -> StagedBatch | None:
        """Stage ``batch`` in a free slot (see the class); ``None`` when ``stop`` is set while it waits."""
        got = self._take(stop)
        if got is None:
            return None
        slot, copied = got
        try:
            if copied is not None and not self._copied_out(copied, stop):
                self._free.put((slot, copied))
                return None
            if self.num_classes is not None and np.issubdtype(batch.labels.dtype, np.integer):
                check_label_range(batch.labels, self.num_classes)
            x = self._pinned(slot, "inputs", batch.inputs.shape, self.dtype)
            np.copyto(x, batch.inputs, casting="same_kind")
            y = self._pinned(slot, "labels", batch.labels.shape, batch.labels.dtype)
            np.copyto(y, batch.labels, casting="no")
        except BaseException:
            self._free.put((slot, None))  # its copy is done (above), or there never was one
            raise
        return StagedBatch(x, y, batch.epoch, batch.step, batch.sample_ids, batch.read_s, batch.wait_s,
                           slot=slot)

    stage = __call__

    def _copied_out(self, copied, stop) -> bool:
        """Wait until the copy that last read a slot is done (True), or ``stop`` is set (False)."""
        with self.xp.cuda.Device(self._device_id):  # a new thread starts on device 0
            while not copied.done:
                if stop is not None and stop.is_set():
                    return False
                time.sleep(COPY_POLL_S)
        return True

    # -- the step's thread ----------------------------------------------------------------------------------
    def _device_array(self, buf: dict, name: str, shape, dtype):
        have = buf.get(name)
        if have is None or have.shape != tuple(shape) or have.dtype != dtype:
            have = buf[name] = self.xp.empty(tuple(shape), dtype=dtype)
        return have

    def _upload(self, staged: StagedBatch):
        xp = self.xp
        buf = self._device[self._dslot]
        self._dslot ^= 1
        # a buffer (re)made here comes from the compute stream's memory, and the compute stream read it two
        # steps ago: the copy must not land before either is done, so the event comes after both
        x = self._device_array(buf, "inputs", staged.inputs.shape, staged.inputs.dtype)
        y = self._device_array(buf, "labels", staged.labels.shape, staged.labels.dtype)
        compute = xp.cuda.get_current_stream()
        self._freed.record(compute)
        self.copy_stream.wait_event(self._freed)
        x.set(staged.inputs, stream=self.copy_stream)
        y.set(staged.labels, stream=self.copy_stream)
        done = self._copied[staged.slot]
        done.record(self.copy_stream)
        self._recorded[staged.slot] = True
        self._free.put((staged.slot, done))
        up = Batch(x, y, staged.epoch, staged.step, staged.sample_ids, staged.read_s, staged.wait_s)
        return up, done

    def next(self) -> Batch:
        """The next batch on the device (ordered before every later kernel of the compute stream)."""
        if self._ahead is None:
            self._ahead = self._upload(self._staged())
        batch, done = self._ahead
        self._ahead = None
        self.xp.cuda.get_current_stream().wait_event(done)
        # the reader's epochs repeat, so there always is a following batch (the one uploaded after the last
        # step of a run is never used)
        self._ahead = self._upload(self._staged())
        return batch

    __next__ = next

    def _staged(self) -> StagedBatch:
        batch = self.reader.next()
        if not isinstance(batch, StagedBatch):  # the reader's stage was replaced: refuse, do not race
            raise DataError(f"{type(self.reader).__name__} returned an unstaged batch; the uploader's stage "
                            f"was removed from the reader")
        return batch

    def state(self) -> dict[str, Any]:
        """The reader's state at the batch :meth:`next` returns next (the batch uploaded ahead counts as
        unread)."""
        st = self.reader.state()
        if self._ahead is not None:
            st["epoch"], st["step"] = self._ahead[0].epoch, self._ahead[0].step
        return st

    def load_state(self, state: dict[str, Any]) -> None:
        self._ahead = None
        self.reader.load_state(state)

    def close(self) -> None:
        self._ahead = None
        self.reader.close()

