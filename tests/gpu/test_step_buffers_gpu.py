"""A training step on a GPU keeps its buffers and reads its per-step values from device memory: what a
step captured once as a CUDA graph and replayed relies on.

The worker (``__main__`` below, one rank, on the CUDA/CuPy stand-in in every test run and on real CuPy with
``LBANNPY_GPU=real``) trains a net with batch-norm, dropout and a residual sum for four steps with an
optimizer whose learning rate follows a schedule, on CuPy and on NumPy from the same weights and data:

- every buffer that lives across steps (parameters, gradients, optimizer state, the step table and counter,
  batch-norm running statistics, the dropout counter, the summed gradient of a tensor read twice) is the
  one of step 0 at steps 1 to 3;
- the update kernels get the same arguments at every step while the learning rate changes;
- weights, optimizer state, running statistics and dropout masks equal the NumPy run's (float64).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
OPTIMIZERS = ["sgd", "adam"]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_a_gpu_step_keeps_its_buffers_and_equals_numpy(gpu_launch, opt):
    (row,) = gpu_launch(HERE, opt, 1, timeout=300)
    assert row["same_buffers"] == [True] * 3, row
    assert row["same_launches"] == [True] * 3 and row["learning_rates"] > 2, row
    assert row["max_rel"] <= 1e-11, row
    assert row["masks_equal"] and row["summed"], row


# ---------------------------------------------------------------------------------------------- worker
SPEC = {"input": {"channels": 2, "spatial": [6, 6]},
        "layers": [{"name": "c1", "type": "conv", "filters": 3, "kernel": 3, "padding": 1},
                   {"name": "b1", "type": "batchnorm"}, {"name": "r1", "type": "relu"},
                   {"name": "d1", "type": "dropout", "p": 0.3},
                   {"name": "s1", "type": "sum", "parents": ["d1", "c1"]},
                   {"name": "f1", "type": "fc", "units": 4}]}
CONFIGS = {"sgd": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True,
                   "schedule": {"type": "cosine", "warmup_steps": 1}},
           "adam": {"type": "adam", "lr": 0.01, "weight_decay": 1e-3,
                    "schedule": {"type": "step", "step_size": 1, "gamma": 0.5}}}


def _ptr(a) -> int:
    return a.data.ptr


def _buffers(model, opt) -> dict:
    out = {}
    for p in model.params:
        out[p.name] = (_ptr(p.value), _ptr(p.grad))
    for name, st in opt.state.items():
        for slot, a in st.items():
            out[f"{name}/{slot}"] = _ptr(a)
    out["table"] = sorted(_ptr(t) for t in opt.steps.tables.values())
    out["counter"] = _ptr(opt.steps.tdev)
    for layer in model.layers:
        for attr in ("running_mean", "running_var", "_step_dev"):
            if getattr(layer, attr, None) is not None:
                out[f"{layer.name}.{attr}"] = _ptr(getattr(layer, attr))
    for key, buf in model._grad_sums.items():
        out[f"sum {key[0]}"] = _ptr(buf)
    return out


def _worker(kind: str) -> dict:  # pragma: no cover - runs under mpiexec
    import cupy
    import numpy as np

    import lbannpy.optim as optim
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.optim import learning_rate, make_optimizer
    from lbannpy.tensor import DistTensor

    cfg = CONFIGS[kind]
    runs = {}
    for xp in (cupy, np):
        model = Model(SPEC, 3, LayerContext(SingleCommunicator(), xp, "float64", seed=4), {})
        runs[xp] = (model, make_optimizer(cfg, model.params, total_steps=4))
    (md, od), (mh, oh) = runs[cupy], runs[np]
    for pd, ph in zip(md.params, mh.params):  # the same initial weights
        pd.value[...] = cupy.asarray(ph.value)
    calls: list = []
    kernels = optim._gpu_updates(md.params[0].value)
    for name, k in list(kernels.items()):
        kernels[name] = lambda *a, _k=k: calls.append(tuple(
            _ptr(v) if isinstance(v, cupy.ndarray) else v for v in a)) or _k(*a)
    rng = np.random.default_rng(6)
    seen, launched = None, None
    state0 = {k: v for k, v in _buffers(md, od).items() if "/" in k}  # the optimizer state at set-up
    out = {"same_buffers": [], "same_launches": [], "masks_equal": True, "max_rel": 0.0}
    for _ in range(4):
        x, dy = rng.standard_normal((3, 2, 6, 6)), rng.standard_normal((3, 4))
        masks = []
        for xp, (model, opt) in runs.items():
            model.set_train(True)
            opt.zero_grad()
            y = model.forward(DistTensor(xp.asarray(x), model.input_shape, model.input_dist, 0))
            # where the dropout output is zero (dropped, or cut by the ReLU before it): the batch-norm
            # before it rounds differently on the device, the kept values differ in the last bits
            d1 = model._acts["d1"].local
            masks.append(cupy.asnumpy(d1 == 0) if xp is cupy else d1 == 0)
            model.backward(DistTensor(xp.asarray(dy), y.global_shape, y.dist, 0), input_grad=False)
            if xp is cupy:
                calls.clear()
            opt.step()
        out["masks_equal"] &= bool(np.array_equal(masks[0], masks[1]))
        now = _buffers(md, od)
        if seen is not None:
            out["same_buffers"].append(now == seen and all(now[k] == v for k, v in state0.items()))
            out["same_launches"].append(bool(calls) and calls == launched)
        seen, launched = now, list(calls)
        pairs = [(pd.value, ph.value) for pd, ph in zip(md.params, mh.params)]
        pairs += [(od.state[p.name][s], a) for p in mh.params for s, a in oh.state[p.name].items()]
        pairs += [(getattr(ld, k), getattr(lh, k)) for ld, lh in zip(md.layers, mh.layers)
                  for k in ("running_mean", "running_var") if hasattr(lh, k)]
        for d, h in pairs:
            rel = float(np.abs(cupy.asnumpy(d) - h).max() / max(np.abs(h).max(), 1e-300))
            out["max_rel"] = max(out["max_rel"], rel)
    out["learning_rates"] = len({learning_rate(cfg["lr"], t, 4, cfg["schedule"]) for t in range(4)})
    out["summed"] = any(k.startswith("sum ") for k in seen)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from mpi4py import MPI

    result = {"rank": MPI.COMM_WORLD.Get_rank()}
    result.update(_worker(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
