"""The stand-in's ElementwiseKernel and ReductionKernel (CuPy's argument rules, the body compiled for the
host), and batch-norm's GPU path through them: the same numbers as the host's compiled kernels and a fixed
handful of kernel launches per layer and step. Run by tests/test_gpu_kernels_standin.py in a subprocess
whose PYTHONPATH starts with tests/gpu_standin."""
import numpy as np
import pytest

import cupy
from cupy import _standin

from lbannpy.layers.kernels import batchnorm as K

RNG = np.random.default_rng(3)


def test_elementwise_kernel_binds_types_broadcasts_and_writes_given_outputs():
    k = cupy.ElementwiseKernel("T x, T s, float64 m, int32 flag", "T y, float64 z",
                               "y = flag ? x * s : x; z = (double)x + m;", "standin_ek")
    h = RNG.standard_normal((3, 4)).astype(np.float32)
    s = RNG.standard_normal((1, 4)).astype(np.float32)
    y, z = k(cupy.asarray(h), cupy.asarray(s), 0.25, 1)
    assert y.dtype == np.float32 and z.dtype == np.float64 and y.shape == z.shape == (3, 4)
    np.testing.assert_array_equal(y.get(), h * s)
    np.testing.assert_array_equal(z.get(), h.astype(np.float64) + 0.25)
    out = cupy.zeros((3, 4), dtype=np.float32)
    zz = cupy.zeros((3, 4))
    got = k(cupy.asarray(h), cupy.asarray(s), 0.0, 0, out, zz)
    assert got[0] is out and got[1] is zz
    np.testing.assert_array_equal(out.get(), h)
    acc = cupy.ElementwiseKernel("T v", "T a", "a = a + v;", "standin_acc")  # outputs are references
    a = cupy.asarray(np.ones(5, np.float64))
    acc(cupy.asarray(np.arange(5.0)), a)
    np.testing.assert_array_equal(a.get(), 1 + np.arange(5.0))


def test_elementwise_kernel_refuses_what_cupy_refuses():
    k = cupy.ElementwiseKernel("T x, T w", "T y", "y = x + w;", "standin_ek2")
    x32, x64 = cupy.zeros(3, dtype=np.float32), cupy.zeros(3)
    with pytest.raises(TypeError, match="mismatched"):
        k(x32, x64)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        k(x32, np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="Wrong number of arguments"):
        k(x32)
    with pytest.raises(RuntimeError, match="does not compile"):
        cupy.ElementwiseKernel("T x", "T y", "y = no_such_function(x);", "standin_bad")(x32)


def test_kernels_are_ordered_on_streams_like_any_launch():
    k = cupy.ElementwiseKernel("T x", "T y", "y = x * 2;", "standin_twice")
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.arange(4, dtype=np.float32)
    with pytest.raises(_standin.RaceError):
        k(x)  # written on the side stream, read on the current one with nothing ordering them
    ev = side.record()
    cupy.cuda.get_current_stream().wait_event(ev)
    np.testing.assert_array_equal(k(x).get(), 2 * np.arange(4))


def test_reduction_kernel_over_axes():
    k = cupy.ReductionKernel("T x, T s", "float64 r", "((double)x - s) * ((double)x - s)", "a + b", "r = a",
                             "0", "standin_sq")
    h = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    s = h[0:1, :, 0:1]
    ref = ((h.astype(np.float64) - s) ** 2)
    for axis, keep in (((0, 2), False), ((0, 2), True), (None, False), (1, False)):
        got = k(cupy.asarray(h), cupy.asarray(np.ascontiguousarray(s)), axis=axis, keepdims=keep)
        want = ref.sum(axis=axis, keepdims=keep)
        assert got.shape == np.shape(want) and got.dtype == np.float64
        np.testing.assert_allclose(got.get(), want, rtol=1e-13)
    mx = cupy.ReductionKernel("T x", "T m", "x", "max(a, b)", "m = a", "-1e300", "standin_max")
    np.testing.assert_array_equal(mx(cupy.asarray(h), axis=2).get(), h.max(axis=2))


