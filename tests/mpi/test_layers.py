"""Every layer type under every distribution it supports, at any rank count, against PyTorch (float64).

Each case runs the distributed layer (forward, backward, gradient sync) and compares the gathered output,
input gradient and every parameter gradient with ``torch.autograd`` on the global arrays, to 1e-10
relative. Sizes are odd and uneven (17×23 images, 5 channels, 5 samples) so blocks differ in size.
"""
from __future__ import annotations

import pytest

from layer_cases import Case, compare, run_lbannpy
from lbannpy.layers.base import LayerError
from mpi_util import assert_all, raises_all

N, C, H, W = 5, 5, 17, 23


def splits(size: int, dims=("n", "h", "w"), allow_replication=True):
    """Distributions over ``dims`` for ``size`` ranks: each single dim, pairs, and (at 4) a replicated one."""
    out = [{}] if size == 1 else []
    for d in dims:
        if size > 1:
            out.append({d: size})
    if size == 4:
        if "n" in dims and "h" in dims:
            out.append({"n": 2, "h": 2})
        if "h" in dims and "w" in dims:
            out.append({"h": 2, "w": 2})
        if allow_replication and "h" in dims:
            out.append({"h": 2})  # two ranks per block: leftover ranks replicate
    return out


def conv(name="c", **kw):
    return {"name": name, "type": "conv", "filters": 4, **kw}


CONV_VARIANTS = [
    dict(kernel=1),
    dict(kernel=3, padding="same"),
    dict(kernel=3, stride=2, padding="same"),
    dict(kernel=5, padding=2, bias=False),
    dict(kernel=7, padding=[[3, 1], [0, 2]]),
    dict(kernel=3, dilation=2, padding="same"),
    dict(kernel=7, stride=2, padding=0),
]


def layer_cases(size):
    cases = []
    for v in CONV_VARIANTS:
        for par in splits(size, ("n", "h", "w")):
            cases.append(Case("conv" + "".join(f"-{k}{v[k]}" for k in v), (conv(**v),), (N, C, H, W),
                              {"default": par}))
    for par in splits(size, ("c",)):
        cases.append(Case("conv-filter-parallel", (conv(kernel=3, padding=1),), (N, C, H, W),
                          {"default": par}))
    for par in splits(size, ("n", "h")):
        cases.append(Case("conv3d", (conv(kernel=3, padding=1, stride=(1, 2, 1)),), (5, 2, 7, 9, 11),
                          {"default": par}))
    for mode in ("max", "avg"):
        for kw in (dict(kernel=2, stride=2), dict(kernel=3, stride=2, padding=1)):
            for par in splits(size, ("n", "c", "h", "w")):
                pool = {"name": "p", "type": "pool", "mode": mode, **kw}
                cases.append(Case(f"pool-{mode}-k{kw['kernel']}", (pool,), (N, C, H, W), {"default": par}))
    for par in splits(size, ("n", "c", "h", "w")):
        cases.append(Case("batchnorm-global", ({"name": "b", "type": "batchnorm", "sync": "global"},),
                          (N, C, H, W), {"default": par}))
    for par in splits(size, ("c", "h", "w")):  # per-sample-group statistics equal global ones when n is whole
        cases.append(Case("batchnorm-group", ({"name": "b", "type": "batchnorm"},), (N, C, H, W),
                          {"default": par}))
    # a ReLU reading only a batch-norm runs fused into it (one pass each way); a ReLU after a sum in place
    for sync, dims in (("global", ("n", "c", "h", "w")), ("group", ("c", "h", "w"))):
        for par in splits(size, dims):
            cases.append(Case(f"batchnorm-relu-{sync}", ({"name": "b", "type": "batchnorm", "sync": sync},
                                                         {"name": "r", "type": "relu"}),
                              (N, C, H, W), {"default": par}))
    for par in splits(size, ("n", "h", "w")):
        cases.append(Case("sum-relu-inplace", (conv(kernel=3, padding=1, filters=C),
                                               {"name": "s", "type": "sum", "parents": ["c", "x"]},
                                               {"name": "r", "type": "relu"},
                                                {"name": "b", "type": "batchnorm", "sync": "global"}),
                          (N, C, H, W),
                          {"default": par}))
    for t in ("relu", "leaky_relu"):
        for par in splits(size, ("n", "c", "h", "w")):
            cases.append(Case(t, ({"name": "a", "type": t},), (N, C, H, W), {"default": par}))
    for par in splits(size, ("n", "h", "w")):
        cases.append(Case("residual-sum", (conv("c1", kernel=3, padding=1, filters=5),
                                           {"name": "s", "type": "sum", "parents": ["c1", "x"]}),
                          (N, C, H, W), {"default": par}))
        cases.append(Case("inception-concat", (conv("a", kernel=1), conv("b", kernel=3, padding=1),
                                               {"name": "cat", "type": "concat", "parents": ["a", "b"]}),
                          (N, C, H, W), {"default": par}))
    fc = {"name": "f", "type": "fc", "units": 6}
    for par in splits(size, ("n", "c")):
        cases.append(Case("fc", (fc,), (N, C, 4, 3), {"default": par}))
    if size > 1:  # a whole input on every rank is already the layout a filter/channel split reads: no shuffle
        cases.append(Case("conv-filter-parallel-whole-input", (conv(kernel=3, padding=1),), (N, C, H, W),
                          {"layers": {"c": {"c": size}}}))
        cases.append(Case("fc-model-whole-input", (fc,), (N, C, 4, 3), {"layers": {"f": {"c": size}}}))
    if size == 4:
        cases.append(Case("fc-1.5d", (fc,), (N, C, 4, 3), {"default": {"n": 2, "c": 2}}))
    # a chain whose distributions change from layer to layer
    chain = (conv("c1", kernel=3, padding=1, bias=False),
             {"name": "b1", "type": "batchnorm", "sync": "global"}, {"name": "r1", "type": "relu"},
             {"name": "p1", "type": "pool", "kernel": 2},
             {"name": "f1", "type": "fc", "units": 7})
    if size > 1:
        over = {"c1": {"h": size}, "b1": {"n": size}, "r1": {"w": size}, "p1": {"h": size}, "f1": {"c": size}}
        cases.append(Case("chain", chain, (N, C, H, W), {"layers": over}))
        cases.append(Case("chain", chain, (N, C, H, W),
                          {"default": {"h": size}, "layers": {"f1": {"n": size}}}))
    else:
        cases.append(Case("chain", chain, (N, C, H, W), {}))
    return cases


