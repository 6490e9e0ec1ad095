"""Optimizers (SGD with momentum and weight decay, Adam) and learning-rate schedules.

They update each parameter's local piece from its (already synchronised) gradient; the state (momentum,
moments) has the shape of the local piece, or with ``optimizer.shard_state`` only this rank's share of the
elements of replicated parameters (:mod:`lbannpy.training.shards`), and is saved in checkpoints in global
form by the trainer.
``step_params`` updates a subset, so the overlap engine can update a bucket as soon as its reduction
completes; its ``t`` lets an update that is applied late (replicated fully-connected gradients, applied
just before the layer's next forward) use the learning rate and moments of the step it belongs to.
On a GPU each parameter's update is one ``ElementwiseKernel`` (weight decay, moments and step together),
where the array expressions launch 4 (SGD with momentum) to 12 (Adam) kernels a parameter.

Capture-safe on a GPU: what changes from step to step is read from device memory, never passed as a launch
argument. The learning rate, Adam's bias corrections and the first-step flag of each step are rows of a
table in device memory (:class:`StepTable`, computed on the host once with the same arithmetic as the host
path), and the step counter is a device integer that :meth:`Optimizer.finish_step` increments with a kernel;
an update indexes the table by that counter (less ``back`` steps for a late update, a constant of its call
site). The state (momentum, moments) is created at set-up, so no step binds a new buffer.
"""
from __future__ import annotations

import math

from lbannpy.backend import array_module, flat, module_kernels
from lbannpy.config.run import section_config


class ScheduleError(ValueError):
    pass


