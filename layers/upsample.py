"""Distributed upsampling by integer scales (nearest, and linear: bi-/trilinear, ``align_corners`` either
way), split over samples, channels and every spatial dimension, uneven blocks included.

Each rank computes its block of the output from its block of the input and the few input rows beyond it
that its outputs read: at most one row on a side (two for a block whose edges fall badly on an uneven
split), fetched by an ordinary :class:`~lbannpy.halo.HaloPlan` of a stride-1 window on the input whose
reach is the largest such overhang over all blocks of the split (worked out from the index math of
:mod:`.kernels.upsample`, the same on every rank). A split that needs no overhang (nearest on blocks that
divide evenly) exchanges nothing.

Forward: the exchange is started, the interior of the output block (the outputs that read owned rows only)
is computed while it is in flight, then the boundary boxes from the received window. Backward (the
adjoint, ghost gradients sent back to their owners and added): the boundary boxes' input gradients are
computed first and their ghost rows sent, and the interior's is computed while they are in flight. Turning
``LayerContext.overlap`` off runs the same arithmetic in the same order after the messages. There is no
parameter and nothing is kept between the passes: the backward needs neither the input nor the output.
"""
from __future__ import annotations

import math

from lbannpy.config_types import Bool, Int, Key, PerDim, Str
from lbannpy.dist import Distribution, block_range, box_subtract, box_size, relative_slices
from lbannpy.packing import pack
from lbannpy.stencil import Stencil

from .base import LayerError
from .halo_layer import HaloLayer
from .kernels import upsample as U
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, int_param, needs_image, register


def _scales(scale, nsp: int) -> tuple[int, ...]:
    vals = list(scale) if isinstance(scale, (list, tuple)) else [scale] * nsp
    if len(vals) != nsp:
        raise ValueError(f"scale {scale!r}: need one entry per spatial dimension ({nsp})")
    return tuple(int(v) for v in vals)


def _infer(lay: LayerArgs) -> Inferred:
    needs_image(lay, "upsample before flattening")
    x, p = lay.x, lay.params
    nsp = len(x) - 2
    try:
        scales = _scales(int_param(lay, "scale"), nsp)
    except ValueError as exc:
        raise ShapeError(f"layer {lay.name!r} (upsample): {exc}") from None
    if p["mode"] not in U.MODES:
        raise ShapeError(f"layer {lay.name!r}: upsample mode must be one of {U.MODES}, got {p['mode']!r}")
    out = tuple(x[:2]) + tuple(n * s for n, s in zip(x[2:], scales))
    linear = p["mode"] == "linear"
    # nearest copies each output once; linear takes 3 operations (a difference, a product, a sum) per
    # output of each dimension's pass
    flops = math.prod(out) * (3 * nsp if linear else 1)
    # the halo priced: one input row on each side of a block for linear (its two taps straddle block
    # edges), none for nearest on even blocks (uneven ones may need one: not worth a stencil of its own)
    st = Stencil.conv(len(x), 3 if linear else 1, 1, 1 if linear else 0, 1)
    return Inferred(out, flops, 0, st)


SPEC = LayerSpec(
    "upsample", "upsampling by integer scales: nearest, or linear (bi-/trilinear by the spatial rank)", (
        Key("scale", PerDim(Int(1)), 2, "integer scale factor"),
        Key("mode", Str(U.MODES), "nearest", "nearest, or linear (bilinear in 2-D, trilinear in 3-D)"),
        Key("align_corners", Bool(), False, "linear: map the corner pixels of input and output onto each "
                                            "other (PyTorch's align_corners)")),
    _infer, order=25, capturable=True)


def _overhang(axis: U.Axis, parts: int) -> tuple[int, int]:
    """The most input rows any block of ``parts`` reads before and after its own input block."""
    lo = hi = 0
    for c in range(parts):
        i0, i1 = block_range(axis.n, parts, c)
        o0, o1 = block_range(axis.out, parts, c)
        a, b = axis.source(o0, o1)
        lo, hi = max(lo, i0 - a), max(hi, b - i1)
    return lo, hi


def _interior(axis: U.Axis, i0: int, i1: int, o0: int, o1: int) -> tuple[int, int]:
    """The outputs of ``[o0, o1)`` that read inputs of ``[i0, i1)`` only (a contiguous, maybe empty range:
    the source range is monotone in the output)."""
    inside = [o for o in range(o0, o1) if i0 <= axis.source(o, o + 1)[0] and axis.source(o, o + 1)[1] <= i1]
    return (inside[0], inside[-1] + 1) if inside else (o0, o0)


