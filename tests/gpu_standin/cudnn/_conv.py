"""The arithmetic of the cuDNN stand-in's convolutions: forward, data gradient and filter gradient, 1-D to
3-D, with stride, asymmetric padding, dilation and groups, in cuDNN's cross-correlation convention.

Every operand is first widened to float64 and every product summed in float64; the caller rounds the result
once to the output's type (a float32 graph is therefore float64 arithmetic rounded to float32, at least as
accurate as any cuDNN float32 engine). The work loops over the kernel's taps only: each tap is one batched
matrix product (``numpy.matmul``, BLAS) over the strided window of the padded image it touches, so a test
of realistic layer shapes stays fast without a Python loop over pixels.
"""
import numpy as np


def out_extent(size, pre, post, kernel, stride, dilation):
    """One spatial extent of a convolution's output (cuDNN's and PyTorch's formula)."""
    return (size + pre + post - ((kernel - 1) * dilation + 1)) // stride + 1


def _window(tap, out_sp, stride, dilation):
    """The slices of the padded image that kernel tap ``tap`` reads for every output position."""
    return tuple(slice(r * d, r * d + (o - 1) * s + 1, s)
                 for r, o, s, d in zip(tap, out_sp, stride, dilation))


def _padded(x, pre, post):
    return np.pad(x, [(0, 0), (0, 0)] + [(a, b) for a, b in zip(pre, post)])


def fprop(x, w, pre, post, stride, dilation, out_sp):
    """y[n, k, o] = sum_{c in k's group, r} x_padded[n, c, o * stride + r * dilation] * w[k, c, r]."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, c = x.shape[:2]
    k, cg = w.shape[:2]
    g = c // cg
    xp = _padded(x, pre, post)
    wg = w.reshape((g, k // g, cg) + w.shape[2:])
    p = int(np.prod(out_sp))
    y = np.zeros((n, g, k // g, p))
    for tap in np.ndindex(*w.shape[2:]):
        cols = xp[(slice(None), slice(None)) + _window(tap, out_sp, stride, dilation)]
        y += np.matmul(wg[(Ellipsis,) + tap][None], cols.reshape(n, g, cg, p))
    return y.reshape((n, k) + tuple(out_sp))


def dgrad(dy, w, pre, post, stride, dilation, in_shape):
    """The data gradient (``in_shape`` = the image's [N, C, *spatial]): each tap scatters w^T dy back onto
    the window of the padded image that it read in the forward pass."""
    dy, w = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    n, c = in_shape[:2]
    in_sp = tuple(in_shape[2:])
    k, cg = w.shape[:2]
    g = c // cg
    out_sp = dy.shape[2:]
    p = int(np.prod(out_sp))
    dyg = dy.reshape(n, g, k // g, p)
    wt = np.swapaxes(w.reshape((g, k // g, cg) + w.shape[2:]), 1, 2)   # [g, cg, kg, *taps]
    dxp = np.zeros((n, g, cg) + tuple(s + a + b for s, a, b in zip(in_sp, pre, post)))
    for tap in np.ndindex(*w.shape[2:]):
        part = np.matmul(wt[(Ellipsis,) + tap][None], dyg).reshape((n, g, cg) + tuple(out_sp))
        dxp[(slice(None),) * 3 + _window(tap, out_sp, stride, dilation)] += part
    inner = tuple(slice(a, a + s) for a, s in zip(pre, in_sp))
    return dxp[(slice(None),) * 3 + inner].reshape((n, c) + in_sp)


def wgrad(x, dy, pre, post, stride, dilation, w_shape):
    """The filter gradient (``w_shape`` = [K, C / groups, *taps]): per tap, dy against the image window,
    summed over the batch and the output positions."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    n, c = x.shape[:2]
    k, cg = w_shape[:2]
    g = c // cg
    out_sp = dy.shape[2:]
    p = int(np.prod(out_sp))
    dyt = dy.reshape(n, g, k // g, p).transpose(1, 2, 0, 3).reshape(g, k // g, n * p)
    xp = _padded(x, pre, post)
    dw = np.zeros((g, k // g, cg) + tuple(w_shape[2:]))
    for tap in np.ndindex(*w_shape[2:]):
        cols = xp[(slice(None), slice(None)) + _window(tap, out_sp, stride, dilation)]
        cols = cols.reshape(n, g, cg, p).transpose(1, 0, 3, 2).reshape(g, n * p, cg)
        dw[(Ellipsis,) + tap] = np.matmul(dyt, cols)
    return dw.reshape(tuple(w_shape))
