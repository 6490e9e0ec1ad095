"""The zoo models' conv and batch-norm shapes as they train (``bench layers --models``, ``bench calibrate
--kernels`` and the split-layer calibration), a kernel set's three convolution calls at a shape, and the
interleaved timing of two callables: shared by :mod:`.layers`, :mod:`.layers_new` and :mod:`.kernel_choice`
without those importing each other."""
from __future__ import annotations

import time
from dataclasses import dataclass

from .timing import MAX_REPEATS, MIN_TIMED_S

# (zoo model, input size, batch size) as the models train; --quick shrinks input and batch
MODEL_RUNS = (("lenet5", 32, 32), ("alexnet", 128, 32), ("mesh_tiny", 64, 8), ("mesh1k", 256, 2),
              ("mesh1k", 1024, 1))
QUICK_RUNS = (("lenet5", 32, 2), ("alexnet", 64, 1), ("mesh_tiny", 16, 2), ("mesh1k", 32, 2))
CONV_OPS = ("forward", "data grad", "filter grad")


@dataclass(frozen=True)
class LayerShape:
    """One distinct conv or batch-norm shape of a zoo model (2-D, symmetric padding per dimension)."""

    kind: str  # conv | batchnorm
    x_shape: tuple  # (N, C, H, W)
    filters: int = 0
    kernel: tuple = ()
    stride: tuple = ()
    pad: tuple = ()
    dilation: tuple = ()

    @property
    def id(self) -> str:
        shape = "x".join(str(n) for n in self.x_shape)
        if self.kind == "batchnorm":
            return f"bn {shape}"
        k = "x".join(str(n) for n in self.kernel)
        return f"conv {shape}->{self.filters} k{k} s{self.stride[0]} p{self.pad[0]}"


def model_shapes(runs=MODEL_RUNS, max_size: int = 0) -> list[tuple[str, LayerShape]]:
    """``(model label, shape)`` of every distinct conv / batch-norm shape of ``runs``, from the zoo specs
    through the model graph; the first model that has a shape names it. ``max_size``: skip inputs larger."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.strategy.graph import build_graph
    from lbannpy.zoo import get_spec

    seen: dict[LayerShape, str] = {}
    for name, size, batch in runs:
        if max_size and size > max_size:
            continue
        graph = build_graph(get_spec(name, batch_size=batch, input_size=size)["model"], batch)
        for node in graph.nodes:
            if node.type == "batchnorm":
                shape = LayerShape("batchnorm", tuple(node.in_shape))
            elif node.type == "conv":
                dims = node.stencil.dims[2:]
                if any(d.pad_lo != d.pad_hi for d in dims):
                    raise ValueError(f"{name} {node.name}: asymmetric padding is not benchmarked")
                shape = LayerShape("conv", tuple(node.in_shape), node.out_shape[1],
                                   tuple(d.kernel for d in dims), tuple(d.stride for d in dims),
                                   tuple(d.pad_lo for d in dims), tuple(d.dilation for d in dims))
            else:
                continue
            seen.setdefault(shape, f"{name} {size}^2 b{batch}")
    return [(label, shape) for shape, label in seen.items()]


def conv_set_ops(shape: LayerShape, dtype, ks) -> tuple[dict, tuple]:
    """``({op: callable}, (x, w, b, dy))``: the forward, the data and the filter gradient of kernel set
    ``ks`` (a :class:`~lbannpy.layers.kernels.select.ConvKernels`) at ``shape``, called as an unsplit conv
    layer on one rank calls them: the input block and its padding where the set pads this convolution
    itself (:attr:`~lbannpy.layers.conv.Conv.kernel_pads`), else the padded window in and the window gradient
    (into a reused buffer unless the set allocates its results) cropped; and their arrays."""
    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers import kernels as K

    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape.x_shape).astype(dtype)
    w = (rng.standard_normal((shape.filters, shape.x_shape[1]) + shape.kernel) * 0.1).astype(dtype)
    b = rng.standard_normal(shape.filters).astype(dtype)
    pads = [(p, p) for p in shape.pad]
    xw = K.pad_spatial(x, pads)
    s, d = shape.stride, shape.dilation
    dy = rng.standard_normal(K.conv_forward(xw, w, b, s, d).shape).astype(dtype)
    inside = ks.pads(x.shape, w.shape, s, d, shape.pad, np) if callable(ks.pads) else ks.pads
    if inside:
        p, dx_space = tuple(shape.pad), None if ks.allocates else np.empty_like(x)
        return {
            "forward": lambda: ks.conv_forward(x, w, b, s, d, padding=p),
            "data grad": lambda: ks.conv_backward_input(dy, w, x, s, d, out=dx_space, padding=p),
            "filter grad": lambda: ks.conv_backward_params(x, dy, w, True, s, d, padding=p),
        }, (x, w, b, dy)
    dwindow = None if ks.allocates else np.empty_like(xw)  # the layer's window-gradient workspace, reused
    ops = {
        "forward": lambda: ks.conv_forward(K.pad_spatial(x, pads), w, b, s, d),
        "data grad": lambda: np.ascontiguousarray(K.crop_spatial(
            ks.conv_backward_input(dy, w, xw, s, d, out=dwindow), pads)),
        "filter grad": lambda: ks.conv_backward_params(xw, dy, w, True, s, d),
    }
    return ops, (x, w, b, dy)


def time_pair(ours, theirs, repeats: int, adaptive: bool = True) -> tuple[float, float]:
    """Median seconds of ``ours`` and ``theirs``, one warm-up call each, then interleaved rounds (the order
    alternating); short calls get more rounds (about ``MIN_TIMED_S`` each, at most ``MAX_REPEATS``)."""
    import statistics

    fns = [ours, theirs]
    longest = 0.0
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        longest = max(longest, time.perf_counter() - t0)
    if adaptive:
        repeats = max(repeats, min(MAX_REPEATS, int(MIN_TIMED_S / max(longest, 1e-6))))
    times: list[list[float]] = [[], []]
    for r in range(repeats):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])
