"""Writing one checkpoint: shards (or one parallel-HDF5 file), the index, atomic rename."""
from __future__ import annotations

import errno
import glob
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import time
import uuid
from typing import Sequence

import h5py
import numpy as np

from lbannpy.backend import to_numpy

from .integrity import INDEX_ATTRS, crc32, index_digest, shard_digest
from .plan import FORMAT, VERSION, CheckpointError, Piece, box_slices, layer_state, param_pieces
from .read import Checkpoint, candidates, step_of


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


def save(comm, directory: str, step: int, params, optimizer, meta: dict, layers=(), run_id: str = ""
         ) -> str | None:
    """Collective over ``comm`` (every rank, same params and layers in the same order): write checkpoint
    ``step``. Each unique block is written once, with its CRC32 and the checkpoint's identity (``step``,
    ``run_id``, a fresh id of this write); no tensor data moves between ranks. ``meta`` (small, JSON) and
    each layer's plain-number state are written by rank 0. Returns the final path on every rank. Raises
    :class:`CheckpointError` on every rank when any rank failed to write (a full disk included)."""
    pieces = [(pc, p_val) for pc, p_val in _param_values(params, optimizer, comm.rank)]
    small, state = layer_state(layers)
    pieces += state
    final = os.path.join(directory, f"ckpt-{step:08d}")
    tmp = final + ".tmp"
    err = None
    ckpt_id = uuid.uuid4().hex if comm.rank == 0 else ""
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            _remove_tmp(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            err = f"cannot create {tmp}: {_reason(exc)}"
    err, ckpt_id = comm.bcast_obj((err, ckpt_id))
    if err:
        raise CheckpointError(err)
    ident = {"step": int(step), "run_id": str(run_id), "ckpt_id": ckpt_id}
    single = comm.size == 1 or parallel_hdf5(comm)
    err, rows = None, []
    try:
        if single:
            rows = _write_single(comm, tmp, pieces)
        else:
            _write_shard(comm.rank, tmp, pieces, ident)
    except _WRITE_ERRORS as exc:
        err = f"rank {comm.rank}: writing its checkpoint shard into {tmp} failed: {_reason(exc, tmp)}"
    # every shard is on disk (fsynced) past this point; every rank raises the first rank's reason
    bad = [e for e in comm.allgather_obj(err) if e]
    if bad:
        if comm.rank == 0:  # nothing half-written stays behind (a full disk: the space is given back)
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(bad[0])
    if single and comm.size > 1:  # the writers' block checksums (small: one row per block)
        rows = [r for part in comm.allgather_obj(rows) for r in part]
    err = None
    if comm.rank == 0:
        try:
            if single:
                index, digests = _index_single(pieces, rows), {}
            else:
                index, digests = _index_from_shards(tmp, [p for p, _ in pieces], ident)
            _write_index(tmp, step, optimizer, meta, small, index, "single" if single else "shards",
                         comm.size, ident, digests)
            _fsync_dir(tmp)  # the shard files' directory entries are durable before the rename
            if os.path.lexists(final):  # whatever holds the name is kept, moved aside
                _in_the_way(directory, final, step)
            os.replace(tmp, final)
            _fsync_dir(directory)
        except _WRITE_ERRORS + (CheckpointError,) as exc:
            err = f"writing the checkpoint index {tmp}/index.h5 failed: {_reason(exc, tmp)}"
            shutil.rmtree(tmp, ignore_errors=True)
    err = comm.bcast_obj(err)
    if err:
        raise CheckpointError(err)
    return final


# h5py reports a write that ran out of space as OSError, or (in HDF5's clean-up after it) as RuntimeError
# such as "Slist already enabled?"
_WRITE_ERRORS = (OSError, ValueError, RuntimeError)


def _reason(exc: Exception, where: str = "") -> str:
    """One short line: the system's words for an errno (h5py's own message of a failed write runs to a
    dozen fields), else the message, cut. An h5py error on a full file system is called what it is."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{os.strerror(exc.errno)} (errno {exc.errno})"
    if isinstance(exc, (OSError, RuntimeError)) and _disk_full(exc, where):
        return f"{os.strerror(errno.ENOSPC)} (errno {errno.ENOSPC}; HDF5 said: {_cut(str(exc), 120)})"
    return _cut(str(exc), 240)


def _cut(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + " ..."


_ROOM = 1 << 20  # bytes: a file system with less free than this after a failed write had no room for it


def _disk_full(exc: Exception, where: str) -> bool:
    """Whether an h5py error came from a file system without room (HDF5 hides the errno in its text, or
    reports only a consequence, so the file system of the failed write is asked as well)."""
    text = str(exc)
    if "No space left" in text or "errno = 28" in text:
        return True
    try:
        return bool(where) and shutil.disk_usage(where).free < _ROOM
    except OSError:
        return False


def _remove_tmp(tmp: str) -> None:
    """An interrupted write's temporary directory is the writer's to replace; a link or file of that name
    is removed as a link or file (never followed)."""
    if os.path.islink(tmp) or os.path.isfile(tmp):
        os.unlink(tmp)
    elif os.path.isdir(tmp):
        shutil.rmtree(tmp)


def _in_the_way(directory: str, final: str, step: int) -> None:
    """Rank 0: something already holds the name of the checkpoint being written (a checkpoint that failed
    to read, so the run went on from an older one; a symbolic link; a file another command wrote): moved
    aside with a note, never deleted."""
    mode = os.lstat(final).st_mode
    what = ("a symbolic link" if stat.S_ISLNK(mode) else "a checkpoint directory" if stat.S_ISDIR(mode)
            else "a file")
    dest = set_aside(directory, [final], f"step{int(step)}")
    print(f"lbannpy: {final} ({what}) held the name of the new checkpoint of step {step}; moved it to "
          f"{dest}/", file=sys.stderr, flush=True)


def set_aside(directory: str, paths: Sequence[str], label: str) -> str:
    """Not collective: move ``paths`` (entries of ``directory``, links moved as links) into a new directory
    ``directory/aside-<label>-<time>/`` under their own names, and return it. Nothing is deleted, and
    nothing there is a checkpoint candidate of ``directory`` any more (nor pruned)."""
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", label) or "unknown"
    base = os.path.join(directory, f"aside-{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    dest, n = base, 1
    while os.path.lexists(dest):
        dest, n = f"{base}-{n}", n + 1
    os.mkdir(dest)
    for path in paths:
        os.rename(path, os.path.join(dest, os.path.basename(path.rstrip("/"))))
    _fsync_dir(dest)
    _fsync_dir(directory)
    return dest


def verified_identity(path: str) -> dict | None:
    """Not collective: the identity (step, run id, write id) of the checkpoint at ``path`` when its index
    verifies and every file it names belongs to it and holds each block where the index says (no data is
    read); None when it does not (damaged, unreadable, or of a version without identities)."""
    ck = None
    try:
        ck = Checkpoint(path)
        if not ck.ident:
            return None
        ck.check_files()
        return dict(ck.ident)
    except (OSError, KeyError, ValueError, RuntimeError):  # what a damaged checkpoint raises
        return None
    finally:
        if ck is not None:
            ck.close()


def prune(directory: str, keep: int, *, run_id: str, newest: str) -> list[str]:
    """Not collective (rank 0, after writing the checkpoint ``newest`` of run ``run_id``): delete this
    run's checkpoints older than ``newest`` beyond the newest ``keep`` (``keep`` 0: none), oldest first;
    returns the deleted paths. Only when ``newest`` verifies (:func:`verified_identity`), and only
    checkpoints that verify and carry ``run_id``: one that cannot be read, one of another run, a newer one
    and anything that is not a checkpoint (:func:`candidates`) are never deleted. Directories of
    interrupted writes (``.tmp``) are left to the writer, which replaces them."""
    if keep <= 0:
        return []
    ref = verified_identity(newest)
    if ref is None or ref["run_id"] != run_id or not run_id:
        return []
    older = [p for p in candidates(directory) if p != newest and step_of(p) < ref["step"]]
    mine = [p for p in older if (verified_identity(p) or {}).get("run_id") == run_id]
    gone = []
    for path in reversed(mine[keep - 1:]):
        if os.path.isdir(path) and not os.path.islink(path):
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


def _write_shard(rank: int, tmp: str, pieces, ident: dict) -> None:
    mine = [(pc, v) for pc, v in pieces if pc.writer]
    if not mine:
        return
    path = os.path.join(tmp, f"shard-{rank:06d}.h5")
    rows = []
    buf = io.BytesIO()  # one host copy of the shard (see _write_image)
    with h5py.File(buf, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["rank"] = rank
        for k, v in ident.items():
            f.attrs[k] = v
        for pc, v in mine:  # one host copy of one block at a time
            host = np.ascontiguousarray(to_numpy(v))
            ds = f.create_dataset(pc.key, data=host)
            box = np.asarray(pc.box, dtype=np.int64).reshape(len(pc.box), 2)
            ds.attrs["box"] = box
            ds.attrs["global_shape"] = np.asarray(pc.global_shape, dtype=np.int64)
            ds.attrs["crc32"] = np.int64(crc32(host))
            rows.append((pc.key, box, int(ds.attrs["crc32"])))
        f.attrs["digest"] = shard_digest(ident, rows)
    _write_image(path, buf.getbuffer())


def _write_single(comm, tmp: str, pieces) -> list:
    """Every rank opens one file (``mpio`` when there are several) and creates every dataset in the same
    order (collective in parallel HDF5); each writer then writes its hyperslab. Returns this rank's
    (key, box, crc32) rows of the blocks it wrote."""
    path = os.path.join(tmp, "data.h5")
    buf = io.BytesIO() if comm.size == 1 else None  # one rank: written as an image (see _write_image)
    kw = {"driver": "mpio", "comm": comm.mpi4py_comm} if comm.size > 1 else {}
    rows = []
    with h5py.File(buf if buf is not None else path, "w", **kw) as f:
        dsets = [f.create_dataset(pc.key, shape=pc.global_shape, dtype=np.dtype(v.dtype)) for pc, v in pieces]
        for ds, (pc, v) in zip(dsets, pieces):
            if pc.writer:
                host = np.ascontiguousarray(to_numpy(v))
                ds[box_slices(pc.box)] = host
                rows.append((pc.key, np.asarray(pc.box, dtype=np.int64).reshape(len(pc.box), 2), crc32(host)))
        f.flush()
    if buf is not None:
        _write_image(path, buf.getbuffer())
    elif comm.rank == 0:
        _fsync_file(path)
    return rows


def _index_single(pieces, rows) -> dict:
    """The index of one ``data.h5``: each tensor's written blocks (shard -1: the one file) and their CRCs."""
    by_key: dict[str, list] = {pc.key: [] for pc, _ in pieces}
    for key, box, crc in rows:
        by_key[key].append((box, crc))
    return _tiled({pc.key: tuple(pc.global_shape) for pc, _ in pieces},
                  {k: [(b, -1, c) for b, c in v] for k, v in by_key.items()})


def _index_from_shards(tmp: str, pieces: Sequence[Piece], ident: dict) -> tuple[dict, dict]:
    """Rank 0: the (box, shard, crc32) table of every tensor, read from the shard files' attributes (only
    the tables, no data), checked to tile each tensor exactly; and each shard's digest (a shard of another
    write, left in the directory, is refused by its identity)."""
    want = {pc.key: tuple(pc.global_shape) for pc in pieces}
    rows: dict[str, list] = {k: [] for k in want}
    digests = {}
    for path in sorted(glob.glob(os.path.join(tmp, "shard-*.h5"))):
        rank = int(re.search(r"shard-(\d+)\.h5$", path).group(1))
        with h5py.File(path, "r") as f:
            if f.attrs.get("ckpt_id") != ident["ckpt_id"]:
                raise CheckpointError(f"{path} was not written by this checkpoint write")
            digests[rank] = str(f.attrs["digest"])

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    if name not in rows:
                        raise CheckpointError(f"{path}: unexpected tensor {name}")
                    rows[name].append((np.asarray(obj.attrs["box"], dtype=np.int64), rank,
                                       int(obj.attrs["crc32"])))
            f.visititems(visit)
    return _tiled(want, rows), digests


def _tiled(want: dict, rows: dict) -> dict:
    """key -> (global_shape, boxes, shards, crcs) from each tensor's (box, shard, crc) rows, checked to tile
    the tensor exactly (no block missing, none twice)."""
    index = {}
    for key, gshape in want.items():
        if not rows[key]:
            raise CheckpointError(f"no rank wrote tensor {key}")
        boxes = np.stack([b for b, _, _ in rows[key]])
        shards = np.asarray([r for _, r, _ in rows[key]], dtype=np.int64)
        crcs = np.asarray([c for _, _, c in rows[key]], dtype=np.int64)
        vol = int(np.prod(boxes[:, :, 1] - boxes[:, :, 0], axis=1).sum())
        if vol != math.prod(gshape) or len({b.tobytes() for b in boxes}) != len(boxes):
            raise CheckpointError(f"the blocks written of {key} (shape {gshape}) do not tile it: "
                                  f"{len(boxes)} "
                                  f"blocks of {vol} elements in all; a layer's block does not follow its "
                                  f"writer rule (checkpoint.is_writer)")
        index[key] = (gshape, boxes, shards, crcs)
    return index


def _write_index(tmp, step, optimizer, meta, small, index, layout, nranks, ident, digests) -> None:
    path = os.path.join(tmp, "index.h5")
    attrs = {"format": FORMAT, "version": VERSION, "layout": layout, "ranks": int(nranks), "step": int(step),
             "optimizer_steps": int(optimizer.t) if optimizer is not None else 0,
             "meta": json.dumps(dict(meta, layers=small), sort_keys=True), "run_id": ident["run_id"],
             "ckpt_id": ident["ckpt_id"]}
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        for k in INDEX_ATTRS:
            f.attrs[k] = attrs[k]
        g = f.create_group("tensors")
        for i, (key, (gshape, boxes, shards, crcs)) in enumerate(index.items()):
            t = g.create_group(f"t{i:06d}")
            t.attrs["key"] = key
            t.attrs["global_shape"] = np.asarray(gshape, dtype=np.int64)
            t.create_dataset("boxes", data=boxes)
            t.create_dataset("shards", data=shards)
            t.create_dataset("crc32", data=crcs)
        ranks = sorted(digests)
        f.create_dataset("shard_ranks", data=np.asarray(ranks, dtype=np.int64))
        f.create_dataset("shard_digests", data=np.asarray([digests[r] for r in ranks], dtype="S32"))
        f.attrs["digest"] = index_digest(attrs, index, digests)
    _write_image(path, buf.getbuffer())


def _write_image(path: str, image) -> None:
    """Write an HDF5 file image built in memory with plain file I/O and fsync it: a full disk is one
    clean ENOSPC (HDF5 writing to the file itself fails inside its own close, and the file handle it leaves
    fails again at every later clean-up and at exit, up to a crash)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(image).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------------------------------------
