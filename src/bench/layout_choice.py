"""The host layout of a convolution on ATen's host set, as ``bench calibrate --kernels`` decides it: both
layouts timed, the window and the output gradient NCHW or laid out channels-last (the conversion copies
included), channels-last recorded only where it is at least :data:`CHANNELS_LAST_MARGIN` faster. Shared by the
calibration (:mod:`.kernel_choice`, every rank) and ``bench layers --new`` (one rank)."""
from __future__ import annotations


#: channels-last is recorded where it is at least this much faster (its conversions included), so that a
#: shape whose two layouts time alike keeps NCHW from one calibration to the next
CHANNELS_LAST_MARGIN = 1.15
#: the layouts are timed on the shape with its spatial extents halved until a window holds at most this many
#: elements (their ratio is set by the channels and the filter; the memory is not the calibration's to take)
MEASURE_ELEMENTS = 1 << 21


def measure_layouts(x_shape, w_shape, stride, dilation, dtype="float32") -> tuple[float, float]:
    """``(NCHW s, channels-last s)``: CPU time of one forward and backward of ATen's host convolution of the
    window ``x_shape`` with filters ``w_shape``, with the window and the output gradient NCHW, and laid out
    channels-last with the copy that lays the output gradient out so (output and input gradient come back
    as the layer gets them); both layouts interleaved, the best of two rounds each after a warm-up."""
    import time

    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten

    char, nd = np.dtype(dtype).char, len(x_shape) - 2
    stride, dilation = (tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd for v in (stride, dilation))
    shape, span = list(x_shape), [(k - 1) * d + s for k, d, s in zip(w_shape[2:], dilation, stride)]
    while np.prod(shape) > MEASURE_ELEMENTS and max(n - m for n, m in zip(shape[2:], span)) > 0:
        i = max(range(2, len(shape)), key=lambda j: shape[j] - span[j - 2])
        shape[i] = max(span[i - 2], (shape[i] + 1) // 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(char)
    w, b = rng.standard_normal(w_shape).astype(char), np.zeros(w_shape[0], char)
    y = aten.conv_forward(x, w, b, stride, dilation)
    dy = rng.standard_normal(y.shape).astype(char)
    xc = aten.channels_last_view(np.empty(aten.channels_last_shape(x.shape), char), x.ndim)
    xc[...] = x
    dyc = aten.channels_last_view(np.empty(aten.channels_last_shape(dy.shape), char), x.ndim)

    def step(xw, g):
        if g is not None:
            aten.copy_into(g, dy)
        g = dy if g is None else g
        aten.conv_forward(xw, w, b, stride, dilation)
        aten.conv_backward_input(g, w, xw, stride, dilation)
        aten.conv_backward_params(xw, g, w, True, stride, dilation)

    best = [float("inf")] * 2
    for r in range(3):
        for i, args in enumerate(((x, None), (xc, dyc))):
            t0 = time.process_time()
            step(*args)
            if r:  # the first round builds oneDNN's primitives
                best[i] = min(best[i], time.process_time() - t0)
    return best[0], best[1]


def layout_choice(nchw_s: float, channels_last_s: float) -> str:
    """The recorded layout of a shape whose two layouts took these times."""
    return "channels_last" if channels_last_s * CHANNELS_LAST_MARGIN <= nchw_s else "nchw"


def layer_layouts(typ: str, params: dict, in_shape, dtype="float32") -> tuple[float, float] | None:
    """``(NCHW s, channels-last s)``: CPU time of one forward and backward of the registered layer ``typ``
    on one rank on ATen's host set with each layout (the layer's own copies included: what a run pays),
    interleaved, the best of four rounds each after a warm-up; None where the layer takes no channels-last
    layout at this shape (``channels_last`` stays false under that set). For the layers whose operator a
    layout changes as a whole (the transposed convolution's native path)."""
    import time
    from dataclasses import replace

    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels.select import conv_kernels
    from lbannpy.layers.registry import layer_classes
    from lbannpy.tensor import DistTensor

    in_shape = tuple(int(n) for n in in_shape)
    d = Distribution.make(len(in_shape), 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(in_shape).astype(dtype)
    runs = []
    for layout in ("nchw", "channels_last"):
        ctx = LayerContext(SingleCommunicator(), np, dtype, seed=0)
        ctx.conv_kernels = replace(conv_kernels("aten"), layout=layout)
        layer = layer_classes()[typ]("layout", **params)
        layer.configure(ctx, [in_shape], [d], d)
        if layout == "channels_last" and not getattr(layer, "channels_last", False):
            return None
        dy = rng.standard_normal(layer.out_shape).astype(dtype)
        runs.append((layer, DistTensor(x, in_shape, d, 0),
                     DistTensor(dy, layer.out_shape, layer.out_dist, 0)))
    best = [float("inf")] * 2
    for r in range(5):
        for i, (layer, xt, dyt) in enumerate(runs):
            t0 = time.process_time()
            layer.forward([xt])
            layer.backward(dyt)
            layer.ctx.timer.totals.clear()
            if r:  # the first round builds oneDNN's primitives
                best[i] = min(best[i], time.process_time() - t0)
    return best[0], best[1]
