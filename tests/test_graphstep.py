"""``runtime.cuda_graph``: which runs the step graph refuses, and the one line that names why
(:mod:`lbannpy.training.graphstep`). The models are built on NumPy; a GPU's array module is a small object
whose ``cuda.Stream`` has (or lacks) ``begin_capture``, which is all the decision reads of it."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from lbannpy.comm import SingleCommunicator
from lbannpy.config.run import section_config
from lbannpy.layers.context import LayerContext
from lbannpy.layers.registry import layer_specs
from lbannpy.model import Model
from lbannpy.optim import make_optimizer
from lbannpy.training.graphstep import CaptureRefused, agreed, decide, refusal


class _Stream:
    def begin_capture(self):
        raise AssertionError("the decision must not capture anything")


GPU_XP = types.SimpleNamespace(__name__="cupy", cuda=types.SimpleNamespace(Stream=_Stream))
NO_CAPTURE_XP = types.SimpleNamespace(__name__="cupy", cuda=types.SimpleNamespace(Stream=object))

PLAIN = [{"name": "c1", "type": "conv", "filters": 2, "kernel": 3, "padding": 1},
         {"name": "r1", "type": "relu"},
         {"name": "p1", "type": "pool", "mode": "max", "kernel": 2},
         {"name": "f1", "type": "fc", "units": 3}]


def model(layers=PLAIN, kernels=None):
    ctx = LayerContext(SingleCommunicator(), np, "float64", seed=1)
    if kernels is not None:
        ctx.conv_kernels = kernels
    spec = {"name": "m", "input": {"channels": 2, "spatial": [8, 8]}, "layers": layers,
            "loss": "cross_entropy"}
    return Model(spec, 2, ctx, {})


def cfg(graph="auto", optimizer=None, comm=None):
    """The sections of a run config the decision reads."""
    return types.SimpleNamespace(
        runtime=section_config("runtime", {"cuda_graph": graph}),
        optimizer=section_config("optimizer", optimizer or {"type": "sgd", "lr": 0.1, "momentum": 0.9}),
        comm=section_config("comm", comm))


def why(c=None, m=None, device="gpu", backend="nccl", xp=GPU_XP, trace=False):
    c = c or cfg()
    m = m or model()
    return refusal(c, device, backend, xp, m, make_optimizer(c.optimizer, m.params, 10), trace)


def test_a_plain_sgd_net_on_nccl_is_captured():
    assert why() == ""
    c = cfg("on")
    m = model()
    d = decide(c, "gpu", "nccl", GPU_XP, m, make_optimizer(c.optimizer, m.params, 10))
    assert d.mode == "graph" and "one CUDA graph per input shape" in d.line()


REQUIRED = {"conv": {"filters": 2, "kernel": 1}, "conv_transpose": {"filters": 2, "kernel": 1},
            "groupnorm": {"groups": 1}}


def test_every_layer_type_is_judged_by_its_registry_declaration():
    """The layer registry's declaration, not a list in the step module: each registered one-input type,
    between a conv and an fc, is captured when it declares itself capturable and otherwise named with its
    own note."""
    seen = []
    for name, spec in layer_specs().items():
        if spec.max_parents != 1 or spec.flat_output:
            continue
        layers = [PLAIN[0], {"name": "t", "type": name, **REQUIRED.get(name, {})}, PLAIN[-1]]
        want = "" if spec.capturable else f"layer 't' ({name}): {spec.capture_note}"
        assert why(m=model(layers)) == want, name
        seen.append(name)
    assert {"batchnorm", "dropout", "relu", "pool"} <= set(seen), seen


def test_a_layer_declared_uncapturable_refuses_the_capture():
    m = model()
    assert why(m=m) == ""
    pool = m.layers[2]
    pool.spec = dataclasses.replace(pool.spec, capturable=False, capture_note="it reads a host value")
    assert why(m=m) == "layer 'p1' (pool): it reads a host value"


def test_the_mpi_backend_is_refused():
    assert why(backend="mpi").startswith("runtime.backend mpi: MPI calls wait on the host")


def test_aten_kernels_are_refused_by_layer_name():
    pytest.importorskip("torch")
    from lbannpy.layers.kernels.select import conv_kernels

    got = why(m=model(kernels=conv_kernels("aten", "cpu")))
    assert got.startswith("layer 'c1' uses ATen kernels, whose outputs come from torch's caching allocator")
    assert got.endswith("set runtime.kernels: own")


@pytest.mark.parametrize("opt,start", [
    ({"type": "adam", "lr": 1e-3}, "optimizer adam: its bias corrections change every step"),
    ({"type": "sgd", "lr": 0.1, "schedule": {"type": "cosine"}}, "optimizer.schedule: the learning rate"),
    ({"type": "sgd", "lr": 0.1, "schedule": {"type": "none", "warmup_steps": 3}}, "optimizer.schedule: "),
], ids=["adam", "cosine-schedule", "warmup"])
def test_optimizers_whose_per_step_values_live_on_the_host_are_refused(opt, start):
    assert why(cfg(optimizer=opt)).startswith(start)


def test_an_optimizer_with_a_device_step_table_is_captured_whatever_its_schedule():
    """Learning rate, bias corrections and step counter read from device memory (``Optimizer.steps``)."""
    c = cfg(optimizer={"type": "adam", "lr": 1e-3, "schedule": {"type": "cosine", "warmup_steps": 2}})
    m = model()
    opt = make_optimizer(c.optimizer, m.params, 10)
    assert refusal(c, "gpu", "nccl", GPU_XP, m, opt).startswith("optimizer adam")
    opt.steps = types.SimpleNamespace(generation=0)
    assert refusal(c, "gpu", "nccl", GPU_XP, m, opt) == ""


def test_a_gpu_kernel_that_fails_to_build_is_an_error_with_its_cause():
    """No silent fallback: the host-value refusal above would otherwise name the wrong reason."""
    from lbannpy.backend import BackendError, module_kernels

    fake = types.ModuleType("fakecupy")
    fake.ElementwiseKernel = object

    def build(xp):
        raise RuntimeError("nvrtc: error: identifier 'T' is undefined\nmore")

    with pytest.raises(BackendError, match=r"fakecupy kernels 'k' could not be built: RuntimeError: nvrtc: "
                                           r"error: identifier 'T' is undefined$"):
        module_kernels(fake, "k", build)
    assert module_kernels(types.ModuleType("nokernels"), "k", build) is None


def test_trace_and_a_cupy_without_capture_are_refused():
    # replicated layers and sharded state are captured (the first applied at the end of the step)
    assert why(cfg(comm={"replicate_fc": 1})) == ""
    assert why(cfg(optimizer={"type": "sgd", "lr": 0.1, "momentum": 0.9, "shard_state": True})) == ""
    assert why(trace=True) == "--trace: per-layer timings need eager steps"
    assert why(xp=NO_CAPTURE_XP) == "the array module cupy has no stream capture (Stream.begin_capture)"


def test_on_refuses_with_the_line_auto_falls_back_with_it_off_is_silent():
    c_on, c_auto, c_off = cfg("on"), cfg("auto"), cfg("off")
    m = model()
    opt = make_optimizer(c_on.optimizer, m.params, 10)
    with pytest.raises(CaptureRefused, match=r"^runtime.cuda_graph on: the training step cannot be captured: "
                                             r"runtime.backend mpi: "):
        decide(c_on, "gpu", "mpi", GPU_XP, m, opt)
    d = decide(c_auto, "gpu", "mpi", GPU_XP, m, opt)
    assert d.mode == "eager" and d.reason.startswith("runtime.backend mpi")
    assert d.line().startswith("step: eager (runtime.cuda_graph auto): not capturable: runtime.backend mpi")
    assert "\n" not in d.line()
    d = decide(c_off, "gpu", "nccl", GPU_XP, m, opt)
    assert d.mode == "eager" and d.reason == "" and d.line() == "step: eager (runtime.cuda_graph off)"
    # a CPU run: auto is plainly eager, on is refused
    assert decide(c_auto, "cpu", "mpi", np, m, opt).mode == "eager"
    with pytest.raises(CaptureRefused, match="runtime.device cpu: CUDA graphs need a GPU"):
        decide(c_on, "cpu", "single", np, m, opt)


class _World:
    def __init__(self, size, reasons):
        self.size, self.reasons = size, reasons

    def allgather_obj(self, obj):
        return list(self.reasons)


def test_ranks_agree_on_one_reason_naming_the_first_rank_that_has_one():
    assert agreed(_World(3, ["", "", ""]), "") == ""
    assert agreed(_World(2, ["x", "x"]), "x") == "x"
    assert agreed(_World(3, ["", "layer 'c1' uses ATen", ""]), "") == "layer 'c1' uses ATen (rank 1)"


def test_the_key_takes_yaml_s_bare_on_and_off_as_the_words():
    """``--set runtime.cuda_graph=on`` reaches the schema as YAML 1.1's boolean True."""
    from lbannpy.config import ConfigError
    from lbannpy.config.schema import lookup

    key = lookup(["runtime", "cuda_graph"])
    assert key.default == "auto"
    assert [key.type.check(v, "runtime.cuda_graph") for v in (True, False, "auto", "on")] == \
        ["on", "off", "auto", "on"]
    with pytest.raises(ConfigError, match="runtime.cuda_graph: unknown value 'yes'"):
        key.type.check("yes", "runtime.cuda_graph")


