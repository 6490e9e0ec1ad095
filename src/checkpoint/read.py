"""Reading checkpoints: candidates newest first, the index checked before allocating, hyperslab
restore on any rank count, fallback to an older checkpoint."""
from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
from typing import Callable

import h5py
import numpy as np

from .integrity import INDEX_ATTRS, check_block, check_finite, index_digest
from .plan import FORMAT, VERSION, Box, CheckpointError, StateReader, blocks_meeting, box_slices

# the one rule for what is a checkpoint in a directory: any number of digits after "ckpt-" (steps past
# 99,999,999 included); a directory (version 2 and 3) or a regular HDF5 file with ".h5" (version 1), never a
# symbolic link (its target may be anything, anywhere), a temporary ".tmp" write, or a file of another kind
_V1_NAME = re.compile(r"^ckpt-(\d+)\.h5$")
_V2_NAME = re.compile(r"^ckpt-(\d+)$")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_MAX_NDIM = 8
_MAX_ELEMENTS = 1 << 40  # refuses absurd shapes read from a damaged index before allocating anything
_MAX_BLOCKS = 1 << 24  # blocks of one tensor in an index (one per writing rank at most)
_RELISTS = 64  # times a reader lists the directory again after the checkpoint it picked was deleted
# what a damaged checkpoint raises (h5py: OSError for unreadable blocks, RuntimeError "Object visitation
# failed" for a damaged group); CheckpointError is a RuntimeError
_DAMAGE = (OSError, KeyError, ValueError, RuntimeError)


class CheckpointRefused(CheckpointError):
    """A readable checkpoint that does not belong to this run (``check`` of :func:`resume` refused it)."""


def step_of(path: str) -> int | None:
    """The step a checkpoint's name says (``ckpt-<digits>`` or ``ckpt-<digits>.h5``), None for another
    name."""
    m = _V2_NAME.match(os.path.basename(path.rstrip("/"))) or _V1_NAME.match(os.path.basename(path))
    return int(m.group(1)) if m else None


def candidates(directory: str) -> list[str]:
    """Complete checkpoints in ``directory``, newest (highest step) first, found by one rule: a directory
    ``ckpt-<digits>`` (versions 2 and 3) or a regular file ``ckpt-<digits>.h5`` that is an HDF5 file
    (version 1), for any number of digits. Symbolic links, temporary directories of interrupted writes and
    anything else (a file another command wrote there, a FIFO) are not checkpoints: ignored, so they are
    never read as the newest nor deleted by pruning."""
    import stat

    found = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        m2, m1 = _V2_NAME.match(name), _V1_NAME.match(name)
        if not (m1 or m2):
            continue
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except OSError:  # gone since the listing
            continue
        if m2 and stat.S_ISDIR(mode):
            found.append((int(m2.group(1)), 1, name, path))
        elif m1 and stat.S_ISREG(mode) and _is_hdf5(path):
            found.append((int(m1.group(1)), 0, name, path))
    return [p for _, _, _, p in sorted(found, reverse=True)]


