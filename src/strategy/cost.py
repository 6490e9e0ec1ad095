"""Pure cost model: time and memory of one layer under one distribution, and of moving tensors between two.

Jia et al. (2018) eq. 1: ``t_O = Σ_layers (t_C + t_S) + Σ_edges t_X``. Here

* ``t_C`` = local forward + backward-data + backward-weights compute (γ·FLOPs roofline, or a measured table;
  a layer reading the model input also reads its block of it from the data set, where that is measured)
  plus the layer's own communication: halo exchanges (Dryden et al. 2019 §V-A; periodic padding wraps
  them around the process grid; transposed convolution and upsampling exchange their adjoint's halo on
  output blocks), the statistics of normalisations and global pooling over the ranks that split what
  they reduce, and the partial-sum allreduce of the error signal when output channels are split (the
  second term of Gholami et al. 2018 eq. 8). Layer types a calibration gave a rate (seconds per output
  element or per FLOP, :class:`lbannpy.machine.Rate`) are priced by it instead of the roofline;
* ``t_S`` = gradient synchronisation over the ranks whose weight gradients are partial sums of one weight
  block (the runtime's ``block_group`` over the non-channel dimensions; leftover replicas compute the same
  sums and sync in their own group). The machine's ``gradient_sync`` picks the scheme: ``allreduce``
  (Thakur et al.: recursive doubling below a size threshold, ring above) or ``parameter_server`` (Jia et
  al. §5.1: every copy sends its gradients to a server and gets the updated block back);
* ``t_X`` = redistribution (all-to-all shuffle, Dryden §III-C) of the activation forward and of the error
  signal backward, volumes from box intersections of :mod:`lbannpy.dist` distributions.

A layer's distribution is the distribution of its *output* (Jia: a configuration partitions the output
tensor). Its input must be in :func:`required_input` of it: the same split, with the channel axis
replicated where the layer reduces over input channels (conv, fc).

Units: seconds, bytes, elements; every time is the slowest rank's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import product
from typing import Sequence

import numpy as np

from lbannpy.layers.registry import layer_spec, reduced_dims as registry_reduced_dims

from ..dist import Distribution, block_range, max_local_shape  # noqa: F401  (max_local_shape: re-exported)
from .graph import Node
from ..machine import Link, Machine as MachineModel, allreduce_time
from ..machine import allgather_time  # noqa: F401  (re-exported: callers price allgathers through cost)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reduced_dims(node: Node, dist: Distribution) -> tuple[int, ...]:
    """:func:`lbannpy.layers.registry.reduced_dims` of a graph node."""
    return registry_reduced_dims(layer_spec(node.type), node.in_shape, node.out_shape, dist)


def nbytes(shape: Sequence[int], machine: MachineModel) -> int:
    return math.prod(shape) * machine.dtype_bytes


# --------------------------------------------------------------------------------------------------------
# distributions of a layer's tensors


def required_input(node: Node, dist: Distribution, in_shape: Sequence[int]) -> Distribution:
    """Distribution the layer needs its input (of ``in_shape``) in, given its output distribution ``dist``.

    Pointwise layers (and pool, concat, sum) use the same split. Conv and fc need every input channel for
    their block of outputs, so their input's channel axis is replicated over the output-channel split; an fc
    layer flattens (C, spatial...) into features, so its input is split along samples only.
    """
    return _required(node.type, dist, len(in_shape))


@lru_cache(maxsize=65536)
def _required(typ: str, dist: Distribution, ndim_in: int) -> Distribution:
    return layer_spec(typ).input_dist(dist, ndim_in)


def weight_split(node: Node, dist: Distribution) -> int:
    """Number of pieces the layer's weights are cut into (the output-channel split where the type's weights
    follow it: conv, fc, batchnorm; every split but the samples' where they have the output's shape)."""
    spec = layer_spec(node.type)
    if spec.weights_spatial:
        return math.prod(dist.split[1:])
    return dist.split[1] if spec.weights_split else 1


def _group_span(dist: Distribution, dims: Sequence[str]) -> int:
    """Consecutive ranks spanned by the group of ranks that differ only along ``dims`` (C-order grid)."""
    idx = [dist.dim_names.index(d) for d in dims]
    if not idx:
        return 1
    first = min(idx)
    return math.prod(dist.split[first:])


# --------------------------------------------------------------------------------------------------------
# per-layer costs


@dataclass(frozen=True)
class LayerCost:
    """Predicted cost of one layer under one distribution (seconds; bytes per rank)."""

    fwd_s: float  # local forward compute
    bwd_data_s: float  # local dL/dx compute
    bwd_weights_s: float  # local dL/dw compute
    halo_s: float  # halo exchanges, forward (x) and backward (dL/dy)
    internal_comm_s: float  # BN statistics, partial-sum reduction of dL/dx over the channel split
    allreduce_s: float  # t_S: gradient sync (allreduce or parameter server) over the weight block's group
    mem_persistent_bytes: int  # kept from forward to backward: activations, weights, gradients, optimizer
    mem_transient_bytes: int  # alive only while this layer runs: error signals, halo buffers
    input_s: float = 0.0  # reading this rank's block of the model input (layers that read it)

    @property
    def compute_s(self) -> float:
        """Local work of the rank: the kernels and, for a layer reading the model input, reading its block."""
        return self.fwd_s + self.bwd_data_s + self.bwd_weights_s + self.input_s

    @property
    def comm_s(self) -> float:
        return self.halo_s + self.internal_comm_s + self.allreduce_s

    @property
    def t_c(self) -> float:
        """Jia's t_C: compute plus the layer's own communication."""
        return self.compute_s + self.halo_s + self.internal_comm_s

    @property
    def t_s(self) -> float:
        return self.allreduce_s

    @property
    def total_s(self) -> float:
        return self.t_c + self.t_s

    @property
    def mem_bytes(self) -> int:
        return self.mem_persistent_bytes + self.mem_transient_bytes


def compute_times(node: Node, dist: Distribution, machine: MachineModel,
                  needs_dx: bool = True) -> tuple[float, float, float]:
    """(forward, backward-data, backward-weights) seconds of the local kernels of the slowest rank.

    A measured entry keyed by (type, local input shape, local output shape, split degrees, ranks on the node)
    wins: it was timed while as many ranks ran on the node as this job puts there, so whatever sharing the
    node's cores and memory costs a call is in it, and it is used as it is but for the measured lockstep
    factor (:meth:`MachineModel.shared_at`: medians of calls leave out the time slices other work takes).
    Then one keyed without the rank count, then one without the split (a block timed alone, in no
    particular split's code path); otherwise the roofline ``max(γ·FLOPs, bytes·mem_s_per_byte) + kernel
    overhead``. Conv and fc: dL/dx and dL/dw cost a forward each; pointwise layers: backward costs what
    forward does and there is no dL/dw. These are times of a rank with a compute slot to itself, scaled by
    :meth:`MachineModel.compute_slowdown` where ranks share cores.
    """
    out_local = max_local_shape(node.out_shape, dist)
    in_dist = required_input(node, dist, node.in_shape)
    in_local = max_local_shape(node.in_shape, in_dist)
    key = (node.type, in_local, out_local)
    split = key + (tuple(dist.split),)
    entry = machine.measured.get(split + (machine.ranks_on_node(dist.ranks),))
    if entry is not None:  # the medians of calls: what lockstep ranks lose besides is the shared factor
        shared = machine.shared_at(dist.ranks)[0]
        return entry[0] * shared, (entry[1] * shared if needs_dx else 0.0), entry[2] * shared
    slow = machine.compute_slowdown(dist.ranks)
    entry = machine.measured.get(split, machine.measured.get(key))
    if entry is not None:
        f, bd, bw = entry
        return f * slow, (bd * slow if needs_dx else 0.0), bw * slow
    frac = math.prod(out_local) / math.prod(node.out_shape)
    for i in reduced_dims(node, dist):  # each rank reduces its share of the input along it
        frac *= in_local[i] / node.in_shape[i]
    flops = node.flops_fwd * frac
    rate = machine.rates and machine.rate(node.type, layer_spec(node.type).resolve(node.params))
    if rate:  # measured seconds per unit of this type's work, plus the fixed cost of each call
        # per element of the larger of input and output: a pool's work is its input, an upsampling's output
        units = max(math.prod(out_local), *(math.prod(in_local) for _ in node.in_shapes)) \
            if rate.per == "element" else flops
        f, bd, bw = (machine.kernel_overhead_s + r * units if r else 0.0
                     for r in (rate.fwd_s, rate.bwd_data_s, rate.bwd_weights_s))
        return f * slow, (bd * slow if needs_dx else 0.0), bw * slow
    moved = (math.prod(in_local) * len(node.in_shapes) + math.prod(out_local)) * machine.dtype_bytes
    spec = layer_spec(node.type)
    if spec.reduces_channels:  # the kernel reads the weights too
        moved += node.n_params / weight_split(node, dist) * machine.dtype_bytes

    def kernel(fl: float, by: float) -> float:
        if fl == 0 and by == 0:
            return 0.0
        return machine.kernel_time(fl, by)

    fwd = kernel(flops, moved) * slow
    if spec.reduces_channels:
        return fwd, (fwd if needs_dx else 0.0), fwd
    if spec.no_kernel:
        return 0.0, 0.0, 0.0
    return fwd, (fwd if needs_dx else 0.0), 0.0


@lru_cache(maxsize=None)
def halo_widths(stencil_dims: tuple, in_shape: tuple[int, ...], parts: tuple[int, ...], periodic: bool = False
                ) -> tuple[tuple[int, int], ...]:
    """Largest (lo, hi) halo, in input elements, over all blocks of each dimension when input and output are
    split alike into ``parts``; elements in the padding are not exchanged, unless ``periodic``: then the
    padding of the first and last blocks is the far end of the dimension, fetched from the other end of
    the process grid (a dimension held whole wraps around locally)."""
    out = []
    for w, n, p in zip(stencil_dims, in_shape, parts):
        if p == 1:
            out.append((0, 0))
            continue
        n_out = w.output_size(n)
        lo_max = hi_max = 0
        for j in range(p):
            o0, o1 = block_range(n_out, p, j)
            if o1 <= o0:
                continue
            i0, i1 = block_range(n, p, j)
            lo, hi = w.input_window(o0, o1)
            if not periodic:
                lo, hi = max(lo, 0), min(hi, n)
            lo_max = max(lo_max, i0 - lo)
            hi_max = max(hi_max, hi - i1)
        out.append((max(lo_max, 0), max(hi_max, 0)))
    return tuple(out)


def halo_geometry(node: Node, dist: Distribution) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...],
                                                            tuple[int, ...]] | None:
    """``(widths, forward block, backward block)`` of the halos a stencil layer exchanges under ``dist``,
    or None where it exchanges none: the (lo, hi) widths per dimension and the local shapes whose faces
    move forward and backward. A window (or periodic) layer fetches rows of its input block forward and
    sends back those of dL/dy's block backward (Dryden's FP and BP terms); an adjoint layer
    (:attr:`lbannpy.layers.registry.Inferred.halo`) exchanges its adjoint's halo, whose input is this
    layer's output, on output blocks both ways."""
    if node.stencil is None or all(p == 1 for p in dist.split[2:]):
        return None
    out_local = max_local_shape(node.out_shape, dist)
    if node.halo == "adjoint":
        widths = halo_widths(node.stencil.dims, tuple(node.out_shape), tuple(dist.split))
        return widths, out_local, out_local
    in_local = max_local_shape(node.in_shape, required_input(node, dist, node.in_shape))
    widths = halo_widths(node.stencil.dims, tuple(node.in_shape), tuple(dist.split), node.halo == "periodic")
    return widths, in_local, out_local


