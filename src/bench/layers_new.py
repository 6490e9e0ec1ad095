"""``bench layers --new``: the layer types of U-Nets, SegResNets and ResNets (transposed convolution,
upsampling, instance/group/layer norm, the activations, PReLU, softmax, mul, pad modes, global pooling,
convolutions with circular and reflect padding) against ``torch.nn.functional`` with autograd, one row each:
the registered layer's forward and backward on one rank, PyTorch in NCHW and channels-last, the ratio
against the faster of the two (and of CPU times, which other processes on the cores do not lengthen)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from .kernel_choice import time_sets
from .layer_shapes import LayerShape
from .layout_choice import layer_layouts, layout_choice, measure_layouts
from .timing import time_calls

TARGET_NEW_RATIO = 1.3  # the new layer types' rows: each at most this times PyTorch's time
NEW_KERNELS = ["auto"]  # the conv kernel set of the new layer types' rows: a run's default unless --kernels


@dataclass(frozen=True)
class NewRow:
    """One row of a new layer type: the layer ``type`` with ``params`` on inputs of ``shapes``; ``torch``
    names its reference in :data:`TORCH_REFS`."""

    label: str
    type: str
    params: tuple  # (key, value) pairs
    shapes: tuple
    torch: str

    @property
    def id(self) -> str:
        shape = "x".join(str(n) for n in self.shapes[0])
        return f"{self.label} {shape}"


def new_rows(size: int = 256) -> list[NewRow]:
    """Every row of the new layer types at spatial size ``size`` (2-D rows ``1x16xSxS``, the resampling rows
    ``1x32x(S/2)^2`` in; 3-D rows ``1x8x(S/8)^3``; the tests use a tiny ``size``)."""
    s2 = (1, 16, size, size)
    c32 = (1, 32, size // 2, size // 2)  # an up-convolution's input: the output is size x size
    s3 = (1, 8) + (max(size // 8, 2),) * 3
    p = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    rows = [
        NewRow("conv_transpose ->16 k2 s2", "conv_transpose", p(filters=16, kernel=2, stride=2), (c32,),
               "conv_transpose"),
        NewRow("conv_transpose ->16 k3 s2 p1 op1", "conv_transpose",
               p(filters=16, kernel=3, stride=2, padding=1, output_padding=1), (c32,), "conv_transpose"),
        NewRow("conv_transpose 3d ->8 k2 s2", "conv_transpose", p(filters=8, kernel=2, stride=2), (s3,),
               "conv_transpose"),
        NewRow("upsample nearest x2", "upsample", p(scale=2, mode="nearest"), (c32,), "upsample"),
        NewRow("upsample linear x2", "upsample", p(scale=2, mode="linear"), (c32,), "upsample"),
        NewRow("upsample linear x2 corners", "upsample", p(scale=2, mode="linear", align_corners=True),
               (c32,), "upsample"),
        NewRow("upsample linear 3d x2", "upsample", p(scale=2, mode="linear"), (s3,), "upsample"),
        NewRow("instancenorm", "instancenorm", p(), (s2,), "instancenorm"),
        NewRow("instancenorm affine", "instancenorm", p(affine=True), (s2,), "instancenorm"),
        NewRow("groupnorm g4", "groupnorm", p(groups=4), (s2,), "groupnorm"),
        NewRow("layernorm", "layernorm", p(), (c32,), "layernorm"),
        NewRow("sigmoid", "sigmoid", p(), (s2,), "sigmoid"),
        NewRow("tanh", "tanh", p(), (s2,), "tanh"),
        NewRow("silu", "silu", p(), (s2,), "silu"),
        NewRow("identity", "identity", p(), (s2,), "identity"),
        NewRow("gelu", "gelu", p(), (s2,), "gelu"),
        NewRow("gelu tanh", "gelu", p(approximate="tanh"), (s2,), "gelu"),
        NewRow("elu", "elu", p(), (s2,), "elu"),
        NewRow("prelu 1", "prelu", p(), (s2,), "prelu"),
        NewRow("prelu C", "prelu", p(num_parameters=16), (s2,), "prelu"),
        NewRow("softmax", "softmax", p(), (s2,), "softmax"),
        NewRow("mul", "mul", p(), (s2, s2), "mul"),
        NewRow("pad zeros 1", "pad", p(padding=1), (s2,), "pad"),
        NewRow("pad reflect 1", "pad", p(padding=1, mode="reflect"), (s2,), "pad"),
        NewRow("pad replicate 1", "pad", p(padding=1, mode="replicate"), (s2,), "pad"),
        NewRow("pad circular 1", "pad", p(padding=1, mode="circular"), (s2,), "pad"),
        NewRow("global_pool avg", "global_pool", p(), (s2,), "global_pool"),
        NewRow("global_pool max", "global_pool", p(mode="max"), (s2,), "global_pool"),
        NewRow("conv circular ->16 k3 p1", "conv",
               p(filters=16, kernel=3, padding=1, padding_mode="circular"), ((1, 18, size, size),), "conv"),
        NewRow("conv reflect ->16 k3 p1", "conv",
               p(filters=16, kernel=3, padding=1, padding_mode="reflect"), ((1, 18, size, size),), "conv"),
    ]
    return rows


def _spatial(x) -> int:
    return x.dim() - 2


def _ref_conv_transpose(prm, xs, new):
    import torch.nn.functional as F

    (x,) = xs
    k, groups = prm.get("kernel", 3), prm.get("groups", 1)
    w = new((x.shape[1], prm["filters"] // groups) + (k,) * _spatial(x))
    b = new((prm["filters"],)) if prm.get("bias", True) else None
    fn = (None, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[_spatial(x)]
    return [w] + ([b] if b is not None else []), lambda: fn(
        x, w, b, prm.get("stride", 1), prm.get("padding", 0), prm.get("output_padding", 0), groups,
        prm.get("dilation", 1))


def _ref_upsample(prm, xs, new):
    import torch.nn.functional as F

    (x,) = xs
    if prm.get("mode", "nearest") == "nearest":
        return [], lambda: F.interpolate(x, scale_factor=prm.get("scale", 2), mode="nearest")
    mode = (None, "linear", "bilinear", "trilinear")[_spatial(x)]
    return [], lambda: F.interpolate(x, scale_factor=prm.get("scale", 2), mode=mode,
                                     align_corners=prm.get("align_corners", False))


def _ref_norm(kind):
    def ref(prm, xs, new):
        import torch.nn.functional as F

        (x,) = xs
        eps = prm.get("eps", 1e-5)
        c = x.shape[1]
        if kind == "layernorm":
            ws = [new(tuple(x.shape[1:])), new(tuple(x.shape[1:]))] if prm.get("affine", True) else []
            return ws, lambda: F.layer_norm(x, tuple(x.shape[1:]), *(ws or [None, None]), eps=eps)
        affine = prm.get("affine", kind == "groupnorm")
        ws = [new((c,)), new((c,))] if affine else []
        if kind == "groupnorm":
            return ws, lambda: F.group_norm(x, prm["groups"], *(ws or [None, None]), eps=eps)
        return ws, lambda: F.instance_norm(x, weight=ws[0] if ws else None, bias=ws[1] if ws else None,
                                           eps=eps)
    return ref


def _ref_pointwise(name):
    def ref(prm, xs, new):
        import torch
        import torch.nn.functional as F

        (x,) = xs
        if name == "prelu":
            w = new((prm.get("num_parameters", 1),))
            return [w], lambda: F.prelu(x, w)
        fns = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "identity": lambda t: t,
               "gelu": lambda t: F.gelu(t, approximate=prm.get("approximate", "none")),
               "elu": lambda t: F.elu(t, prm.get("alpha", 1.0)), "softmax": lambda t: F.softmax(t, dim=1)}
        fn = fns[name]
        return [], lambda: fn(x)
    return ref


def _ref_mul(prm, xs, new):
    def run():
        y = xs[0]
        for x in xs[1:]:
            y = y * x
        return y
    return [], run


_TORCH_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate",
                    "circular": "circular"}


def _torch_pad(padding, nsp: int) -> tuple:
    """F.pad's order (last dimension first) of an lbannpy padding (int, per dimension, or [lo, hi] pairs)."""
    per = [padding] * nsp if isinstance(padding, int) else list(padding)
    out = []
    for v in reversed(per):
        out += [v, v] if isinstance(v, int) else list(v)
    return tuple(out)