@register(SPEC)
class Upsample(HaloLayer):

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        nsp = len(in_shape) - 2
        if nsp not in (1, 2, 3):
            raise LayerError(f"layer '{self.name}' (upsample) needs an (n, c, [[d,] h,] w) input, got "
                             f"{in_shape}")
        hp = self.hparams
        try:
            scales = _scales(hp["scale"], nsp)
            self.axes = tuple(U.Axis(int(n), s, hp["mode"], bool(hp["align_corners"]))
                              for n, s in zip(in_shape[2:], scales))
        except (ValueError, U.KernelShapeError) as exc:
            raise LayerError(f"layer '{self.name}' (upsample): {exc}") from None
        self.out_shape = tuple(in_shape[:2]) + tuple(a.out for a in self.axes)
        self.out_dist = dist
        self.in_dists = [dist]
        hang = [_overhang(a, p) for a, p in zip(self.axes, dist.parts[2:])]
        stencil = Stencil.conv(len(in_shape), [lo + hi + 1 for lo, hi in hang], 1, [list(h) for h in hang], 1)
        self.plan_halo(dist, in_shape, stencil)
        rank, xp, dtype = self.ctx.rank, self.ctx.xp, self.ctx.dtype
        ybox = dist.box(self.out_shape, rank)
        xbox = dist.box(in_shape, rank)
        self._ybox = ybox
        if self.halo.local:  # the block's outputs read its own inputs only
            self._whole = U.Plan(self.axes, ybox[2:], [lo for lo, _ in xbox[2:]], xp, dtype)
            self._pieces = []
            return
        self._whole = None
        org = [lo for lo, _ in self.halo.window_box[2:]]
        inner = tuple(ybox[:2]) + tuple(_interior(a, i0, i1, o0, o1)
                                        for a, (i0, i1), (o0, o1) in zip(self.axes, xbox[2:], ybox[2:]))
        y0 = [lo for lo, _ in ybox]

        def piece(box):
            return relative_slices(box, y0), U.Plan(self.axes, box[2:], org, xp, dtype)
        self._interior = piece(inner) if box_size(inner) else None
        self._boundary = [piece(b) for b in (box_subtract(ybox, inner) if self._interior else [ybox])]
        if self.halo.owned_box != self.halo.input_box:
            raise LayerError(f"layer '{self.name}' (upsample): the halo window {self.halo.window_box} does "
                             f"not hold the input block {self.halo.input_box}")

    def fp_compute(self, xs):
        (x,) = xs
        if self._whole is not None:
            return self._whole.forward(x)
        ctx = self.ctx
        t0 = ctx.timer.now()
        exchange = self.halo.start(ctx.comm, x, out=ctx.workspace("upsample window", self.halo.window_shape,
                                                                  x.dtype))
        window = exchange.window
        y = ctx.xp.empty(self._out_block, dtype=x.dtype)
        if self._interior is not None and ctx.overlap:
            sl, plan = self._interior
            plan.forward(window, out=y[sl])
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if self._interior is not None and not ctx.overlap:
            sl, plan = self._interior
            plan.forward(window, out=y[sl])
        for sl, plan in self._boundary:
            plan.forward(window, out=y[sl])
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        return y

    def bp_compute(self, dy):
        if not self.needs_input_grad:
            return [None]
        if self._whole is not None:
            return [self._whole.backward(dy)]
        ctx, hp = self.ctx, self.halo
        xp = ctx.xp
        dwin = ctx.workspace("upsample window gradient", hp.window_shape, dy.dtype)
        dwin[...] = 0

        def add(pieces):
            for sl, plan in pieces:
                dwin[plan.source_slices] += plan.backward(dy[sl])
        add(self._boundary)  # the only pieces that reach the ghost rows
        inner = [] if self._interior is None else [self._interior]
        dx = xp.empty(hp.local_shape, dtype=dy.dtype)
        packed = pack(dwin, hp.recvs, ctx.workspace("upsample ghost gradients", (hp.recv_size,), dy.dtype))
        if not ctx.overlap:
            add(inner)
        acc = hp.accumulate_ghosts_start(ctx.comm, packed, dx)
        if ctx.overlap:
            add(inner)
        dx[...] = dwin[hp.owned_window_slices]
        return [acc.wait()]
