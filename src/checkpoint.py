"""Checkpoints that scale: each unique block written once, read back by hyperslab on any rank count.

Layout (version 2) of one checkpoint, the directory ``ckpt-<step>/``:

* ``shard-<rank>.h5``, one per writing rank: the blocks that rank writes, each a dataset named by its
  tensor key (``params/<param>``, ``optim/<param>/<slot>``, ``state/<layer>/<name>``) with its ``box`` (the
  block's place in the global tensor) as an attribute. A block is written by exactly one of the ranks
  holding it: replica 0 of the block (:func:`is_writer`), so replicated weights are written once, not P
  times. Like PyTorch Distributed Checkpoint, the reader assembles.
* with parallel HDF5 (h5py built with MPI, ``driver='mpio'``) instead one ``data.h5`` holding every tensor
  in its global shape, each writer writing its hyperslab (also used at one rank, without MPI);
* ``index.h5``, written by rank 0 once every shard is on disk: format, version, step, optimizer steps, the
  small metadata (reader position, metric rows, layer counters) as JSON, and per tensor its global shape
  and the (box, shard) table of its blocks. Rank 0 builds that table from the shard files, and checks that
  the blocks tile each tensor exactly (no block missing, none twice).

Saving moves no tensor data between ranks: a writer writes what it holds (per-rank memory: its own
shard, plus one host copy when it lives on a GPU). Restoring, each rank reads the index and then only the
parts of the shards that intersect its own boxes, so resuming on another rank count or distribution costs
each rank its own shard. :func:`save_plan` and :func:`restore_plan` are that arithmetic as pure functions
of a rank's pieces, usable for any rank of any simulated size.

Atomicity: everything is written into ``ckpt-<step>.tmp/``; after a barrier (every shard flushed and
fsynced) rank 0 writes the index, fsyncs it and renames the directory. A half-written checkpoint therefore
never carries a final name; the newest complete one wins on resume, and one that fails to read (on any
rank) is reported and the previous one tried. Nothing is pickled or evaluated: files hold datasets and
attributes, metadata is JSON, and sizes read from files are checked before anything is allocated.

Version 1 checkpoints (one file ``ckpt-<step>.h5`` of global tensors) are still read.
"""
from __future__ import annotations

import copy
import glob
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import h5py
import numpy as np

from lbannpy.backend import to_numpy

FORMAT = "lbannpy-checkpoint"
VERSION = 2
_V1_NAME = re.compile(r"ckpt-(\d{8})\.h5$")
_V2_NAME = re.compile(r"ckpt-(\d{8})$")
_MAX_NDIM = 8
_MAX_ELEMENTS = 1 << 40  # refuses absurd shapes read from a damaged index before allocating anything
_MAX_BLOCKS = 1 << 24  # blocks of one tensor in an index (one per writing rank at most)

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


def is_writer(dist, reduce_dims: Sequence[str], rank: int) -> bool:
    """Whether ``rank`` writes its block of a tensor laid out by ``dist`` whose block depends only on
    the coordinates outside ``reduce_dims``: replica 0 of the block, coordinate 0 along ``reduce_dims``.
    O(ndim), pure. (A block rule this misjudges is caught when the index is built: blocks must tile.)"""
    if dist.replica(rank) != 0:
        return False
    coords = dist.coords(rank)
    names = dist.dim_names
    return all(coords[names.index(d)] == 0 for d in reduce_dims)


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
    return param_pieces(params, optimizer, rank) + [pc for pc, _ in _layer_state(layers)[1]]


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
@dataclass(frozen=True)
class StateTensor:
    """A layer's non-parameter tensor in a checkpoint: this rank's ``value`` is block ``box`` of a
    ``global_shape`` tensor, written by the rank marked ``writer`` (see :meth:`Layer.state`)."""

    global_shape: tuple
    box: Box
    value: Any
    writer: bool


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


def _layer_state(layers) -> tuple[dict, list[tuple[Piece, Any]]]:
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
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def parallel_hdf5(comm) -> bool:
    """Whether one shared file can be written with ``driver='mpio'``: h5py built with MPI and an MPI
    communicator underneath ``comm``."""
    return bool(getattr(h5py.get_config(), "mpi", False)) and getattr(comm, "backend", "") == "mpi"