# ------------------------------------------------------------------------------------ StepGraphs
class _Capture:
    """A CUDA-like runtime in miniature: work issued while a stream captures is recorded, not run, and a
    graph's launch runs what was recorded; allocations name the allocator in use."""

    def __init__(self):
        self.recording = None
        self.allocator = None
        self.cuda = types.SimpleNamespace(MemoryPool=self._Pool, using_allocator=self._using)

    class _Pool:
        def malloc(self, nbytes):
            raise AssertionError("not called by the fake body")

    def _using(self, malloc):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.allocator = malloc
            try:
                yield
            finally:
                self.allocator = None
        return ctx()

    def issue(self, op):
        if self.recording is not None:
            self.recording.append(op)
        else:
            op()

    def empty_like(self, a):
        return np.empty_like(a)


class _Graph:
    def __init__(self, ops):
        self.ops = ops
        self.launches = 0

    def launch(self, stream):
        self.launches += 1
        for op in self.ops:
            op()


class _CaptureStream:
    def __init__(self, rt):
        self.rt = rt

    def begin_capture(self):
        assert self.rt.recording is None, "capture begun twice"
        self.rt.recording = []

    def end_capture(self):
        ops, self.rt.recording = self.rt.recording, None
        return _Graph(ops)


def _step_body(rt, calls):
    """A training step in miniature: one device operation reading both inputs into a persistent output."""
    def body(x, y):
        calls.append(rt.allocator is not None)  # whether the capture's pool was the allocator
        out = np.zeros(1)
        rt.issue(lambda: out.__setitem__(0, 10 * x.sum() + y.sum()))
        return out, out
    return body