def test_layers_match_pytorch(comm):
    bad = []
    for case in layer_cases(comm.size):
        bad += compare(case, comm)
    assert_all(comm, not bad, "\n".join(bad))


def test_fused_batchnorm_relu_equals_the_unfused_layers(comm):
    """Under every split: the fused batch-norm + ReLU (and the in-place ReLU) give the numbers of the
    layers run one by one, to 1e-12 in float64."""
    import numpy as np
    from layer_cases import run_lbannpy

    bad = []
    for case in layer_cases(comm.size):
        if not case.name.startswith(("batchnorm-relu", "sum-relu-inplace")):
            continue
        fused = run_lbannpy(case, comm)
        kinds = {(layer.type, getattr(layer, "fuse_relu", False), getattr(layer, "inplace", False))
                 for layer in fused[4].layers}
        if ("batchnorm", True, False) not in kinds and ("relu", False, True) not in kinds:
            bad.append(f"{case.id}: nothing fused or in place ({sorted(kinds)})")
        alone = run_lbannpy(case, comm, fuse=False)
        pairs = [("output", fused[0], alone[0]), ("input gradient", fused[1], alone[1])]
        pairs += [(f"gradient of {k}", fused[2][k], alone[2][k]) for k in fused[2]]
        for what, a, b in pairs:
            err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
            if not err <= 1e-12:
                bad.append(f"{case.id} {what}: fused against unfused {err:.3g}")
    assert_all(comm, not bad, "\n".join(bad))


def test_overlap_off_gives_identical_numbers(comm):
    case = Case("conv-overlap", (conv(kernel=5, padding=2), {"name": "p", "type": "pool", "kernel": 2}),
                (N, C, H, W), {"default": {"h": comm.size}})
    from layer_cases import run_lbannpy
    import numpy as np
    on = run_lbannpy(case, comm, overlap=True)
    off = run_lbannpy(case, comm, overlap=False)
    same = np.array_equal(on[0], off[0]) and np.array_equal(on[1], off[1]) and all(
        np.array_equal(on[2][k], off[2][k]) for k in on[2])
    assert_all(comm, same, "overlap on/off differ")


def test_fc_spatial_split_is_refused(comm):
    if comm.size < 2:
        pytest.skip("a split needs 2 ranks (decided by comm.size on every rank)")
    from layer_cases import run_lbannpy
    case = Case("fc-spatial", ({"name": "f", "type": "fc", "units": 3},), (N, C, 4, 3),
                {"layers": {"f": {"h": comm.size}}})
    raises_all(comm, (LayerError, ValueError), run_lbannpy, case, comm, match="f")