def _box_slices(box: Box, origin=None) -> tuple:
    origin = origin or [0] * len(box)
    return tuple(slice(a - o, e - o) for (a, e), o in zip(box, origin))


def save(comm, directory: str, step: int, params, optimizer, meta: dict, layers=()) -> str | None:
    """Collective over ``comm`` (every rank, same params and layers in the same order): write checkpoint
    ``step``. Each unique block is written once; no tensor data moves between ranks. ``meta`` (small,
    JSON) and each layer's plain-number state are written by rank 0. Returns the final path on every rank.
    Raises :class:`CheckpointError` on every rank when any rank failed to write."""
    pieces = [(pc, p_val) for pc, p_val in _param_values(params, optimizer, comm.rank)]
    small, state = _layer_state(layers)
    pieces += state
    final = os.path.join(directory, f"ckpt-{step:08d}")
    tmp = final + ".tmp"
    err = None
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            err = f"cannot create {tmp}: {exc}"
    err = comm.bcast_obj(err)
    if err:
        raise CheckpointError(err)
    single = comm.size == 1 or parallel_hdf5(comm)
    err = None
    try:
        if single:
            _write_single(comm, tmp, pieces)
        else:
            _write_shard(comm.rank, tmp, pieces)
    except (OSError, ValueError) as exc:
        err = f"rank {comm.rank}: writing its checkpoint shard into {tmp} failed: {exc}"
    bad = comm.allreduce_obj(err is not None, op="or")  # every shard is on disk (fsynced) past this point
    if bad:
        raise CheckpointError(err or f"another rank failed to write its checkpoint shard into {tmp}")
    err = None
    if comm.rank == 0:
        try:
            index = _index_single(tmp, pieces) if single else _index_from_shards(tmp, [p for p, _ in pieces])
            _write_index(tmp, step, optimizer, meta, small, index, "single" if single else "shards",
                         comm.size)
            _fsync_dir(tmp)  # the shard files' directory entries are durable before the rename
            if os.path.exists(final):  # an older complete checkpoint of the same step is replaced
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(directory)
        except (OSError, ValueError, CheckpointError) as exc:
            err = f"writing the checkpoint index {tmp}/index.h5 failed: {exc}"
    err = comm.bcast_obj(err)
    if err:
        raise CheckpointError(err)
    return final


def _param_values(params, optimizer, rank):
    pcs = param_pieces(params, optimizer, rank)
    vals = []
    for p in params:
        vals.append(p.value)
        if optimizer is not None:
            for slot in sorted(optimizer.state[p.name]):
                vals.append(optimizer.state[p.name][slot])
    return zip(pcs, vals)


def _write_shard(rank: int, tmp: str, pieces) -> None:
    mine = [(pc, v) for pc, v in pieces if pc.writer]
    if not mine:
        return
    path = os.path.join(tmp, f"shard-{rank:06d}.h5")
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["rank"] = rank
        for pc, v in mine:  # one host copy of one block at a time
            ds = f.create_dataset(pc.key, data=to_numpy(v))
            ds.attrs["box"] = np.asarray(pc.box, dtype=np.int64).reshape(len(pc.box), 2)
            ds.attrs["global_shape"] = np.asarray(pc.global_shape, dtype=np.int64)
        f.flush()
    _fsync_file(path)


def _write_single(comm, tmp: str, pieces) -> None:
    """Every rank opens one file (``mpio`` when there are several) and creates every dataset in the same
    order (collective in parallel HDF5); each writer then writes its hyperslab."""
    path = os.path.join(tmp, "data.h5")
    kw = {"driver": "mpio", "comm": comm._comm} if comm.size > 1 else {}
    with h5py.File(path, "w", **kw) as f:
        dsets = [f.create_dataset(pc.key, shape=pc.global_shape, dtype=np.dtype(v.dtype)) for pc, v in pieces]
        for ds, (pc, v) in zip(dsets, pieces):
            if pc.writer:
                ds[_box_slices(pc.box)] = to_numpy(v)
        f.flush()
    if comm.rank == 0:
        _fsync_file(path)


