"""``python -m lbannpy.bench calibrate --kernels MODEL...``: every layer of the named models timed on the
block one rank computes under each split the planner may give it at the calibrated rank count, as
``compute.measured`` rows keyed by that block and the split (``split``, ``procs``: timed while every rank of
the node computed, see :func:`lbannpy.strategy.cost.compute_times`).

A split of ``P' > 1`` ways (every divisor of the ranks) along one dimension (``n``, ``c``, ``h``; a layer's
type must allow it and the planner's checks pass) gives each rank a smaller problem than the whole layer's:
fewer samples, fewer filters or units (a channel split: a narrower GEMM), fewer rows (a spatial split: the
convolution runs on its window, the block and the halo it reads, padded only at the outer edges). On a CPU
such small problems run far below the rate of the large GEMM that γ is measured with, and the fixed cost of
a call weighs more, so the rows are what prices a split layer instead of the roofline.

Convolutions time both kernel sets (as ``--kernels`` does for the whole layer, :mod:`.kernel_choice`) and
write the faster with ``kernel:`` (``runtime.kernels: auto`` takes it at that block; ATen's with its host
layout, ``layout:``, timed on the window the split builds, :func:`.kernel_choice.layout_of`); the other
layer types time the registered layer itself on the block (forward and backward, the layer's fixed cost
included).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np

from .kernel_choice import layout_of, time_sets
from .layout_choice import layer_layouts, layout_choice
from .layer_shapes import MODEL_RUNS, QUICK_RUNS, LayerShape

SPLIT_DIMS = ("n", "c", "h")  # one-dimension splits timed (the planner keeps h >= w: w alone never comes)


def model_graphs(items: list[str], quick: bool) -> list[tuple[str, object]]:
    """``(label, model graph)`` of each item: a zoo name (``NAME[:SIZE[:BATCH]]``; the sizes ``bench layers
    --models`` uses by default, as :func:`lbannpy.bench.kernel_choice.conv_shapes`) or a spec/config file."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.strategy.graph import build_graph
    from lbannpy.zoo import get_spec

    out = []
    for item in items:
        if os.path.splitext(item)[1].lower() in (".yaml", ".yml", ".h5", ".hdf5"):
            from lbannpy.strategy.__main__ import read_config  # late: the config reader and h5py

            tree = read_config(item)
            batch = int(tree["trainer"]["batch_size"])
            out.append((os.path.basename(item), build_graph(tree["model"], batch)))
            continue
        name, *rest = item.split(":")
        spec = get_spec(name)
        table = {n: (sz, b) for n, sz, b in (QUICK_RUNS if quick else MODEL_RUNS)}
        size, batch = table.get(name, (spec["model"]["input"]["spatial"][0], spec["trainer"]["batch_size"]))
        size = int(rest[0]) if rest else size
        batch = int(rest[1]) if len(rest) > 1 else batch
        out.append((f"{name} {size}^2 b{batch}",
                    build_graph(get_spec(name, batch_size=batch, input_size=size)["model"], batch)))
    return out


def split_blocks(graph, ranks: int) -> list[tuple[object, object, tuple, tuple]]:
    """``(node, distribution, local input, local output)`` of every single-input layer of ``graph`` under
    each one-dimension split of every divisor ``> 1`` of ``ranks`` that the planner would consider, and
    held whole (but convolutions: ``--kernels`` times them whole)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.dist import DIM_NAMES, Distribution
    from lbannpy.layers.registry import layer_spec
    from lbannpy.strategy.cost import max_local_shape, required_input
    from lbannpy.strategy.planner import divisors, filter_reason

    out = []
    for node in graph:
        if len(node.in_shapes) != 1 or layer_spec(node.type).no_kernel:
            continue
        nd = len(node.out_shape)
        if node.type != "conv":
            out.append((node, Distribution.whole(nd, ranks), tuple(node.in_shape), tuple(node.out_shape)))
        for p in divisors(ranks)[1:]:
            for dim in SPLIT_DIMS:
                if dim not in layer_spec(node.type).split_dims or dim not in DIM_NAMES[nd]:
                    continue
                d = Distribution.make(nd, ranks, **{dim: p})
                if filter_reason(node, d, 0.25) is not None:
                    continue
                in_local = max_local_shape(node.in_shape, required_input(node, d, node.in_shape))
                out.append((node, d, tuple(in_local), tuple(max_local_shape(node.out_shape, d))))
    return out


def conv_problem(node, dist, out_local: tuple) -> LayerShape | None:
    """The convolution one rank runs for its block: its filters, and along a split spatial dimension the
    window of input rows its output rows read (no padding there: the halo stands in for it). None where the
    padding is asymmetric (not timed, as in :mod:`.kernel_choice`)."""
    dims = node.stencil.dims[2:]
    if any(w.pad_lo != w.pad_hi for w in dims):
        return None
    x = list(node.in_shape)
    x[0] = out_local[0]
    pads = []
    for i, w in enumerate(dims):
        if dist.split[2 + i] > 1:
            x[2 + i] = (out_local[2 + i] - 1) * w.stride + w.dilation * (w.kernel - 1) + 1
            pads.append(0)
        else:
            pads.append(w.pad_lo)
    return LayerShape("conv", tuple(x), out_local[1], tuple(w.kernel for w in dims),
                      tuple(w.stride for w in dims), tuple(pads), tuple(w.dilation for w in dims))


def time_layer(xp, typ: str, params: dict, in_local: tuple, reps: int, kernels=None
               ) -> tuple[tuple, float, float] | None:
    """``(output shape, forward s, backward s)`` of the registered layer on ``in_local`` on this rank alone
    (medians after a warm-up; at least ``reps`` calls, more for short ones, about 50 ms in all), its
    convolutions on ``kernels`` where given (a :class:`~lbannpy.layers.kernels.select.ConvKernels`)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.registry import layer_classes
    from lbannpy.tensor import DistTensor

    ctx = LayerContext(SingleCommunicator(), xp, "float32", seed=0)
    if kernels is not None:
        ctx.conv_kernels = kernels
    layer = layer_classes()[typ]("block", **params)
    d = Distribution.make(len(in_local), 1)
    layer.configure(ctx, [in_local], [d], d)
    rng = np.random.default_rng(0)
    x = DistTensor(xp.asarray(rng.standard_normal(in_local, dtype=np.float32)), in_local, d, 0)
    dy = DistTensor(xp.asarray(rng.standard_normal(layer.out_shape, dtype=np.float32)), layer.out_shape,
                    layer.out_dist, 0)
    fwd, bwd = [], []
    start = time.perf_counter()
    i = 0
    while i <= reps or (time.perf_counter() - start < 0.05 and i < 200):
        t0 = time.perf_counter()
        layer.forward([x])
        t1 = time.perf_counter()
        layer.backward(dy)
        t2 = time.perf_counter()
        ctx.timer.totals.clear()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        i += 1
    return tuple(layer.out_shape), float(np.median(fwd)), float(np.median(bwd))


