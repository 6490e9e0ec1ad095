"""Gradient synchronisation: the overlap engine and the replicated fully-connected policy, in one object.

Two kinds of parameters:

* bucketed: reduced by :class:`lbannpy.comm.overlap.OverlapEngine` in fixed-order buckets during
  backprop; each bucket is handed to the optimizer as soon as it is reduced;
* replicated (Lee et al.'s f, ``comm.replicate_fc``): the weights of the first ``f`` fully-connected
  layers are not in the buckets; their error signals are gathered non-blocking during backprop
  (:meth:`FullyConnected.replicated_grads`) and each layer's update is applied just before its next forward
  (Algorithm 2, line 7) with the optimizer step its gradients belong to, or earlier by :meth:`flush`
  (evaluation, checkpoints, the end of the run). A captured run (:mod:`.graphloop`; the constructor's
  ``captured``) applies them at the end of the step instead: a replay cannot know whether a flush ran
  between two steps, and the update, made with the same optimizer step's values on the same gathered
  gradients before anything reads those weights, gives the same weights bit for bit.
"""
from __future__ import annotations

import sys

from .errors import UserError
from lbannpy.comm.overlap import OverlapEngine
from lbannpy.checkpoint import is_writer
from .shards import StateShards
from lbannpy.optim import PIECE


class GradSync:
    """``cfg_comm``: the run config's ``comm`` section (:mod:`lbannpy.config.run`). Who calls: every rank,
    in the same order (the constructor creates group communicators and the replicated layers' gather
    communicators: collective)."""

    def __init__(self, cfg_comm, model, ctx, rt, optimizer, timer, clock, progress,
                 shard_state: bool = False, captured: bool = False):
        self.optimizer = optimizer
        self.timer = timer
        self.clock = clock
        self.progress = progress
        fcs = [layer for layer in model.layers if hasattr(layer, "replicate_gradients")]
        f = cfg_comm.replicate_fc
        if f > len(fcs):
            raise UserError(f"comm.replicate_fc = {f} but the model has {len(fcs)} fully-connected layer(s) "
                            f"({', '.join(f.name for f in fcs) or 'none'}); use at most {len(fcs)}")
        self.replicated = fcs[:f]
        for layer in self.replicated:  # collective: the same layers in the same order on every rank
            layer.replicate_gradients()
        self._pending_t: dict[str, int] = {}  # replicated layer -> optimizer step its gradients belong to
        # steps may be captured: the replicated layers' updates are applied at the end of the step whose
        # gradients they are (after the gathers are waited for on the device), and no step records a timing
        # event (one recorded in a capture is never recorded at a replay)
        self.captured = bool(captured)
        skip = {id(p) for layer in self.replicated for p in layer.params}
        synced = [p for p in model.params if id(p) not in skip]
        # each distinct gradient block counted once (by the rank that holds replica 0 of it) in the norm
        self._norm_params = [p for p in synced if is_writer(p.dist, p.reduce_dims, rt.world.rank)]
        self._xp, self._world = rt.xp, rt.world
        self._sq_buf = None  # the host's float64 buffer of grad_norm_sq
        self.grad_comms = [ctx.block_comm(p.dist, p.reduce_dims) for p in synced]
        k = cfg_comm.chunks.k
        self.engine = OverlapEngine(
            synced, self.grad_comms, bucket_bytes=int(cfg_comm.bucket_mb * 2**20),
            first_bucket_bytes=int(cfg_comm.first_bucket_mb * 2**20),
            overlap=cfg_comm.overlap, chunk_layers=k or None,
            thread_multiple=getattr(rt, "thread_multiple", True), xp=rt.xp,
            device_timing=clock.name != "host" and not self.captured)
        self.shards = None  # optimizer.shard_state: the replicated parameters' state split over replicas
        if shard_state and optimizer.has_state():
            self.shards = StateShards(self.engine.buckets, optimizer, rt.xp)

    # -- one step, in call order -------------------------------------------------------------------------
    def before_forward(self, layer) -> None:
        """``Model.forward``'s ``before_layer`` hook: apply the layer's pending replicated update."""
        t = self._pending_t.pop(layer.name, None)
        if t is None:
            return
        self.progress(f"replicated gradients of {layer.name}")
        t0 = self.clock.now()
        params = layer.replicated_grads()
        self.timer.add((layer.name, "replicated_grad"), t0, self.clock.now())
        self.optimizer.step_params(params, t=t)

    def start_backward(self) -> int:
        """Before backprop; returns the mark :meth:`finish` reads this step's bucket records from."""
        self.engine.start_step()
        return len(self.engine.records)

    @property
    def bucket_clock(self) -> str:
        """What times the bucket records: ``"host"`` or, for NCCL on a GPU, ``"cuda-events"``."""
        return self.engine.clock

    def bucket_intervals(self, mark: int, seconds) -> list[tuple[float, float]]:
        """``(start, end)`` of each bucket reduction since ``mark``, in the seconds of ``seconds`` (a clock's
        converter); device events are read here, so the step's marks must be settled first."""
        self.engine.resolve(seconds)
        return [(s, e) for _, _, _, s, e in self.engine.records[mark:]]

    @property
    def on_layer(self):
        """``Model.backward``'s ``on_layer`` hook."""
        return self.engine.layer_done

    def finish(self, mark: int) -> list:
        """After backprop: wait for the buckets (each updated as soon as it is reduced), schedule the
        replicated updates and end the optimizer step. Returns this step's bucket records
        ``(bucket, nbytes, _, start, end)``."""
        if self.shards is None:
            self.engine.finish(on_bucket=self.optimizer.step_params)
        else:  # each rank updates its range of a sharded bucket; then one allgather a bucket
            self.engine.finish(on_bucket=self.shards.on_bucket)
            if self.captured:  # a captured run: no timing event (one recorded in a capture never is again)
                self.shards.gather_values()
            else:
                t0 = self.clock.now()
                self.shards.gather_values()
                self.timer.add(("optimizer", "state_gather"), t0, self.clock.now())
        for layer in self.replicated:  # eager: still being gathered, so updated before the next forward
            if self.captured:  # untimed: a timing event recorded in a capture is never recorded at a replay
                self._pending_t.pop(layer.name, None)
                self.optimizer.step_params(layer.replicated_grads())
            else:
                self._pending_t[layer.name] = self.optimizer.t
        self.optimizer.finish_step()
        return self.engine.records[mark:]

    def grad_norm_sq(self):
        """Who calls: every rank (collective over the world, after :meth:`finish`). The squared norm of the
        step's reduced gradients (the bucketed ones; the replicated fully-connected layers' are still being
        gathered), summed in float64, as a one-element array on the device: no host synchronisation."""
        xp = self._xp
        if xp.__name__ == "numpy":  # every gradient packed into one reused buffer: a dot per 64 Ki values
            if self._sq_buf is None:
                self._sq_buf = xp.empty(PIECE, dtype=xp.float64)
            acc = xp.array([packed_sum_squares((p.grad for p in self._norm_params), self._sq_buf)])
        else:
            acc = device_sum_squares(xp, [p.grad for p in self._norm_params])
        return self._world.allreduce(acc)

    def flush(self) -> None:
        """Apply every pending replicated update now (before evaluation, checkpoints and the end of the
        run, which must see the weights of the steps taken so far)."""
        for layer in self.replicated:
            self.before_forward(layer)

    def close(self) -> None:
        if not self.engine.close():  # a thread stuck in a collective keeps its communicators
            sys.stderr.write(f"lbannpy.train: rank {self._world.rank}: the gradient-communication thread did "
                             f"not stop (inside a collective?); its communicators are left to the job's "
                             f"end\n")

    def bucket_summary(self) -> list[dict]:
        """``summary.json`` ``buckets``: size, parameters and median reduction time of each bucket."""
        import numpy as np

        engine, out = self.engine, []
        if engine.clock != "host":  # the end of the run: every bucket's events into seconds
            self.clock.settle()
            engine.resolve(self.clock.seconds)
        for b in engine.buckets:
            times = [e - s for i, _, _, s, e in engine.records if i == b.index]
            out.append({"index": b.index, "bytes": int(b.nbytes), "params": [p.name for p in b.params],
                        "median_s": float(np.median(times)) if times else None,
                        # the part of the bucket's optimizer state this rank keeps (optimizer.shard_state)
                        "state_share": 1.0 if self.shards is None else self.shards.share(b.index)})
        return out