def _index_single(tmp: str, pieces) -> dict:
    return {pc.key: (tuple(pc.global_shape), np.asarray([[(0, s) for s in pc.global_shape]], dtype=np.int64)
                     .reshape(1, len(pc.global_shape), 2), np.asarray([-1], dtype=np.int64))
            for pc, _ in pieces}


def _index_from_shards(tmp: str, pieces: Sequence[Piece]) -> dict:
    """Rank 0: the (box, shard) table of every tensor, read from the shard files' box attributes (only
    the tables, no data), checked to tile each tensor exactly."""
    want = {pc.key: tuple(pc.global_shape) for pc in pieces}
    rows: dict[str, list] = {k: [] for k in want}
    for path in sorted(glob.glob(os.path.join(tmp, "shard-*.h5"))):
        rank = int(re.search(r"shard-(\d+)\.h5$", path).group(1))
        with h5py.File(path, "r") as f:
            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    if name not in rows:
                        raise CheckpointError(f"{path}: unexpected tensor {name}")
                    rows[name].append((np.asarray(obj.attrs["box"], dtype=np.int64), rank))
            f.visititems(visit)
    index = {}
    for key, gshape in want.items():
        if not rows[key]:
            raise CheckpointError(f"no rank wrote tensor {key}")
        boxes = np.stack([b for b, _ in rows[key]])
        shards = np.asarray([r for _, r in rows[key]], dtype=np.int64)
        vol = int(np.prod(boxes[:, :, 1] - boxes[:, :, 0], axis=1).sum())
        if vol != math.prod(gshape) or len({b.tobytes() for b in boxes}) != len(boxes):
            raise CheckpointError(f"the blocks written of {key} (shape {gshape}) do not tile it: "
                                  f"{len(boxes)} "
                                  f"blocks of {vol} elements in all; a layer's block does not follow its "
                                  f"writer rule (checkpoint.is_writer)")
        index[key] = (gshape, boxes, shards)
    return index


def _write_index(tmp, step, optimizer, meta, small, index, layout, nranks) -> None:
    path = os.path.join(tmp, "index.h5")
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["layout"] = layout
        f.attrs["ranks"] = int(nranks)
        f.attrs["step"] = int(step)
        f.attrs["optimizer_steps"] = int(optimizer.t) if optimizer is not None else 0
        f.attrs["meta"] = json.dumps(dict(meta, layers=small), sort_keys=True)
        g = f.create_group("tensors")
        for i, (key, (gshape, boxes, shards)) in enumerate(index.items()):
            t = g.create_group(f"t{i:06d}")
            t.attrs["key"] = key
            t.attrs["global_shape"] = np.asarray(gshape, dtype=np.int64)
            t.create_dataset("boxes", data=boxes)
            t.create_dataset("shards", data=shards)
        f.flush()
    _fsync_file(path)


# -- reading ---------------------------------------------------------------------------------------------
def candidates(directory: str) -> list[str]:
    """Complete checkpoints (directories of version 2, files of version 1), newest first; temporary
    directories and files of interrupted writes are ignored."""
    found = []
    for path in glob.glob(os.path.join(directory, "ckpt-*")):
        m2 = _V2_NAME.search(path)
        m1 = _V1_NAME.search(path)
        if m2 and os.path.isdir(path):
            found.append((int(m2.group(1)), 1, path))
        elif m1 and os.path.isfile(path):
            found.append((int(m1.group(1)), 0, path))
    return [p for _, _, p in sorted(found, reverse=True)]


def _check_shape(shape, what: str) -> tuple:
    shape = tuple(int(s) for s in np.asarray(shape).ravel())
    if len(shape) > _MAX_NDIM or any(s < 0 for s in shape) or math.prod(shape) > _MAX_ELEMENTS:
        raise CheckpointError(f"{what}: implausible shape {shape}")
    return shape