def learning_rate(base_lr: float, step: int, total_steps: int, schedule) -> float:
    """Learning rate of optimizer step ``step`` (0-based): optional linear warmup, then none/step/cosine.
    ``schedule``: the ``optimizer.schedule`` section of a run config, a mapping of its keys (filled with the
    schema's defaults), or None (constant)."""
    if schedule is None:
        return base_lr
    if isinstance(schedule, dict):
        schedule = schedule_value(schedule)
    kind, warm = schedule.type, schedule.warmup_steps
    if warm and step < warm:
        return base_lr * (step + 1) / warm
    s = step - warm
    if kind == "none":
        return base_lr
    if kind == "step":
        return base_lr * float(schedule.gamma) ** (s // max(schedule.step_size, 1))
    if kind == "cosine":
        span = max(total_steps - warm, 1)
        return 0.5 * base_lr * (1 + math.cos(math.pi * min(s, span) / span))
    raise ScheduleError(f"unknown learning-rate schedule {kind!r}; use none, step or cosine")


def schedule_value(schedule: dict):
    """A mapping of ``optimizer.schedule`` keys as the section's frozen value (the schema's defaults)."""
    return section_config("optimizer", {"schedule": schedule}).schedule


# a row of the step table: the learning rate, Adam's bias corrections 1 - b1^k and 1 - b2^k, and whether the
# step is the first (SGD's momentum buffer then takes the gradient itself, as torch.optim.SGD)
ROW = 4
# the row of the update's step in the table ``tab``: the device counter less the call site's constant ``back``
_ROW = "const long long r = (tdev[0] - back) * 4; const T lr = tab[r];"
# the GPU updates: (in, out, operation, name); outputs are updated in place (the parameter, the moments)
_GPU_UPDATES = {
    "sgd": ("T g, T wd, raw T tab, raw int64 tdev, int64 back", "T v",
            _ROW + "v = v - lr * (wd != (T)0 ? g + wd * v : g);", "lbannpy_sgd"),
    "momentum": (
        "T g, T wd, raw T tab, raw int64 tdev, int64 back, T mom, int32 nesterov", "T v, T b",
        _ROW + "const bool first = tab[r + 3] != (T)0;"
        "T gg = wd != (T)0 ? g + wd * v : g; T bb = first ? gg : b * mom + gg; b = bb;"
        "v = v - lr * (nesterov ? gg + mom * bb : bb);", "lbannpy_sgd_momentum"),
    "adam": (
        "T g, T wd, raw T tab, raw int64 tdev, int64 back, T b1, T a1, T b2, T a2, T eps", "T v, T m, T s",
        _ROW + "const T c1 = tab[r + 1], c2 = tab[r + 2];"
        "T gg = wd != (T)0 ? g + wd * v : g; m = m * b1 + a1 * gg; s = s * b2 + a2 * gg * gg;"
        "v = v - lr * (m / c1) / (sqrt(s / c2) + eps);", "lbannpy_adam"),
}
#: most rows a step table plans at set-up (a run of more steps grows it when it gets there, eagerly: the
#: table is then a new buffer, and ``StepTable.generation`` counts up so a captured step is captured again)
MAX_PLANNED_ROWS = 1 << 16


def _gpu_updates(a):
    """The update kernels of ``a``'s array module (a GPU's), or None (NumPy, or no ElementwiseKernel)."""
    return module_kernels(array_module(a), "optim",
                          lambda xp: {k: xp.ElementwiseKernel(*v) for k, v in _GPU_UPDATES.items()})


PIECE = 1 << 16  # elements per piece of a host update (a few hundred KiB: the piece stays in cache)


def _pieces(*arrays):
    """The arrays (same shape) in matching flat pieces: an update of a large host array then reads and
    writes each element once while the piece is in cache, and its temporaries are piece-sized (heap memory
    reused step to step, where a whole-array temporary of a 40 MB layer is fresh pages every step). Device
    and non-contiguous arrays come whole: the arithmetic per element is the same either way."""
    a0 = arrays[0]
    if type(a0).__module__ != "numpy" or a0.size <= PIECE or not all(a.flags.c_contiguous for a in arrays):
        yield arrays
        return
    flat = [a.reshape(-1) for a in arrays]
    for i in range(0, a0.size, PIECE):
        yield tuple(f[i:i + PIECE] for f in flat)


def _module(a):
    import sys

    return sys.modules[type(a).__module__.split(".")[0]]


class StepTable:
    """What changes from optimizer step to step, in device memory: a row of :data:`ROW` values per step (see
    :func:`Optimizer.row`) in each dtype the parameters use, and the step counter ``tdev`` (one int64). An
    update reads row ``tdev - back``; rows are planned for the run's steps at set-up, so a replayed step
    launches the same arguments every time."""

    def __init__(self, xp, optimizer):
        self.xp, self.optimizer = xp, optimizer
        self.rows = 0
        self.tables: dict = {}  # dtype -> flat device array of rows * ROW values
        self.generation = 0  # counts the times the tables were made anew (a graph reading them is stale)
        self.tdev = xp.zeros(1, dtype=xp.int64)

    def plan(self, dtypes, rows: int) -> None:
        """Rows ``[0, rows)`` in every dtype of ``dtypes`` (computed on the host, uploaded once)."""
        import numpy

        dtypes = {numpy.dtype(d) for d in dtypes} | set(self.tables)
        if rows <= self.rows and dtypes <= set(self.tables):
            return
        rows = max(rows, self.rows)
        host = numpy.array([self.optimizer.row(t) for t in range(rows)], dtype=numpy.float64).reshape(-1)
        # each value rounded once to the dtype, as a Python float argument of the same kernel would be
        self.tables = {d: self.xp.asarray(host.astype(d)) for d in dtypes}
        self.rows = rows
        self.generation += 1

    def table(self, dtype, t: int):
        """The table of ``dtype``, with a row for step ``t`` (grown, eagerly, by doubling past the plan)."""
        import numpy

        dtype = numpy.dtype(dtype)
        if t >= self.rows or dtype not in self.tables:
            self.plan([dtype], max(t + 1, 2 * self.rows) if t >= self.rows else self.rows)
        return self.tables[dtype]

    def set_step(self, t: int) -> None:
        """The device counter to ``t`` (at set-up and after a resume: a copy, never in a step)."""
        self.tdev[...] = t


class Optimizer:
    def __init__(self, params, lr: float, weight_decay: float = 0.0, schedule: dict | None = None,
                 total_steps: int = 1):
        self.params = list(params)
        self.base_lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.schedule = schedule
        self.total_steps = total_steps
        self._t = 0  # optimizer steps taken
        self.state: dict[str, dict] = {p.name: {} for p in self.params}
        self.shards = None  # a lbannpy.training.shards.StateShards keeps part of the state (shard_state)
        self.steps = None  # the StepTable of GPU parameters
        devs = [p for p in self.params if type(p.value).__module__ != "numpy"]
        if devs and _gpu_updates(devs[0].value) is not None:
            self.steps = StepTable(_module(devs[0].value), self)
            self.steps.plan({p.value.dtype for p in devs}, min(int(total_steps), MAX_PLANNED_ROWS) + 1)
        for p in self.params:  # at set-up: no step binds a new state buffer
            self._slots(p.value, self.state[p.name])

    @property
    def t(self) -> int:
        """Optimizer steps taken (the host's count; the device counter follows it)."""
        return self._t

    @t.setter
    def t(self, value: int) -> None:
        self._t = int(value)
        if self.steps is not None:
            self.steps.set_step(self._t)

    def rewind(self, t: int) -> None:
        """The host's step count back to ``t``: a CUDA-graph capture that failed ran its step's bookkeeping
        on the host only (nothing of it reached the device), so the step is taken again eagerly."""
        self.t = t

    def row(self, t: int) -> tuple:
        """Step ``t``'s row of the device table: learning rate, the two bias corrections (1 for an optimizer
        without them), and 1.0 on the first step."""
        return (learning_rate(self.base_lr, t, self.total_steps, self.schedule), 1.0, 1.0,
                1.0 if t == 0 else 0.0)

    def _slots(self, value, st: dict) -> dict:
        """``st`` with every state slot of a parameter piece like ``value`` (zeros where one is missing: at
        set-up, or after a resume from a checkpoint without it)."""
        for slot in self.slot_names():
            if slot not in st:
                st[slot] = _module(value).zeros(value.shape, dtype=value.dtype)
        return st

    def _launch_step(self, g, t: int):
        """The GPU update's step arguments ``(table, counter, back)``: the row read is ``t``'s."""
        back = self._t - t
        if not 0 <= back <= self._t:
            raise ValueError(f"optimizer step {t} is not one of the {self._t + 1} steps so far")
        return self.steps.table(g.dtype, t), self.steps.tdev, back

    def has_state(self) -> bool:
        """Whether the optimizer keeps state per parameter element (momentum, moments)."""
        return bool(self.slot_names())

    def slot_names(self) -> list[str]:
        """The state slots every updated parameter has (sorted), the same on every rank."""
        return []

    def unshard_state(self) -> None:
        """Who calls: every rank (collective when the state is sharded): whole state, for a checkpoint."""
        if self.shards is not None:
            self.shards.unshard()

    def reshard_state(self) -> None:
        """This rank's part of the state again, after a checkpoint or a resume (no communication)."""
        if self.shards is not None:
            self.shards.reshard()

    @property
    def lr(self) -> float:
        return learning_rate(self.base_lr, self.t, self.total_steps, self.schedule)

    def step(self) -> None:
        self.step_params(self.params)
        self.finish_step()

    def step_params(self, params, t: int | None = None) -> None:
        """Update ``params`` from their gradients as optimizer step ``t`` (default: the current step)."""
        t = self.t if t is None else int(t)
        lr = learning_rate(self.base_lr, t, self.total_steps, self.schedule)
        for p in params:
            p.settle()
            self._update(p.value, p.grad, lr, self.state[p.name], t)

    def step_pieces(self, pieces, t: int | None = None) -> None:
        """Update elements ``[a, b)`` of each flattened parameter of ``pieces`` ``(param, a, b)``, keeping
        the state of those elements only (see :mod:`lbannpy.training.shards`)."""
        t = self.t if t is None else int(t)
        lr = learning_rate(self.base_lr, t, self.total_steps, self.schedule)
        for p, a, b in pieces:
            p.settle()
            self._update(flat(p.value)[a:b], flat(p.grad)[a:b], lr, self.state[p.name], t)

    def _decayed(self, value, g):
        """The gradient with weight decay added (the host path; the GPU kernels add it themselves)."""
        return g + self.weight_decay * value if self.weight_decay else g

    def finish_step(self) -> None:
        self._t += 1
        if self.steps is not None:  # on the device, in stream order: a replayed step counts too
            self.steps.tdev += 1

    def count_replayed_step(self) -> None:
        """The host's count after a replayed captured step (whose graph advanced the device counter
        itself); the next step's row is planned here, outside any capture."""
        self._t += 1
        if self.steps is not None and self._t >= self.steps.rows:
            self.steps.plan(self.steps.tables, max(self._t + 1, 2 * self.steps.rows))

    def zero_grad(self) -> None:
        """Every gradient to zeros; a lazy parameter's is only marked stale (its layer's first contribution
        overwrites it, and :meth:`lbannpy.layers.param.Param.settle` zeroes it where none comes)."""
        for p in self.params:
            if getattr(p, "lazy", False):
                p.stale = True
            else:
                p.grad[...] = 0


class SGD(Optimizer):
    def __init__(self, params, lr, momentum: float = 0.0, nesterov: bool = False, **kw):
        self.momentum = float(momentum)
        self.nesterov = nesterov
        super().__init__(params, lr, **kw)

    def slot_names(self) -> list[str]:
        return ["momentum"] if self.momentum else []

    def _update(self, value, g, lr, st, t):
        gpu = _gpu_updates(g)
        if gpu is not None:
            tab, tdev, back = self._launch_step(g, t)
            if not self.momentum:
                gpu["sgd"](g, self.weight_decay, tab, tdev, back, value)
                return
            buf = self._slots(value, st)["momentum"]
            gpu["momentum"](g, self.weight_decay, tab, tdev, back, self.momentum, int(self.nesterov), value,
                            buf)
            return
        g = self._decayed(value, g)
        if self.momentum:
            buf = self._slots(value, st)["momentum"]
            first = t == 0  # the buffer takes the first update's (decayed) gradient
            for v, gv, bv in _pieces(value, g, buf):
                if first:
                    bv[...] = gv
                else:
                    bv *= self.momentum
                    bv += gv
                v -= lr * (gv + self.momentum * bv if self.nesterov else bv)
            return
        for v, gv in _pieces(value, g):
            v -= lr * gv


class Adam(Optimizer):
    def __init__(self, params, lr, betas=(0.9, 0.999), eps: float = 1e-8, **kw):
        self.b1, self.b2 = (float(b) for b in betas)
        self.eps = float(eps)
        super().__init__(params, lr, **kw)

    def slot_names(self) -> list[str]:
        return ["m", "v"]

    def row(self, t: int) -> tuple:
        k = t + 1
        return (learning_rate(self.base_lr, t, self.total_steps, self.schedule), 1 - self.b1 ** k,
                1 - self.b2 ** k, 1.0 if t == 0 else 0.0)

    def _update(self, value, g, lr, st, t):
        self._slots(value, st)
        m, v = st["m"], st["v"]
        gpu = _gpu_updates(g)
        if gpu is not None:
            tab, tdev, back = self._launch_step(g, t)
            b1, b2 = self.b1, self.b2
            gpu["adam"](g, self.weight_decay, tab, tdev, back, b1, 1 - b1, b2, 1 - b2, self.eps, value, m, v)
            return
        g = self._decayed(value, g)
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * g * g
        mhat = m / (1 - self.b1 ** (t + 1))
        vhat = v / (1 - self.b2 ** (t + 1))
        value -= lr * mhat / (vhat ** 0.5 + self.eps)


def make_optimizer(cfg, params, total_steps: int) -> Optimizer:
    """The optimizer of a run config's ``optimizer`` section (:mod:`lbannpy.config.run`), or of a mapping of
    its keys (a benchmark's, a test's: checked and filled with the schema's defaults, which live there
    only)."""
    if isinstance(cfg, dict) or cfg is None:
        cfg = section_config("optimizer", cfg)
    common = dict(weight_decay=cfg.weight_decay, schedule=cfg.schedule, total_steps=total_steps)
    if cfg.type == "sgd":
        return SGD(params, cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **common)
    if cfg.type == "adam":
        return Adam(params, cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **common)
    raise ScheduleError(f"unknown optimizer {cfg.type!r}; use sgd or adam")

