"""Element-wise layers: ReLU, leaky ReLU, dropout (with a split-independent mask), the smooth activations
(sigmoid, tanh, SiLU, GELU exact and tanh, ELU), PReLU, softmax over channels and the product of inputs.

Dropout masks come from a counter-based hash (a chain of splitmix64 finalisers) of
``(seed, step, layer_id, global coordinates)``: an element's mask bit depends only on its global index, so
any distribution of the tensor over ranks draws the same mask, and nothing has to be stored between the
forward and backward pass beyond the keys.

Compiled path (NumPy float32/float64, where ``_cact`` is built):
sigmoid's forward and backward, SiLU's and exact GELU's forward are one loop each (the NumPy path's formulas
in its order, an inline vectorised exp: its results to round-off), where NumPy's pass per step had left them
1.5x to 2.6x PyTorch's fused kernels' time on one thread.
"""
from __future__ import annotations


import numpy

from lbannpy.backend import array_module, get_xp, module_kernels

from .batchnorm import relu_mask

try:  # the compiled kernels are optional: no compiler, no extension
    from . import _cact
except ImportError:  # pragma: no cover - depends on the build
    _cact = None

USE_COMPILED = _cact is not None  # tests switch it to check both paths

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def relu_forward(x, out=None):
    """``max(x, 0)`` (NaN propagates, as in PyTorch); into ``out`` when given (``out=x``: in place)."""
    return array_module(x).maximum(x, x.dtype.type(0), out=out)


def relu_backward(dy, x):
    """``dy`` where ``x > 0``, else 0 (ReLU's subgradient at 0 is 0, as in PyTorch). ``x`` may as well be
    the ReLU's output: it is positive exactly where the input is. One compiled pass on NumPy arrays."""
    return relu_mask(dy, x)


def leaky_relu_forward(x, slope=0.01):
    return array_module(x).where(x > 0, x, x * x.dtype.type(slope))


def leaky_relu_backward(dy, x, slope=0.01):
    return array_module(x).where(x > 0, dy, dy * dy.dtype.type(slope))