def _halo_exchange_time(widths: Sequence[tuple[int, int]], local: Sequence[int], link: Link,
                        dtype_bytes: int) -> float:
    """Dryden's FP_ℓ halo terms generalised to any number of split dimensions: for each non-empty subset S of
    the dimensions with a halo, one send/recv per side combination, of volume Π_{S} width · Π_{rest} extent
    (2SR(O·I_N·I_C·I_H) + 2SR(O·I_N·I_C·I_W) + 4SR(O²·I_N·I_C) for 2-D)."""
    dims = [i for i, (lo, hi) in enumerate(widths) if lo or hi]
    total = 0.0
    for r in range(1, len(dims) + 1):
        for subset in _subsets(dims, r):
            for sides in product((0, 1), repeat=len(subset)):
                vol = 1
                for i in range(len(local)):
                    if i in subset:
                        vol *= widths[i][sides[subset.index(i)]]
                    else:
                        vol *= local[i]
                if vol:
                    total += link.time(vol * dtype_bytes)
    return total


def _subsets(items: list[int], r: int) -> list[tuple[int, ...]]:
    from itertools import combinations
    return list(combinations(items, r))


def halo_time(node: Node, dist: Distribution, machine: MachineModel, needs_dx: bool = True) -> float:
    """Forward halo plus backward halo (:func:`halo_geometry`: the same widths, on the blocks it says)."""
    geo = halo_geometry(node, dist)
    if geo is None:
        return 0.0
    widths, fwd_local, bwd_local = geo
    link = machine.link(_group_span(dist, dist.dim_names[2:]))
    fp = _halo_exchange_time(widths, fwd_local, link, machine.dtype_bytes)
    bp = _halo_exchange_time(widths, bwd_local, link, machine.dtype_bytes) if needs_dx else 0.0
    return fp + bp


