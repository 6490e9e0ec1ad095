"""The training step as one CUDA graph (``runtime.cuda_graph``), or why it is not.

:func:`decide` reads the run (config, runtime, model, optimizer) and returns a :class:`Decision`: the step
is captured, or it runs eagerly with one line naming the first thing that prevents capture (``auto``), or
the run is refused with that line (``on``). What a layer type allows is declared in the layer registry
(``LayerSpec.capturable``), not listed here.

:class:`StepGraphs` follows ``torch.cuda.graphs``: every step runs on a stream of its own (not the legacy
default stream, which cannot be captured); a new input shape first runs ``warmup`` eager steps (plans,
workspaces, optimizer state and NCCL communicators come into being there), then one step is captured into a
graph whose allocations come from a private memory pool, and every later step of that shape copies its
batch into the graph's static input buffers and replays the graph: one launch a step. The captured step
leaves its outputs (loss statistics, squared gradient norm) in buffers of the pool, which a logged step
reads after the replay.
"""
from __future__ import annotations

from dataclasses import dataclass

#: eager steps of an input shape before it is captured (the first allocates plans and state; the second
#: runs as every later step will)
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Decision:
    """``mode``: ``graph`` or ``eager``; ``asked``: the config's ``runtime.cuda_graph``; ``reason``: what
    prevents capture ('' when nothing does or it was not asked for)."""

    mode: str
    asked: str
    reason: str = ""

    def line(self) -> str:
        """The one line a run prints about its step mode."""
        if self.mode == "graph":
            return (f"step: one CUDA graph per input shape, captured after {WARMUP_STEPS} eager steps "
                    f"(runtime.cuda_graph {self.asked})")
        if self.reason:
            return f"step: eager (runtime.cuda_graph {self.asked}): not capturable: {self.reason}"
        return f"step: eager (runtime.cuda_graph {self.asked})"

    def as_dict(self) -> dict:
        return {"mode": self.mode, "asked": self.asked, "reason": self.reason}


class CaptureRefused(ValueError):
    """``runtime.cuda_graph: on`` for a run whose step cannot be captured; the message names what."""


class CaptureFailed(RuntimeError):
    """The capture of a step failed on some rank (agreed on by every rank); nothing of it ran on the
    device, and no rank keeps a graph. The message names the rank and the error."""


def _optimizer_reason(optimizer, opt_cfg) -> str:
    """Why the optimizer's update cannot be replayed, or ''. One with a device step table (``steps``:
    learning rate, bias corrections and step counter in device memory) reads every per-step value there.
    One without (its parameters are host arrays: NumPy, or a module without ``ElementwiseKernel``) computes
    the learning rate (and Adam its bias corrections) on the host each step, which a replay would repeat
    unchanged: right only while they stay the same every step."""
    if optimizer.steps is not None:
        return ""
    if opt_cfg.type == "adam":
        return ("optimizer adam: its bias corrections change every step and are passed to the update "
                "kernel as host values")
    sched = opt_cfg.schedule
    if sched.type != "none" or sched.warmup_steps:
        return ("optimizer.schedule: the learning rate changes during the run and is passed to the update "
                "kernels as a host value")
    return ""


def _kernel_reason(model) -> str:
    """ATen kernels allocate their outputs from torch's caching allocator, which only a capture that torch
    itself begins (``torch.cuda.graph``) gives a private pool: in a capture begun by CuPy those blocks could
    be handed to other work while the graph still writes them. cuDNN Frontend's set (``cudnn``) is
    captured: its outputs come from CuPy's allocator (the capture's pool), its plans and workspaces are made
    by the eager warm-up steps, and each call only sets its handle's stream and enqueues the plan on the
    capturing stream (:mod:`lbannpy.layers.kernels.cudnn`)."""
    for layer in model.layers:
        kern = getattr(layer, "kern", None)
        if kern is not None and getattr(kern, "name", "") == "aten":
            return (f"layer '{layer.name}' uses ATen kernels, whose outputs come from torch's caching "
                    f"allocator outside the capture's memory pool; set runtime.kernels: own")
    return ""


def refusal(run, device: str, backend: str, xp, model, optimizer, trace: bool = False) -> str:
    """The first thing that prevents capturing the training step, as one clause a user can act on; ''
    when nothing does. ``run``: the run config (:mod:`lbannpy.config.run`). Pure but for reading the
    objects."""
    if device != "gpu":
        return f"runtime.device {device}: CUDA graphs need a GPU"
    if backend == "mpi":
        return ("runtime.backend mpi: MPI calls wait on the host for the stream; use runtime.backend nccl "
                "(or auto)")
    why = _kernel_reason(model)
    if why:
        return why
    for layer in model.layers:
        spec = layer.spec
        if not spec.capturable:
            return f"layer '{layer.name}' ({spec.name}): {spec.capture_note}"
    why = _optimizer_reason(optimizer, run.optimizer)
    if why:
        return why
    if trace:
        return "--trace: per-layer timings need eager steps"
    stream = getattr(getattr(xp, "cuda", None), "Stream", None)
    if stream is None or not hasattr(stream, "begin_capture"):
        return f"the array module {getattr(xp, '__name__', xp)} has no stream capture (Stream.begin_capture)"
    return ""


