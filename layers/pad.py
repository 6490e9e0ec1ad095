"""Explicit padding of the spatial dimensions (PyTorch's ``F.pad``): zeros (or a constant), reflect,
replicate or circular, split like a convolution.

The padded output block of a rank is the input window of a 1-tap stencil with that padding: the halo plan
(:class:`~lbannpy.halo.HaloPlan`, with the mode as its boundary) fills it straight into the output array,
owned rows copied, rows another rank holds received, padding past a tensor edge zeroed (then set to
``value``) or mapped onto the tensor's rows (a periodic dimension wraps around the process grid). So the
forward is one copy of the block plus the few rows that move, and the backward is the adjoint: the owned
part of the output gradient, plus the gradients of the rows that went elsewhere (sent back and added).
"""
from __future__ import annotations

from lbannpy.config_types import Float, Key, Padding, Str
from lbannpy.dist import Distribution, DistributionError
from lbannpy.stencil import Stencil

from .base import LayerError
from .conv import PADDING_MODES, check_padding_mode
from .halo_layer import HaloLayer
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, register


def _stencil(ndim: int, padding) -> Stencil:
    return Stencil.conv(ndim, 1, 1, padding, 1)


def _infer(lay: LayerArgs) -> Inferred:
    x, p = lay.x, lay.params
    if not 3 <= len(x) <= 5:
        raise ShapeError(f"layer {lay.name!r} (pad) needs an (N, C, spatial...) input with 1 to 3 spatial "
                         f"dimensions, got {x} from {lay.parents[0]!r}")
    try:
        st = _stencil(len(x), p["padding"])
    except (DistributionError, TypeError, ValueError) as exc:
        raise ShapeError(f"layer {lay.name!r} (pad) on input {x}: {exc}") from None
    check_padding_mode(lay, st, p["mode"])
    if p["mode"] != "zeros" and float(p.get("value") or 0.0) != 0.0:
        raise ShapeError(f"layer {lay.name!r} (pad): 'value' pads in mode zeros only, got mode {p['mode']!r}")
    out = st.output_shape(x)
    return Inferred(out, 0, 0, st, "periodic" if p["mode"] == "circular" else "window")


SPEC = LayerSpec(
    "pad", "padding of the spatial dimensions (zeros or a constant, reflect, replicate, circular)", (
        Key("padding", Padding(), 0, "padding on each side, per dimension, or [lo, hi] pairs (as conv)"),
        Key("mode", Str(PADDING_MODES), "zeros", "zeros, reflect, replicate or circular (periodic)"),
        Key("value", Float(), 0.0, "the constant of mode zeros")),
    _infer, order=25, capturable=True)


@register(SPEC)
class Pad(HaloLayer):
    output_kept = False

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        if not 3 <= len(in_shape) <= 5:
            raise LayerError(f"layer '{self.name}' (pad) needs an (n, c, spatial...) input, got {in_shape}")
        hp = self.hparams
        self.mode = hp["mode"]
        if self.mode not in PADDING_MODES:
            raise LayerError(f"layer '{self.name}' (pad): mode must be one of {', '.join(PADDING_MODES)}, "
                             f"got {self.mode!r}")
        self.value = float(hp.get("value") or 0.0)
        if self.mode != "zeros" and self.value != 0.0:
            raise LayerError(f"layer '{self.name}' (pad): 'value' pads in mode zeros only")
        self.stencil = _stencil(len(in_shape), hp["padding"])
        self.out_shape = self.stencil.output_shape(in_shape)
        self.out_dist = dist
        self.in_dists = [dist]
        from lbannpy.halo import HaloPlan  # as plan_halo: only stencil layers need the halo module

        self.halo = HaloPlan(dist, in_shape, self.stencil, self.ctx.rank, tag=self.ctx.new_tag(2),
                             boundary=self.mode)

    def fp_compute(self, xs):
        (x,) = xs
        plan, ctx = self.halo, self.ctx
        y = ctx.xp.empty(plan.window_shape, dtype=x.dtype)
        if plan.local:
            plan.local_window(x, y)
        else:
            exchange = plan.start(ctx.comm, x, out=y)
            t0 = ctx.timer.now()
            exchange.wait()
            ctx.timer.add((self.name, "halo_wait"), t0, ctx.timer.now(), "comm")
        if self.value != 0.0:
            for sl in plan.padding_slices:
                y[sl] = self.value
        return y

    def bp_compute(self, dy):
        return [self.halo_backward(dy)]
