"""Distributed max and average pooling (2-D and 3-D): halo exchange + local valid pooling.

Spatially split like a convolution (windows that cross a block edge get their halo). Max pooling treats
padding as -inf (it never wins), average pooling counts padding as zeros (PyTorch's
``count_include_pad=True``). Channels and samples split freely; pooling has no parameters.
"""
from __future__ import annotations

from lbannpy.dist import Distribution, Stencil

from . import kernels as K
from .base import Layer, LayerError


class Pool(Layer):
    type = "pool"

    def setup(self, dist: Distribution) -> None:
        (in_shape,) = self.in_shapes
        if len(in_shape) not in (4, 5):
            raise LayerError(f"layer '{self.name}' (pool) needs an (n, c, [d,] h, w) input, got {in_shape}")
        hp = self.hparams
        self.mode = hp.get("mode", "max")
        if self.mode not in ("max", "avg"):
            raise LayerError(f"layer '{self.name}' (pool): mode must be max or avg, got {self.mode!r}")
        if hp.get("global", False):  # one window over the whole spatial extent (fetched by the halo plan)
            kernel, stride, padding = tuple(in_shape[2:]), 1, 0
        else:
            kernel = hp.get("kernel", 2)
            stride = hp.get("stride") or kernel
            padding = hp.get("padding", 0)
        self.stencil = Stencil.conv(len(in_shape), kernel, stride, padding, 1)
        sp = self.stencil.dims[2:]
        self.kernel = tuple(w.kernel for w in sp)
        self.stride = tuple(w.stride for w in sp)
        self.out_shape = self.stencil.output_shape(in_shape)
        if min(self.out_shape[2:]) < 1:
            raise LayerError(f"layer '{self.name}' (pool): kernel {self.kernel} does not fit input {in_shape}")
        self.out_dist = dist
        self.in_dists = [dist]
        from lbannpy.halo import HaloPlan
        self.halo = HaloPlan(dist, in_shape, self.stencil, self.ctx.rank, tag=self.ctx.new_tag(2))

    def _mask_padding(self, window):
        """Set the parts of the window outside the tensor (padding) to -inf for max pooling."""
        wbox = self.halo.window_box
        for axis, ((lo, hi), n) in enumerate(zip(wbox, self.in_shapes[0])):
            if axis < 2:
                continue
            sl = [slice(None)] * window.ndim
            if lo < 0:
                sl[axis] = slice(0, -lo)
                window[tuple(sl)] = -float("inf")
            if hi > n:
                sl[axis] = slice(n - hi, None)
                window[tuple(sl)] = -float("inf")
        return window

    def fp_compute(self, xs):
        (x,) = xs
        window = self.halo.start(self.ctx.comm, x).wait()
        self._wshape = window.shape
        if self.mode == "max":
            y, self._arg = K.max_pool_forward(self._mask_padding(window), self.kernel, self.stride)
            return y
        return K.avg_pool_forward(window, self.kernel, self.stride)

    def bp_compute(self, dy):
        if self.mode == "max":
            dwin = K.max_pool_backward(dy, self._arg, self._wshape, self.kernel, self.stride)
            self._arg = None
        else:
            dwin = K.avg_pool_backward(dy, self._wshape, self.kernel, self.stride)
        return [self.halo.accumulate_start(self.ctx.comm, dwin).wait()]
