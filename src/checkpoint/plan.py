"""What each rank holds, writes and reads back: pieces, writers, save and restore plans (pure
arithmetic, usable for any rank of a simulated size), layer state tensors, and the format constants."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from lbannpy.backend import to_numpy
from lbannpy.layers.state import StateTensor, is_writer  # noqa: F401 (the layers' half of the format)

FORMAT = "lbannpy-checkpoint"
VERSION = 3  # 3: block checksums, checkpoint identity, index digest

Box = tuple


class CheckpointError(RuntimeError):
    pass


def assemble(comm, global_shape, box, local) -> np.ndarray:
    """Collective over ``comm``: the global tensor from every rank's (box, piece), on every rank. For tests
    and small tools only (it moves every piece to every rank); checkpoints never call it."""
    pieces = comm.allgather_obj((box, to_numpy(local)))
    out = np.zeros(global_shape, dtype=np.float64)
    for b, arr in pieces:
        out[tuple(slice(a, e) for a, e in b)] = arr
    return out


# -- pieces and the pure plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """One rank's block of one checkpointed tensor. ``writer`` marks the one rank that writes the block."""

    key: str
    global_shape: tuple
    box: Box
    writer: bool
    itemsize: int = 8

    @property
    def nbytes(self) -> int:
        return int(math.prod(e - a for a, e in self.box)) * self.itemsize


def param_pieces(params, optimizer, rank: int) -> list[Piece]:
    """This rank's pieces of every parameter and optimizer slot, in a fixed order (identical on every
    rank). Pure: needs no communicator."""
    out = []
    for p in params:
        w = is_writer(p.dist, p.reduce_dims, rank)
        item = np.dtype(p.value.dtype).itemsize
        out.append(Piece(f"params/{p.name}", tuple(p.global_shape), tuple(p.box), w, item))
        if optimizer is not None:
            for slot in sorted(optimizer.state[p.name]):
                out.append(Piece(f"optim/{p.name}/{slot}", tuple(p.global_shape), tuple(p.box), w, item))
    return out


def rank_pieces(params, optimizer, layers, rank: int) -> list[Piece]:
    """Every piece rank ``rank`` holds in a checkpoint (parameters, optimizer slots, layer state tensors),
    from a model built for that rank (e.g. against a recording communicator of any size). Not
    collective; the input of :func:`save_plan` and :func:`restore_plan`."""
    return param_pieces(params, optimizer, rank) + [pc for pc, _ in layer_state(layers)[1]]


@dataclass(frozen=True)
class SavePlan:
    """What one rank does in a save: bytes it writes, bytes that move into it over the network or from
    other ranks' files (rank 0 reads every shard's box table to build the index), and its peak extra
    memory (one host copy of one block at a time)."""

    rank: int
    held_bytes: int
    written_bytes: int
    received_bytes: int
    peak_extra_bytes: int


def save_plan(pieces: Sequence[Piece], rank: int, index_entries: int = 0) -> SavePlan:
    """Pure: the save work of ``rank`` from its own pieces. ``index_entries`` is the number of (tensor,
    block) rows of the whole checkpoint; only rank 0 reads them (2·ndim+1 int64 each)."""
    held = sum(p.nbytes for p in pieces)
    mine = [p for p in pieces if p.writer]
    written = sum(p.nbytes for p in mine)
    ndim = max((len(p.global_shape) for p in pieces), default=1)
    received = index_entries * 8 * (2 * ndim + 1) if rank == 0 else 0
    peak = max((p.nbytes for p in mine), default=0)
    return SavePlan(rank, held, written, received, peak)


def box_slices(box: Box, origin=None) -> tuple:
    """The slices of ``box`` (global ``(start, end)`` per dimension) in an array whose first element sits at
    global ``origin`` (default the global origin)."""
    origin = origin or [0] * len(box)
    return tuple(slice(a - o, e - o) for (a, e), o in zip(box, origin))


def blocks_meeting(boxes: np.ndarray, box: Box) -> np.ndarray:
    """Indices of the rows of ``boxes`` (an (n, ndim, 2) table) that intersect ``box`` (vectorised)."""
    if len(boxes) == 0:
        return np.zeros(0, dtype=np.int64)
    b = np.asarray(box, dtype=np.int64)
    lo = np.maximum(boxes[:, :, 0], b[:, 0])
    hi = np.minimum(boxes[:, :, 1], b[:, 1])
    return np.nonzero(np.all(hi > lo, axis=1))[0]


def restore_plan(index: dict, pieces: Sequence[Piece]) -> dict:
    """Pure: for each of a rank's pieces, the (shard, source box ∩ own box) reads it needs from a
    checkpoint whose ``index`` maps key -> (global_shape, boxes (n, ndim, 2), shards (n,)). Returns
    ``{"reads": {key: [(shard, box), ...]}, "read_bytes": int, "index_bytes": int}``."""
    reads, total, ib = {}, 0, 0
    for pc in pieces:
        _, boxes, shards = index[pc.key]
        ib += boxes.nbytes + shards.nbytes
        rows = blocks_meeting(boxes, pc.box)
        lst = []
        for i in rows:
            inter = tuple((max(int(a), x), min(int(e), y)) for (a, e), (x, y) in zip(boxes[i], pc.box))
            lst.append((int(shards[i]), tuple(map(tuple, boxes[i].tolist())), inter))
            total += int(math.prod(e - a for a, e in inter)) * pc.itemsize
        reads[pc.key] = lst
    return {"reads": reads, "read_bytes": total, "index_bytes": ib}


# -- layer state ---------------------------------------------------------------------------------------
class StateReader:
    """Handed to :meth:`Layer.load_state` for each tensor of its state: ``global_shape`` as written, and
    ``read(box)`` the written values in ``box`` (only the shards meeting ``box`` are opened)."""

    def __init__(self, key: str, global_shape: tuple, read: Callable[[str, Box], np.ndarray]):
        self.key = key
        self.global_shape = tuple(global_shape)
        self._read = read
        self._cache: dict = {}

    def read(self, box: Box) -> np.ndarray:
        box = tuple(tuple(int(v) for v in x) for x in box)
        for (a, e), s in zip(box, self.global_shape):
            if not 0 <= a <= e <= s:
                raise CheckpointError(f"{self.key}: box {box} outside the written shape {self.global_shape}")
        if box not in self._cache:  # read once: the layer's dry run and its real load share the reads
            self._cache[box] = self._read(self.key, box)
        return self._cache[box].copy()


def layer_state(layers) -> tuple[dict, list[tuple[Piece, Any]]]:
    """The layers' checkpointed state: plain numbers (``{layer: {name: value}}``) and tensors as pieces."""
    small, tensors = {}, []
    for layer in layers:
        st = layer.state()
        for name, v in st.items():
            if isinstance(v, StateTensor):
                key = f"state/{layer.name}/{name}"
                item = np.dtype(getattr(v.value, "dtype", np.float64)).itemsize
                tensors.append((Piece(key, tuple(v.global_shape), tuple(v.box), bool(v.writer), item),
                                v.value))
            else:
                small.setdefault(layer.name, {})[name] = v
    return small, tensors


# -- saving ----------------------------------------------------------------------------------------------
