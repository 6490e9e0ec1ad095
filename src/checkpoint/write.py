"""Writing one checkpoint: shards (or one parallel-HDF5 file), the index, atomic rename."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
from typing import Sequence

import h5py
import numpy as np

from lbannpy.backend import to_numpy

from .plan import FORMAT, VERSION, CheckpointError, Piece, box_slices, layer_state, param_pieces
from .read import candidates


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


def save(comm, directory: str, step: int, params, optimizer, meta: dict, layers=()) -> str | None:
    """Collective over ``comm`` (every rank, same params and layers in the same order): write checkpoint
    ``step``. Each unique block is written once; no tensor data moves between ranks. ``meta`` (small,
    JSON) and each layer's plain-number state are written by rank 0. Returns the final path on every rank.
    Raises :class:`CheckpointError` on every rank when any rank failed to write."""
    pieces = [(pc, p_val) for pc, p_val in _param_values(params, optimizer, comm.rank)]
    small, state = layer_state(layers)
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
            err = f"cannot create {tmp}: {_reason(exc)}"
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
        err = f"rank {comm.rank}: writing its checkpoint shard into {tmp} failed: {_reason(exc)}"
    bad = comm.allreduce_obj(err is not None, op="or")  # every shard is on disk (fsynced) past this point
    if bad:
        if comm.rank == 0:  # nothing half-written stays behind (a full disk: the space is given back)
            shutil.rmtree(tmp, ignore_errors=True)
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
            err = f"writing the checkpoint index {tmp}/index.h5 failed: {_reason(exc)}"
            shutil.rmtree(tmp, ignore_errors=True)
    err = comm.bcast_obj(err)
    if err:
        raise CheckpointError(err)
    return final


def _reason(exc: Exception) -> str:
    """One short line: the system's words for an errno (h5py's own message of a failed write runs to a
    dozen fields), else the message, cut."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{os.strerror(exc.errno)} (errno {exc.errno})"
    text = " ".join(str(exc).split())
    return text if len(text) <= 240 else text[:240] + " ..."


def prune(directory: str, keep: int) -> list[str]:
    """Not collective (rank 0, after a complete write): delete all but the newest ``keep`` complete
    checkpoints in ``directory`` (``keep`` 0: none), oldest first; returns the deleted paths. Directories of
    interrupted writes (``.tmp``) are left to the writer, which replaces them."""
    if keep <= 0:
        return []
    gone = []
    for path in reversed(candidates(directory)[keep:]):
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        gone.append(path)
    return gone


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
    kw = {"driver": "mpio", "comm": comm.mpi4py_comm} if comm.size > 1 else {}
    with h5py.File(path, "w", **kw) as f:
        dsets = [f.create_dataset(pc.key, shape=pc.global_shape, dtype=np.dtype(v.dtype)) for pc, v in pieces]
        for ds, (pc, v) in zip(dsets, pieces):
            if pc.writer:
                ds[box_slices(pc.box)] = to_numpy(v)
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
