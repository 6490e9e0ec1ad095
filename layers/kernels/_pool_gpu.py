"""Max pooling on a GPU in one kernel each way (1-3 spatial dimensions, any kernel, stride and dilation).

The array-expression path launched about five kernels per tap forward (maximum, then the winning tap by
comparisons walked backwards) and three per tap backward: some 70 launches for a 3x3 pooling layer and
step. Here the forward computes each output's maximum and winning tap in one pass over its window, and the
backward gathers, for each input element, the gradients of the outputs it won (no atomics: the sum runs in
tap order, so a result does not depend on scheduling). Same rules as :mod:`.pool`: the first maximum in
row-major tap order wins, and a NaN wins (the first NaN).
"""
from __future__ import annotations

from lbannpy.backend import module_kernels

_GEO = ("int64 O0, int64 O1, int64 O2, int64 W0, int64 W1, int64 W2, int64 K0, int64 K1, int64 K2, "
        "int64 S0, int64 S1, int64 S2, int64 D0, int64 D1, int64 D2")

_FWD = (
    "raw T x, " + _GEO, "T y, I a",
    """
    long long r = i;
    const long long o2 = r % O2; r /= O2;
    const long long o1 = r % O1; r /= O1;
    const long long o0 = r % O0;
    const long long base = (r / O0) * W0 * W1 * W2;
    T best = (T)0;
    int arg = 0, t = 0;
    bool first = true;
    for (long long t0 = 0; t0 < K0; ++t0)
      for (long long t1 = 0; t1 < K1; ++t1)
        for (long long t2 = 0; t2 < K2; ++t2, ++t) {
          const T v = x[base + ((o0 * S0 + t0 * D0) * W1 + (o1 * S1 + t1 * D1)) * W2 + (o2 * S2 + t2 * D2)];
          if (first || (best == best && (v > best || v != v))) { best = v; arg = t; first = false; }
        }
    y = best;
    a = (I)arg;
    """, "lbannpy_maxpool_fwd")

_BWD = (
    "raw T dy, raw I a, " + _GEO, "T dx",
    """
    long long r = i;
    const long long w2 = r % W2; r /= W2;
    const long long w1 = r % W1; r /= W1;
    const long long w0 = r % W0;
    const long long nc = r / W0;
    T acc = (T)0;
    for (long long t0 = 0; t0 < K0; ++t0) {
      const long long q0 = w0 - t0 * D0;
      if (q0 < 0 || q0 % S0 != 0 || q0 / S0 >= O0) continue;
      for (long long t1 = 0; t1 < K1; ++t1) {
        const long long q1 = w1 - t1 * D1;
        if (q1 < 0 || q1 % S1 != 0 || q1 / S1 >= O1) continue;
        for (long long t2 = 0; t2 < K2; ++t2) {
          const long long q2 = w2 - t2 * D2;
          if (q2 < 0 || q2 % S2 != 0 || q2 / S2 >= O2) continue;
          const long long oi = ((nc * O0 + q0 / S0) * O1 + q1 / S1) * O2 + q2 / S2;
          if ((long long)a[oi] == (t0 * K1 + t1) * K2 + t2) acc += dy[oi];
        }
      }
    }
    dx = acc;
    """, "lbannpy_maxpool_bwd")



def kernels(xp):
    """``(forward, backward)`` ElementwiseKernels of the array module ``xp``, or None (NumPy, or no
    ElementwiseKernel)."""
    return module_kernels(xp, "maxpool",
                          lambda xp: (xp.ElementwiseKernel(*_FWD), xp.ElementwiseKernel(*_BWD)))


def _three(vals, fill):
    return (fill,) * (3 - len(vals)) + tuple(int(v) for v in vals)


def _geo(window_shape, k, s, d, out):
    return (*_three(out, 1), *_three(window_shape[2:], 1), *_three(k, 1), *_three(s, 1), *_three(d, 1))


def max_forward(xp, kern, x_window, k, s, d, out, idx_dtype):
    """``(y, argmax)`` of a valid max pooling of ``x_window`` (see :func:`.pool.max_pool_forward`)."""
    x = xp.ascontiguousarray(x_window)
    shape = tuple(x.shape[:2]) + tuple(out)
    y, arg = xp.empty(shape, dtype=x.dtype), xp.empty(shape, dtype=idx_dtype)
    kern[0](x, *_geo(x.shape, k, s, d, out), y, arg)
    return y, arg


def max_backward(xp, kern, dy, argmax, x_window_shape, k, s, d, out):
    """The window's gradient (see :func:`.pool.max_pool_backward`)."""
    dx = xp.empty(tuple(x_window_shape), dtype=dy.dtype)
    kern[1](xp.ascontiguousarray(dy), xp.ascontiguousarray(argmax), *_geo(x_window_shape, k, s, d, out), dx)
    return dx
