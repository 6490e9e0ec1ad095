"""Halo exchange for stencils (convolution, pooling) on blocked distributions, and its adjoint.

A :class:`HaloPlan` answers, for one rank, which part of the input its block of the output reads (the
*window*, in global coordinates, possibly reaching past ``[0, n)`` into zero padding) and where each part of
that window lives: the rank's own block (*owned*), blocks of other ranks of the same replica (*receives*),
or padding. It also lists what this rank must *send* (the parts of its block that other ranks' windows
read). Output blocks are those of the same split applied to ``stencil.output_shape(global_shape)``, so with
stride 2 a rank's window need not meet its own block and may need rows from a non-neighbour; windows may
reach past an immediate neighbour. Nothing here assumes a halo narrower than a block.

Plans are pure: built from shapes only, computable for any rank, cached by :func:`halo_plan`. A plan built
directly (a layer's own) also keeps the packed send and receive buffers of its exchanges, planned at the
first and reused by every later one (a captured step keeps using the same buffers); an exchange started
while the last one of its direction is still in flight gets fresh buffers, so overlapping uses stay correct.

No hang on a bad plan: :func:`check_halo` loops over *every* rank's geometry, so a plan that cannot work
(an empty input or output block, a kernel longer than the padded input) raises the same
:class:`~lbannpy.dist.DistributionError` on every rank before any message is posted. No rank is left
waiting for a peer that gave up.

Execution (point to point, within one replica group; every rank of the distribution must start it):

* ``plan.start(comm, local)`` copies the owned part, zeros the padding, posts one receive and one send per
  peer (contiguous packed buffers laid out once in the plan) and returns a :class:`HaloExchange`; its
  ``.window`` already holds owned data and padding, so ``plan.interior_*`` outputs can be computed before
  ``.wait()``, which unpacks the receives and returns the full window.
* ``plan.accumulate_start(comm, grad_window)`` is the adjoint: the gradient with respect to the local
  block is the owned part of ``grad_window`` plus, added, every part of other ranks' window gradients that
  lies in this block; padding gradients are dropped.

Boundaries: by default the window's parts past the tensor's edges are zero padding. A plan built with
``boundary`` (one mode for every spatial dimension, or one per tensor dimension) fills them instead from
the tensor itself, as ``F.pad`` does: ``reflect`` (mirrored about the edge row, which is not repeated),
``replicate`` (the edge row repeated) or ``circular`` (periodic: the rows at the other end). Each is an index
map of the padded rows onto rows of the tensor, so the plan treats them like the window's other parts: the
rows they map to are received from whichever rank holds them (a periodic dimension wraps around the
process grid, the rank at the other end sends them), or copied (mirrored where the map reverses) from this
rank's own block; the adjoint sends their gradients back to those rows and adds them. One rank, or a
dimension that is not split, wraps locally.

Message tags: a plan has a base tag ``t`` (given, or derived from its geometry) and uses ``2t`` for the
exchange and ``2t + 1`` for the accumulation, both below 32768 (the smallest ``MPI_TAG_UB`` the standard
allows). Plans that may be in flight at the same time on the same communicator need distinct base tags;
the derived tag differs between plans of different geometry, so pass ``tag=`` when two plans of the *same*
geometry overlap (the activation halo and the error-signal halo of one layer, say).
"""
from __future__ import annotations

import functools
import math
import zlib
from typing import Sequence

from lbannpy.backend import array_module
from lbannpy.comm.base import Communicator, Handle, wait_all
from lbannpy.dist import (Box, Distribution, DistributionError, block_range, box_shape, box_size,
                          box_subtract, empty_block, intersect, relative_slices, shape_str)
from lbannpy.halo_boundary import boundary_modes, runs_1d, source_slices, window_sources
from lbannpy.stencil import Stencil
from lbannpy.packing import (Segment, check_array, check_comm, pack, packed_size, relayout, segments,
                             unpack)

TAG_LIMIT = 16384  # base tags are < TAG_LIMIT; messages use 2*tag and 2*tag+1 <= 32767