def test_step_graphs_warm_up_capture_once_per_shape_and_replay_on_new_inputs():
    from lbannpy.training.graphstep import StepGraphs

    rt = _Capture()
    graphs = StepGraphs(rt, _CaptureStream(rt), warmup=2)
    calls: list = []
    body = _step_body(rt, calls)
    hows, got = [], []
    for i in range(6):
        x, y = np.full((2, 3), float(i)), np.array([i, 1])
        (out, _), how = graphs.step(x, y, body)
        hows.append(how)
        got.append(float(out[0]))
        assert got[-1] == 10 * x.sum() + y.sum(), (i, how, got)  # a stale batch would give an old value
    assert hows == ["eager", "eager", "captured", "replayed", "replayed", "replayed"]
    # the body ran for the warm-up steps and once under capture (with the private pool), never at a replay
    assert calls == [False, False, True]
    assert graphs.captures == 1 and graphs.replays == 3
    # another shape (a last partial batch) warms up and is captured on its own; the first graph stays
    x2, y2 = np.ones((1, 3)), np.array([4])
    assert [graphs.step(x2, y2, body)[1] for _ in range(4)] == ["eager", "eager", "captured", "replayed"]
    (out, _), how = graphs.step(np.full((2, 3), 7.0), np.array([7, 1]), body)
    assert how == "replayed" and out[0] == 10 * 42 + 8
    assert graphs.captures == 2 and len(calls) == 6


def test_a_failing_capture_is_ended_agreed_on_and_nothing_is_launched():
    from lbannpy.training.graphstep import CaptureFailed, StepGraphs

    rt = _Capture()
    told = []

    def agree(err):  # as agreed(): this rank's error, or another rank's
        told.append(err)
        return err or "RuntimeError: rank 1 could not capture (rank 1)"

    graphs = StepGraphs(rt, _CaptureStream(rt), warmup=0, agree=agree)

    def bad(x, y):
        raise RuntimeError("a host synchronisation during capture\nat layer c1")

    with pytest.raises(CaptureFailed, match=r"^RuntimeError: a host synchronisation during capture$"):
        graphs.step(np.zeros(2), np.zeros(1), bad)
    assert rt.recording is None and rt.allocator is None and graphs.captures == 0
    # this rank captured, another did not: no rank launches its graph
    calls: list = []
    out = np.full(1, -1.0)

    def good(x, y):
        calls.append(1)
        rt.issue(lambda: out.__setitem__(0, 5.0))
        return out, out

    with pytest.raises(CaptureFailed, match="rank 1 could not capture"):
        graphs.step(np.zeros(2), np.zeros(1), good)
    assert told == ["RuntimeError: a host synchronisation during capture", ""]
    assert out[0] == -1.0 and calls == [1] and graphs.captures == 0