def _ref_pad(prm, xs, new):
    import torch.nn.functional as F

    (x,) = xs
    pads, mode = _torch_pad(prm.get("padding", 0), _spatial(x)), _TORCH_PAD_MODES[prm.get("mode", "zeros")]
    if mode == "constant":
        return [], lambda: F.pad(x, pads, mode="constant", value=prm.get("value", 0.0))
    return [], lambda: F.pad(x, pads, mode=mode)


def _ref_global_pool(prm, xs, new):
    (x,) = xs
    dims = tuple(range(2, x.dim()))
    if prm.get("mode", "avg") == "max":
        return [], lambda: x.amax(dim=dims, keepdim=True)
    return [], lambda: x.mean(dim=dims, keepdim=True)


def _ref_conv(prm, xs, new):
    """A PyTorch convolution with a padding mode other than zeros: ``F.pad`` in that mode, then the
    unpadded convolution (what ``nn.Conv2d`` does)."""
    import torch.nn.functional as F

    (x,) = xs
    k, nsp = prm.get("kernel", 3), _spatial(x)
    w = new((prm["filters"], x.shape[1] // prm.get("groups", 1)) + (k,) * nsp)
    b = new((prm["filters"],))
    pads = _torch_pad(prm.get("padding", 0), nsp)
    mode = _TORCH_PAD_MODES[prm.get("padding_mode", "zeros")]
    fn = (None, F.conv1d, F.conv2d, F.conv3d)[nsp]
    if mode == "constant":
        return [w, b], lambda: fn(x, w, b, prm.get("stride", 1), prm.get("padding", 0))
    return [w, b], lambda: fn(F.pad(x, pads, mode=mode), w, b, prm.get("stride", 1))


#: row.torch -> ``ref(params, input tensors, new_param) -> (parameter tensors, forward callable)``
TORCH_REFS = {"conv_transpose": _ref_conv_transpose, "upsample": _ref_upsample,
              "instancenorm": _ref_norm("instancenorm"), "groupnorm": _ref_norm("groupnorm"),
              "layernorm": _ref_norm("layernorm"), "mul": _ref_mul, "pad": _ref_pad,
              "global_pool": _ref_global_pool, "conv": _ref_conv,
              **{k: _ref_pointwise(k) for k in ("sigmoid", "tanh", "silu", "identity", "gelu", "elu", "prelu",
                                                 "softmax")}}


def new_row_missing(row: NewRow) -> str:
    """Why ``row`` cannot run in this build ('' when it can): its type is not registered, or does not take
    one of the row's parameters yet."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.registry import layer_specs

    spec = layer_specs().get(row.type)
    if spec is None:
        return f"layer type {row.type!r} is not registered"
    unknown = [k for k, _ in row.params if k not in spec.accepts()]
    if unknown:
        return f"{row.type} does not take {', '.join(unknown)}"
    return ""


def calibrated_set(row: NewRow, kernels, choice: str = "auto", dtype="float32"):
    """``kernels`` (``runtime.kernels`` = ``choice``) as a run on a calibrated machine would hand them to the
    row's layer, as ``bench calibrate --kernels`` records them for its shape, timed here and now:

    - a convolution under ``auto``: the faster of lbannpy's own set and ATen's by forward, data and filter
      gradient (:func:`.kernel_choice.time_sets`, as the calibration picks a shape's ``kernel``);
    - a convolution on ATen's host set: channels-last where that times at least the margin faster
      (:func:`.layout_choice.measure_layouts`); a transposed convolution on it likewise, the layer itself
      timed (:func:`.layout_choice.layer_layouts`);

    any other row's set as it is."""
    if row.type not in ("conv", "conv_transpose") or kernels.name != "aten":
        return kernels
    if row.type == "conv_transpose":  # the layer itself, as the calibration times it
        times = layer_layouts(row.type, dict(row.params), row.shapes[0])
        return kernels if times is None else replace(kernels, layout=layout_choice(*times))
    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import aten
    from lbannpy.layers.kernels.select import own

    prm, x = dict(row.params), row.shapes[0]
    nsp = len(x) - 2
    per = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v,) * nsp  # noqa: E731
    pads = per(prm.get("padding", 0))
    stride, dilation = per(prm.get("stride", 1)), per(prm.get("dilation", 1))
    w_shape = (prm["filters"], x[1] // prm.get("groups", 1)) + per(prm.get("kernel", 3))
    if choice == "auto" and prm.get("groups", 1) == 1:
        times = time_sets(LayerShape("conv", tuple(x), prm["filters"], tuple(w_shape[2:]), stride, pads,
                                     dilation), np.dtype(dtype), 5)
        if sum(times["own"]) < sum(times["aten"]):
            return own()
    window = tuple(x[:2]) + tuple(n + 2 * p for n, p in zip(x[2:], pads))
    layout = None
    if aten.has_channels_last(window, w_shape):
        layout = layout_choice(*measure_layouts(window, w_shape, stride, dilation))
    return kernels if layout is None else replace(kernels, layout=layout)


def new_row_contenders(row: NewRow, dtype) -> dict:
    """``{"ours": ..., "torch NCHW": ..., "torch NHWC": ...}``: zero-argument callables, each one forward
    and backward of the row on the same inputs and output gradient, each contender on copies of its own
    (ours: the registered layer on one rank, the conv kernel set of ``--kernels``; PyTorch: autograd
    through the reference op, gradients of the inputs and the parameters)."""
    import numpy as np
    import torch

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.dist import Distribution
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels.select import conv_kernels
    from lbannpy.layers.registry import layer_classes
    from lbannpy.tensor import DistTensor

    prm = dict(row.params)
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal(s).astype(dtype) for s in row.shapes]
    ctx = LayerContext(SingleCommunicator(), np, dtype, seed=0)
    ctx.conv_kernels = calibrated_set(row, conv_kernels(NEW_KERNELS[0]), NEW_KERNELS[0], dtype)
    layer = layer_classes()[row.type]("bench", **prm)
    d = Distribution.make(len(row.shapes[0]), 1)
    layer.configure(ctx, list(row.shapes), [d] * len(row.shapes), d)
    xs = [DistTensor(h, h.shape, d, 0) for h in hosts]
    dy_h = rng.standard_normal(layer.out_shape).astype(dtype)
    dy = DistTensor(dy_h, layer.out_shape, layer.out_dist, 0)

    def ours():
        layer.forward(xs)
        layer.backward(dy)

    # a convolution row's kernel set and host layout, as calibrated (printed beside the row)
    ours.layout = ""
    if row.type in ("conv", "conv_transpose"):
        ours.layout = ctx.conv_kernels.layout if ctx.conv_kernels.name == "aten" else ctx.conv_kernels.name
    out = {"ours": ours}
    for label, fmt in (("torch NCHW", torch.contiguous_format), ("torch NHWC", None)):
        if fmt is None:
            fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(row.shapes[0]))
            if fmt is None:
                continue
        # copies of their own: a contender that read ours' arrays would find them in the cache after ours
        xt = [torch.from_numpy(h).clone(memory_format=fmt).requires_grad_() for h in hosts]
        gen = np.random.default_rng(1)

        def new(shape):
            return torch.from_numpy((gen.standard_normal(shape) * 0.1).astype(dtype)).requires_grad_()

        ws, fwd = TORCH_REFS[row.torch](prm, xt, new)
        y = fwd()
        if tuple(y.shape) != tuple(layer.out_shape):
            raise ValueError(f"{row.id}: PyTorch's output {tuple(y.shape)} is not lbannpy's "
                             f"{layer.out_shape}")
        dyt = torch.from_numpy(dy_h).clone(memory_format=fmt if y.dim() == len(row.shapes[0]) else
                                           torch.contiguous_format)
        wrt = xt + ws

        def run(fwd=fwd, dyt=dyt, wrt=wrt):
            torch.autograd.grad(fwd(), wrt, dyt)
        out[label] = run
    return out


def run_new(dtype, repeats: int, size: int, adaptive: bool = True) -> int:
    """The new layer types' table: one row each (skipped rows say why), then the geometric mean, the worst
    row and every row above :data:`TARGET_NEW_RATIO`."""
    import statistics

    import numpy as np

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels.select import conv_kernels
    from lbannpy.layers.registry import layer_specs

    print(f"new layer types ({len(layer_specs())} registered), forward+backward of the layer on one rank "
          f"(conv kernels {NEW_KERNELS[0]}: {conv_kernels(NEW_KERNELS[0]).name}) against "
          f"torch.nn.functional + autograd, spatial size {size}; ratio of the median wall times, and of the "
          f"median CPU times (cpu: what other processes on the cores do not lengthen)")
    head = (f"{'case':<44} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'cpu':>6}  {'torch layout':<12} "
            f"{'NCHW ms':>9} {'NHWC ms':>9}")
    print(head)
    print("-" * len(head))
    ratios: dict[str, list] = {"wall": [], "CPU": []}
    skipped = []
    for row in new_rows(size):
        why = new_row_missing(row)
        if why:
            skipped.append(row.id)
            print(f"{row.id:<44} skipped: {why}", flush=True)
            continue
        contenders = new_row_contenders(row, dtype)
        calls = time_calls(contenders, repeats, adaptive)
        t = {k: statistics.median(w for w, _ in v) for k, v in calls.items()}
        c = {k: statistics.median(u for _, u in v) for k, v in calls.items()}
        layout = min((k for k in t if k.startswith("torch")), key=lambda k: t[k])
        ratio = t["ours"] / t[layout]
        cpu = c["ours"] / max(min(v for k, v in c.items() if k.startswith("torch")), 1e-9)
        ratios["wall"].append((ratio, row.id))
        ratios["CPU"].append((cpu, row.id))
        over = "  over" if max(ratio, cpu) > TARGET_NEW_RATIO else ""
        nhwc = f"{t['torch NHWC'] * 1e3:9.3f}" if "torch NHWC" in t else f"{'-':>9}"
        print(f"{row.id:<44} {t['ours'] * 1e3:9.3f} {t[layout] * 1e3:9.3f} {ratio:6.2f} {cpu:6.2f}  "
              f"{layout[6:]:<12} {t['torch NCHW'] * 1e3:9.3f} {nhwc}{over}"
              + (f"  (ours {contenders['ours'].layout}, as calibrated)" if contenders["ours"].layout else ""),
              flush=True)
    print()
    for kind, rs in ratios.items():
        if not rs:
            continue
        geo = float(np.exp(np.mean(np.log([r for r, _ in rs]))))
        worst = max(rs)
        over = [f"{rid} {r:.2f}" for r, rid in rs if r > TARGET_NEW_RATIO]
        verdict = "met" if not over else f"NOT met by {len(over)}: " + "; ".join(over)
        print(f"new layers ratio ours/torch ({kind} time) over {len(rs)} rows: geometric mean {geo:.2f}, "
              f"worst {worst[0]:.2f} ({worst[1]}); target <= {TARGET_NEW_RATIO} on every row: {verdict}")
    if skipped:
        print(f"skipped {len(skipped)} row(s) not runnable in this build: {', '.join(skipped)}")
    return 0