def check_halo(dist: Distribution, global_shape: Sequence[int], stencil: Stencil,
               boundary=None) -> tuple[int, ...]:
    """Refuse a halo plan that cannot work; returns the output shape.

    Pure and rank-independent: it checks every rank's input and output block, so every rank raises the
    same error (naming the first offending rank) without communication. A ``reflect`` boundary needs
    padding below the extent and a ``circular`` one at most the extent (PyTorch's rules: the padded rows
    map onto the tensor once).
    """
    global_shape = tuple(int(n) for n in global_shape)
    what = f"halo plan for input {shape_str(global_shape)} under {dist}"
    if len(global_shape) != dist.ndim or len(stencil.dims) != dist.ndim:
        raise DistributionError(
            f"{what}: the input has {len(global_shape)} dimensions, the distribution {dist.ndim} and the "
            f"stencil {len(stencil.dims)}; build all three for the same tensor rank")
    if any(n < 1 for n in global_shape):
        raise DistributionError(f"{what}: every extent must be >= 1")
    modes = boundary_modes(boundary, len(global_shape))
    for name, n, w, mode in zip(dist.dim_names, global_shape, stencil.dims, modes):
        most = {"reflect": n - 1, "circular": n}.get(mode)
        if most is not None and max(w.pad_lo, w.pad_hi) > most:
            raise DistributionError(
                f"{what}: {mode} padding ({w.pad_lo}, {w.pad_hi}) along '{name}' needs at most {most} rows "
                f"of padding on a side for an extent of {n} (each padded row maps onto one row of the "
                f"tensor); pad less, or use a larger input")
    out_shape = stencil.output_shape(global_shape)
    for name, n, w, m in zip(dist.dim_names, global_shape, stencil.dims, out_shape):
        if m < 1:
            raise DistributionError(
                f"{what}: along '{name}' a kernel of reach {w.reach} (kernel {w.kernel}, dilation "
                f"{w.dilation}) does not fit the padded input {w.pad_lo}+{n}+{w.pad_hi}, so the output "
                f"would be empty on every rank; pad more, or use a smaller kernel or dilation")
    for shape, kind in ((global_shape, "input"), (out_shape, "output")):
        bad = empty_block(dist, shape)
        if bad is not None:
            r, d = bad
            name = dist.dim_names[d]
            raise DistributionError(
                f"{what} (output {shape_str(out_shape)}): rank {r} (block {dist.coords(r)}) would hold an "
                f"empty {kind} block along '{name}' ({kind} extent {shape[d]} split {dist.parts[d]} ways); "
                f"lower the '{name}' degree to at most {min(global_shape[d], out_shape[d])}"
                + (" or use a smaller stride" if kind == "output" else ""))
    return out_shape


