"""Distributed transposed convolution (1-D to 3-D; stride, padding, output padding, dilation, groups), split
over samples, filters and every spatial dimension, uneven blocks included.

A transposed convolution ``X -> Y`` is the adjoint (the data gradient) of the convolution ``Y -> X`` with
the same kernel, stride, padding and dilation, whose filter in PyTorch's layout ``(F, C/groups, *k)`` is
exactly the transposed convolution's ``(C_in, filters/groups, *k)``. So the layer runs that convolution's
passes backwards with lbannpy's convolution kernels, and its halo is that convolution's
:class:`~lbannpy.halo.HaloPlan` on the output ``Y``, also run backwards: the plan's output blocks are the
blocks of ``X`` and its windows the rows of ``Y`` each input block writes.

* Forward: each rank computes the window of ``Y`` its input block writes (the convolution's data gradient
  of that block), keeps the part it owns and sends the ghost parts to their owners, which add them (the
  plan's accumulation). The boundary boxes of the input block (those writing ghost rows) are computed
  first and their ghost rows sent; the interior is computed while they are in flight.
* Backward: the halo exchange of ``dL/dY`` (the plan's forward), the interior of ``dL/dX`` (the
  convolution of the window) computed while it is in flight, then its boundary; then the filter
  gradient from the same window and the input block kept from the forward.

Filter split (``c``, as a convolution's): every rank of the ``c`` group holds the input channels its filters
read (the input's ``c`` grid axis is replicated, so the base class's redistribution gathers them) and
computes its block of filters, whose filter weights ``(C_in, filters/groups, *k)`` are one box: a block
inside one group reads that group's input channels and the block's columns, a block of whole groups those
groups' rows. A block that begins or ends inside a group and reaches into another is no box and is refused
(:func:`filter_split_check`: ``validate``, the planner and the layer). The input gradient is a partial sum
over the filters, summed by one allreduce over the ``c`` group, in flight while the filter gradient is
computed.

Output shape per spatial dimension: ``(X - 1)*stride - 2*padding + dilation*(kernel - 1) + output_padding
+ 1``. The output padding rows (written by no input) hold the bias only, as in PyTorch.
"""
from __future__ import annotations

import math

from lbannpy.config_types import REQUIRED, Bool, Int, Key, PerDim
from lbannpy.dist import Distribution, DistributionError, block_starts, box_size, shape_str
from lbannpy.packing import pack, relayout
from lbannpy.stencil import Stencil

from .base import LayerError
from .halo_layer import HaloLayer
from .kernels import conv as K
from .kernels import aten as CT
from .kernels.select import own
from .registry import Inferred, LayerArgs, LayerSpec, ShapeError, needs_image, register, split_refusal

def _per_dim(v, nsp: int, name: str, lo: int) -> tuple[int, ...]:
    vals = list(v) if isinstance(v, (list, tuple)) else [v] * nsp
    if len(vals) != nsp or not all(isinstance(x, int) and not isinstance(x, bool) and x >= lo for x in vals):
        raise ValueError(f"'{name}' must be an integer >= {lo} or one per spatial dimension ({nsp}), "
                         f"got {v!r}")
    return tuple(vals)