class Checkpoint:
    """An opened checkpoint (either version): its step, metadata, tensor index and a hyperslab reader.
    Opening reads the index only; :meth:`read` opens the shards a box meets (kept open until
    :meth:`close`)."""

    def __init__(self, path: str):
        self.path = path
        self._files: dict = {}
        if os.path.isdir(path):
            self._open_v2(path)
        else:
            self._open_v1(path)

    def _open_v2(self, path):
        ipath = os.path.join(path, "index.h5")
        with h5py.File(ipath, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{ipath} is not an lbannpy checkpoint index")
            version = int(f.attrs.get("version", -1))
            if version != VERSION:
                raise CheckpointError(f"{path} has checkpoint version {version}; this lbannpy reads 1 and "
                                      f"{VERSION}")
            self.layout = str(f.attrs["layout"])
            if self.layout not in ("single", "shards"):
                raise CheckpointError(f"{ipath}: unknown layout {self.layout!r}")
            self.step = int(f.attrs["step"])
            self.optimizer_steps = int(f.attrs["optimizer_steps"])
            self.meta = json.loads(str(f.attrs["meta"]))
            self.index = {}
            for t in f["tensors"].values():
                key = str(t.attrs["key"])
                gshape = _check_shape(t.attrs["global_shape"], f"{ipath} tensor {key}")
                bds, sds = t["boxes"], t["shards"]
                n = sds.shape[0] if sds.ndim == 1 else -1
                if n < 0 or bds.shape != (n, len(gshape), 2) or n > _MAX_BLOCKS:
                    raise CheckpointError(f"{ipath} tensor {key}: box table of shape {bds.shape} does not "
                                          f"match {n} blocks of a rank-{len(gshape)} tensor")
                boxes = np.asarray(bds[()], dtype=np.int64)
                hi = np.asarray(gshape, dtype=np.int64)
                if np.any(boxes[:, :, 0] < 0) or np.any(boxes[:, :, 1] > hi) or np.any(
                        boxes[:, :, 0] > boxes[:, :, 1]):
                    raise CheckpointError(f"{ipath} tensor {key}: a block lies outside shape {gshape}")
                self.index[key] = (gshape, boxes, np.asarray(sds[()], dtype=np.int64))

    def _open_v1(self, path):
        self.layout = "v1"
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not an lbannpy checkpoint "
                                      f"(format {f.attrs.get('format')!r})")
            version = int(f.attrs.get("version", -1))
            if version != 1:
                raise CheckpointError(f"{path} has checkpoint version {version}; this lbannpy reads 1 and "
                                      f"{VERSION}")
            self.step = int(f.attrs["step"])
            self.optimizer_steps = int(f.attrs["optimizer_steps"])
            self.meta = json.loads(str(f.attrs["meta"]))
            self.index = {}

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    gshape = _check_shape(obj.shape, f"{path} tensor {name}")
                    self.index[name] = (gshape, np.asarray([[(0, s) for s in gshape]], dtype=np.int64)
                                        .reshape(1, len(gshape), 2), np.asarray([-1], dtype=np.int64))
            f.visititems(visit)
        # version 1 kept layer tensors (batch-norm statistics) as JSON lists of the global channels: they
        # read as one sample group
        self._v1_state = {}
        for lname, st in (self.meta.get("layers") or {}).items():
            for k, v in st.items():
                if isinstance(v, list):
                    arr = np.asarray(v, dtype=np.float64).reshape(1, -1)
                    self._v1_state[f"state/{lname}/{k}"] = arr
                    self.index[f"state/{lname}/{k}"] = (arr.shape, np.asarray([[(0, 1), (0, arr.shape[1])]],
                                                        dtype=np.int64), np.asarray([-2], dtype=np.int64))

    def _file(self, shard: int):
        if shard not in self._files:
            if self.layout == "v1":
                name = self.path
            elif shard < 0:
                name = os.path.join(self.path, "data.h5")
            else:
                name = os.path.join(self.path, f"shard-{shard:06d}.h5")
            self._files[shard] = h5py.File(name, "r")
        return self._files[shard]

    def read(self, key: str, box: Box, dtype=np.float64) -> np.ndarray:
        """The values of tensor ``key`` in ``box``, assembled from the blocks that meet it."""
        if key not in self.index:
            raise CheckpointError(f"{self.path} has no tensor {key}; was it written for another model?")
        gshape, boxes, shards = self.index[key]
        out = np.empty(tuple(e - a for a, e in box), dtype=dtype)
        filled = 0
        for i in blocks_meeting(boxes, box):
            src = tuple(map(tuple, boxes[i].tolist()))
            inter = tuple((max(a, x), min(e, y)) for (a, e), (x, y) in zip(src, box))
            if shards[i] == -2:
                piece = self._v1_state[key][_box_slices(inter)]
            else:
                ds = self._file(int(shards[i]))[key]
                want = tuple(e - a for a, e in src) if self.layout == "shards" else gshape
                if tuple(ds.shape) != want:
                    raise CheckpointError(f"{self.path}: {key} in shard {shards[i]} has shape {ds.shape}, "
                                          f"the index says {want}")
                piece = ds[_box_slices(inter, [a for a, _ in src])]
            out[_box_slices(inter, [a for a, _ in box])] = piece
            filled += piece.size
        if filled != out.size:
            raise CheckpointError(f"{self.path}: the blocks of {key} cover {filled} of the {out.size} "
                                  f"elements of box {box}")
        return out

    def read_global(self) -> dict:
        """Every tensor in its global shape (tools and tests; one process reads everything)."""
        return {k: self.read(k, tuple((0, s) for s in g)) for k, (g, _, _) in self.index.items()}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def load(path: str) -> dict:
    """Not collective (tools and tests): the checkpoint at ``path`` (a version 2 directory or a version 1
    file) with every tensor assembled in its global shape."""
    ck = Checkpoint(path)
    try:
        return {"step": ck.step, "optimizer_steps": ck.optimizer_steps, "meta": ck.meta,
                "tensors": ck.read_global()}
    finally:
        ck.close()


