"""Training-mode batch normalisation on CuPy arrays through cuDNN Frontend's batch-norm graphs, for a run
whose kernel set is cuDNN Frontend's (``runtime.kernels: cudnn``, or ``auto`` on a GPU where ``cudnn``
imports: :mod:`.select`).

Which pass runs where, and why:

- Where the layer's statistics are this rank's block alone (a statistics group of one rank: no split of
  space, and samples whole or ``sync: group``), the forward is cuDNN's fused training ``batchnorm`` (the
  batch's mean and inverse standard deviation and the normalised output in one plan) and the backward
  cuDNN's ``batchnorm_backward`` (input, scale and bias gradients in one plan), both reducing over the
  block, which is then the whole domain of the statistics.
- Where the statistics span ranks (a split domain), cuDNN's reductions would be wrong: they cover the local
  block only, and the only cross-device port the real API offers (``peer_stats``) exchanges partial
  statistics between the GPUs of one node through peer memory, not over NCCL or MPI between nodes. There
  lbannpy's per-channel partial sums (float64, about each row's own values: :mod:`.batchnorm`) and their
  allreduce stay as they are, and cuDNN's ``batchnorm_inference`` normalises with the global mean and
  inverse standard deviation given as tensors. The input gradient keeps lbannpy's one-pass CuPy kernel from
  the reduced sums: the real API has no batch-norm backward that takes reduced sums (no ``dbn_weight`` or
  ``bn_finalize``), and a graph of pointwise nodes alone has no anchoring operation for cuDNN's
  runtime-fusion engines. A block of one value per channel (``N * H * W = 1``) also takes this path, whose
  unbiased variance is the layer's own (cuDNN's divides by ``N - 1``).
- Evaluation normalises with the running statistics through the same ``batchnorm_inference`` plans.

The running statistics are updated by one per-channel CuPy kernel, never by cuDNN's running-statistics
ports: they stay the layer's float64 buffers in every run (a float32 graph's statistics tensors are float32)
and follow the layer's definitions (momentum, unbiased variance) whichever library computed the batch's
statistics. A fused ReLU (the layer's ``fuse_relu``) is applied, and its gradient mask taken, by lbannpy's
CuPy kernels around the cuDNN plans, so every cuDNN graph holds one norm node.

Plans: one cuDNN Frontend graph per (pass, device, block shape, type, epsilon), built and given its
workspace on first use (an eager warm-up step in a training run, never a captured one) through
:func:`.cudnn.finish` (no non-deterministic engines, float32 kept float32), and kept; a call only sets the
device's handle to CuPy's current stream and enqueues the plan, so it is ordered with the CuPy work around
it without a host synchronisation and recorded into a captured step like any kernel. A shape no cuDNN engine
runs (``cudnnGraphNotSupportedError`` at planning) takes lbannpy's own CuPy kernels, and the layer then
names those as its kernels.
"""
from __future__ import annotations

from lbannpy.backend import module_kernels

from . import cudnn
from .batchnorm import relu_mask

_PLANS: dict = {}  # (pass, device, image shape, dtype char, eps) -> Plan, or None where cuDNN has no engine

_RELU = ("T x", "T y", "y = x > (T)0 ? x : (T)0;", "lbannpy_cudnn_bn_relu")
_ELT = (
    # the split path: mean and variance from the reduced sums (as the own kernels compute them), the
    # normalisation's tensors in the graph's type, the running statistics updated in place
    ("float64 t1, float64 t2, float64 count, float64 eps, float64 mom",
     "float64 mean, float64 var, T mt, T it, float64 rm, float64 rv",
     "double mu = t1 / count; double v = t2 / count - mu * mu; v = v < 0.0 ? 0.0 : v;"
     "mean = mu; var = v; mt = (T)mu; it = (T)(1.0 / sqrt(v + eps));"
     "rm = (1.0 - mom) * rm + mom * mu;"
     "rv = (1.0 - mom) * rv + mom * (v * (count / (count > 1.0 ? count - 1.0 : 1.0)));",
     "lbannpy_cudnn_bn_stats"),
    # the fused path: the running statistics from cuDNN's mean and inverse standard deviation
    ("T mc, T ic, float64 count, float64 eps, float64 mom", "float64 rm, float64 rv",
     "double mu = (double)mc; double inv = (double)ic; double v = 1.0 / (inv * inv) - eps;"
     "v = v < 0.0 ? 0.0 : v;"
     "rm = (1.0 - mom) * rm + mom * mu;"
     "rv = (1.0 - mom) * rv + mom * (v * (count / (count > 1.0 ? count - 1.0 : 1.0)));",
     "lbannpy_cudnn_bn_running"),
    # evaluation: the running statistics as the normalisation's tensors
    ("float64 rm, float64 rv, float64 eps", "T mt, T it", "mt = (T)rm; it = (T)(1.0 / sqrt(rv + eps));",
     "lbannpy_cudnn_bn_eval"),
    ("T ds, T db", "T gg, T gb", "gg = gg + ds; gb = gb + db;", "lbannpy_cudnn_bn_add_grads"),
)


