"""Distributed convolution (2-D and 3-D): halo exchange + an ordinary local convolution.

Distributions
-------------
* sample and spatial splits (n, d, h, w, any mix): the input window each output block needs is fetched by
  a :class:`~lbannpy.halo.HaloPlan`; weights are replicated and their gradients are partial sums over the
  n/d/h/w block group.
* filter (output-channel) split along ``c``: every rank of the ``c`` group holds all input channels (the
  input's ``c`` grid axis is replicated, so the input is gathered by the base class's redistribution) and
  computes its own slice of filters; the input gradient is a partial sum over filters, summed by one
  allreduce over the ``c`` group.

Overlap
-------
Forward: the halo exchange is started, the interior of the output block (computable from owned input
alone) is computed while it is in flight, then the boundary from the received window.
Backward: the local input-window gradient is computed first; its halo accumulation (ghost contributions
sent back to their owners and added) is in flight while the weight gradient is computed. This is the
adjoint form of Dryden et al.'s backward halo exchange of dL/dy: the same volume, overlapped with the same
work. ``LayerContext.overlap = False`` runs the same arithmetic without overlap.
"""
from __future__ import annotations

import math

import numpy as np

from lbannpy.dist import Distribution, Stencil, box_size, relative_slices
from lbannpy.halo import HaloPlan

from . import kernels as K
from .base import Layer, LayerError


class Conv(Layer):
    type = "conv"
    splittable = ("n", "c", "d", "h", "w")

    def setup(self, dist: Distribution) -> None:
        hp = self.hparams
        (in_shape,) = self.in_shapes
        ndim = len(in_shape)
        if ndim not in (4, 5):
            raise LayerError(f"layer '{self.name}' (conv) needs an (n, c, [d,] h, w) input, got shape "
                             f"{in_shape}; put it before any fully-connected layer")
        self.filters = int(hp["filters"])
        self.stencil = Stencil.conv(ndim, hp.get("kernel", 3), hp.get("stride", 1), hp.get("padding", 0),
                                    hp.get("dilation", 1))
        self.use_bias = bool(hp.get("bias", True))
        sp = self.stencil.dims[2:]
        self.kernel = tuple(w.kernel for w in sp)
        self.stride = tuple(w.stride for w in sp)
        self.dilation = tuple(w.dilation for w in sp)
        halo_out = self.stencil.output_shape(in_shape)
        if min(halo_out[2:]) < 1:
            raise LayerError(f"layer '{self.name}' (conv): a {self.kernel} kernel (dilation {self.dilation}) "
                             f"does not fit the padded input {in_shape}; lower the kernel size or pad more")
        self.out_shape = (in_shape[0], self.filters) + tuple(halo_out[2:])
        self.out_dist = dist
        cdeg = dist.split[1]
        if 1 in dist.replicate:
            raise LayerError(f"layer '{self.name}' (conv): its output distribution {dist} cannot replicate c")
        self.in_dists = [Distribution(dist.split, dist.ranks, (1,) if cdeg > 1 else ())]
        self.halo = HaloPlan(self.in_dists[0], in_shape, self.stencil, self.ctx.rank,
                             tag=self.ctx.new_tag(2))
        self._window_buf = None  # the window kept from step to step when keeps_window (see fp_compute)
        cin = in_shape[1]
        wshape = (self.filters, cin) + self.kernel
        fan_in = cin * math.prod(self.kernel)
        w0 = self.rng("weight").standard_normal(wshape) * math.sqrt(2.0 / fan_in)
        fbox = dist.box(self.out_shape, self.ctx.rank)[1]
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        self.w = self.new_param("weight", wshape, w0, (fbox,) + tuple((0, s) for s in wshape[1:]),
                                dist, reduce_dims)
        self.b = (self.new_param("bias", (self.filters,), None, (fbox,), dist, reduce_dims)
                  if self.use_bias else None)
        self.cgroup = self.ctx.grid_comm(self.in_dists[0], ["c"]) if cdeg > 1 else None

    # -- forward ---------------------------------------------------------------------------------------
    def _conv(self, xwin, out=None):
        return K.conv_forward(xwin, self.w.value, None if self.b is None else self.b.value,
                              self.stride, self.dilation, out=out)

    def fp_compute(self, xs):
        (x,) = xs
        ctx, plan, xp = self.ctx, self.halo, self.ctx.xp
        t0 = ctx.timer.now()
        # the window lives from this forward to the layer's backward, which frees it: the windows of layers
        # already back-propagated make room for the gradients of the layers still to go (kept from step to
        # step, they raised the peak of the full mesh1k model by 10 %). A layer reading the model input is
        # back-propagated last, so its window is alive through every backward anyway: it keeps one buffer
        # from step to step, which spares the page faults of a fresh one (on a 4x18x1024^2 input, 300 MB)
        if self.keeps_window and (self._window_buf is None or self._window_buf.dtype != x.dtype):
            self._window_buf = xp.empty(plan.window_shape, dtype=x.dtype)
        exchange = plan.start(ctx.comm, x, out=self._window_buf if self.keeps_window else None)
        window = exchange.window
        # interior and boundary are computed apart, with or without overlap, so that turning overlap off
        # changes when the interior runs, not its arithmetic (BLAS may round a GEMM differently by size)
        split = box_size(plan.interior_box) > 0
        if split:
            y = xp.empty(self.out_dist.local_shape(self.out_shape, ctx.rank), dtype=x.dtype)

        def out(sl):  # the plan's output slices cover input channels in dim 1; ours cover all filters
            return (sl[0], slice(None)) + tuple(sl[2:])

        def interior():
            self._conv(window[plan.interior_window_slices], out=y[out(plan.interior_slices)])
        if split and ctx.overlap:
            interior()
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if split:
            if not ctx.overlap:
                interior()
            for osl, wsl in zip(plan.boundary_slices, plan.boundary_window_slices):
                self._conv(window[wsl], out=y[out(osl)])
        else:
            y = self._conv(window)
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        self._window = window
        return y

    # -- backward --------------------------------------------------------------------------------------
    def bp_compute(self, dy):
        ctx = self.ctx
        window = self._window
        if not self.needs_input_grad:  # the model input: only the weight gradient
            self.w.grad += K.conv_backward_filter(window, dy, self.w.value.shape, self.stride, self.dilation)
            if self.b is not None:
                self.b.grad += K.conv_backward_bias(dy)
            self._window = None
            return [None]
        # the window gradient lives until the halo accumulation below ends: a workspace shared by all layers
        dwin = K.conv_backward_data(dy, self.w.value, window.shape, self.stride, self.dilation,
                                    out=ctx.workspace("conv window gradient", window.shape, dy.dtype))
        if self.cgroup is not None:  # partial sums over this rank's filters
            dwin = self.cgroup.allreduce(dwin)
        acc = self.halo.accumulate_start(ctx.comm, dwin)
        if not ctx.overlap:
            dx = acc.wait()
        self.w.grad += K.conv_backward_filter(window, dy, self.w.value.shape, self.stride, self.dilation)
        if self.b is not None:
            self.b.grad += K.conv_backward_bias(dy)
        if ctx.overlap:
            dx = acc.wait()
        self._window = None
        return [dx]