def resolve(path: str) -> str | None:
    """The checkpoint ``path`` names: itself when it is one, else the newest complete one in the directory
    ``path`` (``None`` when there is none)."""
    found = candidates(path) if os.path.isdir(path) else []
    if found:
        return found[0]
    return path if os.path.exists(path) else None


def restore_weights(path: str, params, layers, xp) -> int:
    """Not collective (inference, ``model.init``): parameters and layer state from the checkpoint at
    ``path``, each rank reading only its own boxes; no optimizer state. Returns the checkpoint's step."""
    ck = Checkpoint(path)
    try:
        for p in params:
            key = f"params/{p.name}"
            if key not in ck.index:
                raise CheckpointError(f"{path} has no tensor for parameter {p.name}; was it written for "
                                      f"another model?")
            if tuple(ck.index[key][0]) != tuple(p.global_shape):
                raise CheckpointError(f"parameter {p.name}: checkpoint shape {tuple(ck.index[key][0])} != "
                                      f"model shape {tuple(p.global_shape)}")
            p.value[...] = xp.asarray(ck.read(key, p.box), dtype=p.value.dtype)
        for layer in layers:
            st = _layer_readers(ck, layer)
            if st:
                layer.load_state(st)
        return ck.step
    finally:
        ck.close()


def load_newest(directory: str) -> tuple[str, dict] | tuple[None, None]:
    """Not collective (tools and tests): the newest readable checkpoint in ``directory`` with every
    tensor assembled in its global shape, skipping broken ones with a note."""
    errors = []
    for path in candidates(directory):
        ck = None
        try:
            ck = Checkpoint(path)
            data = {"step": ck.step, "optimizer_steps": ck.optimizer_steps, "meta": ck.meta,
                    "tensors": ck.read_global()}
            return path, data
        except (OSError, KeyError, ValueError, CheckpointError) as exc:
            errors.append(f"{path}: {exc}")
        finally:
            if ck is not None:
                ck.close()
    if errors:
        raise CheckpointError("no readable checkpoint in " + directory + ": " + "; ".join(errors))
    return None, None


