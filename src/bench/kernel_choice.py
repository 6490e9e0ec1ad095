"""``python -m lbannpy.bench calibrate --kernels ...``: which conv kernel set is faster at each layer shape.

For every distinct conv shape of the named models, lbannpy's own kernels and PyTorch's ATen kernels
(:mod:`lbannpy.layers.kernels.select`) are timed as the conv layer calls them: forward, data gradient, filter
gradient, interleaved, on every rank at once (each with its compute slot, like the GEMM rate), the slowest
rank's median kept. The faster set by the sum of the three becomes a ``compute.measured`` row of the machine
file with that set's times and ``kernel: own|aten``; ``runtime.kernels: auto`` then takes that set at that
shape (with ``parallel.machine`` naming the file) and the cost model prices the layer with its times.
Where ATen's set is the faster, its convolution is also timed with the window and the output gradient laid
out channels-last (the conversion copies included, :func:`.layout_choice.measure_layouts`), and the row says
``layout: channels_last`` where that is at least the margin of :mod:`.layout_choice` faster on the slowest
rank: a run's conv layer takes that layout there (``runtime.kernels`` auto or aten, on the host, where it
builds a window) and nowhere else, so its numbers never follow a timing of the run itself.

A model is a zoo name, optionally ``NAME:SIZE:BATCH`` (input side and batch; by default the sizes
``bench layers --models`` uses, else the zoo's), or a spec / config file (its model and batch size). Rows
are keyed by the whole layer's input and output shapes, i.e. what one rank holds when the layer is not split;
two conv layers of equal input and output shapes but other stencils share a key: the first one's row stays.
"""
from __future__ import annotations

import os

from .layout_choice import layout_choice, measure_layouts
from .layer_shapes import MODEL_RUNS, QUICK_RUNS, LayerShape, conv_set_ops, model_shapes, time_pair


def _runs(item: str, quick: bool) -> list[tuple[str, int, int]] | None:
    """``[(zoo name, size, batch)]`` of a zoo item, or None when ``item`` is a file."""
    if os.path.splitext(item)[1].lower() in (".yaml", ".yml", ".h5", ".hdf5"):
        return None
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.zoo import get_spec

    name, *rest = item.split(":")
    table = {n: (sz, b) for n, sz, b in (QUICK_RUNS if quick else MODEL_RUNS)}
    spec = get_spec(name)  # an unknown name raises here, naming the choices
    size = spec["model"]["input"]["spatial"][0]
    size, batch = table.get(name, (size, spec["trainer"]["batch_size"]))
    if rest:
        size = int(rest[0])
    if len(rest) > 1:
        batch = int(rest[1])
    return [(name, size, batch)]


def _file_shapes(path: str) -> list[tuple[str, LayerShape]]:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.strategy.__main__ import read_config
    from lbannpy.strategy.graph import build_graph

    tree = read_config(path)
    batch = int(tree["trainer"]["batch_size"])
    graph = build_graph(tree["model"], batch)
    out = []
    for node in graph.nodes:
        if node.type != "conv":
            continue
        dims = node.stencil.dims[2:]
        if any(d.pad_lo != d.pad_hi for d in dims):
            continue  # asymmetric padding: not timed (the rule of runtime.kernels applies there)
        out.append((os.path.basename(path), LayerShape(
            "conv", tuple(node.in_shape), node.out_shape[1], tuple(d.kernel for d in dims),
            tuple(d.stride for d in dims), tuple(d.pad_lo for d in dims), tuple(d.dilation for d in dims))))
    return out


def conv_shapes(items: list[str], quick: bool = False) -> list[tuple[str, LayerShape]]:
    """``(model label, shape)`` of every distinct conv shape of ``items``, in order of first appearance."""
    seen: dict[LayerShape, str] = {}
    for item in items:
        runs = _runs(item, quick)
        found = _file_shapes(item) if runs is None else model_shapes(runs)
        for label, shape in found:
            if shape.kind == "conv":
                seen.setdefault(shape, label)
    return [(label, shape) for shape, label in seen.items()]


