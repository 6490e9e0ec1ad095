"""Training-mode batch normalisation on a GPU in a fixed handful of kernels per layer and step.

The array-expression path issued about 80 CuPy operations per layer and step (row sums, a dozen small
per-channel vector operations each for the statistics, the running statistics, the scale and shift and the
backward's coefficients): on an H100 the whole step was host-bound, batch-norm taking ~40 ms of host time a
mesh1k step. Here each pass is one kernel:

forward   two reductions of the block (the sum and the sum of squares of ``x - s`` per channel, ``s`` the
          channel's first value, in float64), one per-channel kernel turning them into the ``(sum x, sum
          x^2)`` vector the statistics allreduce carries, one per-channel kernel for mean, variance, scale,
          shift and the running statistics, one element-wise normalise (+ ReLU);
backward  two reductions (``sum dy`` and ``sum dy (x - mean)``, ``dy`` masked by a fused ReLU, in float64),
          one per-channel kernel for the ``(sum dy, sum dy xhat)`` vector, one adding the parameter gradients,
          one per-channel kernel for the data gradient's coefficients and one element-wise data gradient.

Same results as :mod:`.batchnorm`'s NumPy and compiled paths to round-off (checked on the CuPy stand-in,
which compiles these kernels' C++ bodies for the host, in every test run).
"""
from __future__ import annotations

_RED = (  # (in, out, map, reduce, post, identity, name)
    ("T x, T s", "float64 r", "(double)x - (double)s", "a + b", "r = a", "0", "lbannpy_bn_sum"),
    ("T x, T s", "float64 r", "((double)x - (double)s) * ((double)x - (double)s)", "a + b", "r = a", "0",
     "lbannpy_bn_sumsq"),
    ("T dy, T y, int32 relu", "float64 r", "(relu && !(y > (T)0)) ? 0.0 : (double)dy", "a + b", "r = a", "0",
     "lbannpy_bn_sum_dy"),
    ("T dy, T y, int32 relu, T x, float64 m", "float64 r",
     "((relu && !(y > (T)0)) ? 0.0 : (double)dy) * ((double)x - m)", "a + b", "r = a", "0",
     "lbannpy_bn_sum_dy_xc"),
)
_ELT = (  # (in, out, operation, name)
    ("float64 s1, float64 s2, T s, float64 n", "float64 t1, float64 t2",
     "double v = (double)s; t1 = s1 + n * v; t2 = s2 + 2.0 * v * s1 + n * v * v;", "lbannpy_bn_sums"),
    # the running statistics rm, rv are updated in place (a captured step keeps writing the same buffers)
    ("float64 t1, float64 t2, float64 count, T gamma, T beta, float64 eps, float64 mom",
     "float64 mean, float64 var, T scale, T shift, float64 rm, float64 rv",
     "double mu = t1 / count; double v = t2 / count - mu * mu; v = v < 0.0 ? 0.0 : v;"
     "double k = (double)gamma / sqrt(v + eps);"
     "mean = mu; var = v; scale = (T)k; shift = (T)((double)beta - mu * k);"
     "rm = (1.0 - mom) * rm + mom * mu;"
     "rv = (1.0 - mom) * rv + mom * (v * (count / (count > 1.0 ? count - 1.0 : 1.0)));",
     "lbannpy_bn_stats"),
    ("float64 mean, float64 var, T gamma, T beta, float64 eps", "T scale, T shift",
     "double k = (double)gamma / sqrt(var + eps); scale = (T)k; shift = (T)((double)beta - mean * k);",
     "lbannpy_bn_scale_shift"),
    ("float64 s1, float64 s2, float64 var, float64 eps", "float64 t1, float64 t2",
     "t1 = s1; t2 = s2 / sqrt(var + eps);", "lbannpy_bn_bwd_sums"),
    ("float64 t2, float64 t1", "T gg, T gb", "gg = gg + (T)t2; gb = gb + (T)t1;", "lbannpy_bn_add_grads"),
    ("T dy, T y", "T dx", "dx = y > (T)0 ? dy : (T)0;", "lbannpy_relu_bwd"),
    ("float64 mean, float64 var, T gamma, float64 eps, float64 t1, float64 t2, float64 count",
     "T a, T b, T c",
     "double inv = 1.0 / sqrt(var + eps); double k = (double)gamma * inv;"
     "double bb = -k * inv * t2 / count;"
     "a = (T)k; b = (T)bb; c = (T)(-k * t1 / count - bb * mean);", "lbannpy_bn_coefficients"),
)