class _Kernels:
    def __init__(self, xp):
        self.relu = xp.ElementwiseKernel(*_RELU)
        self.stats, self.running, self.eval, self.add_grads = (xp.ElementwiseKernel(*k) for k in _ELT)


def _kernels(cp) -> _Kernels:
    return module_kernels(cp, "cudnn_bn", _Kernels)


def image_shape(shape) -> tuple:
    """The block as cuDNN's norms take it: 4-D and 5-D blocks as they are, any other ``(N, C, ...)`` as
    ``(N, C, 1, P)`` (the statistics do not depend on how space is laid out)."""
    shape = tuple(int(n) for n in shape)
    if len(shape) in (4, 5):
        return shape
    p = 1
    for n in shape[2:]:
        p *= n
    return (shape[0], shape[1], 1, p)


def channel_shape(image) -> tuple:
    return (1, image[1]) + (1,) * (len(image) - 2)


def _build(cp, handle, kind: str, image: tuple, dtype, eps: float):
    """The plan of pass ``kind`` (train, backward, inference), or None where no cuDNN engine runs it."""
    cd = cudnn.module()
    dt = cudnn.data_type(cd, dtype)
    chan = channel_shape(image)
    g = cd.pygraph(io_data_type=dt, intermediate_data_type=dt, compute_data_type=dt, handle=handle)

    def tensor(name, shape):
        return g.tensor(name=name, dim=list(shape), stride=cudnn.row_major(shape), data_type=dt)

    if kind == "train":
        ins = {"x": tensor("x", image), "scale": tensor("scale", chan), "bias": tensor("bias", chan)}
        y, mean, inv = g.batchnorm(input=ins["x"], scale=ins["scale"], bias=ins["bias"],
                                   epsilon=g.tensor_scalar(eps, dt, name="epsilon"), name="bn")[:3]
        outs = {"y": (y, image), "mean": (mean, chan), "inv": (inv, chan)}
    elif kind == "inference":
        ins = {"x": tensor("x", image), "mean": tensor("mean", chan), "inv": tensor("inv", chan),
               "scale": tensor("scale", chan), "bias": tensor("bias", chan)}
        y = g.batchnorm_inference(input=ins["x"], mean=ins["mean"], inv_variance=ins["inv"],
                                  scale=ins["scale"], bias=ins["bias"], name="bn_inference")
        outs = {"y": (y, image)}
    else:
        ins = {"dy": tensor("dy", image), "x": tensor("x", image), "scale": tensor("scale", chan),
               "mean": tensor("mean", chan), "inv": tensor("inv", chan)}
        dx, dscale, dbias = g.batchnorm_backward(grad=ins["dy"], input=ins["x"], scale=ins["scale"],
                                                 mean=ins["mean"], inv_variance=ins["inv"],
                                                 name="bn_backward")
        outs = {"dx": (dx, image), "dscale": (dscale, chan), "dbias": (dbias, chan)}
    for t, shape in outs.values():
        t.set_output(True).set_dim(list(shape)).set_stride(cudnn.row_major(shape)).set_data_type(dt)
    try:
        return cudnn.finish(cp, g, dict(ins, **{role: t for role, (t, _) in outs.items()}), handle,
                            exact_float32=dtype.char == "f")
    except cd.cudnnGraphNotSupportedError:
        return None


def plan(cp, kind: str, image: tuple, dtype, eps: float):
    """The :class:`.cudnn.Plan` of pass ``kind`` (train, backward, inference) for a block of shape ``image``
    (:func:`image_shape`) on the current device, built on first use and kept; None where cuDNN has none."""
    dev, handle = cudnn.device_handle(cp)
    key = (kind, dev, image, dtype.char, float(eps) if kind == "train" else None)
    if key not in _PLANS:
        _PLANS[key] = _build(cp, handle, kind, image, dtype, eps)
    return _PLANS[key]


def planned() -> int:
    """How many batch-norm plans this process holds (those cuDNN runs)."""
    return sum(p is not None for p in _PLANS.values())