#: values per concatenated group of :func:`device_sum_squares` (64 MiB of float32)
DEVICE_GROUP = 16 << 20


def device_sum_squares(xp, arrays, group: int = DEVICE_GROUP):
    """Σ a² over device arrays, in float64, as a one-element device array (no host synchronisation). The
    arrays are concatenated in groups of up to ``group`` values (one array larger than that is a group of its
    own), each group converted and reduced by one dot product: four kernels a group, not three per array
    (launches are host time, and a deep net has many small gradients)."""
    acc = xp.zeros(1, dtype=xp.float64)
    run: list = []
    size = 0

    def flush():
        flat = run[0] if len(run) == 1 else xp.concatenate(run)
        g = flat.astype(xp.float64, copy=False)
        acc[...] += xp.dot(g, g)

    for a in arrays:
        flat = a.reshape(-1)
        if run and size + flat.size > group:
            flush()
            run, size = [], 0
        run.append(flat)
        size += flat.size
    if run:
        flush()
    return acc


def packed_sum_squares(arrays, buf) -> float:
    """Σ a² over host arrays, in float64: consecutive pieces of the arrays are converted into ``buf`` and
    each full buffer is one dot product, so a net of many small gradients costs a copy per gradient and a
    dot per ``buf.size`` values, not a conversion and a dot each."""
    import numpy

    total, fill, size = 0.0, 0, buf.size
    for a in arrays:
        flat = a.reshape(-1)
        i = 0
        while i < flat.size:
            n = min(size - fill, flat.size - i)
            buf[fill:fill + n] = flat[i:i + n]
            fill, i = fill + n, i + n
            if fill == size:
                total += float(numpy.dot(buf, buf))
                fill = 0
    if fill:
        part = buf[:fill]
        total += float(numpy.dot(part, part))
    return total
