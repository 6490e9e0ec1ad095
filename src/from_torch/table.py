"""The importer's one table: each ATen operator it accepts, the lbannpy layer type it becomes, the limits on
its arguments, and its converter.

The table is plain Python (no torch import): ``python -m lbannpy.docs`` renders it into
``docs/from_torch.md``, and :mod:`lbannpy.from_torch.capture` keeps every operator named here intact when it
decomposes the captured graph (``run_decompositions``), so an operator is seen as the user wrote it (a
``group_norm``, not its arithmetic) and anything else arrives as core ATen, where it is refused by name.

A converter gets the :class:`lbannpy.from_torch.capture.Builder`, the graph node and the node's arguments
bound by name (the operator schema's names and defaults). It either emits lbannpy layers, folds the node
into its input (a view that changes nothing lbannpy sees), or refuses with what it does support.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

PAD_MODES = {"constant": "zeros", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


@dataclass(frozen=True)
class Op:
    """ATen overloads (``aten.name.overload``) that one converter handles, what they become and the limits."""

    aten: tuple[str, ...]
    becomes: str
    limits: str
    convert: Callable


def _short(values):
    """One int where every spatial dimension has the same value (the spec's short form), else a list."""
    values = [int(v) for v in values]
    return values[0] if len(set(values)) == 1 else values


def _padding(per_dim):
    """The spec's padding from [lo, hi] per spatial dimension: one int where every side is the same, else
    one entry per dimension (an int where its two sides agree, else the pair)."""
    short = [int(lo) if lo == hi else [int(lo), int(hi)] for lo, hi in per_dim]
    return short[0] if all(v == short[0] for v in short) and not isinstance(short[0], list) else short


def _spatial(b, node, arg) -> int:
    return len(b.shape(arg)) - 2


def _dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


# ------------------------------------------------------------------------------------------- convolution
def _convolution(b, node, a):
    x, w, bias = a["input"], a["weight"], a["bias"]
    wshape = b.shape(w)
    nsp = len(wshape) - 2
    origin = {"weight": w, "bias": bias}
    groups = int(a["groups"])
    if a["transposed"]:
        params = {"filters": wshape[1] * groups, "kernel": _short(wshape[2:]), "stride": _short(a["stride"]),
                  "padding": _short(a["padding"]), "output_padding": _short(a["output_padding"]),
                  "dilation": _short(a["dilation"]), "groups": groups, "bias": bias is not None}
        b.emit(node, "conv_transpose", params, [b.input(node, x)], origin)
        return
    if any(int(p) for p in a["output_padding"]):
        b.refuse(node, "output_padding on a forward convolution", "output_padding 0")
    padding = [[int(p), int(p)] for p in a["padding"]]
    mode, src = "zeros", x
    pending = b.pending_pad.pop(x, None)
    if pending is not None and not any(p for pair in padding for p in pair):
        src, padding, mode = pending
    elif pending is not None:  # the convolution pads too: the pad stays a layer of its own
        _emit_pad(b, x, pending[0], pending[1], pending[2], 0.0)
    params = {"filters": wshape[0], "kernel": _short(wshape[2:]), "stride": _short(a["stride"]),
              "padding": _padding(padding), "dilation": _short(a["dilation"]), "bias": bias is not None}
    if groups != 1:
        params["groups"] = groups
    if mode != "zeros":
        params["padding_mode"] = mode
    if len(padding) != nsp:
        b.refuse(node, f"padding {padding} for a {nsp}-D kernel", "one padding per spatial dimension")
    b.emit(node, "conv", params, [b.input(node, src)], origin)


def _pad(b, node, a):
    x = a["input"]
    nsp = _spatial(b, node, x)
    pads = [int(p) for p in a["pad"]]
    mode = a["mode"] or "constant"
    if mode not in PAD_MODES:
        b.refuse(node, f"mode {mode!r}", f"modes {', '.join(PAD_MODES)}")
    if len(pads) > 2 * nsp or len(pads) % 2:
        b.refuse(node, f"pad {pads} reaches beyond the {nsp} spatial dimension(s)", "padding of H, W (and D)")
    if any(p < 0 for p in pads):
        b.refuse(node, f"negative padding {pads} (a crop)", "padding >= 0")
    pads += [0] * (2 * nsp - len(pads))
    per_dim = [[pads[2 * (nsp - 1 - i)], pads[2 * (nsp - 1 - i) + 1]] for i in range(nsp)]
    value = float(a["value"] or 0.0)
    if not any(pads):
        b.alias(node, x)
        return
    users = list(node.users)
    if (len(users) == 1 and str(users[0].target) == "aten.convolution.default" and value == 0.0
            and not users[0].args[6]):
        b.pending_pad[node] = (x, per_dim, PAD_MODES[mode])  # the convolution takes it as its padding
        return
    _emit_pad(b, node, x, per_dim, PAD_MODES[mode], value)


def _emit_pad(b, node, x, per_dim, mode: str, value: float):
    params = {"padding": _padding(per_dim), "mode": mode}
    if value:
        params["value"] = value
    b.emit(node, "pad", params, [b.input(node, x)])


def _linear(b, node, a):
    x = a["input"]
    if len(b.shape(x)) != 2:
        b.refuse(node, f"a linear layer over the last axis of a {b.shape(x)} tensor",
                 "linear on (N, features): flatten first")
    w = a["weight"]
    b.emit(node, "fc", {"units": b.shape(w)[0], "bias": a["bias"] is not None}, [b.input(node, x)],
           {"weight": w, "bias": a["bias"]})


# ------------------------------------------------------------------------------------------------- norms
def _affine(b, node, a) -> bool:
    if (a["weight"] is None) != (a["bias"] is None):
        b.refuse(node, "a weight without a bias (or the reverse)", "both or neither (affine)")
    return a["weight"] is not None


def _batch_norm(b, node, a):
    if not a["training"] or a["running_mean"] is None:
        b.refuse(node, "batch norm with frozen or no running statistics (module in eval mode, or "
                       "track_running_stats=False)", "training-mode batch norm with running statistics")
    if not _affine(b, node, a):
        b.refuse(node, "batch norm without affine parameters", "affine=True")
    origin = {"scale": a["weight"], "bias": a["bias"], "running_mean": a["running_mean"],
              "running_var": a["running_var"]}
    b.emit(node, "batchnorm", {"eps": float(a["eps"]), "momentum": float(a["momentum"]), "sync": "global"},
           [b.input(node, a["input"])], origin, counter=True)
    b.outputs_used[node] = {0}


def _frozen_batch_norm(b, node, a):
    b.refuse(node, "batch norm with frozen statistics (the module was in eval mode)",
             "import a module in training mode (module.train())")


def _group_norm(b, node, a):
    params = {"groups": int(a["num_groups"]), "eps": float(a["eps"]), "affine": _affine(b, node, a)}
    b.emit(node, "groupnorm", params, [b.input(node, a["input"])], {"scale": a["weight"], "bias": a["bias"]})


def _layer_norm(b, node, a):
    x = a["input"]
    if tuple(a["normalized_shape"]) != b.shape(x)[1:]:
        b.refuse(node, f"normalized_shape {list(a['normalized_shape'])} of a {b.shape(x)} input",
                 "layer norm over (C, spatial...) (normalized_shape = x.shape[1:])")
    b.emit(node, "layernorm", {"eps": float(a["eps"]), "affine": _affine(b, node, a)}, [b.input(node, x)],
           {"scale": a["weight"], "bias": a["bias"]})


def _instance_norm(b, node, a):
    if not a["use_input_stats"]:
        b.refuse(node, "instance norm from running statistics (eval mode)", "instance norm in training mode")
    track = a["running_mean"] is not None
    params = {"eps": float(a["eps"]), "affine": _affine(b, node, a), "track_running_stats": track,
              "momentum": float(a["momentum"])}
    origin = {"scale": a["weight"], "bias": a["bias"]}
    if track:
        origin.update(running_mean=a["running_mean"], running_var=a["running_var"])
    b.emit(node, "instancenorm", params, [b.input(node, a["input"])], origin, counter=track)


# ----------------------------------------------------------------------------------------------- pooling
def _window(b, node, a, name):
    nsp = _spatial(b, node, a["input"])
    v = list(a[name]) if isinstance(a[name], (list, tuple)) else [a[name]]
    return [int(i) for i in (v * nsp if len(v) == 1 else v)]


def _pool(mode):
    def convert(b, node, a):
        x = a["input"]
        kernel = _window(b, node, a, "kernel_size")
        stride = _window(b, node, a, "stride") if list(a["stride"] or []) else kernel
        padding = _window(b, node, a, "padding")
        if mode == "max" and any(d != 1 for d in _window(b, node, a, "dilation")):
            b.refuse(node, f"dilation {list(a['dilation'])}", "max pooling with dilation 1")
        if mode == "avg" and (a["divisor_override"] or (not a["count_include_pad"] and any(padding))):
            b.refuse(node, "count_include_pad=False with padding, or divisor_override",
                     "average pooling that counts padding (PyTorch's default)")
        floor = [(n + 2 * p - k) // s + 1 for n, k, s, p in zip(b.shape(x)[2:], kernel, stride, padding)]
        if list(b.shape(node)[2:]) != floor:
            b.refuse(node, "ceil_mode=True where it changes the output size", "ceil_mode=False")
        b.emit(node, "pool", {"mode": mode, "kernel": _short(kernel), "stride": _short(stride),
                              "padding": _short(padding)}, [b.input(node, x)])
        b.outputs_used[node] = {0}
    return convert


def _global(mode, reduce_args: bool):
    def convert(b, node, a):
        x = a["input"]
        nd = len(b.shape(x))
        if reduce_args:
            dims = sorted(_dim(int(d), nd) for d in (a["dim"] or range(nd)))
            if dims != list(range(2, nd)) or a.get("dtype") is not None:
                b.refuse(node, f"a reduction over dimensions {dims} of a {b.shape(x)} tensor",
                         "the mean or max over every spatial dimension (global pooling)")
            keep = bool(a["keepdim"])
        else:
            size = [int(s) for s in a["output_size"]]
            if size == list(b.shape(x)[2:]):
                b.alias(node, x)
                return
            if any(s != 1 for s in size):
                b.refuse(node, f"adaptive pooling to {size}", "adaptive pooling to 1 (global pooling)")
            keep = True
        b.global_pool(node, mode, x, keep)
        b.outputs_used[node] = {0}
    return convert


# ---------------------------------------------------------------------------------------- resampling
def _upsample(mode):
    def convert(b, node, a):
        x = a["input"]
        nin, nout = b.shape(x)[2:], b.shape(node)[2:]
        scale = [o // i for i, o in zip(nin, nout)]
        given = list(a.get("scale_factors") or [])
        if any(i * s != o for i, s, o in zip(nin, scale, nout)) or any(float(g) != int(g) for g in given):
            b.refuse(node, f"scale {given or [o / i for i, o in zip(nin, nout)]} ({list(nin)} -> "
                           f"{list(nout)})", "integer scale factors")
        params = {"scale": _short(scale), "mode": "nearest" if mode == "nearest" else "linear"}
        if mode == "linear":
            params["align_corners"] = bool(a["align_corners"])
        b.emit(node, "upsample", params, [b.input(node, x)])
    return convert


# ------------------------------------------------------------------------------------------- pointwise
def _unary(kind):
    def convert(b, node, a):
        b.emit(node, kind, {}, [b.input(node, a["input"])])
    return convert


def _leaky_relu(b, node, a):
    b.emit(node, "leaky_relu", {"slope": float(a["negative_slope"])}, [b.input(node, a["input"])])


def _gelu(b, node, a):
    approx = a.get("approximate", "none") or "none"
    b.emit(node, "gelu", {"approximate": approx} if approx != "none" else {}, [b.input(node, a["input"])])


def _elu(b, node, a):
    if float(a["scale"]) != 1.0 or float(a["input_scale"]) != 1.0:
        b.refuse(node, f"scale {a['scale']}, input_scale {a['input_scale']} (SELU/CELU)", "ELU (scales 1)")
    b.emit(node, "elu", {"alpha": float(a["alpha"])}, [b.input(node, a["input"])])


def _prelu(b, node, a):
    w = a["weight"]
    b.emit(node, "prelu", {"num_parameters": math.prod(b.shape(w))}, [b.input(node, a["input"])],
           {"weight": w})


def _softmax(b, node, a):
    x = a["input"]
    if _dim(int(a["dim"]), len(b.shape(x))) != 1 or a.get("dtype") is not None or a.get("half_to_float"):
        b.refuse(node, f"softmax over dimension {a['dim']}", "softmax over the channels (dim=1)")
    b.emit(node, "softmax", {}, [b.input(node, x)])


def _dropout(b, node, a):
    x = a["input"]
    if not a["train"] or not float(a["p"]):
        b.alias(node, x)
    else:
        b.emit(node, "dropout", {"p": float(a["p"])}, [b.input(node, x)])
    b.outputs_used[node] = {0}


def _binary(kind):
    def convert(b, node, a):
        x, y = a["self"], a["other"]
        if not (b.is_tensor(x) and b.is_tensor(y)):
            b.refuse(node, f"{'adding' if kind == 'sum' else 'multiplying by'} a constant",
                     "two tensors of one shape")
        if b.shape(x) != b.shape(y) or float(a.get("alpha", 1) or 1) != 1.0:
            b.refuse(node, f"shapes {b.shape(x)} and {b.shape(y)} (broadcasting) or alpha != 1",
                     "two tensors of one shape")
        b.emit(node, kind, {}, [b.input(node, x), b.input(node, y)])
    return convert


def _cat(b, node, a):
    xs = list(a["tensors"])
    nd = len(b.shape(xs[0]))
    if _dim(int(a["dim"]), nd) != 1:
        b.refuse(node, f"concatenation along dimension {a['dim']}", "concatenation along channels (dim=1)")
    if len(xs) == 1:
        b.alias(node, xs[0])
    else:
        b.emit(node, "concat", {"axis": 1}, [b.input(node, x) for x in xs])


def _view(b, node, a):
    x = a["input"]
    sin, sout = b.shape(x), b.shape(node)
    if sin == sout:
        b.alias(node, x)
    elif len(sout) == 2 and sout[0] == sin[0] and sout[1] == math.prod(sin[1:]):
        b.emit(node, "flatten", {}, [b.input(node, x)])
    else:
        b.refuse(node, f"reshape {sin} -> {sout}",
                 "flattening to (N, features), or views that keep the shape")


def _getitem(b, node, a):
    src, index = node.args
    if index not in b.outputs_used.get(src, ()):
        b.refuse(node, f"output {index} of {b.opname(src)}", "the operator's first output")
    b.alias(node, src)


POOL_NOTE = "ceil_mode only where it changes nothing; max: dilation 1; avg: count_include_pad"
TABLE: tuple[Op, ...] = (
    Op(("aten.convolution.default",), "conv, conv_transpose",
       "1-3 spatial dims; any stride, padding, dilation, groups; a preceding F.pad (padding_mode) folds in",
       _convolution),
    Op(("aten.pad.default",), "pad (or the next conv's padding and padding_mode)",
       "modes constant (zeros), reflect, replicate, circular; spatial dimensions only; no cropping", _pad),
    Op(("aten.linear.default",), "fc", "on a (N, features) input", _linear),
    Op(("aten._native_batch_norm_legit_functional.default",), "batchnorm (sync: global)",
       "training mode, affine, running statistics, a numeric momentum", _batch_norm),
    Op(("aten._native_batch_norm_legit_no_training.default",), "(refused)",
       "a module in eval mode: import it in training mode", _frozen_batch_norm),
    Op(("aten.group_norm.default",), "groupnorm", "affine or not", _group_norm),
    Op(("aten.layer_norm.default",), "layernorm", "normalized_shape = x.shape[1:]", _layer_norm),
    Op(("aten.instance_norm.default",), "instancenorm", "training mode; affine and running statistics or not",
       _instance_norm),
    Op(("aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
        "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default"), "pool (max)",
       POOL_NOTE, _pool("max")),
    Op(("aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default"), "pool (avg)",
       POOL_NOTE, _pool("avg")),
    Op(("aten.adaptive_avg_pool1d.default", "aten.adaptive_avg_pool2d.default",
        "aten.adaptive_avg_pool3d.default"), "global_pool (avg)", "output size 1 (or the input's size)",
       _global("avg", False)),
    Op(("aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool3d.default"), "global_pool (max)",
       "output size 1 (or the input's size)", _global("max", False)),
    Op(("aten.mean.dim",), "global_pool (avg) [+ flatten]", "over every spatial dimension",
       _global("avg", True)),
    Op(("aten.amax.default",), "global_pool (max) [+ flatten]", "over every spatial dimension",
       _global("max", True)),
    Op(("aten.upsample_nearest1d.vec", "aten.upsample_nearest2d.vec", "aten.upsample_nearest3d.vec",
        "aten._upsample_nearest_exact1d.vec", "aten._upsample_nearest_exact2d.vec",
        "aten._upsample_nearest_exact3d.vec"), "upsample (nearest)", "integer scale factors",
       _upsample("nearest")),
    Op(("aten.upsample_linear1d.vec", "aten.upsample_bilinear2d.vec", "aten.upsample_trilinear3d.vec"),
       "upsample (linear)", "integer scale factors; align_corners either", _upsample("linear")),
    Op(("aten.relu.default",), "relu", "", _unary("relu")),
    Op(("aten.leaky_relu.default",), "leaky_relu", "", _leaky_relu),
    Op(("aten.sigmoid.default",), "sigmoid", "", _unary("sigmoid")),
    Op(("aten.tanh.default",), "tanh", "", _unary("tanh")),
    Op(("aten.silu.default",), "silu", "", _unary("silu")),
    Op(("aten.gelu.default",), "gelu", "approximate none or tanh", _gelu),
    Op(("aten.elu.default",), "elu", "scale and input_scale 1", _elu),
    Op(("aten.prelu.default",), "prelu", "one or C weights", _prelu),
    Op(("aten.softmax.int", "aten._softmax.default"), "softmax", "over dim 1", _softmax),
    Op(("aten.dropout.default", "aten.native_dropout.default"), "dropout", "p = 0 (or eval) folds away",
       _dropout),
    Op(("aten.add.Tensor",), "sum", "two tensors of one shape, alpha 1", _binary("sum")),
    Op(("aten.mul.Tensor",), "mul", "two tensors of one shape", _binary("mul")),
    Op(("aten.cat.default",), "concat", "along dim 1", _cat),
    Op(("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.flatten.using_ints",
        "aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default", "aten.clone.default",
        "aten.alias.default", "aten.contiguous.default"), "flatten, or folded",
       "to (N, features), or the same shape", _view),
    Op(("getitem",), "folded", "the first output of batch norm, dropout, max pooling", _getitem),
)

#: ATen overload name -> Op
BY_NAME: dict[str, Op] = {name: op for op in TABLE for name in op.aten}


def supported_text() -> str:
    """The short list of supported operators, as a refusal names it (``Nd``: 1-D, 2-D and 3-D)."""
    names = {re.sub(r"[123]d\b", "Nd", n.split(".")[1]) for op in TABLE for n in op.aten
             if "." in n and not n.split(".")[1].startswith("_")}
    return "ops " + ", ".join(sorted(names | {"batch_norm"})) + " (docs/from_torch.md)"


def table_markdown() -> list[str]:
    """The table as Markdown rows (the generated page's body)."""
    lines = ["| ATen operator(s) | lbannpy layer | supported arguments |", "|---|---|---|"]
    for op in TABLE:
        names = "<br>".join(f"`{n}`" for n in op.aten)
        lines.append(f"| {names} | {op.becomes} | {op.limits or 'all'} |")
    return lines