def internal_comm_time(node: Node, dist: Distribution, machine: MachineModel, needs_dx: bool = True) -> float:
    """Communication inside the layer: batch-norm statistics over the spatial group (forward and backward),
    the statistics a layer declares (:class:`lbannpy.layers.registry.Statistics`: one allreduce per pass
    of its numbers over the ranks splitting what it reduces; the backward's only where dL/dx is wanted),
    and for conv/fc with split output channels the allreduce of the partial sums of dL/dx over that split."""
    t = 0.0
    spatial = dist.dim_names[2:]
    spec = layer_spec(node.type)
    st = spec.statistics  # says more than spatial_statistics, which it replaces where both are set
    if spec.spatial_statistics and st is None and any(dist.split[2:][i] > 1 for i in range(len(spatial))):
        p = math.prod(dist.split[2:])
        c_local = ceil_div(node.out_shape[1], dist.split[1])
        link = machine.link(_group_span(dist, spatial))
        t += 2 * allreduce_time(2 * c_local * machine.dtype_bytes, p, link, machine)
    if st is not None:
        over = [d for d in dist.dim_names if d in st.over]
        p = math.prod(dist.split[dist.dim_names.index(d)] for d in over)
        if p > 1:
            out_local = max_local_shape(node.out_shape, dist)
            count = math.prod(out_local[dist.dim_names.index(d)] for d in st.per if d in dist.dim_names)
            if st.groups is not None and "c" in st.per:  # per group: the block's share of the groups
                groups = int(layer_spec(node.type).resolve(node.params)[st.groups])
                c_local = out_local[1]
                count = count // c_local * max(1, ceil_div(groups * c_local, node.out_shape[1]))
            link = machine.link(_group_span(dist, over))
            for numbers in (st.forward, st.backward if needs_dx else 0):
                t += allreduce_time(numbers * count * machine.dtype_bytes, p, link, machine)
    if spec.reduces_channels and dist.split[1] > 1 and needs_dx:
        in_dist = required_input(node, dist, node.in_shape)
        dx_bytes = nbytes(max_local_shape(node.in_shape, in_dist), machine)
        link = machine.link(_group_span(dist, ["c"]))
        t += allreduce_time(dx_bytes, dist.split[1], link, machine)
    return t