def _bn_step(xp, h, dy, relu, dtype):
    """One training step of a batch-norm layer's kernels (as layers/batchnorm.py calls them)."""
    c = h.shape[1]
    x, d = xp.asarray(h.astype(dtype)), xp.asarray(dy.astype(dtype))
    g = xp.asarray(np.linspace(0.5, 1.5, c).astype(dtype))
    b = xp.asarray(np.linspace(-0.2, 0.3, c).astype(dtype))
    rm, rv = xp.asarray(np.full(c, 0.1)), xp.asarray(np.full(c, 0.9))
    gg, gb = xp.asarray(np.full(c, 1.0, dtype)), xp.asarray(np.full(c, -1.0, dtype))
    count = float(h.size // c)
    if xp is cupy:
        _standin.reset_launches()
    tot = K.bn_local_sums(x)
    y, mean, var, rm2, rv2 = K.bn_train_forward(x, tot, count, g, b, 1e-5, 0.1, rm, rv, relu=relu,
                                                in_place=True)
    assert rm2 is rm and rv2 is rv  # the running statistics stay in their buffers (a captured step's)
    t2 = K.bn_backward_sums(d, x, mean, var, 1e-5, y=y if relu else None)
    K.bn_add_param_grads(t2, gg, gb)
    dx = K.bn_backward_data_summed(d, x, mean, var, g, 1e-5, t2, count, y=y if relu else None)
    ev = K.bn_forward(x, rm2, rv2, g, b, 1e-5, relu=relu)
    launched = _standin.launches() if xp is cupy else None
    out = [y, mean, var, rm2, rv2, tot, t2, gg, gb, dx, ev]
    return [cupy.asnumpy(a) if xp is cupy else a for a in out], launched


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 7), (3, 2, 2, 3, 2), (4, 6)])
def test_batchnorm_gpu_path_equals_the_host_kernels(shape, relu, dtype):
    h = (RNG.standard_normal(shape) * 3 + 5).astype(dtype)  # an offset mean: the sums' precision shows
    dy = RNG.standard_normal(shape).astype(dtype)
    gpu, launched = _bn_step(cupy, h, dy, relu, dtype)
    host, _ = _bn_step(np, h, dy, relu, dtype)
    names = ["y", "mean", "var", "running_mean", "running_var", "sums", "backward sums", "dgamma", "dbeta",
             "dx", "eval y"]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, b in zip(names, gpu, host):
        assert a.dtype == b.dtype, name
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()), err_msg=name)
    kernels = {k: v for k, v in launched.items() if k.startswith("kernel ")}
    # forward: 2 reductions, the sums, the statistics, normalise; backward: 2 reductions, the sums, the
    # parameter gradients, the coefficients, the data gradient; evaluation: scale/shift and normalise
    assert sum(kernels.values()) == 13, kernels
    assert all(v == 1 or k.endswith("relu_fwd") for k, v in kernels.items()), kernels
    assert launched == kernels, launched  # nothing else writes device memory (views and allocations only)


