"""PyTorch's ATen convolutions on lbannpy's arrays: oneDNN on the CPU, cuDNN on a GPU, zero-copy by DLPack.

Same signatures and semantics as the own kernels of :mod:`.conv` (valid convolutions of the window the layer
hands over, halo and padding included; 1, 2 or 3 spatial dimensions; float32 or float64), so a layer can take
either set (:mod:`.select`). ``torch.from_dlpack`` wraps a NumPy or CuPy array without a copy and
``xp.from_dlpack`` hands the result back the same way; a result goes into a caller's ``out`` buffer with one
copy. On a GPU the calls run on CuPy's current stream (an external stream to torch), so they are ordered with
the surrounding CuPy work without a host synchronisation. Torch is imported on first use only.
"""
from __future__ import annotations

import functools
import math
import os

import numpy as np

from lbannpy.packing import relayout

from . import _conv_one, _conv_tiles
from . import conv as _conv

_torch = None


def torch():
    """The torch module, imported once; its intra-op threads follow the rank's thread choice."""
    global _torch
    if _torch is None:
        import torch as t

        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit() and int(threads) > 0:
            t.set_num_threads(int(threads))
        _torch = t
    return _torch


def available(device: str = "cpu") -> bool:
    """Whether ATen kernels can run here: torch imports (and, for ``gpu``, sees a CUDA device)."""
    try:
        t = torch()
    except ImportError:
        return False
    return device != "gpu" or bool(t.cuda.is_available())


def set_tf32(on: bool) -> None:
    """Whether cuDNN may run float32 convolutions as TF32 (``runtime.tf32``). PyTorch allows it by default,
    which on Ampere and later GPUs rounds the products' operands to a 10-bit mantissa: lbannpy's float32
    results would then differ from the own kernels' and the CPU's by far more than float32 round-off."""
    torch().backends.cudnn.allow_tf32 = bool(on)


