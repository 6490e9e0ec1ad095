"""Instance norm's running statistics (``track_running_stats``) under every split, at any rank count.

Two training forwards move the running mean and variance as ``torch.nn.InstanceNorm2d`` moves its buffers
(the batch's average of each sample's mean and unbiased variance, ``momentum`` 0.3), whatever split holds
the samples, channels and pixels; the evaluation forward then normalises with them as PyTorch's does. The
statistics survive a checkpoint written under one split and resumed under another (float64, 1e-12).
"""
from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch

from lbannpy import checkpoint
from lbannpy.checkpoint import assemble
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.optim import SGD
from lbannpy.tensor import DistTensor
from mpi_util import assert_all
from test_layers import splits

N, C, H, W = 5, 6, 17, 23
LAYER = {"name": "i", "type": "instancenorm", "affine": True, "track_running_stats": True, "momentum": 0.3}


def _inputs(steps: int = 3):
    rng = np.random.default_rng(3)
    # shifted and scaled per channel, so the statistics differ from the initial zeros and ones
    return [rng.standard_normal((N, C, H, W)) * rng.uniform(0.5, 2.0, (1, C, 1, 1))
            + rng.normal(0, 3, (1, C, 1, 1)) for _ in range(steps)]


def _model(comm, par):
    ctx = LayerContext(comm, np, "float64", seed=4)
    spec = {"input": {"channels": C, "spatial": [H, W]}, "layers": [dict(LAYER)]}
    return Model(spec, N, ctx, {"default": par}), ctx


def _running(comm, layer):
    box = (layer.cbox,)
    return tuple(assemble(comm, (C,), box, getattr(layer, k)) for k in ("running_mean", "running_var"))


def _torch_run(xs):
    ref = torch.nn.InstanceNorm2d(C, affine=True, track_running_stats=True, momentum=0.3).double()
    ref.train()
    for x in xs[:-1]:
        ref(torch.tensor(x))
    ref.eval()
    with torch.no_grad():
        y = ref(torch.tensor(xs[-1])).numpy()
    return ref.running_mean.numpy(), ref.running_var.numpy(), y


def _err(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def test_running_statistics_and_evaluation_equal_pytorch(comm):
    xs = _inputs()
    rm_t, rv_t, y_t = _torch_run(xs)
    bad = []
    for par in splits(comm.size, ("n", "c", "h", "w")):
        model, _ = _model(comm, par)
        layer = model.layers[0]
        model.set_train(True)
        for x in xs[:-1]:
            model.forward(DistTensor.scatter(x, model.input_dist, comm))
        rm, rv = _running(comm, layer)
        model.set_train(False)
        y = model.forward(DistTensor.scatter(xs[-1], model.input_dist, comm)).gather(comm)
        for what, a, b in (("running mean", rm, rm_t), ("running var", rv, rv_t),
                           ("evaluation output", y, y_t)):
            if not _err(a, b) <= 1e-12:
                bad.append(f"{par}: {what} relative error {_err(a, b):.3g}")
    assert_all(comm, not bad, "\n".join(bad))


@pytest.mark.timeout(120)
def test_running_statistics_survive_a_checkpoint_under_another_split(comm):
    xs = _inputs()
    d = comm.bcast_obj(tempfile.mkdtemp(prefix="lbannpy-norm-") if comm.rank == 0 else None)
    try:
        pars = splits(comm.size, ("n", "c", "h", "w"))
        first, last = pars[0], pars[-1]
        model, _ = _model(comm, first)
        model.set_train(True)
        for x in xs[:-1]:
            model.forward(DistTensor.scatter(x, model.input_dist, comm))
        want = _running(comm, model.layers[0])
        checkpoint.save(comm, d, 2, model.params, SGD(model.params, 0.1), {"step": 2}, model.layers)
        again, _ = _model(comm, last)
        path, info = checkpoint.resume(comm, d, again.params, SGD(again.params, 0.1), again.layers, np)
        got = _running(comm, again.layers[0])
        ok = path is not None and all(np.array_equal(a, b) for a, b in zip(got, want))
        assert_all(comm, ok, f"saved under {first}, resumed under {last}: {got} != {want}")
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(d, ignore_errors=True)