def parameter_server_time(nbytes_: float, copies: int, copies_on_node: int, intra: Link, inter: Link
                          ) -> float:
    """Seconds to synchronise a weight block of ``nbytes_`` bytes held by ``copies`` ranks through one
    parameter server (Jia et al. 2018 §5.1, t_S): each copy sends its gradient to the server and receives the
    updated block back. The server is one of the copies (its own transfer is free). It takes the other
    ``copies_on_node - 1`` copies of its node one after another over ``intra`` and, at the same time, the
    ``copies - copies_on_node`` copies on other nodes one after another over ``inter`` (its node's NIC);
    then the same back::

        2 · max((copies_on_node - 1)(α_intra + nbytes_ β_intra),
                (copies - copies_on_node)(α_inter + nbytes_ β_inter))      # seconds

    (α: seconds per message, β: seconds per byte). Unlike a ring allreduce (2 (p-1)/p · nβ, nearly flat in
    p) this grows with the number of copies, which is what makes parameter-heavy layers prefer fewer copies
    under Jia et al.'s model."""
    if copies <= 1 or nbytes_ <= 0:
        return 0.0
    local = max(1, min(copies_on_node, copies))
    t_intra = (local - 1) * (intra.alpha_s + nbytes_ * intra.beta_s_per_byte)
    t_inter = (copies - local) * (inter.alpha_s + nbytes_ * inter.beta_s_per_byte)
    return 2 * max(t_intra, t_inter)