def resume(comm, directory: str, params, optimizer, layers, xp) -> tuple[str | None, dict | None]:
    """Collective over ``comm``: restore the newest checkpoint every rank can read into ``params``, the
    optimizer state and the layers' state; each rank reads only its own hyperslabs. A checkpoint that
    fails on any rank is reported (rank 0 prints a note) and the previous one is tried. Returns
    ``(path, {"step", "optimizer_steps", "meta"})``, or ``(None, None)`` when there is none; raises
    :class:`CheckpointError` when none is readable."""
    paths = comm.bcast_obj(candidates(directory) if comm.rank == 0 else None)
    errors = []
    for path in paths:
        ck, staged, err = None, None, None
        try:
            ck = Checkpoint(path)
            staged = _stage(ck, params, optimizer, layers)
            readers = [_layer_readers(ck, layer) for layer in layers]
            for layer, st in zip(layers, readers):
                # a dry run on a shallow copy reads (and caches) what the layer needs before anything changes
                if st:
                    copy.copy(layer).load_state(st)
        except (OSError, KeyError, ValueError, CheckpointError) as exc:
            err = f"rank {comm.rank}: {path}: {exc}"
        if comm.allreduce_obj(err is not None, op="or"):
            if ck is not None:
                ck.close()
            msg = err or f"{path}: unreadable on another rank"
            errors.append(msg)
            if comm.rank == 0 or err:
                print(f"lbannpy: checkpoint {path} cannot be used ({msg}); trying the previous one",
                      file=sys.stderr, flush=True)
            continue
        try:
            _apply(staged, params, optimizer, layers, readers, xp)
        finally:
            ck.close()
        optimizer.t = ck.optimizer_steps
        return path, {"step": ck.step, "optimizer_steps": ck.optimizer_steps, "meta": ck.meta}
    if errors:
        raise CheckpointError(f"no readable checkpoint in {directory}: " + "; ".join(errors))
    return None, None


def _stage(ck: Checkpoint, params, optimizer, layers) -> dict:
    """Read everything this rank needs into host buffers (its own shard's size) before touching the
    model, so a checkpoint that fails half-way leaves the model as it was."""
    out = {"params": {}, "optim": {}}
    for p in params:
        key = f"params/{p.name}"
        if key not in ck.index:
            raise CheckpointError(f"no tensor for parameter {p.name}; was it written for another model?")
        gshape = ck.index[key][0]
        if tuple(gshape) != tuple(p.global_shape):
            raise CheckpointError(f"parameter {p.name}: checkpoint shape {gshape} != model shape "
                                  f"{tuple(p.global_shape)}")
        out["params"][p.name] = ck.read(key, tuple(p.box))
        prefix = f"optim/{p.name}/"
        out["optim"][p.name] = {k[len(prefix):]: ck.read(k, tuple(p.box))
                                for k in ck.index if k.startswith(prefix)}
    return out


def _layer_readers(ck: Checkpoint, layer) -> dict:
    """What :meth:`Layer.load_state` gets: plain numbers from the metadata, a :class:`StateReader` per
    tensor."""
    st = dict((ck.meta.get("layers") or {}).get(layer.name) or {})
    if ck.layout == "v1":  # version 1 kept tensors as JSON lists (indexed above as one sample group)
        st = {k: v for k, v in st.items() if not isinstance(v, list)}
    prefix = f"state/{layer.name}/"
    for k in ck.index:
        if k.startswith(prefix):
            st[k[len(prefix):]] = StateReader(k, ck.index[k][0], ck.read)
    return st


def _apply(staged, params, optimizer, layers, readers, xp) -> None:
    for p in params:
        p.value[...] = xp.asarray(staged["params"][p.name], dtype=p.value.dtype)
        st = optimizer.state[p.name]
        st.clear()
        for k, v in staged["optim"][p.name].items():
            st[k] = xp.asarray(v, dtype=p.value.dtype)
    for layer, st in zip(layers, readers):  # from the reads the dry run cached
        if st:
            layer.load_state(st)
