"""Batches uploaded to the GPU one ahead of the step that reads them (pinned staging, a copy stream,
events)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .reader import Batch
from lbannpy.layers.kernels.loss import check_label_range


class DeviceUploader:
    """Batches of a reader uploaded to the GPU one batch ahead, asynchronously.

    :meth:`next` returns the batch uploaded during the previous call (inputs converted to ``dtype``, labels
    as read, both device arrays) and starts the upload of the following one: the host batch is copied
    into a page-locked staging buffer, then ``ndarray.set(..., stream=copy stream)`` copies it to the device
    without blocking the host, after the compute stream is done with the memory it lands in (the copy
    stream waits on an event of the compute stream). The compute stream waits on the copy's event when the
    batch is handed out, so the first kernel that reads it is ordered after its copy and nothing
    blocks the host. Two staging buffers alternate; one is refilled once the copy that read it a step
    earlier is done (asked without blocking; a fresh buffer otherwise).

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
        self._staging: list[dict] = [{}, {}]   # per slot: name -> (pinned host array, copy-done event)
        self._slot = 0
        self._ahead = None                     # (Batch with device arrays, copy-done event)
        self._retired: list = []               # (pinned array, event) still read by a copy

    def __getattr__(self, name):
        if name == "reader":  # not set yet (during __init__ or unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.reader, name)

    def _pinned(self, slot: dict, name: str, shape, dtype):
        """The staging array ``name`` of a slot, reused when its last copy (issued a step ago) is done and
        the shape fits. The host never waits: a buffer still being read is retired (kept alive until its
        copy is done, asked without blocking) and a fresh one is used."""
        self._retired = [(a, e) for a, e in self._retired if not e.done]
        have = slot.get(name)
        if have is not None:
            arr, done = have
            if done is not None and not done.done:
                self._retired.append((arr, done))
            elif arr.shape == tuple(shape) and arr.dtype == dtype:
                return arr
        nbytes = max(int(math.prod(shape)) * dtype.itemsize, 1)
        alloc = getattr(self.xp.cuda, "alloc_pinned_memory", None)
        if alloc is None:  # an array module without page-locked memory (the test suite's CUDA stand-in)
            arr = np.empty(tuple(shape), dtype)
            slot[name] = (arr, None)
            return arr
        mem = alloc(nbytes)  # as cupyx.empty_pinned does
        arr = np.ndarray(tuple(shape), dtype=dtype, buffer=mem)
        slot[name] = (arr, None)
        return arr

    def _upload(self, batch: Batch):
        xp = self.xp
        if self.num_classes is not None and np.issubdtype(batch.labels.dtype, np.integer):
            check_label_range(batch.labels, self.num_classes)
        slot = self._staging[self._slot]
        self._slot ^= 1
        # device memory comes from the compute stream's pool: the copy must not land before the compute
        # stream's earlier work on that memory is done
        compute = xp.cuda.get_current_stream()
        x = xp.empty(batch.inputs.shape, dtype=self.dtype)
        y = xp.empty(batch.labels.shape, dtype=batch.labels.dtype)
        freed = xp.cuda.Event(disable_timing=True)
        freed.record(compute)
        self.copy_stream.wait_event(freed)
        for name, host, dev in (("inputs", batch.inputs, x), ("labels", batch.labels, y)):
            pinned = self._pinned(slot, name, host.shape, dev.dtype)
            np.copyto(pinned, host, casting="same_kind" if name == "inputs" else "no")
            dev.set(pinned, stream=self.copy_stream)
        done = xp.cuda.Event(disable_timing=True)
        done.record(self.copy_stream)
        for name in ("inputs", "labels"):
            slot[name] = (slot[name][0], done)
        up = Batch(x, y, batch.epoch, batch.step, batch.sample_ids, batch.read_s, batch.wait_s)
        return up, done

    def next(self) -> Batch:
        """The next batch on the device (ordered before every later kernel of the compute stream)."""
        if self._ahead is None:
            self._ahead = self._upload(self.reader.next())
        batch, done = self._ahead
        self._ahead = None
        self.xp.cuda.get_current_stream().wait_event(done)
        # the reader's epochs repeat, so there always is a following batch (the one uploaded after the last
        # step of a run is never used)
        self._ahead = self._upload(self.reader.next())
        return batch

    __next__ = next

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