def _is_hdf5(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
    except OSError:
        return False


def _check_shape(shape, what: str) -> tuple:
    shape = tuple(int(s) for s in np.asarray(shape).ravel())
    if len(shape) > _MAX_NDIM or any(s < 0 for s in shape) or math.prod(shape) > _MAX_ELEMENTS:
        raise CheckpointError(f"{what}: implausible shape {shape}")
    return shape


_READS = (1, 2, VERSION)  # versions this lbannpy reads; only version 3 carries checksums


class Checkpoint:
    """An opened checkpoint (any version): its step, metadata, tensor index and a hyperslab reader.
    Opening reads the index only (version 3: checks its digest, and that its step is the directory's);
    :meth:`read` opens the shards a box meets (kept open until :meth:`close`; version 3: each shard's
    identity checked against the index) and checks the CRC32 of every block it reads from (``verify``)."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        self.verify = verify
        self._files: dict = {}
        self.crcs: dict = {}
        self.ident: dict = {}
        self.shard_digests: dict = {}
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
            if version not in _READS:
                raise CheckpointError(f"{path} has checkpoint version {version}; this lbannpy reads "
                                      f"{', '.join(map(str, _READS))}")
            self.version = version
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
                if version >= 3:
                    crcs = np.asarray(t["crc32"][()], dtype=np.int64)
                    if crcs.shape != (n,):
                        raise CheckpointError(f"{ipath} tensor {key}: {crcs.shape} checksums for {n} blocks")
                    self.crcs[key] = crcs
            named = step_of(path)
            if named is not None and named != self.step:
                raise CheckpointError(f"{ipath}: step {self.step} disagrees with the directory name "
                                      f"{os.path.basename(path.rstrip('/'))}")
            if version >= 3:
                self._check_index(f, ipath)
            self._check_shards_named(ipath)

    def _check_shards_named(self, ipath: str) -> None:
        """Every block's file is one this layout has: ``data.h5`` (-1) in a single file, a shard rank
        (version 3: one the index holds a digest for) otherwise; anything else is a damaged or edited
        index, refused here like any other damage."""
        for key, (_, _, shards) in self.index.items():
            if self.layout == "single":
                bad = shards[shards != -1]
            elif self.shard_digests:
                bad = shards[~np.isin(shards, list(self.shard_digests))]
            else:
                bad = shards[shards < 0]
            if bad.size:
                raise CheckpointError(f"{ipath} tensor {key}: its shard table names file {int(bad[0])}, "
                                      f"which a checkpoint of layout {self.layout!r} does not have")

    def _check_index(self, f, ipath: str) -> None:
        """Version 3: the index's digest over its attributes, tables and shard digests."""
        attrs = {k: f.attrs[k] for k in INDEX_ATTRS}
        ranks = np.asarray(f["shard_ranks"][()], dtype=np.int64)
        digests = [d.decode() if isinstance(d, bytes) else str(d) for d in f["shard_digests"][()]]
        if len(ranks) != len(digests):
            raise CheckpointError(f"{ipath}: {len(ranks)} shard ranks for {len(digests)} shard digests")
        self.shard_digests = dict(zip(ranks.tolist(), digests))
        index = {k: (g, b, s, self.crcs[k]) for k, (g, b, s) in self.index.items()}
        if index_digest(attrs, index, self.shard_digests) != str(f.attrs.get("digest", "")):
            raise CheckpointError(f"{ipath} fails its digest: its step, tables or metadata were edited, or "
                                  f"it is damaged")
        self.ident = {"step": self.step, "run_id": str(f.attrs["run_id"]), "ckpt_id": str(f.attrs["ckpt_id"])}

    def _open_v1(self, path):
        self.layout, self.version = "v1", 1
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
            f = h5py.File(name, "r")
            try:
                if self.ident and shard >= 0:
                    self._check_shard(f, shard, name)
            except BaseException:
                f.close()
                raise
            self._files[shard] = f
        return self._files[shard]

    def _check_shard(self, f, shard: int, name: str) -> None:
        """Version 3: a shard belongs to this checkpoint (same step, run and write) and its digest is the
        one the index holds for it."""
        got = {k: (int(f.attrs[k]) if k == "step" else str(f.attrs[k])) if k in f.attrs else None
               for k in self.ident}
        if got != self.ident:
            raise CheckpointError(f"{name} belongs to another checkpoint (step {got['step']}, write "
                                  f"{got['ckpt_id']}; the index is step {self.step}, write "
                                  f"{self.ident['ckpt_id']}): a shard copied in or left over")
        if str(f.attrs.get("digest", "")) != self.shard_digests.get(shard):
            raise CheckpointError(f"{name}: its digest is not the one the index holds for shard {shard}")

    def _check_box(self, ds, key: str, want) -> None:
        """A shard's block carries its place in the global tensor (``box``): it must be the index row's,
        or the block would land elsewhere (an index whose rows were swapped, a block of another write)."""
        got = ds.attrs.get("box")
        if got is None and self.version < 3:
            return  # written before blocks carried their boxes
        got = None if got is None else np.asarray(got, dtype=np.int64)
        if got is None or got.shape != want.shape or not np.array_equal(got, want):
            raise CheckpointError(f"{ds.file.filename}: block {key} is the block at "
                                  f"{None if got is None else got.tolist()}, the index puts it at "
                                  f"{want.tolist()}: the index is damaged or was edited")

    def check_files(self) -> None:
        """Open every file the index names and check, without reading any data, that it belongs to this
        checkpoint (version 3: identity and digest) and holds each block where the index says, with its
        shape and box; raises :class:`CheckpointError` (or an h5py error) otherwise."""
        for key, (gshape, boxes, shards) in self.index.items():
            for i, shard in enumerate(shards.tolist()):
                if shard == -2:
                    continue
                ds = self._file(int(shard))[key]
                want = tuple(e - a for a, e in boxes[i].tolist()) if self.layout == "shards" else gshape
                if tuple(ds.shape) != tuple(want):
                    raise CheckpointError(f"{self.path}: {key} in shard {shard} has shape {ds.shape}, the "
                                          f"index says {tuple(want)}")
                if self.layout == "shards":
                    self._check_box(ds, key, boxes[i])

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
                piece = self._v1_state[key][box_slices(inter)]
            else:
                ds = self._file(int(shards[i]))[key]
                want = tuple(e - a for a, e in src) if self.layout == "shards" else gshape
                if tuple(ds.shape) != want:
                    raise CheckpointError(f"{self.path}: {key} in shard {shards[i]} has shape {ds.shape}, "
                                          f"the index says {want}")
                if self.layout == "shards":
                    self._check_box(ds, key, boxes[i])
                origin = [a for a, _ in src] if self.layout == "shards" else [0] * len(src)
                if self.verify and key in self.crcs:  # the whole block: its checksum covers all of it
                    block = ds[box_slices(src, origin)]
                    where = f"{ds.file.filename}: block {key} {list(src)}"
                    check_block(block, self.crcs[key][i], where)
                    check_finite(block, where)
                    piece = block[box_slices(inter, [a for a, _ in src])]
                else:
                    piece = ds[box_slices(inter, origin)]
            out[box_slices(inter, [a for a, _ in box])] = piece
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
    if os.path.basename(path) == "index.h5" and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))  # a checkpoint directory's index names the directory
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