class Kernels:
    """The compiled kernels of one array module (see :func:`kernels`)."""

    def __init__(self, xp, fwd, bwd):
        self.xp, self.fwd, self.bwd = xp, fwd, bwd
        self.sum, self.sumsq, self.sum_dy, self.sum_dy_xc = (xp.ReductionKernel(*k) for k in _RED)
        (self.sums, self.stats, self.scale_shift, self.bwd_sums, self.add_grads, self.relu_mask,
         self.coefficients) = (xp.ElementwiseKernel(*k) for k in _ELT)


def _ncp(x):
    n, c = x.shape[0], x.shape[1]
    return x.reshape(n, c, -1)


def _two(xp, c):
    """A float64 ``(2C,)`` vector and its two halves."""
    tot = xp.empty(2 * c, dtype="float64")
    return tot, tot[:c], tot[c:]


def local_sums(k: Kernels, x):
    """``(sum x, sum x^2)`` per channel, one float64 ``(2C,)`` vector (what the statistics allreduce
    carries): sums of ``x - s`` about each channel's first value ``s`` (float64), shifted back per channel."""
    xf = _ncp(x)
    n, c, p = xf.shape
    s = xf[0:1, :, 0:1]
    s1, s2 = k.sum(xf, s, axis=(0, 2)), k.sumsq(xf, s, axis=(0, 2))
    tot, t1, t2 = _two(k.xp, c)
    k.sums(s1, s2, xf[0, :, 0], float(n * p), t1, t2)
    return tot


def train_forward(k: Kernels, x, tot, count, gamma, beta, eps, momentum, running_mean, running_var, relu):
    """``(y, mean, var, running_mean, running_var)`` from the reduced sums: one per-channel kernel, one
    element-wise pass. The running statistics are updated in the given arrays."""
    c = tot.shape[0] // 2
    beta = 0.0 if beta is None else beta
    xp = k.xp
    mean, var = xp.empty(c, dtype="float64"), xp.empty(c, dtype="float64")
    scale, shift = xp.empty(c, dtype=x.dtype), xp.empty(c, dtype=x.dtype)
    k.stats(tot[:c], tot[c:], float(count), gamma, beta, float(eps), float(momentum), mean, var, scale, shift,
            running_mean, running_var)
    return _normalise(k, x, scale, shift, relu), mean, var, running_mean, running_var


def forward(k: Kernels, x, mean, var, gamma, beta, eps, relu):
    """Normalise with given statistics (evaluation): one per-channel kernel, one element-wise pass."""
    scale, shift = k.scale_shift(mean, var, gamma, 0.0 if beta is None else beta, float(eps))
    return _normalise(k, x, scale, shift, relu)


def _normalise(k, x, scale, shift, relu):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return k.fwd(x, scale.reshape(shape), shift.reshape(shape), int(relu))


def backward_sums(k: Kernels, dy, x, mean, var, eps, y):
    """``(sum dy, sum dy * xhat)`` per channel as one float64 ``(2C,)`` vector; ``dy`` counts only where
    ``y > 0`` when ``y`` (a fused ReLU's output) is given."""
    xf, dyf = _ncp(x), _ncp(dy)
    yf, relu = (xf, 0) if y is None else (_ncp(y), 1)
    s1 = k.sum_dy(dyf, yf, relu, axis=(0, 2))
    s2 = k.sum_dy_xc(dyf, yf, relu, xf, mean.reshape(1, -1, 1), axis=(0, 2))
    tot, t1, t2 = _two(k.xp, xf.shape[1])
    k.bwd_sums(s1, s2, var, float(eps), t1, t2)
    return tot


def add_param_grads(k: Kernels, tot, gamma_grad, beta_grad):
    """``gamma_grad += sum dy xhat``, ``beta_grad += sum dy`` in one kernel."""
    c = tot.shape[0] // 2
    k.add_grads(tot[c:], tot[:c], gamma_grad, beta_grad)


def backward_data(k: Kernels, dy, x, mean, var, gamma, eps, tot, count, y):
    """The input gradient from the reduced sums: one per-channel kernel, one element-wise pass."""
    c = tot.shape[0] // 2
    a, b, cc = k.coefficients(mean, var, gamma, float(eps), tot[:c], tot[c:], float(count))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return k.bwd(dy, x, x if y is None else y, int(y is not None), a.reshape(shape), b.reshape(shape),
                 cc.reshape(shape))
