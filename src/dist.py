"""Blocked distributions of tensors over a grid of ranks: pure index math.

Nothing here talks to a communicator. Every function answers for *any* rank, so plans (halo exchange,
redistribution) are computed identically on every rank, errors are raised identically on every rank, and
the geometry is testable without ``mpiexec``.

Conventions
-----------
* Tensor dimensions are named by rank of the tensor: ``(n, c)`` for fully-connected activations,
  ``(n, c, h, w)`` for 2-D images and ``(n, c, d, h, w)`` for 3-D volumes.
* A :class:`Distribution` gives a split degree per tensor dimension and the number of ranks it is laid on.
  ``prod(split)`` ranks hold distinct blocks; the remaining factor ``leftover = ranks // prod(split)``
  holds identical copies (a layer may use fewer ranks than exist, as in Jia et al.).
* Rank layout: ``rank = copy_index * nblocks + block``, with ``block`` the C-order linear index of the
  block coordinates. The spatial (last) dimensions vary fastest, so the ranks that share a sample are
  neighbours in rank order (usually on one node), and the copies of a block are contiguous groups.
* Blocks are as even as possible: ``extent = q * parts + r`` gives the first ``r`` blocks ``q + 1``
  elements. A block is a half-open box ``((start, stop), ...)`` in global coordinates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

DIM_NAMES = {
    2: ("n", "c"),
    3: ("n", "c", "w"),
    4: ("n", "c", "h", "w"),
    5: ("n", "c", "d", "h", "w"),
}

Box = tuple  # tuple[tuple[int, int], ...]: half-open (start, stop) per dimension


class DistributionError(ValueError):
    """A distribution, shape or plan that cannot work. The message names rank, shapes and the fix."""


# --------------------------------------------------------------------------------------------------------
# one-dimensional block partition


def block_range(extent: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open range of block ``index`` when ``extent`` elements are split into ``parts`` blocks."""
    q, r = divmod(extent, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def block_starts(extent: int, parts: int) -> list[int]:
    """Starts of all blocks plus the final stop (``parts + 1`` numbers)."""
    return [block_range(extent, parts, i)[0] for i in range(parts)] + [extent]


def block_owner(extent: int, parts: int, i: int) -> int:
    """Index of the block that holds global element ``i`` (``0 <= i < extent``)."""
    if not 0 <= i < extent:
        raise IndexError(f"element {i} outside [0, {extent})")
    q, r = divmod(extent, parts)
    big = r * (q + 1)  # elements held by the first r (larger) blocks
    if i < big:
        return i // (q + 1)
    return r + (i - big) // q


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or ``None`` when it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def box_contains(outer: Box, inner: Box) -> bool:
    """True when every element of ``inner`` lies in ``outer`` (an empty ``inner`` lies everywhere)."""
    if any(hi <= lo for lo, hi in inner):
        return True
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def clip_box(box: Box, global_shape: Sequence[int]) -> Box | None:
    """The part of ``box`` inside the tensor ``[0, n)`` per dimension, or ``None`` when it is empty."""
    return intersect(box, tuple((0, int(n)) for n in global_shape))


def box_subtract(outer: Box, inner: Box) -> list[Box]:
    """Disjoint boxes that together cover ``outer`` minus ``inner`` exactly (at most ``2 * ndim`` slabs).

    Slab ``d`` is cut along dimension ``d`` and spans, in the dimensions before ``d``, only the range
    ``inner`` covers; so the slabs do not overlap and each is a single box (halo faces, then edges and
    corners fall into the slab of the first dimension they stick out of).
    """
    cut = intersect(outer, inner)
    if cut is None:
        return [tuple(outer)] if box_size(outer) else []
    out = []
    cur = list(outer)
    for d, ((o0, o1), (c0, c1)) in enumerate(zip(outer, cut)):
        if o0 < c0:
            out.append(tuple(cur[:d] + [(o0, c0)] + cur[d + 1:]))
        if c1 < o1:
            out.append(tuple(cur[:d] + [(c1, o1)] + cur[d + 1:]))
        cur[d] = (c0, c1)
    return out


def relative_slices(inner: Box, outer_origin: Sequence[int]) -> tuple[slice, ...]:
    """Slices selecting ``inner`` (global coordinates) from an array whose element 0 is at
    ``outer_origin``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inner, outer_origin))


# --------------------------------------------------------------------------------------------------------
# convolution geometry (per spatial dimension)


@dataclass(frozen=True)
class ProcessGrid:
    """Ranks arranged in a C-order grid of the given shape (``ranks == prod(shape)``)."""

    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise DistributionError(f"rank {rank} outside a grid of {self.size} ranks {self.shape}")
        out = []
        for extent in reversed(self.shape):
            rank, c = divmod(rank, extent)
            out.append(c)
        return tuple(reversed(out))

    def rank(self, coords: Sequence[int]) -> int:
        r = 0
        for c, extent in zip(coords, self.shape):
            if not 0 <= c < extent:
                raise DistributionError(f"coordinates {tuple(coords)} outside grid {self.shape}")
            r = r * extent + c
        return r


@dataclass(frozen=True)
class Distribution:
    """Split degree per tensor dimension, laid on ``ranks`` ranks (the leftover factor holds copies).

    ``split[i]`` is the extent of the process grid along tensor dimension ``i``. A grid axis listed in
    ``replicate`` does not partition its dimension: every rank along that axis holds the whole extent
    (DESIGN: "which grid axes replicate"). This keeps the rank layout of two related distributions
    aligned: the input of a 1.5D fully-connected layer is ``n=Pc`` split with the ``c`` axis (``Pr`` ranks)
    replicated, laid out exactly like its output ``n=Pc, c=Pr``.

    Rank layout: ``rank = outer * prod(split) + C-order index of the grid coordinates``, with
    ``outer < leftover = ranks // prod(split)``. A *block* is a distinct piece of the tensor (partitioned
    coordinates only); a *copy index* enumerates the ranks holding the same block (``outer``, then the
    coordinates on replicated axes).

    Vocabulary (one word, one meaning, used this way everywhere in lbannpy):

    * ``split``: the extent of the process grid along each tensor dimension, replicated axes included;
    * ``parts``: how many pieces each dimension is actually cut into (1 on a replicated axis), so
      ``parts == split`` without ``replicate``; ``parts_of(name)`` is ``parts`` of one dimension and
      ``degrees()`` the ``{name: parts}`` of the cut dimensions (what a spec's ``parallel`` entry holds);
    * ``replicate``: the grid axes that hold copies instead of pieces (the only use of the word here);
      ``leftover``: the factor ``ranks // prod(split)`` of whole-grid copies; ``copies``: how many ranks
      hold each block (both kinds of copies together); ``copy_index(rank)``: that rank's index among
      them; ``Distribution.whole``: the distribution in which every rank holds the whole tensor;
    * "replicated" elsewhere in lbannpy names Lee et al.'s replicated fully-connected gradients
      (``comm.replicate_fc``), not a distribution;
    * a *plan* (halo, shuffle, bucket, checkpoint) is what one rank does, computed once from shapes.

    >>> d = Distribution.make(4, ranks=4, n=2, h=2); str(d)
    'n2·h2'
    >>> d.local_shape((5, 3, 17, 23), rank=3)
    (2, 3, 8, 23)
    """

    split: tuple[int, ...]
    ranks: int
    replicate: tuple[int, ...] = ()

    def __post_init__(self):
        split = tuple(int(s) for s in self.split)
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "replicate", tuple(sorted(set(int(i) for i in self.replicate))))
        if len(split) not in DIM_NAMES:
            raise DistributionError(f"tensors of rank {len(split)} are not supported (2 to 5 dimensions)")
        if any(s < 1 for s in split):
            raise DistributionError(f"split degrees must be >= 1, got {self._fmt()}")
        if any(not 0 <= i < len(split) for i in self.replicate):
            raise DistributionError(f"replicated axes {self.replicate} outside a rank-{len(split)} tensor")
        if self.ranks < 1:
            raise DistributionError(f"a distribution needs at least one rank, got {self.ranks}")
        ng = math.prod(split)
        if ng > self.ranks:
            raise DistributionError(
                f"distribution {self._fmt()} needs {ng} ranks but only {self.ranks} exist; "
                f"lower the split degrees or run on more ranks")
        if self.ranks % ng:
            raise DistributionError(
                f"distribution {self._fmt()} uses {ng} ranks, which does not divide the {self.ranks} ranks "
                f"that exist; choose degrees whose product divides {self.ranks}")

    # -- construction and naming
    @classmethod
    def make(cls, ndim: int, ranks: int, replicate: Iterable[str] = (), **degrees: int) -> "Distribution":
        """``Distribution.make(4, ranks=8, n=2, h=2)``; unnamed dimensions are not split.
        ``replicate=["c"]`` makes the ``c`` grid axis hold copies instead of pieces."""
        names = DIM_NAMES.get(ndim)
        if names is None:
            raise DistributionError(f"tensors of rank {ndim} are not supported (2 to 5 dimensions)")
        unknown = (set(degrees) | set(replicate)) - set(names)
        if unknown:
            raise DistributionError(
                f"unknown dimension(s) {sorted(unknown)} for a rank-{ndim} tensor; use {list(names)}")
        return cls(tuple(int(degrees.get(n, 1)) for n in names), ranks,
                   tuple(names.index(n) for n in replicate))

    @classmethod
    def whole(cls, ndim: int, ranks: int) -> "Distribution":
        """Every rank holds the whole tensor (nothing is cut)."""
        return cls((1,) * ndim, ranks)

    @property
    def ndim(self) -> int:
        return len(self.split)

    @property
    def dim_names(self) -> tuple[str, ...]:
        return DIM_NAMES[self.ndim]

    @property
    def parts(self) -> tuple[int, ...]:
        """How many pieces each tensor dimension is cut into (1 on replicated axes)."""
        return tuple(1 if i in self.replicate else s for i, s in enumerate(self.split))

    @property
    def nblocks(self) -> int:
        """Number of distinct blocks."""
        return math.prod(self.parts)

    @property
    def copies(self) -> int:
        """Number of ranks holding each block."""
        return self.ranks // self.nblocks

    @property
    def leftover(self) -> int:
        """The ranks left over by the grid: ``ranks // prod(split)`` copies of the whole grid."""
        return self.ranks // math.prod(self.split)

    @property
    def grid(self) -> ProcessGrid:
        """Grid of shape ``(leftover, *split)``."""
        return ProcessGrid((self.leftover,) + self.split)

    def degrees(self) -> dict[str, int]:
        return {n: s for i, (n, s) in enumerate(zip(self.dim_names, self.split)) if s > 1
                and i not in self.replicate}

    def parts_of(self, name: str) -> int:
        """Number of pieces along dimension ``name``."""
        return self.parts[self.dim_names.index(name)]

    def with_ranks(self, ranks: int) -> "Distribution":
        return Distribution(self.split, ranks, self.replicate)

    def _fmt(self) -> str:
        names = DIM_NAMES.get(len(self.split), tuple(f"x{i}" for i in range(len(self.split))))
        parts = []
        for i, (n, s) in enumerate(zip(names, self.split)):
            if s != 1:
                parts.append(f"{n}(r{s})" if i in self.replicate else f"{n}{s}")
        return "·".join(parts) if parts else "1"

    def __str__(self) -> str:
        s = self._fmt()
        rep = self.leftover
        return s if rep == 1 else (f"r{rep}" if s == "1" else f"{s}×r{rep}")

    # -- rank <-> grid, block and copy
    def grid_coords(self, rank: int) -> tuple[int, ...]:
        """Grid coordinates (one per tensor dimension, replicated axes included) of ``rank``."""
        return self.grid.coords(rank)[1:]

    def coords(self, rank: int) -> tuple[int, ...]:
        """Block coordinates (one per tensor dimension; 0 on replicated axes) of ``rank``."""
        g = self.grid_coords(rank)
        return tuple(0 if i in self.replicate else c for i, c in enumerate(g))

    def copy_index(self, rank: int) -> int:
        """Index of ``rank`` among the ranks holding its block (0 .. copies-1)."""
        full = self.grid.coords(rank)
        r = full[0]
        for i in self.replicate:
            r = r * self.split[i] + full[1 + i]
        return r

    def rank_of(self, coords: Sequence[int], copy_index: int = 0) -> int:
        """Rank holding block ``coords`` as its copy number ``copy_index``."""
        if not 0 <= copy_index < self.copies:
            raise DistributionError(f"copy {copy_index} outside 0..{self.copies - 1} of {self}")
        g = list(coords)
        outer = copy_index
        for i in reversed(self.replicate):
            outer, g[i] = divmod(outer, self.split[i])
        return self.grid.rank((outer,) + tuple(g))

    def block_ranks(self, coords: Sequence[int]) -> list[int]:
        """All ranks that hold the block at ``coords`` (one per copy)."""
        return [self.rank_of(coords, r) for r in range(self.copies)]

    def group(self, rank: int, dims: Iterable[str]) -> list[int]:
        """Ranks whose grid coordinates differ from ``rank``'s only along ``dims`` (same ``outer`` copy of
        the grid), in rank order.

        ``group(r, ["h", "w"])`` is the spatial group of a sample block (batch-norm statistics);
        ``group(r, ["n"])`` the ranks that hold the other samples of the same spatial block; on a
        replicated axis, ``group(r, ["c"])`` are the ranks that hold copies along ``c``.
        """
        idx = {self.dim_names.index(d) for d in dims}
        full = self.grid.coords(rank)
        out = []
        for r in range(math.prod(self.split)):
            g = self.grid.coords(r)[1:]
            if all(g[i] == full[1 + i] for i in range(self.ndim) if i not in idx):
                out.append(self.grid.rank((full[0],) + g))
        return out

    def block_group(self, rank: int, dims: Iterable[str] | None = None) -> list[int]:
        """Ranks of ``rank``'s copy index whose *block* coordinates differ from ``rank``'s only along
        ``dims`` (default: all dimensions), in block order.

        This is the group over which per-block partial sums are reduced exactly once: a weight gradient
        over ``["n", "h", "w"]``, a loss over all dimensions. Copies on replicated axes and leftover
        copies fall in different groups, each of which computes the same reduction.
        """
        names = self.dim_names if dims is None else tuple(dims)
        idx = {self.dim_names.index(d) for d in names}
        mine = self.coords(rank)
        rep = self.copy_index(rank)
        out = []
        for b in range(self.nblocks):
            c = _unravel(b, self.parts)
            if all(c[i] == mine[i] for i in range(self.ndim) if i not in idx):
                out.append(self.rank_of(c, rep))
        return out

    # -- groups without listing them: O(ndim) per rank
    def group_spec(self, rank: int, dims: Iterable[str]) -> "GroupSpec":
        """``rank``'s group of :meth:`group` (grid coordinates vary only along ``dims``, same ``outer``
        copy of the grid), described in O(ndim): colour, size and position, no member list."""
        idx = {self.dim_names.index(d) for d in dims}
        return GroupSpec.of(self.grid.shape, {1 + i for i in idx}, rank)

    def block_group_spec(self, rank: int, dims: Iterable[str] | None = None) -> "GroupSpec":
        """``rank``'s group of :meth:`block_group` in O(ndim): block coordinates vary along ``dims``
        (replicated axes and the outer replica stay fixed, so each replica index forms its own groups)."""
        names = self.dim_names if dims is None else tuple(dims)
        idx = {self.dim_names.index(d) for d in names}
        return GroupSpec.of(self.grid.shape, {1 + i for i in idx if i not in self.replicate}, rank)

    # -- shapes and boxes
    def check_shape(self, global_shape: Sequence[int], what: str = "tensor") -> None:
        """Refuse shapes that leave a block empty (a split degree larger than the extent)."""
        if len(global_shape) != self.ndim:
            raise DistributionError(
                f"{what} of shape {tuple(global_shape)} has {len(global_shape)} dimensions but distribution "
                f"{self} has {self.ndim}")
        for name, n, s in zip(self.dim_names, global_shape, self.parts):
            if n < s:
                raise DistributionError(
                    f"{what} of shape {tuple(global_shape)} cannot be split {s} ways along '{name}' "
                    f"(extent {n}): ranks would hold empty blocks under distribution {self}; lower the "
                    f"'{name}' degree to at most {n}")

    def box(self, global_shape: Sequence[int], rank: int) -> Box:
        """Half-open box of global indices owned by ``rank``."""
        return tuple(block_range(n, p, c) for n, p, c in zip(global_shape, self.parts, self.coords(rank)))

    def local_shape(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return box_shape(self.box(global_shape, rank))

    def offsets(self, global_shape: Sequence[int], rank: int) -> tuple[int, ...]:
        return tuple(lo for lo, _ in self.box(global_shape, rank))

    def owner_coords(self, global_shape: Sequence[int], index: Sequence[int]) -> tuple[int, ...]:
        """Block coordinates of the block holding global element ``index``."""
        return tuple(block_owner(n, p, i) for n, p, i in zip(global_shape, self.parts, index))

    def blocks_meeting(self, global_shape: Sequence[int], box: Box) -> list[tuple[int, ...]]:
        """Block coordinates of every block that intersects ``box`` (clipped to the tensor), C order."""
        ranges = []
        for n, s, (lo, hi) in zip(global_shape, self.parts, box):
            lo, hi = max(lo, 0), min(hi, n)
            if lo >= hi:
                return []
            ranges.append(range(block_owner(n, s, lo), block_owner(n, s, hi - 1) + 1))
        out = [()]
        for r in ranges:
            out = [c + (i,) for c in out for i in r]
        return out


@dataclass(frozen=True)
class GroupSpec:
    """One rank's group in a partition of the ranks of a C-order grid into the sub-grids that vary along
    some axes: what ``comm.split(color, key=rank)`` needs, computed in O(ndim) per rank.

    ``key`` names the partition and is identical on every rank (two distributions or dimension lists that
    cut the ranks the same way have the same key: axes of extent 1 are dropped and neighbouring axes of
    the same kind merged); ``color`` is the smallest rank of the group (the same on all its members);
    ``size`` its number of ranks; ``index`` this rank's position in it (members are in rank order).
    ``members()`` lists the group (O(size), for tests and for backends that need the list).
    """

    key: tuple
    color: int
    size: int
    index: int
    runs: tuple  # ((extent, stride, varying), ...) of the merged axes

    @classmethod
    def of(cls, shape: Sequence[int], varying: set, rank: int) -> "GroupSpec":
        merged: list[list] = []  # [extent, varying] runs of axes, slowest first
        for a, extent in enumerate(shape):
            if extent == 1:
                continue
            v = a in varying
            if merged and merged[-1][1] == v:
                merged[-1][0] *= extent
            else:
                merged.append([extent, v])
        total = math.prod(shape)
        if not 0 <= rank < total:
            raise DistributionError(f"rank {rank} outside a grid of {total} ranks {tuple(shape)}")
        runs, stride = [], 1
        for extent, v in reversed(merged):
            runs.append((extent, stride, v))
            stride *= extent
        runs.reverse()
        color, size, index = rank, 1, 0
        for extent, stride, v in runs:
            if v:
                c = rank // stride % extent
                color -= c * stride
                index = index * extent + c
                size *= extent
        key = (total,) + tuple((e, v) for e, v in merged)
        return cls(key, color, size, index, tuple(runs))

    def members(self) -> list[int]:
        out = [self.color]
        for extent, stride, v in self.runs:
            if v:
                out = [m + c * stride for m in out for c in range(extent)]
        return out


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for extent in reversed(shape):
        index, c = divmod(index, extent)
        out.append(c)
    return tuple(reversed(out))


def empty_block(dist: "Distribution", global_shape: Sequence[int]) -> tuple[int, int] | None:
    """The first rank (in rank order) whose block of ``global_shape`` is empty, and the dimension in which
    it is, or ``None`` when every block holds data.

    Every rank that asks gets the same answer and can raise the same error without talking to the
    others. O(ndim), not a loop over ranks: along dimension ``d`` the blocks ``c >= extent`` are the empty
    ones, so the first empty rank sits at coordinate ``extent`` of one dimension and 0 elsewhere
    (:func:`empty_block_brute` is the every-rank reference the tests compare it with).
    """
    first = None
    for d, (n, p) in enumerate(zip(global_shape, dist.parts)):
        n = int(n)
        if n < p:  # blocks 0..n-1 hold one element each, blocks n.. none
            coords = tuple(n if i == d else 0 for i in range(dist.ndim))
            r = dist.rank_of(coords, 0)
            if first is None or r < first:
                first = r
    if first is None:
        return None
    for d, (lo, hi) in enumerate(dist.box(global_shape, first)):
        if hi <= lo:
            return first, d
    raise AssertionError("unreachable: the first empty rank has an empty dimension")  # pragma: no cover


def empty_block_brute(dist: "Distribution", global_shape: Sequence[int]) -> tuple[int, int] | None:
    """:func:`empty_block` by looping over every rank (O(P)); the reference for tests, never for plans."""
    for r in range(dist.ranks):
        for d, (lo, hi) in enumerate(dist.box(global_shape, r)):
            if hi <= lo:
                return r, d
    return None


def max_local_shape(shape: Sequence[int], dist: "Distribution") -> tuple[int, ...]:
    """Shape of the largest block of ``shape`` under ``dist`` (the slowest rank's share): the cost model
    prices it, the reader sizes its buffers by it."""
    return tuple(-(-n // p) for n, p in zip(shape, dist.parts))


def shape_str(shape: Sequence[int]) -> str:
    return "×".join(str(int(s)) for s in shape)
