"""Distributed max and average pooling (2-D and 3-D): halo exchange + local valid pooling.

Spatially split like a convolution (windows that cross a block edge get their halo). Max pooling treats
padding as -inf (it never wins), average pooling counts padding as zeros (PyTorch's
``count_include_pad=True``). Channels and samples split freely; pooling has no parameters. The halo
exchange overlaps the interior of the output block as in a convolution (the base class's stencil template).
"""
from __future__ import annotations

import math

from lbannpy.config_types import Bool, Int, Key, Padding, PerDim, Str
from lbannpy.dist import Distribution
from lbannpy.stencil import Stencil

from . import kernels as K
from .base import LayerError
from .halo_layer import HaloLayer
from .registry import (Inferred, LayerArgs, LayerSpec, ShapeError, int_param, needs_image, register,
                       window_stencil)


def _infer(lay: LayerArgs) -> Inferred:
    needs_image(lay, "pool before flattening")
    if len(lay.x) == 3:  # the layer computes over planes and volumes (its set-up refuses a line)
        raise ShapeError(f"layer {lay.name!r} (pool) needs 2 or 3 spatial dimensions, got the 1-D "
                         f"input {tuple(lay.x)}; give a line of W as model.input.spatial [1, W] "
                         f"(data (N, C, 1, W)) with kernel [1, k]")
    x, p = lay.x, lay.params
    if p["mode"] not in ("max", "avg"):
        raise ShapeError(f"layer {lay.name!r}: pool mode must be 'max' or 'avg', got {p['mode']!r}")
    if p["global"]:
        kernel, stride, padding = list(x[2:]), 1, 0
    else:
        kernel = int_param(lay, "kernel")
        stride = int_param(lay, "stride", kernel)
        padding = p["padding"]
    st = window_stencil(lay, x, kernel, stride, padding, 1)
    out = st.output_shape(x)
    return Inferred(out, math.prod(out) * math.prod(w.kernel for w in st.dims[2:]), 0, st)


_POS = Int(1)
SPEC = LayerSpec(
    "pool", "max or average pooling over the spatial dimensions", (
        Key("mode", Str(("max", "avg")), "max", "max or average"),
        Key("kernel", PerDim(_POS), 2, "window size"),
        Key("stride", PerDim(_POS), default_from="kernel", doc="stride; default: the kernel size"),
        Key("padding", Padding(), 0, "padding on each side (ignored by max, zeros for avg)"),
        Key("global", Bool(), False, "pool each channel over its whole spatial extent (kernel, stride and "
                                     "padding unused)")),
    _infer, order=20, capturable=True)


@register(SPEC)
class Pool(HaloLayer):

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        if len(in_shape) not in (4, 5):
            raise LayerError(f"layer '{self.name}' (pool) needs an (n, c, [d,] h, w) input, got {in_shape}")
        hp = self.hparams
        self.mode = hp["mode"]
        if self.mode not in ("max", "avg"):
            raise LayerError(f"layer '{self.name}' (pool): mode must be max or avg, got {self.mode!r}")
        if hp["global"]:  # one window over the whole spatial extent (fetched by the halo plan)
            kernel, stride, padding = tuple(in_shape[2:]), 1, 0
        else:
            kernel, stride, padding = hp["kernel"], hp["stride"], hp["padding"]
        self.stencil = Stencil.conv(len(in_shape), kernel, stride, padding, 1)
        sp = self.stencil.dims[2:]
        self.kernel = tuple(w.kernel for w in sp)
        self.stride = tuple(w.stride for w in sp)
        self.out_shape = self.stencil.output_shape(in_shape)
        if min(self.out_shape[2:]) < 1:
            raise LayerError(f"layer '{self.name}' (pool): kernel {self.kernel} does not fit input "
                             f"{in_shape}")
        self.out_dist = dist
        self.in_dists = [dist]
        self.plan_halo(dist, in_shape, self.stencil)

    def _mask_padding(self, window):
        """Set the parts of the window outside the tensor (padding) to -inf for max pooling. The exchange
        never writes there, so this runs while it is in flight."""
        for sl in self.halo.padding_slices:
            window[sl] = -float("inf")

    def _pool(self, window, y, index=None):
        if self.mode == "max":
            piece, arg = K.max_pool_forward(window, self.kernel, self.stride)
        else:
            piece, arg = K.avg_pool_forward(window, self.kernel, self.stride), None
        if y is None:  # the whole block at once
            self._arg = arg
            return piece
        y[...] = piece
        if arg is not None:
            self._arg[index] = arg
        return None

    def fp_compute(self, xs):
        (x,) = xs
        is_max = self.mode == "max"
        if is_max and not self.halo.local:  # the winning taps of the whole block, filled piece by piece
            self._arg = self.ctx.xp.empty(self._out_block, dtype="int8" if math.prod(self.kernel) <= 127
                                          else "int16")
        window, y = self.halo_forward(x, self._pool, prepare=self._mask_padding if is_max else None)
        self._wshape = window.shape
        return y

    def bp_compute(self, dy):
        if self.mode == "max":
            dwin = K.max_pool_backward(dy, self._arg, self._wshape, self.kernel, self.stride)
            self._arg = None
        else:
            dwin = K.avg_pool_backward(dy, self._wshape, self.kernel, self.stride)
        return [self.halo_backward(dwin)]