def _interior_1d(w, lo: int, hi: int, n: int, o0: int, o1: int, edge_lo: bool | None = None,
                 edge_hi: bool | None = None) -> tuple[int, int]:
    """Outputs in ``[o0, o1)`` whose inputs lie in ``[lo, hi)`` or in padding past a tensor edge the block
    touches (a possibly empty range inside ``[o0, o1]``); ``edge_lo``/``edge_hi`` (default: the block
    touches that edge) say whether the padding past that edge is ready before the exchange ends (zeros,
    or a boundary map onto this rank's own rows)."""
    edge_lo = lo == 0 if edge_lo is None else edge_lo
    edge_hi = hi == n if edge_hi is None else edge_hi
    # output o reads [o*s - pad_lo, o*s - pad_lo + reach)
    first = o0 if edge_lo else -((-(lo + w.pad_lo)) // w.stride)  # ceil((lo + pad_lo) / s)
    last = o1 - 1 if edge_hi else (hi + w.pad_lo - w.reach) // w.stride
    i0 = min(max(o0, first), o1)
    return i0, max(i0, min(o1, last + 1))


class HaloPlan:
    """Where rank ``rank``'s stencil window comes from and what it sends (pure; see the module docstring).

    Geometry (global coordinates unless named ``*_slices``):

    ``output_shape`` / ``output_box``: the output tensor and this rank's block of it (same split);
    ``input_box``, ``local_shape``: this rank's input block; ``window_box``, ``window_shape``: the input
    the output block reads; ``owned_box``: ``window ∩ input block`` (``None`` when empty);
    ``padding_boxes``: disjoint boxes of the window outside the tensor; ``recvs`` / ``sends``: one
    :class:`~lbannpy.tensor.Segment` per peer (``slices`` into the window / the local block; ``offset``
    into the packed buffer); ``interior_box``: outputs computable from owned data and padding alone (may
    be empty, ``box_size == 0``); ``boundary_boxes``: disjoint boxes covering the rest of the output
    block. ``*_slices`` select these from the local output (``interior_slices``) or the window
    (``interior_window_slices``, the inputs those outputs read).

    ``boundary`` (see the module docstring): ``modes`` holds it per tensor dimension, ``periodic`` the
    circular dimensions; ``wraps`` are ``(window slices, local slices)`` of the padded parts this rank
    fills from its own block (slices of the block reversed where a reflection reverses the rows);
    a send segment's ``box`` is then the block's rows it packs, a receive segment's the window's.
    """

    def __init__(self, dist: Distribution, global_shape: Sequence[int], stencil: Stencil, rank: int,
                 tag: int | None = None, boundary=None):
        global_shape = tuple(int(n) for n in global_shape)
        self.output_shape = check_halo(dist, global_shape, stencil, boundary)
        modes = self.modes = boundary_modes(boundary, len(global_shape))
        self.periodic = tuple(i for i, m in enumerate(modes) if m == "circular")
        mapped = any(m != "zeros" for m in modes)
        if not 0 <= rank < dist.ranks:
            raise DistributionError(f"halo plan: rank {rank} outside the {dist.ranks} ranks of {dist}")
        if tag is None:
            key = (dist, global_shape, stencil) + ((modes,) if mapped else ())
            tag = zlib.crc32(repr(key).encode()) % TAG_LIMIT
        if not 0 <= tag < TAG_LIMIT:
            raise DistributionError(f"halo plan: tag {tag} outside [0, {TAG_LIMIT})")
        self.dist, self.global_shape, self.stencil = dist, global_shape, stencil
        self.rank, self.tag = rank, tag

        self.input_box = dist.box(global_shape, rank)
        self.local_shape = box_shape(self.input_box)
        self.output_box = dist.box(self.output_shape, rank)
        self.output_local_shape = box_shape(self.output_box)
        self.window_box = stencil.input_window(self.output_box)
        self.window_shape = box_shape(self.window_box)
        win0 = tuple(lo for lo, _ in self.window_box)
        in0 = tuple(lo for lo, _ in self.input_box)
        out0 = tuple(lo for lo, _ in self.output_box)

        # owned part, padding
        self.owned_box = intersect(self.window_box, self.input_box)
        self.owned_window_slices = None if self.owned_box is None else relative_slices(self.owned_box, win0)
        self.owned_local_slices = None if self.owned_box is None else relative_slices(self.owned_box, in0)
        # padding: the window past the edges of the dimensions without a boundary map
        inside = intersect(self.window_box, tuple(w if m != "zeros" else (0, n) for w, n, m
                                                  in zip(self.window_box, global_shape, modes)))
        self.padding_boxes = (box_subtract(self.window_box, inside) if inside is not None
                              else [self.window_box])
        self.padding_slices = [relative_slices(b, win0) for b in self.padding_boxes]

        # receives: the blocks of the same replica that the window's data comes from; sends: my block's
        # rows in the windows of the ranks that read them (each list in the receiver's order, so the
        # pieces of one peer travel as one message)
        replica = dist.copy_index(rank)
        recv_pieces, wraps = [], []
        for peer, win, src, flips in window_sources(dist, global_shape, self.window_box, modes, replica):
            if peer != rank:
                recv_pieces.append((peer, win))
            elif win != src:  # a boundary map onto this rank's own rows
                wraps.append((relative_slices(win, win0), source_slices(src, in0, flips)))
        self.wraps = tuple(wraps)
        send_pieces = []
        for peer in sorted(dist.rank_of(c, replica) for c in _readers(dist, self.output_shape, stencil,
                                                                     self.input_box, global_shape, modes)):
            if peer == rank:
                continue
            window = stencil.input_window(dist.box(self.output_shape, peer))
            send_pieces += sorted((peer, win, src, flips) for q, win, src, flips
                                  in window_sources(dist, global_shape, window, modes, replica) if q == rank)
        self.recvs: tuple[Segment, ...] = segments(sorted(recv_pieces), win0)
        sends, offset = [], 0
        for peer, _, src, flips in send_pieces:
            sends.append(Segment(peer, src, source_slices(src, in0, flips), offset))
            offset = sends[-1].stop
        self.sends: tuple[Segment, ...] = tuple(sends)
        self.recv_size = packed_size(self.recvs)
        self.send_size = packed_size(self.sends)
        # nothing to exchange (one rank, or a split the stencil does not cross: samples, channels, 1x1
        # kernels): the window is the owned block, padding and wraps, and its gradient goes to this block
        self.local = not self.recvs and not self.sends

        self._plan_interior(global_shape, out0, win0)
        # (direction, dtype, array module) -> (receive, send) buffers; directions in flight
        self.keep_buffers = True
        self._buffers: dict = {}
        self._in_flight: set = set()

    def _plan_interior(self, global_shape: tuple, out0: tuple, win0: tuple) -> None:
        """The interior of the output block (read from owned data, padding and wraps only: computable
        while the exchange is in flight) and the boundary boxes covering the rest."""
        stencil, modes = self.stencil, self.modes
        ranges = []
        for w, (lo, hi), n, (o0, o1), (a, b), m in zip(stencil.dims, self.input_box, global_shape,
                                                       self.output_box, self.window_box, modes):
            edges = [lo == 0, hi == n]
            if m != "zeros":  # an edge's padding is ready early where it maps onto this block's rows
                for k, part in enumerate((runs_1d(a, min(b, 0), n, m) if a < 0 else [],
                                          runs_1d(max(a, n), b, n, m) if b > n else [])):
                    edges[k] = edges[k] and all(lo <= sa and sa + wb - wa <= hi for wa, wb, sa, _ in part)
            ranges.append(_interior_1d(w, lo, hi, n, o0, o1, *edges))
        self.interior_box: Box = tuple(ranges)
        self.boundary_boxes: list[Box] = (box_subtract(self.output_box, self.interior_box)
                                          if box_size(self.interior_box) else [self.output_box])
        self.interior_slices = relative_slices(self.interior_box, out0)
        self.interior_window_slices = relative_slices(stencil.input_window(self.interior_box), win0)
        self.boundary_slices = [relative_slices(b, out0) for b in self.boundary_boxes]
        self.boundary_window_slices = [relative_slices(stencil.input_window(b), win0)
                                       for b in self.boundary_boxes]

    def _exchange_buffers(self, xp, direction: str, dtype):
        """``(key, recv, send)`` for an exchange (``"fwd"``: ``recv_size``/``send_size`` elements) or its
        adjoint (``"bwd"``: the reverse): the plan's own buffers, or fresh ones (``key`` None) while the
        last exchange of that direction is still in flight or the plan is shared."""
        n_recv, n_send = (self.recv_size, self.send_size) if direction == "fwd" else \
            (self.send_size, self.recv_size)
        key = (direction, dtype, xp)  # the objects themselves: a NumPy dtype's str() is slow
        if not self.keep_buffers or key in self._in_flight:
            return None, xp.empty(n_recv, dtype=dtype), xp.empty(n_send, dtype=dtype)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = (xp.empty(n_recv, dtype=dtype), xp.empty(n_send, dtype=dtype))
        self._in_flight.add(key)
        return (key,) + bufs

    def _done(self, key) -> None:
        self._in_flight.discard(key)

    def __repr__(self) -> str:
        return (f"HaloPlan(rank {self.rank}, input {shape_str(self.global_shape)} under {self.dist}, "
                f"window {self.window_box}, {len(self.recvs)} receives, {len(self.sends)} sends)")

    @property
    def peers(self) -> tuple[int, ...]:
        """Ranks this plan exchanges messages with (either direction)."""
        return tuple(sorted({s.peer for s in self.recvs} | {s.peer for s in self.sends}))

    # -- the kernel-padded (windowless) form -------------------------------------------------------
    def kernel_padding_fits(self, pads: Sequence[int]) -> bool:
        """Whether a kernel that pads the local block by ``pads`` (both sides of each spatial dimension)
        computes exactly this rank's output block, every output reading the global input rows it should,
        with the ghost rows of the window read as zeros: each dimension's block starts on a stride
        (``o0 * s == lo``) and the padded block gives as many outputs as the block holds. Then the output
        is that convolution plus, on the boundary boxes only, the convolution of the ghost values
        (:attr:`ghost_pieces`): no window is built."""
        pads = (0, 0) + tuple(int(p) for p in pads)
        if len(pads) != len(self.stencil.dims) or any(m != "zeros" for m in self.modes):
            return False
        for w, p, (lo, hi), (o0, o1) in zip(self.stencil.dims, pads, self.input_box, self.output_box):
            if w.pad_lo != p or w.pad_hi != p or o0 * w.stride != lo:
                return False
            if (hi - lo + 2 * p - w.reach) // w.stride + 1 != o1 - o0:
                return False
        return True

    @functools.cached_property
    def ghost_pieces(self) -> tuple[GhostPiece, ...]:
        """The boundary boxes whose input window meets a received part, each with the pieces of the
        receive buffer that land in it (see :class:`GhostPiece`)."""
        out0 = tuple(lo for lo, _ in self.output_box)
        pieces = []
        for b in self.boundary_boxes:
            win = self.stencil.input_window(b)
            links = []
            for j, seg in enumerate(self.recvs):
                meet = intersect(win, seg.box)
                if meet is not None:
                    links.append((j, relative_slices(meet, [lo for lo, _ in win]),
                                  relative_slices(meet, [lo for lo, _ in seg.box])))
            if links:  # a box next to padding only reads nothing that differs from the kernel's zeros
                pieces.append(GhostPiece(relative_slices(b, out0), box_shape(win), tuple(links)))
        return tuple(pieces)

    @functools.cached_property
    def ghost_fraction(self) -> float:
        """The share of this rank's output block in :attr:`ghost_pieces` (boxes whose ghost terms a
        windowless convolution computes again over a window of their own)."""
        inside = sum(math.prod(sl.stop - sl.start for sl in p.out_slices) for p in self.ghost_pieces)
        n = box_size(self.output_box)
        return inside / n if n else 0.0

    def start_ghosts(self, comm: Communicator, local) -> "HaloExchange":
        """:meth:`start` without a window: only the ghost values move (point to point, same group);
        ``wait()`` returns the receive buffer (``recv_size`` elements, laid out as ``recvs``)."""
        check_comm(comm, self.dist, self.rank, "halo exchange")
        check_array(local, self.local_shape, "halo exchange input block", self.rank)
        key, recvbuf, sendbuf = self._exchange_buffers(array_module(local), "fwd", local.dtype)
        pack(local, self.sends, sendbuf)
        handles = self._post(comm, recvbuf, self.recvs, sendbuf, self.sends, 2 * self.tag)

        def finish():
            self._done(key)
            return recvbuf

        return HaloExchange(None, handles, finish, (recvbuf, sendbuf, local), f"halo rank {self.rank}",
                            received=recvbuf)

    def ghost_window(self, received, piece: GhostPiece):
        """Not collective: the input window of ``piece`` with its received values in place and zeros
        elsewhere (owned rows and padding: what the kernel-padded convolution already accounted for)."""
        g = array_module(received).zeros(piece.shape, dtype=received.dtype)
        for j, psl, ssl in piece.links:
            seg = self.recvs[j]
            g[psl] = received[seg.offset:seg.stop].reshape(seg.shape)[ssl]
        return g

    def add_ghost_gradient(self, packed, piece: GhostPiece, grad_window) -> None:
        """Adds the gradient of ``piece``'s window (``grad_window``) at its received positions into
        ``packed`` (``recv_size`` elements, the layout of ``recvs``), for :meth:`accumulate_ghosts_start`."""
        for j, psl, ssl in piece.links:
            seg = self.recvs[j]
            packed[seg.offset:seg.stop].reshape(seg.shape)[ssl] += grad_window[psl]

    def accumulate_ghosts_start(self, comm: Communicator, packed, grad) -> Handle:
        """Adjoint of :meth:`start_ghosts` (point to point, same group): sends the ghost gradients
        ``packed`` to their owners and, on ``wait()``, adds what this rank's block receives into ``grad``
        (this rank's input gradient block, in place), which it returns."""
        check_comm(comm, self.dist, self.rank, "halo accumulate")
        check_array(grad, self.local_shape, "halo accumulate output block", self.rank)
        key, recvbuf, _ = self._exchange_buffers(array_module(grad), "bwd", grad.dtype)
        handles = self._post(comm, recvbuf, self.sends, packed, self.recvs, 2 * self.tag + 1)

        def finish():
            unpack(recvbuf, self.sends, grad, add=True)
            self._done(key)
            return grad

        return Handle(lambda: wait_all(handles), lambda: all(h.test() for h in handles), finish,
                      (recvbuf, packed, grad), f"halo accumulate rank {self.rank}")

    # -- execution ----------------------------------------------------------------------------------
    @staticmethod
    def _post(comm: Communicator, recvbuf, recv_segs, sendbuf, send_segs, tag: int) -> list:
        """Posts one receive per segment of ``recv_segs`` into ``recvbuf`` and one send per segment of
        ``send_segs`` from ``sendbuf`` (the exchange and its adjoint swap the two), then flushes: backends
        that batch point-to-point operations start them now, before the interior work."""
        handles = [comm.irecv(recvbuf[a:b], peer, tag) for peer, a, b in _messages(recv_segs)]
        handles += [comm.isend(sendbuf[a:b], peer, tag) for peer, a, b in _messages(send_segs)]
        comm.flush()
        return handles

    def start(self, comm: Communicator, local, out=None) -> "HaloExchange":
        """Point to point among the ranks of this rank's replica group; every rank of the distribution
        starts its own plan. ``local`` is this rank's input block; ``out`` (optional) receives the window.
        Returns a :class:`HaloExchange` whose ``wait()`` returns the window (shape ``window_shape``)."""
        check_comm(comm, self.dist, self.rank, "halo exchange")
        window = self.local_window(local, out)
        key, recvbuf, sendbuf = self._exchange_buffers(array_module(local), "fwd", local.dtype)
        pack(local, self.sends, sendbuf)
        handles = self._post(comm, recvbuf, self.recvs, sendbuf, self.sends, 2 * self.tag)

        def finish():
            unpack(recvbuf, self.recvs, window)
            self._done(key)
            return window

        return HaloExchange(window, handles, finish, (recvbuf, sendbuf, window, local),
                            f"halo rank {self.rank}", received=recvbuf)

    def refill(self, local, received, out):
        """Not collective: the window of an exchange already done, rebuilt into ``out`` from the same local
        block and the exchange's ``received`` buffer (after its ``wait()``). A layer that keeps its input
        block (alive anyway as its parent's output) and these few ghost values keeps no window between its
        forward and backward."""
        check_array(out, self.window_shape, "halo refill output window", self.rank, local.dtype)
        for sl in self.padding_slices:
            out[sl] = 0
        if self.owned_box is not None:
            relayout(out[self.owned_window_slices], local[self.owned_local_slices])
        for wsl, lsl in self.wraps:
            out[wsl] = local[lsl]
        return unpack(received, self.recvs, out)

    def local_window(self, local, out=None):
        """Not collective: the window with its owned part (from ``local``, this rank's input block) and
        its padding (zeros) filled in, written into ``out`` when given; the whole window when ``local``
        (no exchange needed), else ghost parts are left for :meth:`start`'s receives."""
        check_array(local, self.local_shape, "halo exchange input block", self.rank)
        if out is None:
            window = array_module(local).empty(self.window_shape, dtype=local.dtype)
        else:
            check_array(out, self.window_shape, "halo exchange output window", self.rank, local.dtype)
            window = out
        for sl in self.padding_slices:
            window[sl] = 0
        if self.owned_box is not None:
            relayout(window[self.owned_window_slices], local[self.owned_local_slices])
        for wsl, lsl in self.wraps:
            window[wsl] = local[lsl]
        return window

    def local_gradient(self, grad_window):
        """Not collective, for a ``local`` plan: the gradient with respect to this rank's input block (a
        new array): the owned part of ``grad_window``; inputs no window reads get zeros."""
        check_array(grad_window, self.window_shape, "halo accumulate window gradient", self.rank)
        if self.owned_box == self.input_box:  # every input is read: one copy, nothing to zero
            owned = grad_window[self.owned_window_slices]
            grad = relayout(array_module(grad_window).empty(owned.shape, dtype=owned.dtype), owned)
        else:
            grad = array_module(grad_window).zeros(self.local_shape, dtype=grad_window.dtype)
            if self.owned_box is not None:
                grad[self.owned_local_slices] = grad_window[self.owned_window_slices]
        self._add_wraps(grad, grad_window)
        return grad

    def _add_wraps(self, grad, grad_window) -> None:
        """The adjoint of the wraps: their window gradients added to the rows they were copied from (one
        piece at a time: pieces may share rows)."""
        for wsl, lsl in self.wraps:
            grad[lsl] += grad_window[wsl]

    def accumulate_start(self, comm: Communicator, grad_window, out=None) -> Handle:
        """Adjoint of :meth:`start` (point to point, same group). ``grad_window`` has ``window_shape``;
        ``wait()`` returns the gradient with respect to the local input block (``local_shape``), written
        into ``out`` when given."""
        check_comm(comm, self.dist, self.rank, "halo accumulate")
        check_array(grad_window, self.window_shape, "halo accumulate window gradient", self.rank)
        xp = array_module(grad_window)
        if out is None:
            grad = xp.zeros(self.local_shape, dtype=grad_window.dtype)
        else:
            check_array(out, self.local_shape, "halo accumulate output block", self.rank, grad_window.dtype)
            grad = out
            grad[...] = 0
        if self.owned_box is not None:
            grad[self.owned_local_slices] = grad_window[self.owned_window_slices]
        self._add_wraps(grad, grad_window)
        key, recvbuf, sendbuf = self._exchange_buffers(xp, "bwd", grad_window.dtype)
        pack(grad_window, self.recvs, sendbuf)
        handles = self._post(comm, recvbuf, self.sends, sendbuf, self.recvs, 2 * self.tag + 1)

        def finish():
            unpack(recvbuf, self.sends, grad, add=True)
            self._done(key)
            return grad

        return Handle(lambda: wait_all(handles), lambda: all(h.test() for h in handles), finish,
                      (recvbuf, sendbuf, grad, grad_window), f"halo accumulate rank {self.rank}")


class GhostPiece:
    """One boundary box of a plan's output block, for the kernel-padded (windowless) form: ``out_slices``
    select it from the local output; ``shape`` is the input window it reads; ``links`` are ``(j, piece
    slices, segment slices)``: where received segment ``j`` meets that window."""

    __slots__ = ("out_slices", "shape", "links")

    def __init__(self, out_slices, shape, links):
        self.out_slices, self.shape, self.links = out_slices, shape, links


class HaloExchange(Handle):
    """A halo exchange in flight. ``window`` is the array being filled: owned part and padding are valid
    at once (compute ``plan.interior_*`` from them), the ghost parts after ``wait()``, which returns it."""

    __slots__ = ("window", "received")

    def __init__(self, window, handles, finish, buffers, label, received=None):
        super().__init__(lambda: wait_all(handles), lambda: all(h.test() for h in handles), finish,
                         buffers, label)
        self.window = window
        # the ghost parts as they arrived (``plan.recv_size`` elements): with the local block they rebuild
        # the window later without communication (:meth:`HaloPlan.refill`), until the plan's next exchange
        self.received = received


def _messages(segs):
    """``(peer, start, stop)`` of one message per run of consecutive segments of the same peer (a boundary
    map may give a peer several pieces of one window)."""
    out = []
    for s in segs:
        if out and out[-1][0] == s.peer and out[-1][2] == s.offset:
            out[-1][2] = s.stop
        else:
            out.append([s.peer, s.offset, s.stop])
    return [tuple(m) for m in out]


def _readers(dist: Distribution, output_shape: tuple, stencil: Stencil, input_box: Box,
             global_shape: tuple | None = None, modes: tuple | None = None):
    """Block coordinates of every output block whose input window meets ``input_box``: per dimension the
    output blocks whose window range (through the boundary map of ``modes``, when given, on an input of
    ``global_shape``) meets the input range (a box meets a box exactly when their ranges meet in every
    dimension), then their product. O(sum of the split degrees), never a loop over ranks."""
    per_dim = []
    modes = modes or ("zeros",) * len(output_shape)
    for d, (n, p, w, (lo, hi), m) in enumerate(zip(output_shape, dist.parts, stencil.dims, input_box,
                                                   modes)):
        hit = []
        for c in range(p):
            a, b = w.input_window(*block_range(n, p, c))
            if m != "zeros":
                if any(sa is not None and sa < hi and lo < sa + wb - wa
                       for wa, wb, sa, _ in runs_1d(a, b, global_shape[d], m)):
                    hit.append(c)
            elif a < hi and lo < b:
                hit.append(c)
        if not hit:
            return []
        per_dim.append(hit)
    out = [()]
    for hit in per_dim:
        out = [c + (i,) for c in out for i in hit]
    return out


@functools.lru_cache(maxsize=512)
def halo_plan(dist: Distribution, global_shape: tuple, stencil: Stencil, rank: int,
              tag: int | None = None, boundary=None) -> HaloPlan:
    """Cached :class:`HaloPlan`, shared: it keeps no buffers (a caller may hold one exchange's ghost values
    while another caller starts the next)."""
    plan = HaloPlan(dist, tuple(global_shape), stencil, rank, tag, boundary)
    plan.keep_buffers = False
    return plan