def newest_first(directory: str, attempt: Callable[[str], object],
                 failed: Callable[[str, str, bool], None], comm=None):
    """``(path, attempt(path))`` for the newest checkpoint in ``directory`` that ``attempt`` reads without
    damage, ``(None, None)`` when there is none. A checkpoint that fails (on any rank of ``comm``) is
    reported to ``failed(path, reason, more)`` (``more``: another one is left to try) and the previous one
    tried; one deleted while it was being read (a live run pruned it, having written a newer one) is no
    failure: the directory is listed again and the newest not yet tried is taken. With ``comm``,
    collective: rank 0 lists and decides, every rank reads the same checkpoint, and the ranks agree on each
    attempt (the first failing rank's reason is reported)."""
    def agreed(value):
        return comm.bcast_obj(value if comm.rank == 0 else None) if comm is not None else value

    tried: set[str] = set()
    for _ in range(_RELISTS):
        listed = agreed(candidates(directory))
        relist = False
        left = [p for p in listed if p not in tried]
        for i, path in enumerate(left):
            tried.add(path)
            err, out = None, None
            try:
                out = attempt(path)
            except _DAMAGE as exc:
                err = f"{exc}"
            if comm is not None:
                bad = [(r, e) for r, e in enumerate(comm.allgather_obj(err)) if e]
                err = None if not bad else bad[0][1] if comm.size == 1 else f"rank {bad[0][0]}: {bad[0][1]}"
            if err is None:
                return path, out
            if not agreed(os.path.lexists(path)):  # pruned under the reader: look again
                relist = True
                break
            failed(path, err, i + 1 < len(left))
        if not relist:
            break
    return None, None


def load_newest(directory: str, note: Callable[[str], None] | None = None
                ) -> tuple[str, dict] | tuple[None, None]:
    """Not collective (tools and tests): the newest readable checkpoint in ``directory`` (every block
    verified) with every tensor assembled in its global shape, skipping damaged ones (``note`` says
    which and why) and listing the directory again when the one picked is deleted under it."""
    errors = []

    def failed(path, err, more):
        errors.append(f"{path}: {err}")
        if note is not None:
            note(f"checkpoint {path} cannot be used ({err}); trying the previous one")

    path, data = newest_first(directory, load, failed)
    if path is None and errors:
        raise CheckpointError("no readable checkpoint in " + directory + ": " + "; ".join(errors))
    return path, data