OPT_CASES = [{"type": "sgd", "lr": 0.1},
             {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-2},
             {"type": "sgd", "lr": 0.05, "momentum": 0.8, "nesterov": True},
             {"type": "adam", "lr": 1e-2},
             {"type": "adam", "lr": 3e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 1e-3}]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("cfg", OPT_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_optimizer_gpu_update_is_one_kernel_a_parameter_and_equals_the_host(cfg, dtype):
    from lbannpy.dist import Distribution
    from lbannpy.layers.param import Param
    from lbannpy.optim import make_optimizer

    rng = np.random.default_rng(0)
    shapes = [(4, 3), (7, 1), (2, 3, 5)]
    w0 = [rng.standard_normal(s).astype(dtype) for s in shapes]

    def params(xp):
        return [Param(f"w{i}", w.shape, tuple((0, n) for n in w.shape), xp.asarray(w.copy()),
                      xp.zeros(w.shape, dtype=dtype), Distribution.whole(w.ndim, 1), ())
                for i, w in enumerate(w0)]

    host, dev = params(np), params(cupy)
    opt_h, opt_d = make_optimizer(cfg, host, total_steps=10), make_optimizer(cfg, dev, total_steps=10)
    for step in range(6):
        gs = [rng.standard_normal(s).astype(dtype) for s in shapes]
        for ps, opt, xp in ((host, opt_h, np), (dev, opt_d, cupy)):
            opt.zero_grad()
            for p, g in zip(ps, gs):
                p.grad += xp.asarray(g)
        opt_h.step()
        _standin.reset_launches()
        opt_d.step()
        kernels = {k: v for k, v in _standin.launches().items() if k.startswith("kernel ")}
        assert sum(kernels.values()) == len(shapes), kernels  # one kernel per parameter
        tol = 1e-13 if dtype == np.float64 else 2e-6
        for ph, pd in zip(host, dev):
            np.testing.assert_allclose(cupy.asnumpy(pd.value), ph.value, rtol=tol, atol=tol)
            for slot, sh in opt_h.state[ph.name].items():
                np.testing.assert_allclose(cupy.asnumpy(opt_d.state[pd.name][slot]), sh, rtol=tol, atol=tol)
    assert sorted(opt_d.state["w0"]) == sorted(opt_h.state["w0"])  # the checkpoint's slots


POOLS = [((2, 3, 9, 8), (3, 3), (2, 2), 1), ((1, 2, 8, 8), (2, 2), None, 1), ((2, 2, 11), (3,), (2,), 2),
         ((1, 2, 5, 6, 7), (2, 3, 2), (1, 2, 2), 1), ((2, 1, 10, 9), (3, 2), (1, 3), (2, 1))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,kernel,stride,dilation", POOLS)
def test_max_pool_gpu_path_is_one_kernel_each_way_and_equals_the_host(shape, kernel, stride, dilation, dtype):
    from lbannpy.layers.kernels import pool

    h = RNG.integers(-3, 4, size=shape).astype(dtype)  # small integers: ties between taps are frequent
    h.reshape(-1)[::17] = np.nan  # and NaNs win
    _standin.reset_launches()
    y, arg = pool.max_pool_forward(cupy.asarray(h), kernel, stride, dilation)
    fwd = {k: v for k, v in _standin.launches().items() if k.startswith("kernel ")}
    hy, harg = pool.max_pool_forward(h, kernel, stride, dilation)
    np.testing.assert_array_equal(y.get(), hy)  # NaN where the host has NaN
    np.testing.assert_array_equal(arg.get(), harg)
    dy = RNG.standard_normal(hy.shape).astype(dtype)
    _standin.reset_launches()
    dx = pool.max_pool_backward(cupy.asarray(dy), arg, shape, kernel, stride, dilation)
    bwd = {k: v for k, v in _standin.launches().items() if k.startswith("kernel ")}
    hdx = pool.max_pool_backward(dy, harg, shape, kernel, stride, dilation)
    np.testing.assert_allclose(dx.get(), hdx, rtol=1e-6 if dtype == np.float32 else 1e-14, atol=1e-6)
    assert fwd == {"kernel lbannpy_maxpool_fwd": 1} and bwd == {"kernel lbannpy_maxpool_bwd": 1}, (fwd, bwd)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_is_one_kernel_and_equals_the_host(dtype):
    from lbannpy.layers.kernels import relu_backward

    y = RNG.standard_normal((3, 4, 5)).astype(dtype)
    y.reshape(-1)[::7] = 0.0
    y.reshape(-1)[::11] = np.nan
    dy = RNG.standard_normal(y.shape).astype(dtype)
    d_dy, d_y = cupy.asarray(dy), cupy.asarray(y)
    _standin.reset_launches()
    got = relu_backward(d_dy, d_y)
    assert _standin.launches() == {"kernel lbannpy_relu_bwd": 1}
    np.testing.assert_array_equal(got.get(), relu_backward(dy, y))


def _dev_params(xp, shapes, dtype, seed=0):
    from lbannpy.dist import Distribution
    from lbannpy.layers.param import Param

    rng = np.random.default_rng(seed)
    return [Param(f"w{i}", s, tuple((0, n) for n in s), xp.asarray(rng.standard_normal(s).astype(dtype)),
                  xp.zeros(s, dtype=dtype), Distribution.whole(len(s), 1), ()) for i, s in enumerate(shapes)]


def _args(call):
    """A launch's arguments as what a captured graph would keep: device pointers and host values."""
    return tuple(a.data.ptr if isinstance(a, cupy.ndarray) else a for a in call)


SCHEDULED = [dict(OPT_CASES[1], schedule={"type": "cosine", "warmup_steps": 2}),
             dict(OPT_CASES[2], schedule={"type": "step", "step_size": 2, "gamma": 0.5}),
             dict(OPT_CASES[4], schedule={"type": "cosine", "warmup_steps": 3})]


@pytest.mark.parametrize("cfg", SCHEDULED, ids=lambda c: f"{c['type']}-{c['schedule']['type']}")
def test_optimizer_launches_the_same_arguments_every_step(cfg, monkeypatch):
    """The learning rate, Adam's bias corrections, the first-step flag and the step counter are read from
    device memory: every step launches the same arguments into the same buffers (what a step captured once
    and replayed does), and the updates equal the host optimizer's, also a late update of the step before
    and a resumed step counter."""
    import lbannpy.optim as optim
    from lbannpy.optim import learning_rate, make_optimizer

    shapes, steps = [(4, 3), (7, 1)], 6
    dev, host = _dev_params(cupy, shapes, np.float64), _dev_params(np, shapes, np.float64)
    opt_d, opt_h = make_optimizer(cfg, dev, total_steps=steps), make_optimizer(cfg, host, total_steps=steps)
    assert len({learning_rate(cfg["lr"], t, steps, cfg["schedule"]) for t in range(steps)}) > 2
    state0 = {(p, s): a.data.ptr for p, st in opt_d.state.items() for s, a in st.items()}
    assert sorted(opt_d.state["w0"]) == opt_d.slot_names()  # created at set-up, before any step
    calls = []
    kernels = optim._gpu_updates(dev[0].value)
    for name, k in list(kernels.items()):
        monkeypatch.setitem(kernels, name, lambda *a, _k=k: calls.append(_args(a)) or _k(*a))
    rng = np.random.default_rng(4)
    seen = []

    def step(t=None, late=False):
        gs = [rng.standard_normal(s) for s in shapes]
        for ps, xp in ((dev, cupy), (host, np)):
            for p, g in zip(ps, gs):
                p.grad[...] = xp.asarray(g)
        calls.clear()
        if late:
            opt_d.step_params(dev, t=t)
            opt_h.step_params(host, t=t)
        else:
            opt_d.step()
            opt_h.step()
        seen.append(list(calls))
        for pd, ph in zip(dev, host):
            np.testing.assert_allclose(cupy.asnumpy(pd.value), ph.value, rtol=1e-13, atol=1e-15)
            for slot, sh in opt_h.state[ph.name].items():
                np.testing.assert_allclose(cupy.asnumpy(opt_d.state[pd.name][slot]), sh, rtol=1e-13,
                                           atol=1e-15)

    for _ in range(steps):
        step()
    assert len(seen[0]) == len(shapes) and all(s == seen[0] for s in seen), seen
    assert {(p, s): a.data.ptr for p, st in opt_d.state.items() for s, a in st.items()} == state0
    step(t=opt_d.t - 1, late=True)  # a replicated layer's update, applied after its step ended
    late = seen[-1]
    step(t=opt_d.t - 1, late=True)
    assert seen[-1] == late  # a late update launches its own constant arguments too
    for opt in (opt_d, opt_h):  # a resume sets the counter (a copy, outside any step)
        opt.t = 2
    step()
    assert int(opt_d.steps.tdev[0]) == 3


def test_optimizer_update_follows_the_learning_rate_in_device_memory():
    """Writing a step's learning rate into the device table changes that step's update: the value is read
    from device memory, not launched."""
    from lbannpy.optim import make_optimizer

    dev = _dev_params(cupy, [(5, 2)], np.float64)
    p = dev[0]
    opt = make_optimizer({"type": "sgd", "lr": 0.1}, dev, total_steps=4)
    g = np.random.default_rng(2).standard_normal((5, 2))
    want = cupy.asnumpy(p.value).copy()
    for t, lr in enumerate((0.1, 0.75, 0.1)):
        if lr != 0.1:
            opt.steps.table(np.float64, t)[4 * t:4 * t + 1] *= 7.5  # on the device
        p.grad[...] = cupy.asarray(g)
        opt.step()
        want -= lr * g
        np.testing.assert_allclose(cupy.asnumpy(p.value), want, rtol=1e-14)


def test_optimizer_step_table_grows_outside_steps_and_says_so():
    """Past the planned steps the table is planned anew (eagerly, by the host's count of replayed steps),
    its generation tells a captured step to capture again, and the rows are the schedule's."""
    from lbannpy.optim import learning_rate, make_optimizer

    cfg = {"type": "adam", "lr": 0.01, "schedule": {"type": "step", "step_size": 1, "gamma": 0.5}}
    opt = make_optimizer(cfg, _dev_params(cupy, [(2, 2)], np.float32), total_steps=2)
    rows, gen = opt.steps.rows, opt.steps.generation
    for _ in range(rows):
        opt.count_replayed_step()
    assert opt.steps.rows > opt.t and opt.steps.generation == gen + 1
    tab = cupy.asnumpy(opt.steps.table(np.float32, opt.t)).reshape(-1, 4)
    want = [(learning_rate(0.01, t, 2, cfg["schedule"]), 1 - 0.9 ** (t + 1), 1 - 0.999 ** (t + 1), t == 0)
            for t in range(opt.steps.rows)]
    np.testing.assert_array_equal(tab, np.array(want, dtype=np.float64).astype(np.float32))

def test_dropout_mask_from_a_device_step_counter_equals_the_host_keys():
    from lbannpy.layers.kernels import activation as A

    box = ((0, 3), (2, 7), (1, 5))
    step = cupy.zeros(1, dtype=np.uint64)
    for k in range(4):
        got = A.dropout_mask(11, step, 5, box, 0.4, xp=cupy, dtype=np.float64)
        np.testing.assert_array_equal(cupy.asnumpy(got), A.dropout_mask(11, k, 5, box, 0.4, dtype=np.float64))
        step += 1


def test_dropout_layer_draws_each_steps_mask_from_device_memory():
    """The GPU layer's masks at steps 0, 1, 2 (and after a resume to step 7) equal the host layer's; the
    step lives in one device counter the forward advances on the device."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    spec = {"input": {"channels": 3, "spatial": [5, 6]},
            "layers": [{"name": "d1", "type": "dropout", "p": 0.5}, {"name": "f1", "type": "fc", "units": 2}]}
    h = RNG.standard_normal((2, 3, 5, 6))
    models = {xp: Model(spec, 2, LayerContext(SingleCommunicator(), xp, "float64", seed=9), {})
              for xp in (cupy, np)}
    counter = models[cupy].layers[0]._step_dev
    ptr = counter.data.ptr
    for k in range(4):
        if k == 3:
            for m in models.values():
                m.layers[0].load_state({"step": 7})
        masks = []
        for xp, m in models.items():
            m.set_train(True)
            m.forward(DistTensor(xp.asarray(h), m.input_shape, m.input_dist, 0))
            masks.append(m._acts["d1"].local)
        np.testing.assert_array_equal(cupy.asnumpy(masks[0]), masks[1])
        assert not (masks[1] == h).all()
    assert models[cupy].layers[0]._step_dev.data.ptr == ptr and int(counter[0]) == 8
    counter += 2  # two replayed forwards advance the device counter alone: a checkpoint saves it
    assert models[cupy].layers[0].state() == {"step": 10}


def _step_buffers(model, opt):
    """The device buffers a captured training step reads and writes that live across steps: parameters,
    gradients, optimizer state and step table, batch-norm running statistics, dropout counters and the
    summed gradients of tensors read twice."""
    out = {}
    for p in model.params:
        out[p.name] = (p.value.data.ptr, p.grad.data.ptr)
    for name, st in opt.state.items():
        for slot, a in st.items():
            out[(name, slot)] = a.data.ptr
    out["table"] = [t.data.ptr for t in opt.steps.tables.values()]
    out["counter"] = opt.steps.tdev.data.ptr
    for layer in model.layers:
        for attr in ("running_mean", "running_var", "_step_dev"):
            if getattr(layer, attr, None) is not None:
                out[(layer.name, attr)] = getattr(layer, attr).data.ptr
    for key, buf in model._grad_sums.items():
        out[("sum",) + key[:1]] = buf.data.ptr
    return out


def test_a_training_step_keeps_its_buffers_and_equals_the_host():
    """Steps 1, 2 and 3 of a net with batch-norm, dropout, a residual sum and an SGD schedule write the
    same device buffers as step 0 (what a step captured once and replayed does) and give the host's
    weights, running statistics and masks."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.optim import make_optimizer
    from lbannpy.tensor import DistTensor

    spec = {"input": {"channels": 2, "spatial": [6, 6]},
            "layers": [{"name": "c1", "type": "conv", "filters": 3, "kernel": 3, "padding": 1},
                       {"name": "b1", "type": "batchnorm"}, {"name": "r1", "type": "relu"},
                       {"name": "d1", "type": "dropout", "p": 0.3},
                       {"name": "s1", "type": "sum", "parents": ["d1", "c1"]},
                       {"name": "f1", "type": "fc", "units": 4}]}
    cfg = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "schedule": {"type": "cosine", "warmup_steps": 1}}
    runs = {}
    for xp in (cupy, np):
        model = Model(spec, 3, LayerContext(SingleCommunicator(), xp, "float64", seed=4), {})
        runs[xp] = (model, make_optimizer(cfg, model.params, total_steps=4))
    for pd, ph in zip(runs[cupy][0].params, runs[np][0].params):  # the same initial weights
        pd.value[...] = cupy.asarray(ph.value)
    rng = np.random.default_rng(6)
    seen = None
    for _ in range(4):
        x, dy = rng.standard_normal((3, 2, 6, 6)), rng.standard_normal((3, 4))
        for xp, (model, opt) in runs.items():
            model.set_train(True)
            opt.zero_grad()
            y = model.forward(DistTensor(xp.asarray(x), model.input_shape, model.input_dist, 0))
            model.backward(DistTensor(xp.asarray(dy), y.global_shape, y.dist, 0), input_grad=False)
            opt.step()
        (md, od), (mh, oh) = runs[cupy], runs[np]
        now = _step_buffers(md, od)
        assert seen is None or now == seen
        seen = now
        for pd, ph in zip(md.params, mh.params):
            np.testing.assert_allclose(cupy.asnumpy(pd.value), ph.value, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(cupy.asnumpy(od.state[pd.name]["momentum"]),
                                       oh.state[ph.name]["momentum"], rtol=1e-12, atol=1e-12)
        for ld, lh in zip(md.layers, mh.layers):
            if hasattr(lh, "running_mean"):
                np.testing.assert_allclose(cupy.asnumpy(ld.running_var), lh.running_var, rtol=1e-12)
    assert any(k[0] == "sum" for k in seen if isinstance(k, tuple))  # c1's two readers