class LayerPlans:
    """The cuDNN side of one batch-norm layer: its epsilon and momentum, and whether every pass it ran was
    cuDNN's (:attr:`name`, what ``summary.json`` says)."""

    def __init__(self, eps: float, momentum: float):
        self.eps, self.momentum = float(eps), float(momentum)
        self.fell_back = False

    @property
    def name(self) -> str:
        return "own" if self.fell_back else "cudnn"

    def _plans(self, cp, x, *kinds):
        image = image_shape(x.shape)
        plans = [plan(cp, kind, image, x.dtype, self.eps) for kind in kinds]
        if any(p is None for p in plans):
            self.fell_back = True
            return None, image
        return plans, image

    def _relu(self, cp, y, relu: bool):
        if relu:
            _kernels(cp).relu(y, y)
        return y

    def forward_local(self, x, gamma, beta, count: float, running_mean, running_var, relu: bool):
        """A training forward whose statistics are this block's: ``(y, saved)`` (``saved`` for
        :meth:`backward_local`), the running statistics updated in place; None where cuDNN has no plan for
        the shape (the caller then takes the own kernels)."""
        cp = cudnn.cupy_module()
        plans, image = self._plans(cp, x, "train", "backward")
        if plans is None:
            return None
        chan = channel_shape(image)
        y = cp.empty(image, dtype=x.dtype)
        mean, inv = cp.empty(chan, dtype=x.dtype), cp.empty(chan, dtype=x.dtype)
        xc = cudnn.contiguous(cp, x).reshape(image)
        plans[0].run(cp, {"x": xc, "scale": gamma.reshape(chan), "bias": beta.reshape(chan), "y": y,
                          "mean": mean, "inv": inv})
        _kernels(cp).running(mean.reshape(-1), inv.reshape(-1), float(count), self.eps, self.momentum,
                             running_mean, running_var)
        return self._relu(cp, y, relu).reshape(x.shape), (xc, mean, inv)

    def backward_local(self, dy, saved, gamma, gamma_grad, beta_grad, y=None):
        """The input gradient of :meth:`forward_local`'s step; ``gamma_grad`` and ``beta_grad`` grow by this
        block's scale and bias gradients. With ``y`` (a fused ReLU's output) ``dy`` counts where ``y > 0``."""
        cp = cudnn.cupy_module()
        xc, mean, inv = saved
        image, chan = tuple(xc.shape), tuple(mean.shape)
        bwd = plan(cp, "backward", image, xc.dtype, self.eps)
        g = dy if y is None else relu_mask(dy, y)
        dx = cp.empty(image, dtype=xc.dtype)
        dscale, dbias = cp.empty(chan, dtype=xc.dtype), cp.empty(chan, dtype=xc.dtype)
        bwd.run(cp, {"dy": cudnn.contiguous(cp, g).reshape(image), "x": xc, "scale": gamma.reshape(chan),
                     "mean": mean, "inv": inv, "dx": dx, "dscale": dscale, "dbias": dbias})
        _kernels(cp).add_grads(dscale.reshape(-1), dbias.reshape(-1), gamma_grad, beta_grad)
        return dx.reshape(dy.shape)

    def forward_reduced(self, x, tot, count: float, gamma, beta, running_mean, running_var, relu: bool):
        """A training forward from the statistics group's reduced sums ``tot`` (float64 ``(2C,)``: sums then
        sums of squares): ``(y, mean, var)`` (float64 ``(C,)``, what the own backward reads), the running
        statistics updated in place; None where cuDNN has no plan for the shape."""
        cp = cudnn.cupy_module()
        plans, image = self._plans(cp, x, "inference")
        if plans is None:
            return None
        c = tot.shape[0] // 2
        mean, var = cp.empty(c, dtype="float64"), cp.empty(c, dtype="float64")
        mt, it = cp.empty(c, dtype=x.dtype), cp.empty(c, dtype=x.dtype)
        _kernels(cp).stats(tot[:c], tot[c:], float(count), self.eps, self.momentum, mean, var, mt, it,
                           running_mean, running_var)
        y = self._normalise(cp, plans[0], x, image, mt, it, gamma, beta, relu)
        return y, mean, var

    def forward_eval(self, x, running_mean, running_var, gamma, beta, relu: bool):
        """Normalisation with the running statistics (evaluation); None where cuDNN has no plan."""
        cp = cudnn.cupy_module()
        plans, image = self._plans(cp, x, "inference")
        if plans is None:
            return None
        mt, it = _kernels(cp).eval(running_mean, running_var, self.eps, cp.empty(running_mean.shape, x.dtype),
                                   cp.empty(running_mean.shape, x.dtype))
        return self._normalise(cp, plans[0], x, image, mt, it, gamma, beta, relu)

    def _normalise(self, cp, inference, x, image, mt, it, gamma, beta, relu):
        chan = channel_shape(image)
        y = cp.empty(image, dtype=x.dtype)
        inference.run(cp, {"x": cudnn.contiguous(cp, x).reshape(image), "mean": mt.reshape(chan),
                      "inv": it.reshape(chan), "scale": gamma.reshape(chan), "bias": beta.reshape(chan),
                      "y": y})
        return self._relu(cp, y, relu).reshape(x.shape)