def geometry(in_shape, params) -> tuple[tuple[int, ...], Stencil]:
    """``(output shape, the adjoint convolution's stencil on the output)``; ValueError naming the key."""
    in_shape = tuple(int(n) for n in in_shape)
    nsp = len(in_shape) - 2
    k = _per_dim(params.get("kernel", 3), nsp, "kernel", 1)
    s = _per_dim(params.get("stride", 1), nsp, "stride", 1)
    p = _per_dim(params.get("padding", 0), nsp, "padding", 0)
    op = _per_dim(params.get("output_padding", 0), nsp, "output_padding", 0)
    d = _per_dim(params.get("dilation", 1), nsp, "dilation", 1)
    filters, groups, cin = int(params["filters"]), int(params.get("groups", 1)), in_shape[1]
    if groups < 1 or cin % groups or filters % groups:
        raise ValueError(f"groups {groups} must divide the input channels ({cin}) and the filters "
                         f"({filters})")
    out = []
    for n, ki, si, pi, oi, di in zip(in_shape[2:], k, s, p, op, d):
        if oi >= max(si, di):
            raise ValueError(f"output_padding {oi} must be smaller than the stride ({si}) or the dilation "
                             f"({di}), as in PyTorch")
        if oi > pi + si - 1:
            raise ValueError(f"output_padding {oi} larger than padding + stride - 1 ({pi + si - 1}) is not "
                             f"supported; pad the output afterwards instead")
        m = (n - 1) * si - 2 * pi + di * (ki - 1) + oi + 1
        if m < 1:
            raise ValueError(f"an input of {n} gives an output of {m} (stride {si}, padding {pi}, kernel "
                             f"{ki}, dilation {di}); lower the padding")
        out.append(m)
    out_shape = (in_shape[0], filters) + tuple(out)
    # the convolution Y -> X: its padding past the end is whatever keeps its output at X (the output padding
    # rows are read by no window)
    st = Stencil.conv(len(in_shape), k, s, [(pi, max(pi - oi, 0)) for pi, oi in zip(p, op)], d)
    if st.output_shape(out_shape)[2:] != in_shape[2:]:  # pragma: no cover - the algebra above
        raise ValueError(f"the adjoint convolution of {out_shape} gives {st.output_shape(out_shape)}")
    return out_shape, st