def _mix_int(z: int) -> int:
    """splitmix64 finaliser on a Python int (used to derive the per-layer, per-step key)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _mix(xp, z):
    """splitmix64 finaliser, element-wise on a uint64 array (wrapping arithmetic)."""
    z = z + xp.uint64(_GOLDEN)
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(_M1)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(_M2)
    return z ^ (z >> xp.uint64(31))


def dropout_mask(seed, step, layer_id, global_box, p, xp=None, dtype=numpy.float32):
    """Multiplier of the elements in ``global_box`` (``((start, stop), ...)`` in global coordinates):
    ``1/(1-p)`` where kept, ``0`` where dropped; each element is dropped with probability ``p``.

    The result depends only on ``(seed, step, layer_id)`` and each element's global coordinates.
    ``xp`` is the array module of the result (NumPy by default; a module or 'numpy'/'cupy'). ``step`` is an
    int, or a one-element uint64 array of ``xp`` (a step counter in device memory: the key is then derived
    on the device, so a replayed launch draws the mask of the counter's current value).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if xp is None or isinstance(xp, str):
        xp = get_xp(xp or "numpy")
    ndim = len(global_box)
    key = _mix_int(int(seed) & _MASK64)
    if not hasattr(step, "reshape"):
        key = _mix_int(key ^ (int(step) & _MASK64))
        key = _mix_int(key ^ (int(layer_id) & _MASK64))
        h = xp.full((1,) * ndim, key, dtype=xp.uint64)
    else:  # the same splitmix64 chain, on the device counter
        h = _mix(xp, step.reshape((1,) * ndim) ^ xp.uint64(key))
        h = _mix(xp, h ^ xp.uint64(int(layer_id) & _MASK64))
    for i, (lo, hi) in enumerate(global_box):
        if lo < 0 or hi < lo:
            raise ValueError(f"dropout box {tuple(global_box)}: need 0 <= start <= stop in every dimension")
        shape = [1] * ndim
        shape[i] = hi - lo
        coord = xp.arange(lo, hi, dtype=xp.uint64).reshape(shape)
        h = _mix(xp, h ^ coord)
    # top 53 bits as a uniform integer in [0, 2**53); drop when below p * 2**53
    threshold = xp.uint64(min(int(p * (1 << 53)), 1 << 53))
    keep = (h >> xp.uint64(11)) >= threshold
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return keep.astype(dtype) * numpy.dtype(dtype).type(scale)


def dropout_forward(x, mask):
    return x * mask


def dropout_backward(dy, mask):
    return dy * mask


# ---------------------------------------------------------------------------------------------------------
# smooth activations, PReLU, softmax over channels, product of inputs
#
# On NumPy a kernel runs its passes block by block (a block of every operand and the scratch stay in the
# core's L2 cache), so a formula of several ufunc passes reads and writes the whole arrays
# about once, as a fused kernel does, and every pass writes into an existing array (``out=``). Where the
# backward needs more than the output (SiLU, GELU), the training forward computes the derivative ``f'(x)``
# in the same blocks and keeps it instead of the input (one array either way): the backward is then one
# product. On a GPU each forward and backward is one CuPy ElementwiseKernel (softmax and the PReLU weight
# gradient add their reductions), the backward recomputing from the kept input what it needs; where the
# array module has no ElementwiseKernel, the NumPy path's array expressions run on the whole arrays.
# Nothing reads a value back to the host, and the constants (alpha, the GELU form) are fixed at set-up.

#: bytes a block's operands and scratch take together on NumPy: the passes over a block then run in the
#: core's caches (L2 and its share of L3), while a block stays long enough (2**12 to 2**20 elements) for a
#: ufunc call's overhead (about a microsecond) to be small beside its pass; 1 to 4 MiB measured best for
#: every kernel here on a 1 MiB-L2 core, 256 KiB a third slower
_CACHE_BYTES = 1 << 21
#: elements per block of the kernels that work on whole samples (PReLU, softmax)
_BLOCK = 1 << 15

_SQRT1_2 = 0.7071067811865476        # 1/sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327   # 1/sqrt(2 pi)
_SQRT_2_PI = 0.7978845608028654      # sqrt(2/pi), GELU's tanh form
_GELU_CUBIC = 0.044715

#: The normal distribution's upper tail ``q(a) = erfc(a/sqrt 2)/2`` (``a >= 0``) in float64 as
#: ``q = (1 + u) P(u) phi(a)``, ``u = (4 - a)/(4 + a)`` in (-1, 1], ``phi`` the normal density. ``P``
#: (monomial coefficients, lowest first, of a Chebyshev expansion computed at 50 digits) is smooth over the
#: whole half line, so one formula with one exponential (the density, which GELU's derivative needs as well)
#: serves every input without branches: the CDF within 3.4e-16 absolute, the tail within 6e-14 relative down
#: to 1e-300.
_TAIL64 = (0.23665238291356067, 0.19047136385249794, 0.12130119435845221, 0.05844262037479156,
           0.018923970288880924, 0.002362556357713907, -0.0010902869060250046, -0.000510981960150009,
           4.1780545617392063e-05, 7.240866308098399e-05, -5.977293346795411e-07, -1.1011966401340422e-05,
           2.2390524526746172e-07, 1.8554097098850368e-06, -1.958162679346939e-07, -3.2109441390371527e-07,
           8.294863104369398e-08, 5.006174115639638e-08, -2.4685150990909312e-08, -5.5913250643129035e-09,
           5.034370805834905e-09, 1.8403748654682884e-10, -5.291046410835028e-10, 3.759247459049846e-11)
#: float32: Abramowitz and Stegun 7.1.26, ``erfc(z) = t (a1 + a2 t + ... + a5 t^4) exp(-z^2)`` with
#: ``t = 1 / (1 + p z)``, 1.5e-7 absolute (float32's round-off), the form of PyTorch's own vectorised
#: float32 erf; (p, a1..a5)
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
_TAIL_KAPPA = 4.0


def _flat(a):
    """``a`` as a flat C-ordered array (a view when it is contiguous, as the layers' arrays are)."""
    return a.reshape(-1) if a.flags.c_contiguous else array_module(a).ascontiguousarray(a).reshape(-1)


def _blockwise(body, ins, nout, nscratch=0, nbool=0):
    """Run ``body(*in_blocks, *out_blocks, *scratch)`` over flat blocks of ``ins`` (one shape) and return
    the ``nout`` outputs (new arrays of the first input's shape and dtype); ``nbool`` of the scratch arrays
    are boolean. NumPy: blocks of ``_CACHE_BYTES`` over all operands, floating-point warnings off (exp
    overflows to inf where the formulas want it, as in PyTorch's kernels); other array modules: the whole
    arrays at once."""
    x = ins[0]
    xp = array_module(x)
    flat = [_flat(a) for a in ins]
    outs = [xp.empty(x.shape, dtype=x.dtype) for _ in range(nout)]
    oflat = [o.reshape(-1) for o in outs]
    n = flat[0].size
    if xp is numpy:
        per = _CACHE_BYTES // ((len(ins) + nout + nscratch) * x.dtype.itemsize + nbool)
        step = 1 << max(12, min(20, per.bit_length() - 1))
    else:
        step = max(n, 1)
    m = min(n, step)
    scratch = [xp.empty(m, dtype=x.dtype) for _ in range(nscratch)]
    scratch += [xp.empty(m, dtype=bool) for _ in range(nbool)]
    with numpy.errstate(all="ignore"):
        for i in range(0, n, step):
            j = min(n, i + step)
            body(*(a[i:j] for a in flat), *(o[i:j] for o in oflat), *(s[:j - i] for s in scratch))
    return outs


def _compiled(*arrays) -> bool:
    """The compiled kernels take these arrays: NumPy, all float32 or all float64 (made contiguous)."""
    dt = arrays[0].dtype
    return USE_COMPILED and dt.char in "fd" and all(type(a) is numpy.ndarray and a.dtype == dt
                                                    for a in arrays)


def _run(fn, ins, *extra, grad=None):
    """``fn(itemsize, *ins, n, y[, d], *extra)``: ``[y, d]``, new arrays (``grad`` False: ``d`` None)."""
    x = ins[0]
    outs = [numpy.empty(x.shape, dtype=x.dtype) for _ in range(1 + bool(grad))] + [None] * (grad is False)
    fn(x.dtype.itemsize, *(numpy.ascontiguousarray(a) for a in ins), x.size, *outs, *extra)
    return outs


def _sample_blocks(x):
    """Slices of ``x``'s first axis of about ``_BLOCK`` elements each on NumPy (at least one sample), the
    whole array elsewhere: the blocks of the kernels that broadcast over channels or reduce over them."""
    per = max(1, x.size // max(x.shape[0], 1))
    rows = max(1, _BLOCK // per) if array_module(x) is numpy else max(x.shape[0], 1)
    return [slice(i, i + rows) for i in range(0, x.shape[0], rows)]


#: (inputs, outputs, operation) of the GPU kernels; a backward recomputes from the input what the NumPy
#: path keeps (on a GPU the pass is bound by memory traffic, not arithmetic)
_GPU = {
    "sigmoid_fwd": ("T x", "T y", "y = (T)1 / ((T)1 + exp(-x));"),
    "sigmoid_bwd": ("T dy, T y", "T dx", "dx = dy * (((T)1 - y) * y);"),
    "tanh_bwd": ("T dy, T y", "T dx", "dx = dy * (((T)1 - y) * ((T)1 + y));"),
    "silu_fwd": ("T x", "T y", "y = x / ((T)1 + exp(-x));"),
    "silu_bwd": ("T dy, T x", "T dx",
                 "T s = (T)1 / ((T)1 + exp(-x)); dx = dy * (s + x * s * ((T)1 - s));"),
    "gelu_fwd": ("T x", "T y", f"y = x * ((T)0.5 * erfc(-x * (T){_SQRT1_2!r}));"),
    "gelu_bwd": ("T dy, T x", "T dx",
                 f"T c = (T)0.5 * erfc(-x * (T){_SQRT1_2!r});"
                 f"dx = dy * (c + x * exp((T)-0.5 * x * x) * (T){_INV_SQRT_2PI!r});"),
    "gelu_tanh_fwd": ("T x", "T y",
                  f"T t = tanh((T){_SQRT_2_PI!r} * (x + (T){_GELU_CUBIC!r} * x * x * x));"
                  "y = (T)0.5 * x * ((T)1 + t);"),
    "gelu_tanh_bwd": ("T dy, T x", "T dx",
                      f"T t = tanh((T){_SQRT_2_PI!r} * (x + (T){_GELU_CUBIC!r} * x * x * x));"
                      f"T k = (T){_SQRT_2_PI!r} * ((T)1 + (T){3 * _GELU_CUBIC!r} * x * x);"
                      "dx = dy * ((T)0.5 * ((T)1 + t) + (T)0.5 * x * ((T)1 - t * t) * k);"),
    "elu_fwd": ("T x, T alpha", "T y", "y = x > (T)0 ? x : alpha * expm1(x);"),
    "elu_bwd": ("T dy, T y, T alpha", "T dx", "dx = y <= (T)0 ? dy * (y + alpha) : dy;"),
    "prelu_fwd": ("T x, T w", "T y", "y = x > (T)0 ? x : w * x;"),
    "prelu_bwd": ("T dy, T x, T w", "T dx, T dw",
                  "dx = x > (T)0 ? dy : w * dy; dw = x > (T)0 ? (T)0 : x * dy;"),
}


def _kernels(x):
    """The GPU kernels (name -> ElementwiseKernel) of ``x``'s array module, or None (NumPy, or a module
    without ElementwiseKernel)."""
    return module_kernels(array_module(x), "activation", lambda xp: {
        name: xp.ElementwiseKernel(*k, f"lbannpy_act_{name}") for name, k in _GPU.items()})


# -- sigmoid, tanh: the backward reads the output ------------------------------------------------------------
def _sigmoid_body(x, y):
    xp = array_module(x)
    xp.negative(x, out=y)
    xp.exp(y, out=y)
    y += 1
    xp.divide(1, y, out=y)


def sigmoid_forward(x):
    """``1 / (1 + exp(-x))``; the backward takes the output."""
    if _compiled(x):
        return _run(_cact.sigmoid_fwd, [x])[0]
    k = _kernels(x)
    return k["sigmoid_fwd"](x) if k is not None else _blockwise(_sigmoid_body, [x], 1)[0]


def _sigmoid_bwd_body(dy, y, dx):
    array_module(y).subtract(1, y, out=dx)
    dx *= y
    dx *= dy


def sigmoid_backward(dy, y):
    """``dy * y * (1 - y)`` from the output ``y``."""
    if _compiled(y, dy):
        return _run(_cact.sigmoid_bwd, [dy, y])[0]
    k = _kernels(y)
    return k["sigmoid_bwd"](dy, y) if k is not None else _blockwise(_sigmoid_bwd_body, [dy, y], 1)[0]


def tanh_forward(x):
    """``tanh(x)`` (one ufunc, one pass); the backward takes the output."""
    return array_module(x).tanh(x)


def _tanh_bwd_body(dy, y, dx, s):
    xp = array_module(y)
    xp.subtract(1, y, out=dx)
    xp.add(1, y, out=s)
    dx *= s
    dx *= dy


def tanh_backward(dy, y):
    """``dy * (1 - y) * (1 + y)`` from the output ``y`` (``1 - y**2`` would lose the tails' digits)."""
    k = _kernels(y)
    return k["tanh_bwd"](dy, y) if k is not None else _blockwise(_tanh_bwd_body, [dy, y], 1, 1)[0]


# -- SiLU and GELU: the forward keeps what the backward multiplies by ---------------------------------------
def _silu_body(grad):
    def body(x, y, *rest):
        d, s = rest if grad else (None, rest[0])
        xp = array_module(x)
        xp.negative(x, out=s)
        xp.exp(s, out=s)
        s += 1
        if not grad:
            xp.divide(x, s, out=y)
            return
        xp.divide(1, s, out=s)       # sigmoid(x)
        xp.multiply(x, s, out=y)
        xp.subtract(1, s, out=d)
        d *= y
        d += s                       # silu'(x) = s + x s (1 - s) = s + y (1 - s), exact where s is 1
    return body


def silu_forward(x, grad=True):
    """``(x * sigmoid(x), saved)``: ``saved`` (None unless ``grad``) is what :func:`silu_backward` takes,
    the derivative on NumPy, the input on a GPU."""
    if _compiled(x):
        return tuple(_run(_cact.silu_fwd, [x], grad=bool(grad)))
    k = _kernels(x)
    if k is not None:
        return k["silu_fwd"](x), (x if grad else None)
    outs = _blockwise(_silu_body(grad), [x], 2 if grad else 1, 1)
    return outs[0], (outs[1] if grad else None)


def silu_backward(dy, saved):
    k = _kernels(dy)
    return k["silu_bwd"](dy, saved) if k is not None else dy * saved


def _gelu_body(grad):
    c = _TAIL64[::-1]  # highest power first (Horner)

    def body(x, y, *rest):
        d, (a, u, p) = (rest[0], rest[1:]) if grad else (None, rest)
        xp = array_module(x)
        xp.abs(x, out=a)
        a += _TAIL_KAPPA
        xp.divide(2 * _TAIL_KAPPA, a, out=a)   # 1 + u = 8 / (4 + |x|): 0 at infinity
        xp.subtract(a, 1, out=u)
        xp.multiply(u, c[0], out=p)
        for ck in c[1:-1]:
            p += ck
            p *= u
        p += c[-1]
        p *= a                       # (1 + u) P(u)
        xp.multiply(x, x, out=a)
        a *= -0.5
        xp.exp(a, out=a)
        a *= _INV_SQRT_2PI           # phi(x)
        p *= a                       # the tail q(|x|)
        _gelu_finish(x, y, d, a, p, u)
    return body


def _gelu32_body(grad):
    c = [0.5 * ak for ak in _AS_A[::-1]]  # q = erfc / 2, highest power first

    def body(x, y, *rest):
        d, (a, t, p) = (rest[0], rest[1:]) if grad else (None, rest)
        xp = array_module(x)
        xp.abs(x, out=a)
        xp.multiply(a, _AS_P * _SQRT1_2, out=t)
        t += 1
        xp.divide(1, t, out=t)       # t = 1 / (1 + p |x| / sqrt 2)
        xp.multiply(t, c[0], out=p)
        for ck in c[1:]:
            p += ck
            p *= t
        xp.multiply(x, x, out=a)
        a *= -0.5
        xp.exp(a, out=a)
        p *= a                       # the tail q(|x|)
        a *= _INV_SQRT_2PI           # phi(x)
        _gelu_finish(x, y, d, a, p, t)
    return body


def _gelu_finish(x, y, d, phi, q, u):
    """From the density and the tail: ``y = x Phi(x)`` and (``d`` given) ``Phi(x) + x phi(x)``; ``u`` is
    scratch."""
    xp = array_module(x)
    xp.subtract(0.5, q, out=u)
    xp.copysign(u, x, out=u)
    u += 0.5                         # Phi(x): q(|x|) below 0, 1 - q(|x|) above
    xp.multiply(x, u, out=y)
    if d is not None:
        xp.multiply(x, phi, out=d)
        d += u                       # gelu'(x) = Phi(x) + x phi(x)


def _gelu_tanh_body(grad):
    def body(x, y, *rest):
        d, (s, t) = (rest[0], rest[1:]) if grad else (None, rest)
        xp = array_module(x)
        xp.multiply(x, x, out=s)
        xp.multiply(s, _GELU_CUBIC, out=t)
        t += 1
        t *= x
        t *= _SQRT_2_PI
        xp.tanh(t, out=t)
        t += 1                       # 1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))
        xp.multiply(x, t, out=y)
        y *= 0.5
        if grad:                     # 0.5 (1 + th) + 0.5 x (1 - th^2) k, with 0.5 x (1 - th^2) = y (1 - th)
            s *= 3 * _GELU_CUBIC * _SQRT_2_PI
            s += _SQRT_2_PI          # k = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
            xp.subtract(2, t, out=d)
            d *= y
            d *= s
            t *= 0.5
            d += t
    return body


def gelu_forward(x, approximate="none", grad=True):
    """``(x * Phi(x), saved)`` (``approximate`` other than none: PyTorch's tanh form); ``saved`` (None unless
    ``grad``) is what :func:`gelu_backward` takes, the derivative on NumPy, the input on a GPU."""
    k = _kernels(x)
    if k is not None:
        return k["gelu_fwd" if approximate == "none" else "gelu_tanh_fwd"](x), (x if grad else None)
    if approximate == "none" and _compiled(x):
        outs = _run(_cact.gelu_fwd, [x], numpy.array(_TAIL64[::-1]), grad=bool(grad))  # float64's P
    elif approximate == "none":
        body = _gelu32_body(grad) if x.dtype.itemsize <= 4 else _gelu_body(grad)
        outs = _blockwise(body, [x], 2 if grad else 1, 3)
    else:
        outs = _blockwise(_gelu_tanh_body(grad), [x], 2 if grad else 1, 2)
    return outs[0], (outs[1] if grad else None)


def gelu_backward(dy, saved, approximate="none"):
    k = _kernels(dy)
    if k is not None:
        return k["gelu_bwd" if approximate == "none" else "gelu_tanh_bwd"](dy, saved)
    return dy * saved


# -- ELU (alpha >= 0: the output's sign is the input's, so the backward reads the output) -------------------
def _elu_body(alpha):
    def body(x, y, s):
        xp = array_module(x)
        xp.minimum(x, 0, out=y)
        xp.expm1(y, out=y)
        if alpha != 1.0:
            y *= alpha
        xp.maximum(x, 0, out=s)
        y += s                       # x above 0 (where alpha * expm1(min(x, 0)) is 0), alpha expm1(x) else
    return body


def elu_forward(x, alpha=1.0):
    """``x`` above 0, ``alpha * (exp(x) - 1)`` else (``alpha >= 0``)."""
    k = _kernels(x)
    if k is not None:
        return k["elu_fwd"](x, x.dtype.type(alpha))
    return _blockwise(_elu_body(float(alpha)), [x], 1, 1)[0]


def _elu_bwd_body(alpha):
    def body(dy, y, dx, *scratch):
        xp = array_module(y)
        xp.fmin(y, 0, out=dx)        # y where x <= 0 (y <= 0 exactly there), 0 above 0 and at NaN
        if alpha == 1.0:
            dx += 1                  # y + 1 = exp(x) where x <= 0, 1 else
        else:
            s, b = scratch
            xp.less_equal(y, 0, out=b)
            s[...] = b
            dx += alpha - 1.0
            dx *= s
            dx += 1                  # y + alpha = alpha exp(x) where x <= 0, 1 else (NaN: 1, as PyTorch)
        dx *= dy
    return body


def elu_backward(dy, y, alpha=1.0):
    """The input gradient from the output ``y`` (``alpha >= 0``); at 0 the slope is ``alpha``, as in
    PyTorch."""
    k = _kernels(y)
    if k is not None:
        return k["elu_bwd"](dy, y, y.dtype.type(alpha))
    one = float(alpha) == 1.0
    return _blockwise(_elu_bwd_body(float(alpha)), [dy, y], 1, 0 if one else 1, 0 if one else 1)[0]


# -- PReLU ---------------------------------------------------------------------------------------------------
def _per_channel(w, ndim):
    """The weight ``(1,)`` or ``(C,)`` shaped to broadcast over ``(N, C, spatial...)``."""
    return w.reshape((1, -1) + (1,) * (ndim - 2)) if w.size > 1 else w.reshape((1,) * ndim)


def prelu_forward(x, w):
    """``x`` above 0, ``w * x`` else; ``w`` has one value or one per channel (axis 1)."""
    wb = _per_channel(w, x.ndim)
    k = _kernels(x)
    if k is not None:
        return k["prelu_fwd"](x, wb)
    xp = array_module(x)
    y = xp.empty_like(x)
    with numpy.errstate(all="ignore"):
        for sl in _sample_blocks(x):
            xb, yb = x[sl], y[sl]
            s = xp.empty_like(xb)
            xp.minimum(xb, 0, out=yb)
            yb *= wb
            xp.maximum(xb, 0, out=s)
            yb += s
    return y


def prelu_backward(dy, x, w, w_grad):
    """The input gradient; this block's partial sum of the weight gradient (``sum dy * min(x, 0)`` per
    channel, or over everything for one weight) is added to ``w_grad`` (reduced over the ranks later)."""
    wb = _per_channel(w, x.ndim)
    axes = tuple(i for i in range(x.ndim) if i != 1) if w.size > 1 else None
    xp = array_module(x)
    k = _kernels(x)
    if k is not None:
        dx, dw = k["prelu_bwd"](dy, x, wb)
        w_grad += dw.sum(axis=axes).reshape(w_grad.shape)
        return dx
    dx = xp.empty_like(dy)
    acc = xp.zeros(w_grad.shape, dtype=w_grad.dtype)
    wm1 = wb - 1
    with numpy.errstate(all="ignore"):
        for sl in _sample_blocks(x):
            xb, dyb, dxb = x[sl], dy[sl], dx[sl]
            t = xp.empty_like(xb)
            b = xp.empty(xb.shape, dtype=bool)
            xp.minimum(xb, 0, out=t)
            t *= dyb
            acc += t.sum(axis=axes).reshape(acc.shape)
            xp.less_equal(xb, 0, out=b)
            t[...] = b
            t *= wm1
            t += 1                   # 1 above 0, w else
            xp.multiply(dyb, t, out=dxb)
    w_grad += acc
    return dx


# -- softmax over channels (axis 1), reduced within each block of samples --------------------------------
def softmax_forward(x):
    """``exp(x - max) / sum exp(x - max)`` over axis 1; the backward takes the output."""
    xp = array_module(x)
    y = xp.empty_like(x)
    with numpy.errstate(all="ignore"):
        for sl in _sample_blocks(x):
            xb, yb = x[sl], y[sl]
            xp.subtract(xb, xb.max(axis=1, keepdims=True), out=yb)
            xp.exp(yb, out=yb)
            s = yb.sum(axis=1, keepdims=True)
            xp.divide(1, s, out=s)
            yb *= s                  # one division per position, a product per element
    return y


def softmax_backward(dy, y):
    """``y * (dy - sum(dy * y))`` (sums over axis 1) from the output ``y``."""
    xp = array_module(y)
    dx = xp.empty_like(dy)
    with numpy.errstate(all="ignore"):
        for sl in _sample_blocks(y):
            dyb, yb, dxb = dy[sl], y[sl], dx[sl]
            xp.multiply(dyb, yb, out=dxb)
            s = dxb.sum(axis=1, keepdims=True)
            xp.subtract(dyb, s, out=dxb)
            dxb *= yb
    return dx


# -- elementwise product of inputs ---------------------------------------------------------------------------
def mul_forward(xs):
    """``xs[0] * xs[1] * ...`` (one shape), multiplied left to right."""
    xp = array_module(xs[0])
    y = xp.multiply(xs[0], xs[1])
    for x in xs[2:]:
        y *= x
    return y


def mul_backward(dy, xs):
    """Per input, ``dy`` times the product of the other inputs."""
    xp = array_module(dy)
    out = []
    for i in range(len(xs)):
        others = [x for j, x in enumerate(xs) if j != i]
        d = xp.multiply(dy, others[0])
        for x in others[1:]:
            d *= x
        out.append(d)
    return out
