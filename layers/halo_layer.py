"""The template's halo part, for stencil layers (a window over space: conv, pool).

A stencil layer calls ``plan_halo`` in ``setup``, ``halo_forward`` in ``fp_compute`` (the exchange in
flight while the interior of the output block is computed, then the boundary) and ``halo_backward`` in
``bp_compute`` (the accumulation in flight while e.g. the weight gradient is computed); everything else is
the :class:`~lbannpy.layers.base.Layer` template's.
"""
from __future__ import annotations

from lbannpy.dist import Distribution, box_size
from lbannpy.stencil import Stencil

from .base import Layer


class HaloLayer(Layer):
    """Base class of the stencil layers: a :class:`~lbannpy.layers.base.Layer` whose window over space
    crosses block edges, with the halo exchange around its local math."""

    def plan_halo(self, in_dist: Distribution, in_shape: tuple, stencil: Stencil) -> None:
        """Called from ``setup`` of a stencil layer: the halo plan of its input window (``self.halo``)."""
        from lbannpy.halo import HaloPlan  # the halo module is only needed by stencil layers

        self.halo = HaloPlan(in_dist, in_shape, stencil, self.ctx.rank, tag=self.ctx.new_tag(2))

    def halo_forward(self, x, compute, window_out=None, prepare=None):
        """Collective over the spatial group: the forward of a stencil layer on its local input ``x``.

        Starts the halo exchange of ``self.halo`` (into ``window_out`` when given) and calls
        ``prepare(window)`` (e.g. to fill padding) while it is in flight; then ``compute(window_piece,
        y_piece, index)`` (``y_piece`` is ``y[index]``, to be written) on the interior of the output block
        (computable from owned input and padding alone), still while it is in flight; waits; and computes
        the boundary pieces from the received window. Without an interior (a block thinner than the stencil)
        it waits and calls ``compute(window, None, None)``, which returns the whole output.
        ``LayerContext.overlap = False`` computes the same pieces after the wait, so turning overlap off
        changes when the interior runs, not its arithmetic (BLAS may round a GEMM differently by size).
        A plan with nothing to exchange (``local``: its interior is the whole output block) fills the window
        and calls ``compute(window, None)`` at once. Returns ``(window, y)``; ``self.halo_received`` holds
        the ghost values received (for ``self.halo.refill``; None for a local plan) until the next call.
        """
        ctx, plan = self.ctx, self.halo
        if plan.local:  # nothing to exchange (one rank, or no split the stencil crosses): no messages
            window = plan.local_window(x, window_out)
            self.halo_received = None
            if prepare is not None:
                prepare(window)
            return window, compute(window, None)
        t0 = ctx.timer.now()
        exchange = plan.start(ctx.comm, x, out=window_out)
        self.halo_received = exchange.received
        window = exchange.window
        if prepare is not None:
            prepare(window)
        split = box_size(plan.interior_box) > 0
        # an interior that is the whole block (no ghosts read) is computed as a fresh array, so kernels that
        # allocate their result (ATen) do not need a second output-sized array to copy from
        whole = split and not plan.boundary_slices
        if split and not whole:
            y = ctx.xp.empty(self._out_block, dtype=x.dtype)

        def out(sl):  # the plan's output slices cover the input's channels in dim 1; the output's may differ
            return (sl[0], slice(None)) + tuple(sl[2:])

        def interior():
            nonlocal y
            if whole:
                y = compute(window[plan.interior_window_slices], None)
                return
            sl = out(plan.interior_slices)
            compute(window[plan.interior_window_slices], y[sl], sl)
        if split and ctx.overlap:
            interior()
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if split:
            if not ctx.overlap:
                interior()
            for osl, wsl in zip(plan.boundary_slices, plan.boundary_window_slices):
                compute(window[wsl], y[out(osl)], out(osl))
        else:
            y = compute(window, None)
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        return window, y

    def halo_backward(self, dwindow, during=None):
        """Collective over the spatial group: the input gradient of a stencil layer from the gradient of its
        window. The halo accumulation (ghost contributions sent back to their owners and added) is in flight
        while ``during()`` runs (e.g. the weight gradient); overlap off runs it after the wait."""
        if self.halo.local:  # nothing to send back: the owned part of the window gradient
            if during is not None:
                during()
            return self.halo.local_gradient(dwindow)
        acc = self.halo.accumulate_start(self.ctx.comm, dwindow)
        if during is not None and self.ctx.overlap:
            during()
        dx = acc.wait()
        if during is not None and not self.ctx.overlap:
            during()
        return dx