def _infer(lay: LayerArgs) -> Inferred:
    needs_image(lay, "move the layer before the fully-connected layers")
    x, p = lay.x, lay.params
    try:
        out, st = geometry(x, p)
    except (KeyError, ValueError, DistributionError) as exc:
        raise ShapeError(f"layer {lay.name!r} (conv_transpose) on input {shape_str(x)}: {exc}") from None
    groups = int(p.get("groups", 1))
    ksize = math.prod(w.kernel for w in st.dims[2:])
    n_params = x[1] * (out[1] // groups) * ksize + (out[1] if p.get("bias", True) else 0)
    # the halo priced is the adjoint's (the convolution's, on this layer's output blocks), as it moves
    return Inferred(out, 2 * math.prod(x) * (out[1] // groups) * ksize, n_params, st, halo="adjoint")


def _input_dist(dist: Distribution, ndim_in: int) -> Distribution:
    # the input channels of this rank's filters: the input's c grid axis is replicated over the filter split
    return Distribution(dist.split, dist.ranks, (1,) if dist.split[1] > 1 else ())


def filter_block(f0: int, f1: int, fg: int, cg: int):
    """For filters ``[f0, f1)`` of groups of ``fg`` filters reading ``cg`` input channels each:
    ``(input channel range, weight column range, groups in the block)``, the block's weights being
    ``weight[rows, columns]``; None where the block reaches from inside one group into another."""
    g0, g1 = f0 // fg, (f1 - 1) // fg
    if g0 == g1:  # inside one group (every block of an ungrouped layer)
        return (g0 * cg, (g0 + 1) * cg), (f0 - g0 * fg, f1 - g0 * fg), 1
    if f0 % fg or f1 % fg:
        return None
    return (g0 * cg, (g1 + 1) * cg), (0, fg), g1 + 1 - g0


def _blocks_fit(filters: int, groups: int, parts: int) -> bool:
    starts = block_starts(filters, parts)
    return all(filter_block(a, b, filters // groups, 1) is not None for a, b in zip(starts, starts[1:]))


def filter_split_check(params, in_shape, dist: Distribution):
    """``("c", why, fix)`` where a filter split of a grouped transposed convolution gives some rank a
    block reaching from inside one group into another (its weights would be no box), else None."""
    parts = dist.parts_of("c")
    filters, groups = params.get("filters"), params.get("groups", 1)
    if parts == 1 or not all(isinstance(v, int) and v >= 1 for v in (filters, groups)) or filters % groups:
        return None  # nothing split, or parameters shape inference refuses on its own
    if _blocks_fit(filters, groups, parts):
        return None
    ok = [str(p) for p in range(1, filters + 1) if _blocks_fit(filters, groups, p)]
    return ("c", f"a filter split of {parts} gives a rank filters of two of its {groups} groups of "
                 f"{filters // groups}, but not whole groups",
            f"split c so that each block lies inside one group or holds whole groups: c in "
            f"{{{', '.join(ok)}}}")


_POS = Int(1)
SPEC = LayerSpec(
    "conv_transpose", "N-d transposed convolution (the data gradient of a convolution) over the spatial "
                      "dimensions", (
        Key("filters", _POS, REQUIRED, "output channels"),
        Key("kernel", PerDim(_POS), 3, "kernel size"),
        Key("stride", PerDim(_POS), 1, "stride"),
        Key("padding", PerDim(Int(0)), 0, "rows of the full output cropped on each side"),
        Key("output_padding", PerDim(Int(0)), 0, "rows added at the end of each dimension (below the "
                                                 "stride)"),
        Key("dilation", PerDim(_POS), 1, "spacing of kernel taps"),
        Key("groups", _POS, 1, "input and output channels in this many independent groups"),
        Key("bias", Bool(), True, "learn an additive bias")),
    _infer, input_dist=_input_dist, weights_split=True, reduces_channels=True, order=11, capturable=True,
    split_check=filter_split_check)


def _chan(sl):
    """Slices of a plan over ``Y`` (channel dimension: the filters) for an array with other channels."""
    return (sl[0], slice(None)) + tuple(sl[2:])


@register(SPEC)
class ConvTranspose(HaloLayer):

    def setup(self, dist: Distribution) -> None:
        hp = self.hparams
        (in_shape,) = self.in_shapes
        if len(in_shape) not in (3, 4, 5):
            raise LayerError(f"layer '{self.name}' (conv_transpose) needs an (n, c, [[d,] h,] w) input, got "
                             f"shape {in_shape}; put it before any fully-connected layer")
        try:
            self.out_shape, self.stencil = geometry(in_shape, hp)
        except ValueError as exc:
            raise LayerError(f"layer '{self.name}' (conv_transpose) on input {in_shape}: {exc}") from None
        sp = self.stencil.dims[2:]
        self.kernel = tuple(w.kernel for w in sp)
        self.stride = tuple(w.stride for w in sp)
        self.dilation = tuple(w.dilation for w in sp)
        self.groups = int(hp["groups"])
        self.padding = tuple(w.pad_lo for w in sp)
        self.output_padding = _per_dim(hp["output_padding"], len(sp), "output_padding", 0)
        self._whole_space = all(p == 1 for p in dist.parts[2:])
        self.out_dist = dist
        if 1 in dist.replicate:
            raise LayerError(f"layer '{self.name}' (conv_transpose): its output distribution {dist} cannot "
                             f"replicate c")
        cut = split_refusal(self.spec, hp, in_shape, dist)
        if cut is not None:
            raise LayerError(f"layer '{self.name}' (conv_transpose) under {dist}: {cut[1]}; {cut[2]}")
        self.in_dists = [_input_dist(dist, len(in_shape))]
        # the adjoint convolution's plan over the output: its "input" blocks are Y's, its "output" X's
        self.plan_halo(dist, self.out_shape, self.stencil)
        cin, filters = in_shape[1], self.out_shape[1]
        fbox = dist.box(self.out_shape, self.ctx.rank)[1]
        rows, cols, self.local_groups = filter_block(*fbox, filters // self.groups, cin // self.groups)
        # the input channels this rank's filters read (None: all of them)
        self._cin = None if rows == (0, cin) else slice(*rows)
        self._cin_local = rows[1] - rows[0]
        wshape = (cin, filters // self.groups) + self.kernel
        # He initialisation over what one output sums: C_in/groups inputs times the taps that reach it
        fan = max(1.0, cin / self.groups * math.prod(self.kernel) / math.prod(self.stride))
        w0 = self.rng("weight").standard_normal(wshape) * math.sqrt(2.0 / fan)
        reduce_dims = [d for d in dist.dim_names if d != "c"]
        wbox = (rows, cols) + tuple((0, k) for k in self.kernel)
        self.w = self.new_param("weight", wshape, w0, wbox, dist, reduce_dims, lazy=True)
        self.b = (self.new_param("bias", (filters,), None, (fbox,), dist, reduce_dims, lazy=True)
                  if hp["bias"] else None)
        self.cgroup = self.ctx.grid_comm(self.in_dists[0], ["c"]) if dist.split[1] > 1 else None
        h = self.halo
        # the window of Y the whole input block writes is the output block itself (no padding to crop, no
        # ghost rows, every row written): the common stride = kernel case on one rank
        self._exact = h.local and h.window_shape == h.local_shape and h.owned_box == h.input_box
        self._split = not h.local and box_size(h.interior_box) > 0 and bool(h.boundary_slices)
        # space not split (one rank, samples split) and the crop symmetric (no output padding, which crops
        # less at the end): the kernels pad and crop themselves, as PyTorch's do, so no window is filled
        # from dL/dY or cropped into the output
        sp_pads = tuple(w.pad_lo for w in sp)
        self._pads = (sp_pads if not self._exact and all(p == 1 for p in dist.parts[2:]) and any(sp_pads)
                      and all(w.pad_lo == w.pad_hi for w in sp) else None)

    @property
    def kern(self):
        """The convolution kernels the adjoint convolution runs on: as :attr:`Conv.kern` (the set a
        calibration chose for this layer's local shapes, else the run's ``runtime.kernels``, else lbannpy's
        own), except that grouped filters on split space take lbannpy's own where the set is ATen's (which
        convolves one group; cuDNN Frontend's reads the groups from the filter's shape)."""
        k = self.__dict__.get("_kern")
        if k is None:
            ctx, rank = self.ctx, self.ctx.rank
            key = ("conv_transpose", tuple(self.in_dists[0].local_shape(self.in_shapes[0], rank)),
                   tuple(self.out_dist.local_shape(self.out_shape, rank)))
            k = ctx.conv_kernel_table.get(key) or ctx.conv_kernels
            # space whole on ATen: PyTorch's own transposed convolution (groups, output padding and bias
            # inside the operator, no window)
            self._native = k is not None and k.name == "aten" and self._whole_space
            grouped_aten = self.local_groups > 1 and k is not None and k.name == "aten" and not self._native
            k = self._kern = own() if k is None or grouped_aten else k
        return k

    @property
    def native(self) -> bool:
        """Whether the layer runs ATen's transposed convolution itself
        (:func:`.kernels.aten.conv_transpose_forward`)."""
        return self.kern is not None and self.__dict__.get("_native", False)

    @property
    def channels_last(self) -> bool:
        """Whether the native operator runs on channels-last operands: host arrays, 2-D or 3-D, one group of
        more than one input channel, and the set's layout ``channels_last``, which only a calibration of the
        run's machine names for the layer's shape (``bench calibrate --kernels``: oneDNN's NCHW transposed
        convolution is several times slower than its channels-last one at some shapes, its copies
        included). Never timed in a run: the layouts round differently."""
        hit = self.__dict__.get("_cl")
        if hit is None:
            x = self.in_shapes[0][:1] + (self._cin_local,) + tuple(self.in_shapes[0][2:])
            hit = self._cl = bool(self.native and getattr(self.ctx.xp, "__name__", "") == "numpy"
                                  and CT.transposed_channels_last(x, self.local_groups, self.kern.layout))
        return hit

    def _laid_out(self, a, name: str):
        """``a`` copied channels-last into the workspace ``name`` (:func:`lbannpy.packing.relayout`)."""
        buf = self.ctx.workspace(name, CT.channels_last_shape(a.shape), a.dtype)
        return relayout(CT.channels_last_view(buf, a.ndim), a)

    # -- forward ---------------------------------------------------------------------------------------
    def _scatter(self, x, shape, out=None, padding=0):
        """The adjoint convolution's data gradient of ``x``: the window of ``Y`` of ``shape`` it writes
        (into ``out`` when given), or with ``padding`` the block of that shape inside it."""
        if self.kern.name == "own":  # lbannpy's kernels read the window's shape only
            return K.conv_backward_data(x, self.w.value, shape, self.stride, self.dilation, out=out,
                                        padding=padding)
        # others lay their computation out after the window's strides (ATen: a stride-0 stand-in is slower):
        # an array of the shape, never written unless it is ``out``
        like = self.ctx.xp.empty(shape, dtype=x.dtype) if out is None else out
        return self.kern.conv_backward_input(x, self.w.value, like, self.stride, self.dilation, out=out,
                                             padding=padding)

    def _add_bias(self, y):
        if self.b is not None:
            y += self.b.value.reshape((1, -1) + (1,) * (y.ndim - 2))
        return y

    def fp_compute(self, xs):
        (x,) = xs
        ctx, h = self.ctx, self.halo
        if self._cin is not None:  # the input channels this rank's filters read
            x = ctx.xp.ascontiguousarray(x[:, self._cin])
        self._x = x if self.train else None
        if self.native:
            if self.channels_last:  # its result comes back NCHW (:func:`.kernels.aten._back`)
                x = self._laid_out(x, "conv_transpose input channels-last")
            return CT.conv_transpose_forward(x, self.w.value, None if self.b is None else self.b.value,
                                             self.stride, self.padding, self.output_padding, self.dilation,
                                             self.local_groups)
        if self._pads is not None:
            return self._add_bias(self._scatter(x, h.local_shape, padding=self._pads))
        if self._exact:
            return self._add_bias(self._scatter(x, h.window_shape))
        if h.local:
            return self._add_bias(h.local_gradient(self._scatter(x, h.window_shape)))
        if not self._split:  # no interior to overlap: the whole window, then the plan's accumulation
            win = self._scatter(x, h.window_shape,
                                out=ctx.workspace("conv_transpose window", h.window_shape, x.dtype))
            return self._add_bias(h.accumulate_start(ctx.comm, win).wait())
        win = ctx.workspace("conv_transpose window", h.window_shape, x.dtype)
        win[...] = 0
        t0 = ctx.timer.now()
        for osl, wsl in zip(h.boundary_slices, h.boundary_window_slices):  # those writing ghost rows
            part = win[wsl]
            part += self._scatter(x[_chan(osl)], part.shape)
        y = ctx.xp.empty(h.local_shape, dtype=x.dtype)
        packed = pack(win, h.recvs, ctx.workspace("conv_transpose ghosts", (h.recv_size,), x.dtype))

        def interior():
            part = win[h.interior_window_slices]
            part += self._scatter(x[_chan(h.interior_slices)], part.shape)
        if not ctx.overlap:
            interior()
        acc = h.accumulate_ghosts_start(ctx.comm, packed, y)
        if ctx.overlap:
            interior()
        if h.owned_box != h.input_box:  # rows no window of this block writes (beyond the kernel's reach)
            y[...] = 0
        y[h.owned_local_slices] = win[h.owned_window_slices]
        t1 = ctx.timer.now()
        acc.wait()
        t2 = ctx.timer.now()
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        return self._add_bias(y)

    # -- backward --------------------------------------------------------------------------------------
    def _gather(self, dywin, out=None):
        """The adjoint convolution of a window of ``dL/dY``: ``dL/dX`` of the block it covers."""
        return self.kern.conv_forward(dywin, self.w.value, None, self.stride, self.dilation, out=out)

    def _window_and_dx(self, dy, want_dx: bool):
        """``(window of dL/dY, dL/dX or None)``: the exchange in flight while the interior of ``dL/dX`` is
        computed, as a convolution's forward (:meth:`HaloLayer.halo_forward`, here on the input's blocks)."""
        ctx, h = self.ctx, self.halo
        if self._exact:
            return dy, (self._gather(dy) if want_dx else None)
        if self._pads is not None:  # the kernels pad dL/dY themselves
            return dy, (self.kern.conv_forward(dy, self.w.value, None, self.stride, self.dilation,
                                               padding=self._pads) if want_dx else None)
        space = ctx.workspace("conv_transpose window", h.window_shape, dy.dtype)
        if h.local:
            win = h.local_window(dy, space)
            return win, (self._gather(win) if want_dx else None)
        t0 = ctx.timer.now()
        exchange = h.start(ctx.comm, dy, out=space)
        win = exchange.window
        dx = None
        if want_dx and self._split:
            dx = ctx.xp.empty(self.halo.output_local_shape[:1] + (self._cin_local,)
                              + self.halo.output_local_shape[2:], dtype=dy.dtype)

        def interior():
            self._gather(win[h.interior_window_slices], out=dx[_chan(h.interior_slices)])
        if dx is not None and ctx.overlap:
            interior()
        t1 = ctx.timer.now()
        exchange.wait()
        t2 = ctx.timer.now()
        if dx is not None:
            if not ctx.overlap:
                interior()
            for osl, wsl in zip(h.boundary_slices, h.boundary_window_slices):
                self._gather(win[wsl], out=dx[_chan(osl)])
        elif want_dx:
            dx = self._gather(win)
        ctx.timer.add((self.name, "halo_wait"), t1, t2, "comm")
        if ctx.timer.events is not None:
            ctx.timer.add((self.name, "interior"), t0, t1)
        return win, dx

    def _reduce_start(self, dx):
        """Under a filter split: the allreduce over the ``c`` group of this rank's partial input gradient
        (its input channels placed among all of them), started; else None."""
        if self.cgroup is None or dx is None:
            return None
        if self._cin is not None:
            full = self.ctx.xp.zeros(dx.shape[:1] + (self.in_shapes[0][1],) + dx.shape[2:], dtype=dx.dtype)
            full[:, self._cin] = dx
            dx = full
        return self.cgroup.iallreduce(dx, out=dx)

    def _reduce_wait(self, pending, dx):
        if pending is None:
            return dx
        ctx = self.ctx
        t0 = ctx.timer.now()
        dx = pending.wait()
        ctx.timer.add((self.name, "filter_allreduce"), t0, ctx.timer.now(), "comm")
        return dx

    def bp_compute(self, dy):
        x, self._x = self._x, None
        if self.native:
            bias, g = self.b is not None, dy
            if self.channels_last:  # the bias gradient summed from the NCHW dL/dY (oneDNN's is slow there)
                x = self._laid_out(x, "conv_transpose input channels-last")
                g, bias = self._laid_out(dy, "conv_transpose output gradient channels-last"), False
            dx, dw, db = CT.conv_transpose_backward(g, x, self.w.value, bias,
                                                    self.needs_input_grad, self.stride, self.padding,
                                                    self.output_padding, self.dilation, self.local_groups)
            if self.b is not None and not bias:
                db = _channel_sums(dy)
            pending = self._reduce_start(dx)
            self.w.accumulate(dw)
            if db is not None:
                self.b.accumulate(db)
            return [self._reduce_wait(pending, dx)]
        win, dx = self._window_and_dx(dy, self.needs_input_grad)
        pending = self._reduce_start(dx)  # in flight while the filter gradient is computed
        padded = {} if self._pads is None else {"padding": self._pads}
        dw, _ = self.kern.conv_backward_params(win, x, self.w.value, False, self.stride, self.dilation,
                                               **padded)
        self.w.accumulate(dw)
        if self.b is not None:
            self.b.accumulate(_channel_sums(dy))
        return [self._reduce_wait(pending, dx)]


def _channel_sums(a):
    """``a`` summed over every dimension but the channels: over the contiguous spatial rows first (one
    vectorised pass), then the samples."""
    if a.flags.c_contiguous:
        return a.reshape(a.shape[0], a.shape[1], -1).sum(axis=2).sum(axis=0)
    return K.conv_backward_bias(a)