_CONV = {"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1}


@pytest.mark.parametrize("layers,kernels", [((_CONV,), None),
                                            (({"name": "p", "type": "pool", "kernel": 3, "stride": 1,
                                               "padding": 1},), None),
                                            (({"name": "r", "type": "relu"}, _CONV), "aten")],
                         ids=["conv", "pool", "conv-windowless"])
def test_interior_runs_while_the_halo_exchange_is_in_flight(comm, layers, kernels):
    """Rank 1 holds its halo back (it does not enter the layer) until rank 0 has computed a piece of its
    output, which it can do from owned input and padding alone only if it computes its interior (the base
    class's stencil template; a windowless convolution: its whole kernel-padded block) while the exchange is
    in flight. A layer that waits for the exchange first never sends that go: rank 1 gives up after
    ``_GO_BOUND`` seconds (a guard against a hang, not a measurement) and the test fails. The numbers equal
    the run without overlap."""
    if comm.size != 2:
        pytest.skip("the held-back halo is written for 2 ranks (decided by comm.size on every rank)")
    import numpy as np

    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    spec = {"input": {"channels": 4, "spatial": [64, 32]}, "layers": list(layers)}
    x = np.random.default_rng(0).standard_normal((2, 4, 64, 32))
    outs, ok, msg = {}, True, ""
    for overlap in (True, False):
        ctx = LayerContext(comm, np, "float64", seed=1, overlap=overlap)
        if kernels is not None:
            from lbannpy.layers.kernels.select import conv_kernels

            ctx.conv_kernels = conv_kernels(kernels)
        model = Model(spec, 2, ctx, {"default": {"h": 2}})
        assert_all(comm, (kernels is not None) == bool(_windowless(model)), "windowless or not, as meant")
        xt = DistTensor.scatter(x, model.input_dist, comm)
        if not overlap:
            outs[overlap] = model.forward(xt).gather(comm)
            continue
        go = comm.dup()  # the go travels apart from the layer's messages
        if comm.rank == 0:
            sent = []
            _after_first_compute(model.layers[-1], lambda: sent or sent.append(go.isend(np.ones(1), 1, 1)))
            y = model.forward(xt)
            hooked = bool(sent)
            if not sent:  # the hook missed the layer's compute: rank 1 still waits for a go
                sent.append(go.isend(np.ones(1), 1, 1))
            sent[0].wait()
            ok, msg = hooked, "rank 0's output was computed without the test's hook seeing it"
        else:
            got = go.irecv(np.zeros(1), 0, 1)
            ok = _arrives_within(got, _GO_BOUND)
            msg = (f"rank 0 computed nothing of its output within {_GO_BOUND} s of entering the layer while "
                   f"rank 1 held back its halo: the interior waited for the exchange")
            y = model.forward(xt)
            if not ok:
                got.wait()  # rank 0 sends the go once it computes, after its wait
        outs[overlap] = y.gather(comm)
        go.free()
    assert_all(comm, ok, msg)
    assert_all(comm, np.array_equal(outs[True], outs[False]), "overlap changed the numbers")


_GO_BOUND = 20.0  # seconds rank 1 holds its halo back: far beyond a small interior's time, below the test's


def _arrives_within(handle, seconds: float) -> bool:
    """Whether the non-blocking ``handle`` completes within ``seconds`` (polled: the bound only keeps a
    layer that never computes before its wait from hanging the test)."""
    import time

    end = time.monotonic() + seconds
    while not handle.test():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def _after_first_compute(layer, hook) -> None:
    """Call ``hook()`` after each local computation of ``layer``'s forward: a convolution's kernel calls
    (windowed, windowless, planned), a pooling's window pieces."""
    def after(fn):
        def run(*args, **kw):
            out = fn(*args, **kw)
            hook()
            return out
        return run

    if layer.type != "conv":
        layer._pool = after(layer._pool)  # halo_forward's compute is looked up on the instance
        return
    kern = layer.kern

    class Plan:  # the kernel set's plan of this convolution, its forward observed
        def __init__(self, plan):
            self.plan, self.forward = plan, after(plan.forward)

        def __getattr__(self, name):
            return getattr(self.plan, name)

    class Kernels:  # the layer's kernel set (the layer re-plans for a set it has not seen)
        conv_forward = staticmethod(after(kern.conv_forward))
        plan = None if kern.plan is None else staticmethod(lambda *a, **kw: Plan(kern.plan(*a, **kw)))

        def __getattr__(self, name):
            return getattr(kern, name)

    layer._kern = Kernels()


def test_a_whole_input_needs_no_redistribution_for_a_filter_split(comm):
    """Replicas of the whole input and a replicated channel axis are one layout: the layer reads its input
    as it is (numbers checked against PyTorch in test_layers_match_pytorch)."""
    if comm.size == 1:
        return
    for case in (Case("c", (conv(kernel=3, padding=1),), (N, C, H, W), {"layers": {"c": {"c": comm.size}}}),
                 Case("f", ({"name": "f", "type": "fc", "units": 6},), (N, C, 4, 3),
                      {"layers": {"f": {"c": comm.size}}})):
        model = run_lbannpy(case, comm)[4]
        plans = model.layers[0]._in_plans
        assert_all(comm, plans == [None], f"{case.id}: planned {plans}")


def _windowless(model) -> list[str]:
    return [lay.name for lay in model.layers
            if lay.type == "conv" and lay.kernel_pads is not None and not lay.halo.local]


def windowless_cases(size: int) -> list[Case]:
    """Split convolutions that can go windowless (blocks starting on a stride under some splits), a ReLU
    first so that the input gradient is wanted: every conv variant, even blocks with stride 2, 3-D (shared
    with the GPU tier, tests/gpu/test_layers_gpu.py)."""
    relu = {"name": "r0", "type": "relu"}
    cases = [Case("windowless" + "".join(f"-{k}{v[k]}" for k in v), (relu, conv(**v)), (N, C, H, W),
                  {"default": par})
             for v in CONV_VARIANTS for par in splits(size, ("n", "h", "w"))]
    cases += [Case("windowless-even", (relu, conv(kernel=3, stride=2, padding=1)), (4, 3, 16, 24),
                   {"default": par}) for par in splits(size, ("h", "w"))]
    cases += [Case("windowless3d", (relu, conv(kernel=3, padding=1, stride=(1, 2, 1))), (5, 2, 8, 8, 12),
                   {"default": par}) for par in splits(size, ("n", "h", "w"))]
    return cases


@pytest.mark.parametrize("kernels", ["own", "aten"])
def test_split_convolutions_without_a_window_match_pytorch(comm, kernels, monkeypatch):
    """A split convolution whose kernel pads its local block (ATen: every one; lbannpy's own: those of its
    one-call path) where the padding lands each output on its own rows (blocks starting on a stride) runs
    without a window: the local block's convolution plus the ghost rows' terms on the boundary outputs,
    forward and backward, under every spatial split, 2-D and 3-D, strided, dilated, uneven blocks; equal to
    PyTorch to 1e-10. A ReLU first, so the convolution's input gradient is wanted (see below for the layer
    reading the model input)."""
    from lbannpy.layers import conv as conv_layer

    monkeypatch.setattr(conv_layer, "WINDOWLESS_MAX_BOUNDARY", 1.0)  # these small blocks are all boundary
    bad, taken = [], 0
    for case in windowless_cases(comm.size):
        models = []
        bad += compare(case, comm, kernels=kernels, out=models)
        taken += len(_windowless(models[0]))
    # every rank count above one has splits whose blocks start on a stride: some convolutions go windowless
    ok = not bad and (comm.size == 1 or taken > 0)
    assert_all(comm, ok, "\n".join(bad) or f"no convolution ran without a window ({kernels})")


def test_the_convolution_reading_the_model_input_goes_windowless(comm, monkeypatch):
    """The layer reading the model input runs without a window too (keeping its input block, not a window
    of its own from step to step): with and without the input gradient (training's backward computes the
    filter gradient only), under every spatial split, equal to PyTorch."""
    from lbannpy.layers import conv as conv_layer

    monkeypatch.setattr(conv_layer, "WINDOWLESS_MAX_BOUNDARY", 1.0)  # 4 ranks: 1 boundary row of 12
    bad, taken = [], 0
    for par in splits(comm.size, ("h", "w")):
        for input_grad in (True, False):
            models = []
            case = Case("input-windowless" + "".join(f"-{k}{v}" for k, v in par.items()),
                        (conv(kernel=3, padding=1, stride=2),), (2, 3, 96, 96), {"default": par})
            bad += compare(case, comm, kernels="aten", out=models, input_grad=input_grad)
            taken += len(_windowless(models[0]))
            if (models[0].layers[0]._window_buf is None) != bool(_windowless(models[0])) and comm.size > 1:
                bad.append(f"{case.id}: a window kept, or none kept by the window path")
    ok = not bad and (comm.size == 1 or taken > 0)
    assert_all(comm, ok, "\n".join(bad) or "the model input's convolution kept its window")


def test_thin_blocks_keep_their_window(comm):
    """Windowless only where the boundary boxes (convolved again for their ghost terms) are at most
    ``WINDOWLESS_MAX_BOUNDARY`` of the output block: 64 rows over 2 ranks go windowless (1 boundary row of
    32), 16 rows keep the window (1 of 8); both equal PyTorch."""
    if comm.size != 2:
        pytest.skip("written for 2 ranks (decided by comm.size on every rank)")
    relu = {"name": "r0", "type": "relu"}
    bad = []
    for rows, want in ((64, True), (16, False)):
        models = []
        case = Case(f"rows{rows}", (relu, conv(kernel=3, padding=1)), (1, 3, rows, 16), {"default": {"h": 2}})
        bad += compare(case, comm, kernels="aten", out=models)
        if bool(_windowless(models[0])) != want:
            bad.append(f"{rows} rows: windowless {not want}, meant {want}")
    assert_all(comm, not bad, "\n".join(bad))
