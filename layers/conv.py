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

Without a window
----------------
Where the kernel set pads the local block itself (ATen: always; lbannpy's own: its one-call path) and that
padding lands every output of the block on the right input rows (each split block starts on a stride and
gives as many outputs as it holds: :meth:`~lbannpy.halo.HaloPlan.kernel_padding_fits`), a split
convolution builds no window: it convolves its block as on one rank, with the ghost rows read as zeros,
and adds to each boundary box of the output the convolution of the ghost values it reads (linearity: the
window is the padded block plus the ghosts). Backward, the kernel-padded data gradient is the block's own
part; the ghosts' gradients come from the boundary boxes' ``dy`` alone and go back to their owners, and the
filter gradient gains the boundary boxes' ghost terms. Only ghost rows move and are stored: no copy of the
block, no window workspace, no window gradient to crop (on one 1024² sample of mesh1k split over two ranks,
the per-rank peak went from 1963 to 1787 MiB). Ranks decide this each for itself (their messages are the
same either way). The layer reading the model input goes windowless too: it keeps its input block (a
fresh array every step, as on one rank), not its own window (on mesh1k 1024² over two ranks a 36 MiB
window alive all run). Filter-split layers keep the window.

Padding modes and groups
------------------------
``padding_mode`` reflect, replicate or circular (PyTorch's) fills the window's padding from the tensor
itself: the halo plan maps the padded rows onto tensor rows and fetches them like any halo (a periodic
boundary wraps around the process grid; see :mod:`lbannpy.halo`), and its adjoint adds their gradients back
to those rows. Such a convolution always builds its window (the kernels pad with zeros only). ``groups``
(PyTorch's; filter ``(filters, C/groups, *kernel)``): the kernels read the groups from the filter's shape;
under a filter split a rank's filters may begin or end inside a group, so it convolves the input channels
of each group its filters touch (whole groups in one call, a partial group at either end on its own).

Overlap (the stencil template of :class:`~lbannpy.layers.halo_layer.HaloLayer`, shared with pooling)
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

from lbannpy.config_types import REQUIRED, Bool, Key, Padding, PerDim, Int, Str
from lbannpy.dist import Distribution
from lbannpy.stencil import Stencil

from .base import LayerError
from .halo_layer import HaloLayer
from .registry import (Inferred, LayerArgs, LayerSpec, ShapeError, int_param, needs_image, register,
                       window_stencil)
from .kernels import aten
from .kernels.select import own

#: how a convolution (and the pad layer) fills its padding: PyTorch's ``padding_mode`` values
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def check_padding_mode(lay: LayerArgs, st: Stencil, mode: str) -> None:
    """ShapeError unless ``mode`` is known and each padded row maps onto one row of the input (PyTorch's
    rule: reflect pads less than the extent, circular at most the extent)."""
    if mode not in PADDING_MODES:
        raise ShapeError(f"layer {lay.name!r} ({lay.type}): padding mode must be one of "
                         f"{', '.join(PADDING_MODES)}, got {mode!r}")
    most = {"reflect": 0, "circular": 1}.get(mode)
    if most is None:
        return
    for i, (w, n) in enumerate(zip(st.dims[2:], lay.x[2:])):
        if max(w.pad_lo, w.pad_hi) > n - 1 + most:
            raise ShapeError(f"layer {lay.name!r} ({lay.type}): {mode} padding ({w.pad_lo}, {w.pad_hi}) "
                             f"along spatial dimension {i} needs an extent of at least "
                             f"{max(w.pad_lo, w.pad_hi) + 1 - most}, got {n}; pad less or use zeros")


#: a split convolution goes windowless only where its boundary boxes (each convolved again over its own
#: small window for the ghost terms: extra work in proportion) hold at most this share of its output block;
#: thinner blocks keep the window, which is small there anyway (mesh1k 512² on 2 ranks, blocks of 16-128
#: rows: the ghost terms cost about 2 % of the step, and at 1024² the saved copies outweigh them)
WINDOWLESS_MAX_BOUNDARY = 1 / 16


def _infer(lay: LayerArgs) -> Inferred:
    needs_image(lay, "move the layer before the fully-connected layers")
    if len(lay.x) == 3:  # the layer computes over planes and volumes (its set-up refuses a line)
        raise ShapeError(f"layer {lay.name!r} (conv) needs 2 or 3 spatial dimensions, got the 1-D "
                         f"input {tuple(lay.x)}; give a line of W as model.input.spatial [1, W] "
                         f"(data (N, C, 1, W)) with kernel [1, k]")
    x, p = lay.x, lay.params
    filters = int_param(lay, "filters")
    groups = int_param(lay, "groups", 1)
    if x[1] % groups or filters % groups:
        raise ShapeError(f"layer {lay.name!r} (conv): {groups} groups must divide both the input channels "
                         f"({x[1]}) and the filters ({filters})")
    st = window_stencil(lay, x, int_param(lay, "kernel"), int_param(lay, "stride"), p["padding"],
                        int_param(lay, "dilation"))
    check_padding_mode(lay, st, p.get("padding_mode", "zeros"))
    out = (x[0], filters) + st.output_shape(x)[2:]
    ksize = math.prod(w.kernel for w in st.dims[2:])
    cg = x[1] // groups
    n_params = filters * cg * ksize + (filters if p["bias"] else 0)
    halo = "periodic" if p.get("padding_mode") == "circular" else "window"
    return Inferred(out, 2 * math.prod(out) * cg * ksize, n_params, st, halo)


def _input_dist(dist: Distribution, ndim_in: int) -> Distribution:
    # every input channel for this rank's filters: the input's c grid axis is replicated over the filter split
    return Distribution(dist.split, dist.ranks, (1,) if dist.split[1] > 1 else ())


_POS = Int(1)
SPEC = LayerSpec(
    "conv", "N-d convolution (cross-correlation) over the spatial dimensions", (
        Key("filters", _POS, REQUIRED, "output channels"),
        Key("kernel", PerDim(_POS), 3, "kernel size"),
        Key("stride", PerDim(_POS), 1, "stride"),
        Key("padding", Padding(), 0, "zero padding on each side"),
        Key("dilation", PerDim(_POS), 1, "spacing of kernel taps"),
        Key("bias", Bool(), True, "learn an additive bias"),
        Key("groups", _POS, 1, "channel groups: each filter reads C/groups input channels (PyTorch's)"),
        Key("padding_mode", Str(PADDING_MODES), "zeros",
            "how the padding is filled: zeros, reflect, replicate or circular (periodic)")),
    _infer, input_dist=_input_dist, weights_split=True, reduces_channels=True, order=10,
    capturable=True)


@register(SPEC)
class Conv(HaloLayer):
    def setup(self, dist: Distribution) -> None:
        hp = self.hparams
        (in_shape,) = self.in_shapes
        ndim = len(in_shape)
        if ndim not in (4, 5):
            raise LayerError(f"layer '{self.name}' (conv) needs an (n, c, [d,] h, w) input, got shape "
                             f"{in_shape}; put it before any fully-connected layer")
        self.filters = int(hp["filters"])
        self.groups = int(hp.get("groups") or 1)
        self.padding_mode = hp.get("padding_mode") or "zeros"
        if self.padding_mode not in PADDING_MODES:
            raise LayerError(f"layer '{self.name}' (conv): padding_mode must be one of "
                             f"{', '.join(PADDING_MODES)}, got {self.padding_mode!r}")
        if in_shape[1] % self.groups or self.filters % self.groups:
            raise LayerError(f"layer '{self.name}' (conv): {self.groups} groups must divide both the input "
                             f"channels ({in_shape[1]}) and the filters ({self.filters})")
        self.stencil = Stencil.conv(ndim, hp["kernel"], hp["stride"], hp["padding"], hp["dilation"])
        self.use_bias = bool(hp["bias"])
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
        if self.padding_mode == "zeros":
            self.plan_halo(self.in_dists[0], in_shape, self.stencil)
        else:
            from lbannpy.halo import HaloPlan  # as plan_halo: only stencil layers need the halo module

            self.halo = HaloPlan(self.in_dists[0], in_shape, self.stencil, self.ctx.rank,
                                 tag=self.ctx.new_tag(2), boundary=self.padding_mode)
        self._window_buf = None  # the window kept from step to step when keeps_window (see fp_compute)
        cin = in_shape[1]
        wshape = (self.filters, cin // self.groups) + self.kernel
        fan_in = cin // self.groups * math.prod(self.kernel)
        w0 = self.rng("weight").standard_normal(wshape) * math.sqrt(2.0 / fan_in)
        fbox = dist.box(self.out_shape, self.ctx.rank)[1]
        self._segs = _group_segments(fbox, self.filters // self.groups, cin // self.groups, self.groups)
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        self.w = self.new_param("weight", wshape, w0, (fbox,) + tuple((0, s) for s in wshape[1:]),
                                dist, reduce_dims, lazy=True)
        self.b = (self.new_param("bias", (self.filters,), None, (fbox,), dist, reduce_dims, lazy=True)
                  if self.use_bias else None)
        self.cgroup = self.ctx.grid_comm(self.in_dists[0], ["c"]) if cdeg > 1 else None

    # -- forward ---------------------------------------------------------------------------------------
    @property
    def kern(self):
        """The convolution kernels of this layer: the set a calibration chose for its local shapes, else the
        run's (``runtime.kernels``), else lbannpy's own (:mod:`.kernels.select`)."""
        k = self.__dict__.get("_kern")
        if k is None:
            ctx, rank = self.ctx, self.ctx.rank
            key = ("conv", tuple(self.in_dists[0].local_shape(self.in_shapes[0], rank)),
                   tuple(self.out_dist.local_shape(self.out_shape, rank)))
            k = ctx.conv_kernel_table.get(key) or ctx.conv_kernels or own()
            if self.groups > 1 and k.name == "aten":  # ATen's entry points here convolve one group
                k = own()
            self._kern = k
        return k

    @property
    def kernel_pads(self):
        """The padding the kernels apply themselves (a tuple per spatial dimension), or None: where nothing
        is exchanged (no spatial split), the padding is symmetric and the kernel set pads this convolution
        (ATen: always; lbannpy's own: on its small one-call path), the layer hands its input block straight
        to the kernels, with no window built or kept, and gets the input gradient back without a window
        gradient to crop (the padded window exists only inside the kernel, as in PyTorch)."""
        return self._padded()[1]

    def _padded(self):
        """``(kernel set, kernel_pads, the set's plan of this convolution or None)``, worked out once per
        kernel set."""
        kern = self.kern
        cached = self.__dict__.get("_pads")
        if cached is None or cached[0] is not kern:
            sp = self.stencil.dims[2:]
            pads = tuple(w.pad_lo for w in sp)
            # kernel-padded: the local block itself, when the kernel's padding lands every output where it
            # belongs (:meth:`~lbannpy.halo.HaloPlan.kernel_padding_fits`); with a halo to exchange too
            # (windowless), unless the filters are split or the boundary is too large a share of the block
            ok = (kern.pads and self.padding_mode == "zeros" and self._segs is None
                  and self.halo.kernel_padding_fits(pads)
                  and (self.halo.local or (self.cgroup is None
                                           and self.halo.ghost_fraction <= WINDOWLESS_MAX_BOUNDARY)))
            local = self.in_dists[0].local_shape(self.in_shapes[0], self.ctx.rank)
            wshape = self.w.value.shape
            if ok and callable(kern.pads):  # the set pads some convolutions only
                ok = kern.pads(local, wshape, self.stride, self.dilation, pads, self.ctx.xp)
            plan = None
            if ok and kern.plan is not None:
                plan = kern.plan(local, wshape, self.stride, self.dilation, pads, self.w.value.dtype)
            cached = self._pads = (kern, pads if ok else None, plan)
        return cached

    def _conv(self, xwin, out=None, index=None):
        b = None if self.b is None else self.b.value
        if self._segs is not None:
            return self._conv_segments(xwin, b, out)
        return self.kern.conv_forward(xwin, self.w.value, b, self.stride, self.dilation, out=out)

    # -- a filter split of a grouped convolution: the groups this rank's filters touch, one by one ------
    def _conv_segments(self, xwin, b, out):
        xp, kern, w = self.ctx.xp, self.kern, self.w.value
        ys = [kern.conv_forward(xp.ascontiguousarray(xwin[:, cs]), w[fs], None if b is None else b[fs],
                                self.stride, self.dilation) for fs, cs in self._segs]
        y = ys[0] if len(ys) == 1 else xp.concatenate(ys, axis=1)
        if out is None:
            return y
        out[...] = y
        return out

    def _backward_params_segments(self, window, dy):
        xp, kern, w = self.ctx.xp, self.kern, self.w.value
        c = xp.ascontiguousarray
        parts = [kern.conv_backward_params(c(window[:, cs]), c(dy[:, fs]), w[fs], self.b is not None,
                                           self.stride, self.dilation) for fs, cs in self._segs]
        dw = xp.concatenate([p[0] for p in parts], axis=0)
        return dw, (xp.concatenate([p[1] for p in parts]) if self.b is not None else None)

    def _backward_input_segments(self, dy, window):
        xp, kern, w = self.ctx.xp, self.kern, self.w.value
        dwin = xp.zeros(window.shape, dtype=dy.dtype)
        for fs, cs in self._segs:
            dwin[:, cs] += kern.conv_backward_input(xp.ascontiguousarray(dy[:, fs]), w[fs],
                                                    xp.ascontiguousarray(window[:, cs]), self.stride,
                                                    self.dilation)
        return dwin

    def fp_compute(self, xs):
        (x,) = xs
        kern, pads, plan = self._padded()
        if pads is not None and not self.halo.local:
            self._window = None
            return self._windowless_forward(x, kern, pads, plan)
        if pads is not None:
            self._window = None
            self._x = x if self.train else None
            b = None if self.b is None else self.b.value
            if plan is not None and plan.takes(x):  # every argument worked out once
                return plan.forward(x, self.w.value, b)
            return kern.conv_forward(x, self.w.value, b, self.stride, self.dilation, padding=pads)
        # No window lives from this forward to the layer's backward: it is a (padded) copy of the input
        # block, alive anyway as the parent's output, so the layer keeps that block and the few ghost values
        # received, and the backward rebuilds the window without communication into a workspace shared by
        # every layer (kept windows would add a good part of the activations again). A layer reading the
        # model input is back-propagated last and its input may be the reader's buffer: it keeps its own
        # window from step to step, which also spares the page faults of a fresh one
        if self.keeps_window:
            if self._window_buf is None or self._window_buf.dtype != x.dtype:
                self._window_buf = self._window_space(x.dtype, kept=True)
            self._window, y = self.halo_forward(x, self._conv, self._window_buf)
            return y
        _, y = self.halo_forward(x, self._conv, self._window_space(x.dtype))
        self._window = None
        # evaluation has no backward: nothing is kept, so no activation outlives the pass through this layer
        self._x, self._received = (x, self.halo_received) if self.train else (None, None)
        return y

    def _windowless_forward(self, x, kern, pads, plan):
        """The forward of a split convolution without a window: the kernel pads the local block (as on one
        rank) while the ghost values are in flight, then each boundary box of the output adds the
        convolution of the ghosts it reads (zeros elsewhere: the kernel's padding stood in for them), a
        few rows' work. No copy of the input block, no window workspace."""
        ctx, hp = self.ctx, self.halo
        w, b = self.w.value, None if self.b is None else self.b.value

        def local():
            if plan is not None and plan.takes(x):
                return plan.forward(x, w, b)
            return kern.conv_forward(x, w, b, self.stride, self.dilation, padding=pads)
        t0 = ctx.timer.now()
        exchange = hp.start_ghosts(ctx.comm, x)
        y = local() if ctx.overlap else None
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if y is None:
            y = local()
        received = exchange.received
        for piece in hp.ghost_pieces:
            g = hp.ghost_window(received, piece)
            y[_out(piece.out_slices)] += kern.conv_forward(g, w, None, self.stride, self.dilation)
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        self.halo_received = received
        self._x, self._received = (x, received) if self.train else (None, None)
        return y

    def _window_space(self, dtype, kept=False):
        """The window's array (a workspace shared by every layer, or one of its own that the layer ``kept``),
        laid out channels-last where the layer hands the kernels that layout (:meth:`_channels_last`): the
        halo fill then lays the input out so in the one pass that copies it anyway."""
        shape, xp = self.halo.window_shape, self.ctx.xp
        if not self._channels_last(dtype):
            return xp.empty(shape, dtype=dtype) if kept else self.ctx.workspace("conv window", shape, dtype)
        cl = aten.channels_last_shape(shape)
        buf = xp.empty(cl, dtype=dtype) if kept else self.ctx.workspace("conv window", cl, dtype)
        return aten.channels_last_view(buf, len(shape))

    def _channels_last(self, dtype) -> bool:
        """Whether this layer's window and output gradient go to the kernels channels-last: ATen's kernels on
        the host, a window built (not kernel-padded), one segment of filters, and the calibration of the
        run's machine naming that layout for the layer's shape (the set's ``layout``, from
        :func:`.kernels.select.kernel_table`; :func:`.kernels.aten.takes_channels_last`). Never timed here:
        the layouts round differently, so a run's numbers would follow the timing."""
        key = ("_cl", getattr(dtype, "char", dtype))
        hit = self.__dict__.get(key)
        if hit is None:
            kern, pads, _ = self._padded()
            hit = (kern.name == "aten" and getattr(self.ctx.xp, "__name__", "") == "numpy" and pads is None
                   and self._segs is None and self.cgroup is None and aten.takes_channels_last(
                       self.halo.window_shape, self.w.value.shape, kern.layout))
            self.__dict__[key] = hit
        return hit

    # -- backward --------------------------------------------------------------------------------------
    def _planned_backward(self, plan, x, dy):
        """The backward of a convolution the kernels pad, by the set's plan: the filter and bias
        gradients written straight into ``grad`` where this is the step's first contribution."""
        w, b = self.w, self.b
        gw = w.grad_into()
        gb = None if b is None else b.grad_into()
        dw, db = plan.backward_params(x, dy, b is not None, gw, gb)
        if gw is None:
            w.accumulate(dw)
        if db is not None and gb is None:
            b.accumulate(db)
        return [plan.backward_data(dy, w.value) if self.needs_input_grad else None]

    def _windowless_backward(self, kern, pads, plan, dy):
        """Adjoint of :meth:`_windowless_forward`: the kernel-padded data gradient of the local block, the
        gradients of the ghost values (from the boundary boxes' ``dy`` alone) sent back to their owners and
        added while the filter gradient (the local block's plus the boundary boxes' ghost terms) runs."""
        ctx, hp = self.ctx, self.halo
        x, received = self._x, self._received
        self._x = self._received = None
        w, bias = self.w.value, self.b is not None
        xp = ctx.xp
        ghosts = [(piece, hp.ghost_window(received, piece),
                   xp.ascontiguousarray(dy[_out(piece.out_slices)])) for piece in hp.ghost_pieces]
        planned = plan is not None and plan.takes(x)

        def weight_grads():
            if planned:
                dw, db = plan.backward_params(x, dy, bias)
            else:
                dw, db = kern.conv_backward_params(x, dy, w, bias, self.stride, self.dilation, padding=pads)
            self.w.accumulate(dw)
            if db is not None:
                self.b.accumulate(db)
            for _, g, dyp in ghosts:  # added into the gradient in place: no filter-sized temporary
                self.w.accumulate(kern.conv_backward_params(g, dyp, w, False, self.stride, self.dilation)[0])
        if not self.needs_input_grad:
            weight_grads()
            return [None]
        if planned:
            dx = plan.backward_data(dy, w)
        else:
            dx = kern.conv_backward_input(dy, w, x, self.stride, self.dilation, padding=pads)
        packed = xp.zeros(hp.recv_size, dtype=dy.dtype)
        for piece, g, dyp in ghosts:
            hp.add_ghost_gradient(packed, piece,
                                  kern.conv_backward_input(dyp, w, g, self.stride, self.dilation))
        acc = hp.accumulate_ghosts_start(ctx.comm, packed, dx)
        if ctx.overlap:
            weight_grads()
        dx = acc.wait()
        if not ctx.overlap:
            weight_grads()
        return [dx]

    def bp_compute(self, dy):
        ctx = self.ctx
        _, pads, plan = self._padded()
        if pads is not None and not self.halo.local:
            return self._windowless_backward(self.kern, pads, plan, dy)
        window = self._window
        if pads is not None:  # the input block itself, padded inside the kernels
            window, self._x = self._x, None
            if plan is not None and self.cgroup is None and plan.takes(window):
                return self._planned_backward(plan, window, dy)
        elif window is None:
            window = self.halo.refill(self._x, self._received, self._window_space(dy.dtype))
            self._x = self._received = None

        padded = {} if pads is None else {"padding": pads}
        if pads is None and self._channels_last(dy.dtype):  # laid out once for both gradients
            cl = aten.channels_last_shape(dy.shape)
            g = aten.channels_last_view(ctx.workspace("conv output gradient", cl, dy.dtype), dy.ndim)
            dy = aten.copy_into(g, dy)

        def weight_grads():
            if self._segs is not None:
                dw, db = self._backward_params_segments(window, dy)
            else:
                dw, db = self.kern.conv_backward_params(window, dy, self.w.value, self.b is not None,
                                                        self.stride, self.dilation, **padded)
            self.w.accumulate(dw)
            if db is not None:
                self.b.accumulate(db)
        if not self.needs_input_grad:  # the model input: only the weight gradient
            weight_grads()
            self._window = None
            return [None]
        # the window gradient lives until the halo accumulation below ends: a workspace shared by all layers,
        # unless the kernels allocate it anyway; a kernel-padded one is the input gradient itself, which lives
        # on after this layer (the next convolution's backward would write the shared workspace under it)
        # on the channels-last path the kernel's own result (that layout) is what the halo's adjoint reads:
        # an NCHW workspace would add a copy
        space = (None if self.kern.allocates or pads is not None or self._channels_last(dy.dtype)
                 else ctx.workspace("conv window gradient", window.shape, dy.dtype))
        if self._segs is not None:
            dwin = self._backward_input_segments(dy, window)
        else:
            dwin = self.kern.conv_backward_input(dy, self.w.value, window, self.stride, self.dilation,
                                                 out=space, **padded)
        if self.cgroup is not None:  # partial sums over this rank's filters
            dwin = self.cgroup.allreduce(dwin)
        if pads is not None:  # already the input gradient
            weight_grads()
            return [dwin]
        dx = self.halo_backward(dwin, weight_grads)
        self._window = None
        return [dx]


def _out(sl):
    """A halo plan's output slices (channel dimension: the input's) for the layer's output block."""
    return (sl[0], slice(None)) + tuple(sl[2:])


def _group_segments(fbox, fg: int, cg: int, groups: int):
    """For a rank holding filters ``fbox`` of a grouped convolution (``fg`` filters and ``cg`` input
    channels per group): ``[(local filter slice, input channel slice), ...]``, whole groups in one
    segment, a group the block begins or ends inside in one of its own; None where the kernels can take the
    filters and the whole input at once (one group, or all filters)."""
    f0, f1 = fbox
    if groups == 1 or (f0, f1) == (0, fg * groups):
        return None
    segs, cur = [], f0
    while cur < f1:
        g = cur // fg
        whole = (f1 - cur) // fg if cur % fg == 0 else 0
        end = cur + whole * fg if whole else min((g + 1) * fg, f1)
        ng = max(whole, 1)
        segs.append((slice(cur - f0, end - f0), slice(g * cg, (g + ng) * cg)))
        cur = end
    return segs
