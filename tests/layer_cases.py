"""Shared by the serial and MPI layer tests: run a small model distributed, and the same model in PyTorch.

``run_lbannpy`` builds the model on a communicator with the given ``parallel`` config, feeds a global
input, backpropagates a global output gradient, synchronises weight gradients over their groups, and
returns the gathered global output, input gradient and parameter gradients. ``run_torch`` computes the
same with ``torch.autograd`` from the same initial weights. Everything is float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from lbannpy.checkpoint import assemble
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.tensor import DistTensor
from torch_refs import REFS


@dataclass(frozen=True)
class Case:
    """A model (DESIGN.md ``model`` tree), an input shape and the ``parallel`` config to run it under."""

    name: str
    layers: tuple
    input_shape: tuple
    parallel: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        deg = self.parallel.get("default", {})
        over = self.parallel.get("layers", {})
        d = "·".join(f"{k}{v}" for k, v in deg.items()) or "1"
        o = ";".join(f"{n}:" + "·".join(f"{k}{v}" for k, v in dd.items()) for n, dd in over.items())
        return f"{self.name}[{d}{'|' + o if o else ''}]"

    def spec(self) -> dict:
        return {"input": {"channels": self.input_shape[1], "spatial": list(self.input_shape[2:])},
                "layers": [dict(layer) for layer in self.layers]}


def global_data(case: Case, out_shape, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(case.input_shape)
    dy = rng.standard_normal(out_shape)
    return x, dy


def run_lbannpy(case: Case, comm, xp=np, overlap: bool = True, seed: int = 7, fuse: bool = True,
                kernels=None, input_grad: bool = True):
    """Collective over ``comm``: (y, dx, {param: grad}, {param: value}) as global NumPy arrays; ``fuse``
    False runs every layer on its own (no fused batch-norm + ReLU, no in-place ReLU); ``kernels``: the
    convolution kernel set, a ``runtime.kernels`` name or a :class:`ConvKernels` (default lbannpy's own);
    ``input_grad`` False back-propagates as training does (no gradient w.r.t. the model input: dx is
    None)."""
    ctx = LayerContext(comm, xp, "float64", seed=seed, overlap=overlap, fuse=fuse)
    if kernels is not None:
        from lbannpy.layers.kernels.select import conv_kernels

        ctx.conv_kernels = conv_kernels(kernels) if isinstance(kernels, str) else kernels
    model = Model(case.spec(), case.input_shape[0], ctx, case.parallel)
    x, dy = global_data(case, model.output.out_shape)
    xt = DistTensor.scatter(xp.asarray(x), model.input_dist, comm)
    y = model.forward(xt)
    dyt = DistTensor.scatter(xp.asarray(dy), y.dist, comm)
    dx = model.backward(dyt, input_grad=input_grad)
    grads, values = {}, {}
    for p in model.params:
        gc = ctx.block_comm(p.dist, p.reduce_dims)
        g = gc.allreduce(p.grad) if gc.size > 1 else p.grad
        grads[p.name] = assemble(comm, p.global_shape, p.box, g)
        values[p.name] = assemble(comm, p.global_shape, p.box, p.value)
    return (_np(y.gather(comm)), None if dx is None else _np(dx.gather(comm)), grads, values, model)


def _np(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _t(a, grad=False):
    return torch.tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def torch_reference(case: Case, values: dict, out_shape):
    x, dy = global_data(case, out_shape)
    xt = _t(x, True)
    outs = {"x": xt, "input": xt}
    params = {k: _t(v, True) for k, v in values.items()}
    prev = "x"
    for layer in case.spec()["layers"]:
        parents = layer.get("parents") or [prev]
        outs[layer["name"]] = _apply(layer, [outs[p] for p in parents], params)
        prev = layer["name"]
    y = outs[prev]
    y.backward(_t(dy))
    return (y.detach().numpy(), xt.grad.numpy(),
            {k: (v.grad.numpy() if v.grad is not None else np.zeros(v.shape)) for k, v in params.items()})


def _apply(layer, ins, params):
    name, ltype = layer["name"], layer["type"]
    if ltype == "conv":
        x = ins[0]
        nsp = x.dim() - 2
        k = layer.get("kernel", 3)
        pad = layer.get("padding", 0)
        dil = layer.get("dilation", 1)
        kk = [k] * nsp if isinstance(k, int) else list(k)
        dd = [dil] * nsp if isinstance(dil, int) else list(dil)
        if pad == "same":
            pads = [((d * (q - 1)) // 2, d * (q - 1) - (d * (q - 1)) // 2) for q, d in zip(kk, dd)]
        elif isinstance(pad, int):
            pads = [(pad, pad)] * nsp
        else:
            pads = [tuple(p) if not isinstance(p, int) else (p, p) for p in pad]
        flat = []
        for lo, hi in reversed(pads):
            flat += [lo, hi]
        conv = F.conv2d if nsp == 2 else F.conv3d
        mode = layer.get("padding_mode", "zeros")
        padded = F.pad(x, flat) if mode == "zeros" else F.pad(x, flat, mode=mode)
        return conv(padded, params[f"{name}.weight"], params.get(f"{name}.bias"),
                    stride=layer.get("stride", 1), dilation=dil, groups=layer.get("groups", 1))
    if ltype == "pool":
        nsp = ins[0].dim() - 2
        k = layer.get("kernel", 2)
        s = layer.get("stride", k)
        p = layer.get("padding", 0)
        if layer.get("mode", "max") == "max":
            return (F.max_pool2d if nsp == 2 else F.max_pool3d)(ins[0], k, s, p)
        return (F.avg_pool2d if nsp == 2 else F.avg_pool3d)(ins[0], k, s, p, count_include_pad=True)
    if ltype == "batchnorm":
        return F.batch_norm(ins[0], None, None, params[f"{name}.scale"], params[f"{name}.bias"],
                            training=True, eps=layer.get("eps", 1e-5))
    if ltype == "relu":
        return F.relu(ins[0])
    if ltype == "leaky_relu":
        return F.leaky_relu(ins[0], layer.get("slope", 0.01))
    if ltype == "sum":
        h = ins[0]
        for other in ins[1:]:
            h = h + other
        return h
    if ltype == "concat":
        return torch.cat(ins, dim=1)
    if ltype == "fc":
        return F.linear(ins[0].reshape(ins[0].shape[0], -1), params[f"{name}.weight"],
                        params.get(f"{name}.bias"))
    if ltype in REFS:
        return REFS[ltype](layer, ins, params)
    raise ValueError(f"no torch reference for layer type {ltype}")


def compare(case: Case, comm, xp=np, overlap: bool = True, rtol: float = 1e-10, kernels=None,
            out: list | None = None, input_grad: bool = True):
    """Collective: run both; return a list of mismatch messages (empty when everything agrees); the
    lbannpy model is appended to ``out`` when given; ``input_grad`` False: training's backward, no input
    gradient to compare."""
    y, dx, grads, values, model = run_lbannpy(case, comm, xp, overlap, kernels=kernels, input_grad=input_grad)
    if out is not None:
        out.append(model)
    ty, tdx, tgrads = torch_reference(case, values, model.output.out_shape)
    bad = []

    def check(what, a, b):
        scale = max(np.abs(b).max(), 1e-30)
        err = np.abs(a - b).max() / scale if a.shape == b.shape else np.inf
        if not err <= rtol:
            bad.append(f"{case.id} {what}: relative error {err:.3g} (shape {a.shape} vs {b.shape})")

    check("output", y, ty)
    if input_grad:
        check("input gradient", dx, tdx)
    for k in grads:
        check(f"gradient of {k}", grads[k], tgrads[k])
    return bad