def _block_params(node, out_local: tuple) -> dict:
    """The layer's parameters for its block: a split of the output channels is a layer with fewer of them."""
    params = {k: v for k, v in node.params.items() if k not in ("name", "type", "parents")}
    for key in ("filters", "units"):
        if key in params:
            params[key] = out_local[1]
    return params


def _transposed_set(comm, xp, node, dist, in_local, out_local):
    """Collective: ``(kernel set, its name, host layout)`` of a transposed convolution whose space is whole
    (the layer runs ATen's operator itself) on the host where torch imports: ATen's set, ``channels_last``
    where that layout times at least the margin faster on the slowest rank
    (:func:`.layout_choice.layer_layouts`); ``(None, None, None)`` for every other block (its layer's
    default kernels)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten
    from lbannpy.layers.kernels.select import conv_kernels

    if (node.type != "conv_transpose" or any(p > 1 for p in dist.split[2:]) or xp is not np
            or not aten.available("cpu")):
        return None, None, None
    times = layer_layouts(node.type, _block_params(node, out_local), in_local)
    every = comm.allgather_obj(times)
    layout = None
    if all(e is not None for e in every):
        layout = layout_choice(*(max(e[i] for e in every) for i in range(2)))
    return replace(conv_kernels("aten"), layout=layout or "nchw"), "aten", layout


def measure_split_layers(comm, xp, items: list[str], quick: bool, repeats: int = 5
                         ) -> tuple[list[dict], list[str]]:
    """Collective over ``comm`` (every rank times its own copy at once; the slowest rank's median is kept):
    the ``compute.measured`` rows of every layer block of ``items`` under the splits of
    :func:`split_blocks` at ``comm.size`` ranks, and the printed lines."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten
    from lbannpy.layers.registry import layer_spec

    p = comm.size
    rows, keys = [], set()
    lines = [f"layer blocks of {', '.join(items)} split up to {p} ways (every rank at once, slowest rank's "
             f"median; fwd, dL/dx, dL/dw in ms):"]
    for label, graph in model_graphs(items, quick):
        for node, dist, in_local, out_local in split_blocks(graph, p):
            split = tuple(dist.split)
            whole = all(s == 1 for s in split)
            key = (node.type, in_local, out_local) + (() if whole else (split,))
            if key in keys:
                continue
            kernel = layout = None
            if node.type == "conv":
                shape = conv_problem(node, dist, out_local)
                if shape is None or not aten.available("cpu"):
                    continue
                mine = time_sets(shape, np.float32, 3 if quick else repeats, adaptive=not quick)
                every = comm.allgather_obj(mine)
                worst = {k: tuple(max(r[k][i] for r in every) for i in range(3)) for k in mine}
                kernel = min(worst, key=lambda k: sum(worst[k]))
                f, bd, bw = worst[kernel]
                layout = layout_of(comm, shape) if kernel == "aten" else None  # the window a split builds
            else:
                kernels, kernel, layout = _transposed_set(comm, xp, node, dist, in_local, out_local)
                got = time_layer(xp, node.type, _block_params(node, out_local), in_local,
                                 3 if quick else repeats, kernels)
                every = comm.allgather_obj(None if got is None or got[0] != out_local else got[1:])
                if any(e is None for e in every):
                    continue
                f, b = (max(e[i] for e in every) for i in range(2))
                share = 0.5 if layer_spec(node.type).reduces_channels else 0.0
                bd, bw = b * (1 - share), b * share
            keys.add(key)
            row = {"type": node.type, "in": list(in_local), "out": list(out_local),
                   **({} if whole else {"split": list(split), "procs": p}),
                   "fwd_s": f, "bwd_data_s": bd, "bwd_weights_s": bw}
            if kernel:
                row["kernel"] = kernel
            if layout:
                row["layout"] = layout
            rows.append(row)
            lines.append(f"  {label:<18} {node.name:<9} {str(dist):<5} {'x'.join(map(str, in_local)):>14} -> "
                         f"{'x'.join(map(str, out_local)):<14} {f * 1e3:7.3f} {bd * 1e3:7.3f} {bw * 1e3:7.3f}"
                         + (f"  {kernel}" if kernel else "") + (f" {layout}" if layout else ""))
    return rows, lines