def newest_sound(directory: str) -> str | None:
    """Not collective (rank 0, after a failure): the newest checkpoint in ``directory`` whose every block
    verifies (checksums, finite values), read one tensor at a time; None when there is none."""
    def verify(path):
        ck = Checkpoint(path)
        try:
            for key, (gshape, _, _) in ck.index.items():
                ck.read(key, tuple((0, s) for s in gshape))
        finally:
            ck.close()

    return newest_first(directory, verify, lambda path, err, more: None)[0]


def restore_newest(comm, path: str, params, layers, xp,
                   failed: Callable[[str, str, bool], None]) -> tuple[str | None, int]:
    """Collective over ``comm`` (inference): parameters and layer state from the checkpoint ``path``, or
    from the newest usable one when ``path`` is a directory of checkpoints, each rank reading its own
    blocks. Every rank reads the same checkpoint (rank 0 lists the directory); one that fails on any rank
    goes to ``failed(path, reason, more)`` and the previous one is tried; one deleted under the readers
    (pruned by a live run) makes the directory be listed again. ``comm`` None: this process alone.
    Returns ``(checkpoint, step)``, ``(None, -1)`` when there is none; raises :class:`CheckpointError`
    when a single checkpoint named by ``path`` fails."""
    if os.path.basename(path) == "index.h5" and os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))

    def attempt(found):
        return restore_weights(found, params, layers, xp)

    # a directory of checkpoints (rank 0 decides: one checkpoint directory holds none)
    mine = os.path.isdir(path) and bool(candidates(path))
    if comm.bcast_obj(mine if comm.rank == 0 else None) if comm is not None else mine:
        found, step = newest_first(path, attempt, failed, comm)
        return (found, int(step)) if found is not None else (None, -1)
    if not os.path.exists(path):
        return None, -1
    err, step = None, -1
    try:
        step = attempt(path)
    except _DAMAGE as exc:
        err = f"{exc}"
    errs = comm.allgather_obj(err) if comm is not None else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        raise CheckpointError(bad[0][1] if len(errs) == 1 else f"rank {bad[0][0]}: {bad[0][1]}")
    return path, int(step)


def resume(comm, directory: str, params, optimizer, layers, xp,
           check: Callable[[dict], str | None] | None = None) -> tuple[str | None, dict | None]:
    """Collective over ``comm``: restore the newest checkpoint every rank can read into ``params``, the
    optimizer state and the layers' state; each rank reads only its own hyperslabs. A checkpoint that
    fails on any rank is reported (rank 0 prints a note) and the previous one is tried. ``check(meta)``
    (same on every rank) may raise :class:`CheckpointError` (the checkpoint is unusable: the previous one
    is tried) or return a reason to refuse it (:class:`CheckpointRefused` on every rank, nothing restored).
    Returns ``(path, {"step", "optimizer_steps", "meta"})``, or ``(None, None)`` when there is none; raises
    :class:`CheckpointError` when none is readable."""
    paths = comm.bcast_obj(candidates(directory) if comm.rank == 0 else None)
    errors = []
    for path in paths:
        ck, staged, err, refusal = None, None, None, None
        try:
            ck = Checkpoint(path)
            refusal = check(ck.meta) if check is not None else None
            if refusal is None:
                staged = _stage(ck, params, optimizer, layers)
                readers = [_layer_readers(ck, layer) for layer in layers]
                for layer, st in zip(layers, readers):
                    # a dry run on a shallow copy reads (and caches) what the layer needs before anything
                    # changes
                    if st:
                        copy.copy(layer).load_state(st)
        except _DAMAGE as exc:
            err = f"rank {comm.rank}: {path}: {exc}"
        if comm.allreduce_obj(refusal is not None, op="or"):
            if ck is not None:
                ck.close()
            raise CheckpointRefused(f"{path}: {refusal}" if refusal else f"{path}: refused on another rank")
        bad = [e for e in comm.allgather_obj(err) if e]  # every rank verified its own blocks
        if bad:
            if ck is not None:
                ck.close()
            msg = bad[0]
            errors.append(msg)
            if comm.rank == 0:  # one note, naming the first rank's damaged file and block
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