def gradient_sync_group(node: Node, dist: Distribution) -> int:
    """Ranks whose weight gradients are partial sums of the same weight block: the block group over every
    dimension but the output channels (the runtime sums over ``block_group(rank, non-channel dims)``), or
    over the samples alone where the weights are cut like the output in space too (``weights_spatial``).
    Leftover replicas of a distribution on fewer ranks than exist hold the same partial sums and reduce in
    their own, identical group at the same time, so they do not enlarge it."""
    if node.n_params == 0:
        return 1
    if layer_spec(node.type).weights_spatial:
        return dist.parts[0]
    return math.prod(p for i, p in enumerate(dist.parts) if i != 1)


def gradient_sync_time(node: Node, dist: Distribution, machine: MachineModel) -> float:
    """t_S: synchronisation of the local weight gradients over :func:`gradient_sync_group`, by the
    machine's ``gradient_sync`` scheme: ``allreduce`` (Dryden's BPa = AR(|P(D_C, D_F)|, I_F·I_C·K²)) or
    ``parameter_server`` (:func:`parameter_server_time`, point-to-point links). Depends on this layer's
    distribution only, so t_O stays a sum of per-layer and per-edge terms (the eliminations stay exact)."""
    group = gradient_sync_group(node, dist)
    if group <= 1:
        return 0.0
    block_bytes = ceil_div(node.n_params, weight_split(node, dist)) * machine.dtype_bytes
    # the group lies within one replica's consecutive block ranks: a layer on fewer ranks may stay in a node
    span = _group_span(dist, ["n"] if layer_spec(node.type).weights_spatial else
                       [d for d in dist.dim_names if d != "c"])
    if machine.gradient_sync == "parameter_server":
        # the group's members are spread evenly over the span; a node holds ranks_per_node of its ranks
        on_node = max(1, group * min(span, machine.ranks_per_node) // span)
        return parameter_server_time(block_bytes, group, on_node, machine.intra, machine.inter)
    return allreduce_time(block_bytes, group, machine.link(span), machine)


def optimizer_slots(optimizer: str | None) -> int:
    """Per-parameter state of the optimizer (momentum: 1, Adam: 2, plain SGD: 0)."""
    return {"adam": 2, "adamw": 2, "sgd": 1, "momentum": 1, "sgd_plain": 0}.get(str(optimizer or "sgd"), 1)


def layer_memory(node: Node, dist: Distribution, machine: MachineModel, reads_input: bool = False,
                 optimizer: str | None = "sgd") -> tuple[int, int]:
    """(persistent, transient) bytes per rank.

    Persistent: the output block (kept for backprop), a gathered input copy where the input's channel axis is
    replicated (conv/fc with split output channels, fc), the model input block for layers reading it, and
    weights + gradients + optimizer state of the local weight block. Transient: the error signals dL/dy and
    dL/dx of this layer and, for a stencil layer, the window (input block with its halo, rebuilt in the
    backward) and its gradient.
    """
    b = machine.dtype_bytes
    out_local = max_local_shape(node.out_shape, dist)
    in_dist = required_input(node, dist, node.in_shape)
    in_local = max_local_shape(node.in_shape, in_dist)
    persistent = math.prod(out_local) * b
    if in_dist.replicate or reads_input:
        persistent += math.prod(in_local) * b * len(node.in_shapes)
    if node.n_params:
        w = ceil_div(node.n_params, weight_split(node, dist)) * b
        persistent += w * (2 + optimizer_slots(optimizer))
    transient = (math.prod(out_local) + math.prod(in_local) * len(node.in_shapes)) * b
    if node.stencil is not None:  # the window (block and halo) and its gradient, in the backward
        padded = out_local if node.halo == "adjoint" else in_local
        geo = halo_geometry(node, dist)
        if geo is not None:
            widths, block, _ = geo
            padded = [e + lo + hi for e, (lo, hi) in zip(block, widths)]
        transient += 2 * math.prod(padded) * b
    return int(persistent), int(transient)


def input_time(shape: Sequence[int], dist: Distribution, machine: MachineModel) -> float:
    """Seconds for the slowest rank to read its block of the model input (``shape`` under ``dist``, the
    distribution the layer reading it needs) from the data set: the machine's measured entry keyed
    ``("input", block, block)``, 0 without one. Reading is work of the rank's own core (decoding, copying;
    h5py holds the GIL while it reads), so it is scaled like compute where ranks share cores."""
    block = max_local_shape(shape, dist)
    entry = machine.measured.get(("input", block, block))
    return 0.0 if entry is None else entry[0] * machine.compute_slowdown(dist.ranks)


def layer_cost(node: Node, dist: Distribution, machine: MachineModel, reads_input: bool = False,
               optimizer: str | None = "sgd") -> LayerCost:
    """All per-layer terms for ``node`` with output distribution ``dist``. ``reads_input``: the layer reads
    the model input, which needs no dL/dx, and reads its block of the input from the data set."""
    needs_dx = not reads_input
    f, bd, bw = compute_times(node, dist, machine, needs_dx)
    # where ranks share cores, their messages are copies through shared memory that those cores make, time-
    # sliced as their compute is: the same factor (1 with a compute slot, e.g. a GPU, per rank)
    slow = machine.compute_slowdown(dist.ranks)
    # every blocking exchange also waits for its partner's time slices lost to other work (a pass forward,
    # one backward where dL/dx is wanted): the measured sync_s of ranks computing in lockstep
    waits = (2 if needs_dx else 1) * machine.shared_at(dist.ranks)[1]
    halo = halo_time(node, dist, machine, needs_dx) * slow
    halo += waits if halo else 0.0
    internal = internal_comm_time(node, dist, machine, needs_dx) * slow
    internal += waits if internal else 0.0
    ar = gradient_sync_time(node, dist, machine) * slow
    pers, trans = layer_memory(node, dist, machine, reads_input, optimizer)
    inp = 0.0
    if reads_input:
        inp = input_time(node.in_shape, required_input(node, dist, node.in_shape), machine)
    return LayerCost(f, bd, bw, halo, internal, ar, pers, trans, inp)


# --------------------------------------------------------------------------------------------------------
# redistribution


@lru_cache(maxsize=8192)
def _boxes(dist: Distribution, shape: tuple[int, ...]) -> np.ndarray:
    """(ranks, ndim, 2) array of every rank's owned box (replicated axes: the whole extent), computed with
    the rank layout of :class:`lbannpy.dist.Distribution` (outer replica, then C-order grid coordinates)."""
    r = np.arange(dist.ranks) % math.prod(dist.split)
    coords = np.stack(np.unravel_index(r, dist.split), axis=1) if dist.ranks else np.zeros((0, dist.ndim))
    parts = np.array(dist.parts)
    coords = np.where(parts[None, :] == 1, 0, coords)
    n = np.array(shape)
    q, rem = n // parts, n % parts
    start = coords * q + np.minimum(coords, rem)
    stop = start + q + (coords < rem)
    return np.stack([start, stop], axis=2).astype(np.int64)


@lru_cache(maxsize=256)
def _stacked_boxes(shape: tuple, dists: tuple, active: tuple) -> np.ndarray:
    """Every rank's box of each of ``dists`` along the dimensions ``active``, stacked (candidate lists recur:
    an edge's sources are the destinations of its backward shuffle); int16/int32 to move less memory."""
    out = np.stack([_boxes(d, shape)[:, list(active)] for d in dists])
    return out.astype(np.int16 if max(shape) < 2 ** 15 else np.int32)


def shuffle_volume(shape: tuple[int, ...], src: Distribution, dst: Distribution) -> np.ndarray:
    """Elements each rank must receive to hold its ``dst`` box, given it holds its ``src`` box."""
    return _shuffle_arrays(shape, [src], [dst])[0][0, 0]


def _shuffle_arrays(shape: tuple[int, ...], srcs: Sequence[Distribution], dsts: Sequence[Distribution],
                    ranks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For every (src, dst) pair and rank: elements received and source blocks met (messages, own included).
    Arrays of shape (len(srcs), len(dsts), ranks); ``ranks`` (default all) keeps the first ranks only."""
    a = np.stack([_boxes(d, shape)[:ranks] for d in srcs])[:, None]  # (S, 1, P, nd, 2)
    b = np.stack([_boxes(d, shape)[:ranks] for d in dsts])[None, :]  # (1, D, P, nd, 2)
    lo = np.maximum(a[..., 0], b[..., 0])
    hi = np.minimum(a[..., 1], b[..., 1])
    overlap = np.clip(hi - lo, 0, None).prod(axis=-1)
    need = (b[..., 1] - b[..., 0]).prod(axis=-1)
    n = np.array(shape)
    q = np.stack([-(-n // np.array(d.parts)) for d in srcs])[:, None, None, :]  # (S, 1, 1, nd) block size
    peers = ((b[..., 1] - 1) // q - b[..., 0] // q + 1).prod(axis=-1)
    return need - overlap, peers


def shuffle_times(shape: tuple[int, ...], srcs: Sequence[Distribution], dsts: Sequence[Distribution],
                  machine: MachineModel) -> np.ndarray:
    """One-way all-to-all time for every (src, dst) pair: slowest rank's ``⌈log2(peers)⌉·α + received
    bytes·β`` (Bruck-style; an allgather is the case of ``dst`` replicating an axis of ``src``)."""
    link = machine.redistribution_link or machine.link(srcs[0].ranks)
    out = np.zeros((len(srcs), len(dsts)))
    # a rank's boxes depend on it only through rank % prod(split), so a pair's per-rank times repeat with
    # period lcm(prod(src.split), prod(dst.split)): the first `period` ranks give the exact maximum, and
    # pairs with replicas cost less than P evaluations (at thousands of ranks most pairs have replicas)
    periods = {}
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            if s != d:  # a distribution to itself moves nothing
                periods.setdefault(math.lcm(math.prod(s.split), math.prod(d.split)), []).append((i, j))
    if not periods:
        return out
    # only dimensions split on either side vary between ranks; the others overlap fully and cancel
    active = [k for k in range(len(shape)) if any(d.parts[k] > 1 for d in list(srcs) + list(dsts))]
    const = math.prod(int(shape[k]) for k in range(len(shape)) if k not in active)
    n = np.array([shape[k] for k in active])
    A = _stacked_boxes(tuple(shape), tuple(srcs), tuple(active))  # (S, P, nd', 2)
    B = _stacked_boxes(tuple(shape), tuple(dsts), tuple(active))
    Q = np.stack([-(-n // np.array([d.parts[k] for k in active])) for d in srcs]).astype(A.dtype)
    beta = machine.dtype_bytes * link.beta_s_per_byte
    for period, pairs in periods.items():
        ii = np.array([i for i, _ in pairs])
        jj = np.array([j for _, j in pairs])
        a, b = A[ii, :period], B[jj, :period]  # (pairs, period, nd', 2)
        lo, hi = b[..., 0], b[..., 1]
        overlap = np.maximum(np.minimum(a[..., 1], hi) - np.maximum(a[..., 0], lo), 0).prod(-1,
                                                                                         dtype=np.int64)
        vol = ((hi - lo).prod(-1, dtype=np.int64) - overlap) * const
        q = Q[ii][:, None, :]  # source block size
        peers = ((hi - 1) // q - lo // q + 1).prod(-1, dtype=np.int64)
        msgs = np.ceil(np.log2(np.maximum(peers, 2)))
        t = np.where(vol > 0, msgs * link.alpha_s + vol * beta, 0.0)
        out[ii, jj] = t.max(axis=-1)
    return out


def shuffle_time(shape: tuple[int, ...], src: Distribution, dst: Distribution, machine: MachineModel
                 ) -> float:
    """One-way all-to-all from ``src`` to ``dst`` (see :func:`shuffle_times`)."""
    if src == dst:
        return 0.0
    return float(shuffle_times(shape, [src], [dst], machine)[0, 0])


def redistribution_matrix(shape: tuple[int, ...], srcs: Sequence[Distribution], dsts: Sequence[Distribution],
                          machine: MachineModel) -> np.ndarray:
    """t_X for every (src, dst) pair: forward shuffle plus the backward shuffle of the error signal."""
    return _redistribution_matrix(tuple(shape), tuple(srcs), tuple(dsts), machine).copy()


@lru_cache(maxsize=4096)
def _redistribution_matrix(shape, srcs, dsts, machine) -> np.ndarray:
    t = shuffle_times(shape, srcs, dsts, machine) + shuffle_times(shape, dsts, srcs, machine).T
    t = t * np.array([machine.compute_slowdown(d.ranks) for d in dsts])[None, :]  # see redistribution_time
    waits = np.array([2 * machine.shared_at(d.ranks)[1] for d in dsts])[None, :]
    return t + np.where(t > 0, waits, 0.0)


def redistribution_time(shape: tuple[int, ...], src: Distribution, dst: Distribution,
                        machine: MachineModel) -> float:
    """t_X of an edge: the activation from ``src`` to ``dst`` forward, the error signal back from ``dst`` to
    ``src`` backward (partial sums are already reduced by the consumer); time-sliced where ranks share cores
    (see :func:`layer_cost`), each way also waiting the measured ``sync_s`` for the partners."""
    t = ((shuffle_time(shape, src, dst, machine) + shuffle_time(shape, dst, src, machine))
         * machine.compute_slowdown(dst.ranks))
    return t + 2 * machine.shared_at(dst.ranks)[1] if t > 0 else t


# --------------------------------------------------------------------------------------------------------
# Gholami et al. (2018) eq. 8: 1.5D model+batch parallel fully-connected layers


def fc_15d_comm_time(batch: int, dims: Sequence[int], p_r: int, p_c: int, link: Link,
                     dtype_bytes: int = 4) -> float:
    """Communication of ``len(dims)-1`` fully-connected layers ``d_0 -> d_1 -> ... -> d_L`` on a ``P = Pr×Pc``
    grid (weights split Pr ways, the batch Pc ways), eq. 8 of Gholami et al.::

        Σ_{i=1..L} (α⌈log Pr⌉ + β B/Pc (Pr-1)/Pr d_i)               forward all-gather of the outputs
      + 2 Σ_{i=2..L} (α⌈log Pr⌉ + β B/Pc (Pr-1)/Pr d_{i-1})         all-reduce of dL/dx
      + 2 Σ_{i=2..L} (α⌈log Pc⌉ + β (Pc-1)/Pc |W_i|/Pr)             all-reduce of dL/dW

    Sizes in elements, converted with ``dtype_bytes``; ``|W_i| = d_{i-1}·d_i``.
    """
    a, bb = link.alpha_s, link.beta_s_per_byte * dtype_bytes
    lr, lc = math.ceil(math.log2(p_r)) if p_r > 1 else 0, math.ceil(math.log2(p_c)) if p_c > 1 else 0
    L = len(dims) - 1
    t = sum(a * lr + bb * batch / p_c * (p_r - 1) / p_r * dims[i] for i in range(1, L + 1))
    t += 2 * sum(a * lr + bb * batch / p_c * (p_r - 1) / p_r * dims[i - 1] for i in range(2, L + 1))
    t += 2 * sum(a * lc + bb * (p_c - 1) / p_c * dims[i - 1] * dims[i] / p_r for i in range(2, L + 1))
    return t