def agreed(world, why: str) -> str:
    """Who calls: every rank (collective: one allgather of a short string). The first rank's reason when
    any rank has one (a rank's kernels are chosen by its block's shape, so ranks may differ): every rank
    then runs the same step mode, and the same collectives each step."""
    if world.size == 1:
        return why
    found = [(r, w) for r, w in enumerate(world.allgather_obj(why)) if w]
    if not found:
        return ""
    r, w = found[0]
    return w if all(x == w for _, x in found) and len(found) == world.size else f"{w} (rank {r})"


def decide(run, device: str, backend: str, xp, model, optimizer, trace: bool = False,
           world=None) -> Decision:
    """The run's step mode. Raises :class:`CaptureRefused` for ``on`` when the step cannot be captured.
    With ``world``: collective (see :func:`agreed`)."""
    asked = run.runtime.cuda_graph
    if asked == "off":
        return Decision("eager", asked)
    why = refusal(run, device, backend, xp, model, optimizer, trace)
    if world is not None and device == "gpu":  # a CPU run's reason is the same on every rank
        why = agreed(world, why)
    if not why:
        return Decision("graph", asked)
    if asked == "on":
        raise CaptureRefused(f"runtime.cuda_graph on: the training step cannot be captured: {why}")
    if device != "gpu":  # nothing to say on a CPU: there is no graph to miss
        return Decision("eager", asked)
    return Decision("eager", asked, why)


class _Shape:
    """One input shape's graph: warm-up count, static inputs, the captured graph, its pool and outputs."""

    __slots__ = ("warm", "x", "y", "graph", "mempool", "out")

    def __init__(self):
        self.warm = 0
        self.x = self.y = self.graph = self.mempool = self.out = None


class StepGraphs:
    """The captured training steps of a run, one per input shape.

    ``stream``: the run's compute stream (current for every step; not the legacy default stream).
    ``step(x, y, body)`` runs ``body(x, y) -> outputs`` eagerly during warm-up, captures it once per shape
    and replays it after; returns ``(outputs, how)`` with ``how`` one of ``eager``, ``captured``,
    ``replayed``. On a replay nothing of ``body`` runs on the host: host-side bookkeeping a step needs
    (the optimizer's step counter) is the caller's. ``agree(error) -> error``: every rank's capture error
    ('' for none) made one (collective; see :func:`agreed`), so that either every rank launches its graph
    or none does: a failed capture raises :class:`CaptureFailed` on every rank before anything ran."""

    def __init__(self, xp, stream, warmup: int = WARMUP_STEPS, agree=None):
        self.xp = xp
        self.stream = stream
        self.warmup = int(warmup)
        self.agree = agree or (lambda err: err)
        self._shapes: dict[tuple, _Shape] = {}
        self.captures = 0
        self.replays = 0

    @staticmethod
    def key(x, y) -> tuple:
        return (tuple(x.shape), str(x.dtype), tuple(y.shape), str(y.dtype))

    def reset(self) -> None:
        """Drop every captured graph (something a graph reads was made anew): each shape warms up and is
        captured again."""
        self._shapes.clear()

    def next(self, x, y) -> str:
        """What :meth:`step` will do with inputs like these: ``eager``, ``capture`` or ``replay``."""
        sh = self._shapes.get(self.key(x, y))
        if sh is not None and sh.graph is not None:
            return "replay"
        return "eager" if sh is None or sh.warm < self.warmup else "capture"

    def step(self, x, y, body):
        sh = self._shapes.setdefault(self.key(x, y), _Shape())
        if sh.graph is None and sh.warm < self.warmup:
            sh.warm += 1
            return body(x, y), "eager"
        if sh.graph is None:
            try:
                self._capture(sh, x, y, body)
                err = ""
            except Exception as exc:  # a real error comes back when the step runs eagerly
                err = f"{type(exc).__name__}: {exc}".splitlines()[0]
            err = self.agree(err)
            if err:
                self._shapes.clear()
                self.captures = 0
                raise CaptureFailed(err)
            sh.graph.launch(self.stream)
            return sh.out, "captured"
        # the batch into the buffers the graph reads, on the compute stream, before its launch
        sh.x[...] = x
        sh.y[...] = y
        sh.graph.launch(self.stream)
        self.replays += 1
        return sh.out, "replayed"

    def _capture(self, sh: _Shape, x, y, body) -> None:
        xp, stream = self.xp, self.stream
        # the static inputs are ordinary (default pool) memory: they outlive every step and the host fills
        # them before each launch
        sh.x = xp.empty_like(x)
        sh.y = xp.empty_like(y)
        sh.x[...] = x
        sh.y[...] = y
        # everything the captured step allocates comes from a pool no other work draws from: a replay
        # writes those addresses again, so no block may be handed to anything else while the graph lives
        pool = xp.cuda.MemoryPool()
        with xp.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            try:
                out = body(sh.x, sh.y)
            except BaseException:
                try:  # the capture is invalid either way; the body's error is the one to report
                    stream.end_capture()
                except Exception:
                    pass
                sh.x = sh.y = None
                raise
            graph = stream.end_capture()
        sh.mempool, sh.graph, sh.out = pool, graph, out
        self.captures += 1