def out_shape(shape: LayerShape) -> tuple[int, ...]:
    """The conv's output shape (N, F, spatial...)."""
    sp = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
               zip(shape.x_shape[2:], shape.kernel, shape.stride, shape.pad, shape.dilation))
    return (shape.x_shape[0], shape.filters) + sp


def time_sets(shape: LayerShape, dtype, repeats: int, adaptive: bool = True) -> dict[str, tuple]:
    """``{set name: (forward s, data grad s, filter grad s)}`` of the own and ATen sets, interleaved."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels.select import conv_kernels, own

    own_ops, _ = conv_set_ops(shape, dtype, own())
    aten_ops, _ = conv_set_ops(shape, dtype, conv_kernels("aten"))
    pairs = [time_pair(own_ops[op], aten_ops[op], repeats, adaptive)
             for op in ("forward", "data grad", "filter grad")]
    return {"own": tuple(p[0] for p in pairs), "aten": tuple(p[1] for p in pairs)}


def layout_of(comm, shape: LayerShape) -> str | None:
    """Collective: ``channels_last`` where the ATen set runs ``shape``'s convolution (on the window the
    layer builds) at least the margin of :mod:`.layout_choice` faster so on the slowest rank, ``nchw`` where
    it does not, None where the shape has no channels-last layout."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten

    window = shape.x_shape[:2] + tuple(n + 2 * p for n, p in zip(shape.x_shape[2:], shape.pad))
    w_shape = (shape.filters, shape.x_shape[1]) + tuple(shape.kernel)
    if not aten.has_channels_last(window, w_shape):
        return None
    every = comm.allgather_obj(measure_layouts(window, w_shape, shape.stride, shape.dilation))
    nchw, cl = (max(e[i] for e in every) for i in range(2))
    return layout_choice(nchw, cl)


def measure_kernels(comm, items: list[str], quick: bool, repeats: int = 5) -> tuple[list[dict], list[str]]:
    """Collective: the machine-file rows and the printed table (both meaningful on rank 0)."""
    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten

    if not aten.available("cpu"):
        return [], ["conv kernels: PyTorch is not importable here, so only lbannpy's own set exists: no "
                    "kernel rows written"]
    shapes = conv_shapes(items, quick)
    lines = [f"conv kernel sets at {len(shapes)} layer shape(s) of {', '.join(items)} (float32, every rank "
             f"at once, slowest rank's median; fwd + data grad + filter grad, ms):",
             f"{'model':<22} {'shape':<42} {'own ms':>9} {'aten ms':>9}  chosen (aten: its host layout)"]
    rows, keys = [], set()
    for label, shape in shapes:
        mine = time_sets(shape, np.float32, 3 if quick else repeats, adaptive=not quick)
        every = comm.allgather_obj(mine)
        worst = {k: tuple(max(r[k][i] for r in every) for i in range(3)) for k in mine}
        best = min(worst, key=lambda k: sum(worst[k]))
        key = (tuple(shape.x_shape), out_shape(shape))
        layout = layout_of(comm, shape) if best == "aten" and key not in keys else None
        lines.append(f"{label:<22} {shape.id:<42} {sum(worst['own']) * 1e3:9.3f} "
                     f"{sum(worst['aten']) * 1e3:9.3f}  {best}" + (f" {layout}" if layout else "")
                     + ("" if key not in keys else "  (key taken by an earlier shape)"))
        if key in keys:
            continue
        keys.add(key)
        f, bd, bw = worst[best]
        rows.append({"type": "conv", "in": list(key[0]), "out": list(key[1]), "fwd_s": f, "bwd_data_s": bd,
                     "bwd_weights_s": bw, "kernel": best, **({"layout": layout} if layout else {})})
    chosen = [r["kernel"] for r in rows]
    lines.append(f"chosen: aten at {chosen.count('aten')} shape(s), own at {chosen.count('own')}")
    return rows, lines