def _tuple(v, nd: int) -> tuple:
    return tuple(int(s) for s in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def _xp(a):
    import numpy as np

    return np if isinstance(a, np.ndarray) else __import__("cupy")


_STREAMS: dict = {}


def _torch_stream(cp):
    """torch's handle on CuPy's current stream (``torch.cuda.ExternalStream``), made once per device and
    stream: building one is a CUDA query each time."""
    ptr, dev = cp.cuda.get_current_stream().ptr, cp.cuda.runtime.getDevice()
    s = _STREAMS.get((dev, ptr))
    if s is None:
        if len(_STREAMS) > 64:  # streams come and go (a stream's handle may be reused: same stream then)
            _STREAMS.clear()
        s = _STREAMS[(dev, ptr)] = torch().cuda.ExternalStream(ptr, device=dev)
    return s


def _on_device(fn):
    """Runs ``fn(a, ...)`` as is for NumPy arrays (the step path pays every microsecond of a small layer) and,
    for CuPy arrays, with torch's current stream set to CuPy's current one for the whole call: the DLPack
    conversions in and out as well as the operator, so neither side records an event for the other."""
    @functools.wraps(fn)
    def run(a, *args, **kwargs):
        if _host(a):
            return fn(a, *args, **kwargs)
        with torch().cuda.stream(_torch_stream(_xp(a))):
            return fn(a, *args, **kwargs)
    return run


def _host(a) -> bool:
    return type(a).__module__ == "numpy"


def _t(a):
    # NumPy arrays: torch.from_numpy (the same zero-copy view as from_dlpack, at half its cost per call)
    return torch().from_numpy(a) if _host(a) else _torch.from_dlpack(a)


def _back(result, like, out=None, keep=False):
    """``result`` as an array of ``like``'s kind (into ``out`` when given); on the host C-contiguous unless
    ``keep``: a channels-last result (from channels-last operands) is laid out NCHW in the same copy."""
    if out is not None:
        if _host(out):
            return relayout(out, result.numpy())
        _t(out).copy_(result)
        return out
    if not _host(like):
        return _xp(like).from_dlpack(result)
    if keep or result.is_contiguous():
        return result.numpy()
    return relayout(np.empty(tuple(result.shape), dtype=like.dtype), result.numpy())


# -- the host layout: oneDNN's NCHW kernels are several times slower than its channels-last ones for some
# channel counts (and faster for others), so a layer may hand its window and output gradient over laid out
# channels-last (``Conv`` does, see :func:`channels_last_view`) where the calibration of the run's machine
# found that layout faster for the shape (``python -m lbannpy.bench calibrate --kernels``, a row's
# ``layout: channels_last``). Never timed in a run: the two layouts round differently, and a run's numbers
# must not depend on which was faster at the moment (nor differ between ranks)

#: None: the calibrated layout of the shape (:func:`takes_channels_last`); "nchw" or "channels_last" forces
#: one (tests and benchmarks)
LAYOUT = None


def channels_last_view(buf, ndim: int):
    """An NCHW-shaped view of ``buf`` (shaped ``(N, *spatial, C)``, C-contiguous): channels-last strides."""
    return buf.transpose((0, ndim - 1) + tuple(range(1, ndim - 1)))


def copy_into(dst, src):
    """``dst[...] = src`` for host arrays of different layouts (:func:`lbannpy.packing.relayout`: a tiled
    copy, faster than NumPy's and torch's at transposing NCHW to channels-last)."""
    return relayout(dst, src)


def channels_last_shape(shape) -> tuple:
    return (shape[0],) + tuple(shape[2:]) + (shape[1],)


def has_channels_last(x_shape, w_shape) -> bool:
    """Whether a host convolution of the window ``x_shape`` with filters ``w_shape`` has a channels-last
    layout to take: 2-D or 3-D, more than one input channel, one group."""
    return len(x_shape) in (4, 5) and x_shape[1] != 1 and w_shape[1] == x_shape[1]


def takes_channels_last(x_shape, w_shape, calibrated: str | None = None) -> bool:
    """Whether a host convolution of the window ``x_shape`` with filters ``w_shape`` goes channels-last:
    as :data:`LAYOUT` forces, else where it has that layout and ``calibrated`` (the ``layout`` of the
    machine row of the layer's shape, None where there is none) says ``channels_last``. Nothing is timed."""
    if LAYOUT is not None:
        return LAYOUT == "channels_last"
    return calibrated == "channels_last" and has_channels_last(x_shape, w_shape)


def transposed_channels_last(x_shape, groups: int, calibrated: str | None = None) -> bool:
    """Whether a host transposed convolution of the input ``x_shape`` goes channels-last: 2-D or 3-D, one
    group of more than one input channel, as :data:`LAYOUT` forces, else where ``calibrated`` (the layout of
    the machine row of the layer's shape) says ``channels_last``. Nothing is timed."""
    if len(x_shape) not in (4, 5) or x_shape[1] == 1 or groups != 1:
        return False
    return (LAYOUT if LAYOUT is not None else calibrated) == "channels_last"


# the ATen operators themselves (not torch.nn.functional / torch.nn.grad, whose Python layers cost about as
# much as a small convolution): convolution, and convolution_backward with an output mask, which computes
# only the gradients asked for. Each through its compiled entry point: torch.convolution (a C function) and
# the operator's own builtin under ``torch.ops`` (its Python ``OpOverload.__call__`` wrapper costs as much
# as a small convolution, and a layer makes three calls a step)
_CONV = _CONV_BWD = None
_ZEROS = {1: [0], 2: [0, 0], 3: [0, 0, 0]}  # output padding: none
# which gradients convolution_backward computes: the input's; the filter's; the filter's and the bias's
_DATA, _FILTER, _FILTER_BIAS = [True, False, False], [False, True, False], [False, True, True]


def _ops():
    global _CONV, _CONV_BWD
    if _CONV is None:
        t = torch()
        bwd = t.ops.aten.convolution_backward.default
        _CONV, _CONV_BWD = t.convolution, getattr(bwd, "_op", bwd)
    return _CONV, _CONV_BWD


@functools.lru_cache(maxsize=256)
def _geom(stride, dilation, nd, padding=0):
    """The operator's stride, padding and dilation lists (a layer asks with the same values every step)."""
    return list(_tuple(stride, nd)), list(_tuple(padding, nd)), list(_tuple(dilation, nd))


_SHAPED: dict = {}


def _shaped(like, shape):
    """A tensor of ``shape`` with ``like``'s dtype and device that owns one element (stride 0): the operator
    reads only the shape of the argument whose gradient is not asked for (as ``torch.nn.grad`` does). Kept
    per shape: it is never written."""
    key = (tuple(int(s) for s in shape), like.dtype, like.device)
    t = _SHAPED.get(key)
    if t is None:
        if len(_SHAPED) > 256:
            _SHAPED.clear()
        t = _SHAPED[key] = like.new_empty(1).expand(key[0])
    return t


@_on_device
def conv_forward(x_window, w, b=None, stride=1, dilation=1, out=None, padding=0):
    """Valid convolution of the window: ``(N, F, *out)``; with ``padding`` (both sides of each spatial
    dimension) the window is the input block, padded with zeros inside the kernel."""
    if x_window.shape[1] == 1 and _host(x_window) and not any(_tuple(padding, x_window.ndim - 2)):
        # one input channel: lbannpy's compiled kernel is the faster one there (bench layers compares them)
        y = _conv_one.forward(x_window, w, b, stride, dilation, out)
        if y is not None:
            return y
    conv, _ = _ops()
    nd = x_window.ndim - 2
    s, p, d = _geom(stride, dilation, nd, padding)
    tb = None if b is None else _t(b)
    y = conv(_t(x_window), _t(w), tb, s, p, d, False, _ZEROS[nd], 1)
    return _back(y, x_window, out)


def _backward(tdy, x, w, stride, dilation, mask, padding, bias_sizes=None):
    _, bwd = _ops()
    nd = tdy.ndim - 2
    s, p, d = _geom(stride, dilation, nd, padding)
    return bwd(tdy, x, w, bias_sizes, s, p, d, False, _ZEROS[nd], 1, mask)


@_on_device
def conv_backward_data(dy, w, x_window_shape, stride=1, dilation=1, out=None, padding=0):
    """Gradient w.r.t. the window, of shape ``x_window_shape``."""
    # the operator reads only the input's shape when the filter gradient is not asked for (as torch.nn.grad)
    tdy = _t(dy)
    dx = _backward(tdy, _shaped(tdy, x_window_shape), _t(w), stride, dilation, _DATA, padding)[0]
    return _back(dx, dy, out)


@_on_device
def conv_backward_input(dy, w, x_window, stride=1, dilation=1, out=None, padding=0):
    """:func:`conv_backward_data` given the input itself (what a layer has in hand): oneDNN lays the
    computation out after the input's strides, and a stride-0 stand-in for the input makes it slower. A
    channels-last window (:func:`channels_last_view`) gets its gradient in that layout."""
    tdy, tx = _t(dy), _t(x_window)
    dx = _backward(tdy, tx, _t(w), stride, dilation, _DATA, padding)[0]
    return _back(dx, dy, out, keep=_host(dy) and _is_channels_last(tx))


def _is_channels_last(t) -> bool:
    fmt = {4: torch().channels_last, 5: _torch.channels_last_3d}.get(t.dim())
    return fmt is not None and t.shape[1] > 1 and t.is_contiguous(memory_format=fmt)


@_on_device
def conv_backward_filter(x_window, dy, w_shape, stride=1, dilation=1, padding=0):
    """Gradient w.r.t. the filter, of shape ``w_shape``."""
    tdy = _t(dy)
    dw = _backward(tdy, _t(x_window), _shaped(tdy, w_shape), stride, dilation, _FILTER, padding)[1]
    return _back(dw, dy)


@_on_device
def conv_backward_params(x_window, dy, w, bias=False, stride=1, dilation=1, padding=0):
    """``(filter gradient, bias gradient or None)`` in one operator call, given the filter itself: oneDNN
    lays its filter-gradient computation out after the filter's strides, and a stride-0 stand-in for it (as
    :func:`conv_backward_filter` passes) is slower on wide filters over small images; the bias gradient comes
    from the same pass over ``dy``."""
    tdy, tx, tw = _t(dy), _t(x_window), _t(w)
    if x_window.shape[1] == 1 and x_window.ndim == 4 and _host(x_window):
        tdy, tx, tw = _one_channel_nhwc(tdy, tx, tw)
    mask, sizes = (_FILTER_BIAS, [int(w.shape[0])]) if bias else (_FILTER, None)
    _, dw, db = _backward(tdy, tx, tw, stride, dilation, mask, padding, sizes)
    return _back(dw, dy), (_back(db, dy) if bias else None)


def _one_channel_nhwc(tdy, tx, tw):
    """The filter gradient's operands of a 2-D convolution of one input channel (LeNet's first layer) laid
    out channels-last for oneDNN: the input and the filter are the same memory with the channel stride set
    to 1 (free: the channel axis has one entry), ``dy`` is copied. oneDNN's NCHW filter gradient of one
    input channel is slower than this path, copy included, and the gradients are the same numbers."""
    def nhwc(t):
        return t.as_strided(t.shape, (t.stride(0), 1) + t.stride()[2:])
    return tdy.contiguous(memory_format=torch().channels_last), nhwc(tx), nhwc(tw)


# -- the transposed convolution (:mod:`lbannpy.layers.conv_transpose`): output padding, groups and bias
# inside the one operator, so no window is filled or cropped around it
def _lists(*vals):
    return [list(int(x) for x in v) for v in vals]


# -- a transposed convolution whose stride is its kernel (no padding, no dilation, one group: a U-Net's
# up-convolution) on the host is one matrix product and a copy each way: every input pixel writes its own
# k0 x k1 block of the output, ``Z = W^T X`` with ``W`` as (C_in, F*K) and ``X`` as (C_in, pixels) holds the
# blocks, and the output is ``Z`` with its axes (F, k0, k1, S0, S1) laid out as (F, S0, k0, S1, k1)
# (:func:`lbannpy.packing.relayout`). oneDNN's NCHW operator for it is several times slower than its
# channels-last one, and the product needs neither layout's copies. Where the last kernel extent is 2 and
# the compiled kernels run with AVX-512, the interleaving is computed directly instead, with no blocks
# array (:mod:`._conv_tiles`).
def tiles(x_shape, w_shape, stride, padding, output_padding, dilation, groups: int) -> bool:
    """Whether a host transposed convolution of this geometry takes the matrix-product path."""
    k, nsp = tuple(w_shape[2:]), len(x_shape) - 2
    return (groups == 1 and 1 <= nsp <= 3 and tuple(_tuple(stride, nsp)) == k
            and not any(_tuple(padding, nsp)) and not any(_tuple(output_padding, nsp))
            and all(v == 1 for v in _tuple(dilation, nsp)))


def _blocks_view(a, nsp: int, k) -> tuple:
    """``(a as (N*F, S0, k0, S1, k1, ...), the same axes of an (N*F, k0, k1, ..., S0, S1, ...) array)``:
    the two sides of the copy between an output and its blocks."""
    s = [n // kk for n, kk in zip(a.shape[2:], k)]
    inter = (a.shape[0] * a.shape[1],) + tuple(v for pair in zip(s, k) for v in pair)
    order = (0,) + tuple(i for d in range(nsp) for i in (1 + nsp + d, 1 + d))
    return a.reshape(inter), order, (inter[0],) + tuple(k) + tuple(s)


def _tiles_forward(x, w, b):
    n, c, nsp, k = x.shape[0], x.shape[1], x.ndim - 2, tuple(w.shape[2:])
    f, pix, kk = w.shape[1], math.prod(x.shape[2:]), math.prod(w.shape[2:])
    y = np.empty((n, f) + tuple(sp * kd for sp, kd in zip(x.shape[2:], k)), dtype=x.dtype)
    if _conv_tiles.forward(x, w, b, y):  # a last kernel extent of 2: both column phases at once
        return y
    z = np.empty((n, f * kk, pix), dtype=x.dtype)  # the blocks
    tz, tx, twt = _t(z), _t(x).reshape(n, c, pix), _t(w).reshape(c, f * kk).t()
    for i in range(n):  # a matrix product per sample: torch's product broadcast over the batch is slower
        torch().matmul(twt, tx[i], out=tz[i])
    if b is not None:
        tz += _t(b).repeat_interleave(kk).reshape(1, f * kk, 1)
    yv, order, zshape = _blocks_view(y, nsp, k)
    relayout(yv, z.reshape(zshape).transpose(order))
    return y


def _tiles_backward(dy, x, w, bias: bool, want_dx: bool):
    n, c, nsp, k = x.shape[0], x.shape[1], x.ndim - 2, tuple(w.shape[2:])
    f, pix, kk = w.shape[1], math.prod(x.shape[2:]), math.prod(w.shape[2:])
    dx = np.empty(x.shape, dtype=x.dtype) if want_dx else None
    # the bias gradient first: its sequential pass brings dy into the cache for the direct kernels, which
    # read it filter plane by filter plane (tens of streams, slow from memory)
    db = dy.reshape(n, f, -1).sum(axis=2).sum(axis=0) if bias else None
    if not want_dx or _conv_tiles.backward_data(dy, w, dx):  # both gradients straight from dy (compiled)
        dw = _conv_tiles.backward_filter(dy, x, w)
        if dw is not None:
            return dx, dw, db
    dyv, order, zshape = _blocks_view(dy, nsp, k)
    g = np.empty(zshape, dtype=dy.dtype)  # dL/dY in blocks: (N*F, k0, k1, ..., S0, S1, ...)
    if not _conv_tiles.split(dy, g, k):
        relayout(g.transpose(order), dyv)
    tg, tw, tx = _t(g).reshape(n, f * kk, pix), _t(w).reshape(c, f * kk), _t(x).reshape(n, c, pix)
    dw = np.empty((c, f * kk), dtype=x.dtype)
    tdx, tdw = (_t(dx).reshape(n, c, pix) if want_dx else None), _t(dw)
    for i in range(n):  # matrix products per sample (see _tiles_forward)
        if want_dx:
            torch().matmul(tw, tg[i], out=tdx[i])
        if i == 0:
            torch().matmul(tx[0], tg[0].t(), out=tdw)
        else:
            tdw.addmm_(tx[i], tg[i].t())
    return dx, dw.reshape(w.shape), db


# -- any other host transposed convolution of up to DIRECT_MAX_CHANNELS input channels (one group): its
# forward is a convolution's input gradient, and lbannpy's compiled kernels for that
# (:func:`lbannpy.layers.kernels.conv.conv_backward_data`, where they run with AVX-512) are faster than
# oneDNN's NCHW transposed convolution at few channels and even at 64 (beyond, oneDNN's is the faster:
# ``bench layers --new`` times the 32-channel row); its gradients stay ATen's, not slower than ours there
DIRECT_MAX_CHANNELS = 64


def _direct(x, w, groups: int) -> bool:
    """Whether a host transposed convolution's forward takes the compiled data-gradient kernels."""
    return (groups == 1 and type(x) is np.ndarray and type(w) is np.ndarray and x.dtype.char in "fd"
            and w.dtype == x.dtype and x.shape[1] <= DIRECT_MAX_CHANNELS and _conv.DIRECT_FAST
            and _conv.USE_COMPILED)


def _direct_forward(x, w, b, stride, padding, output_padding, dilation):
    nsp = x.ndim - 2
    s, p, op, d = (_tuple(v, nsp) for v in (stride, padding, output_padding, dilation))
    out = tuple((n - 1) * st - 2 * pp + dd * (kk - 1) + o + 1
                for n, st, pp, dd, kk, o in zip(x.shape[2:], s, p, d, w.shape[2:], op))
    y = _conv.conv_backward_data(np.ascontiguousarray(x), np.ascontiguousarray(w),
                                 (x.shape[0], w.shape[1]) + out, s, d, padding=p)
    if b is not None:
        y += b.reshape((1, -1) + (1,) * nsp)
    return y


@_on_device
def conv_transpose_forward(x, w, b, stride, padding, output_padding, dilation, groups: int):
    """PyTorch's own transposed convolution (ATen ``convolution`` with ``transposed=True``), for a layer
    whose spatial dimensions are not split: ``conv_transpose`` of ``x`` (``(N, C_in, *S)``) with ``w``
    (``(C_in, F/groups, *k)``) and ``b``; on the host, where the stride is the kernel, one matrix product or
    compiled interleaving (:func:`tiles`), and up to :data:`DIRECT_MAX_CHANNELS` input channels otherwise
    lbannpy's compiled data-gradient kernels (:func:`_direct`)."""
    if _host(x) and x.flags.c_contiguous and tiles(x.shape, w.shape, stride, padding, output_padding,
                                                   dilation, groups):
        return _tiles_forward(x, w, b)
    if _direct(x, w, groups):
        return _direct_forward(x, w, b, stride, padding, output_padding, dilation)
    conv, _ = _ops()
    s, p, op, d = _lists(stride, padding, output_padding, dilation)
    y = conv(_t(x), _t(w), None if b is None else _t(b), s, p, d, True, op, int(groups))
    return _back(y, x)


@_on_device
def conv_transpose_backward(dy, x, w, bias: bool, want_dx: bool, stride, padding, output_padding, dilation,
                            groups: int):
    """``(dL/dx or None, dL/dw, dL/db or None)`` in one operator call (on the host, direct kernels or two
    matrix products where the stride is the kernel: :func:`tiles`; the bias gradient of an NCHW ``dy``
    summed before the operator runs, in one sequential pass that also brings ``dy`` into the cache)."""
    if (_host(dy) and dy.flags.c_contiguous and x.flags.c_contiguous
            and tiles(x.shape, w.shape, stride, padding, output_padding, dilation, groups)):
        return _tiles_backward(dy, x, w, bias, want_dx)
    _, bwd = _ops()
    s, p, op, d = _lists(stride, padding, output_padding, dilation)
    db = None
    if bias and _host(dy) and dy.flags.c_contiguous:  # summed first, sequentially: dy comes into the cache
        db, bias = dy.reshape(dy.shape[0], dy.shape[1], -1).sum(axis=2).sum(axis=0), False
    sizes = [int(w.shape[1]) * int(groups)] if bias else None
    gx, gw, gb = bwd(_t(dy), _t(x), _t(w), sizes, s, p, d, True, op, int(groups),
                     [bool(want_dx), True, bool(bias)])
    return (_back(gx, dy) if want_dx else None, _back(gw, dy),
            _back(gb, dy) if bias else db)
