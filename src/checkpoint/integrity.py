"""What makes a checkpoint prove it is whole (version 3): a CRC32 of every block's bytes, the checkpoint's
identity (step, run id, a per-write id) in every shard, each shard's digest and every block's CRC in the
index, and the index's own digest over all of it.

A reader checks the index's digest when it opens it, a shard's identity and digest against the index when
it opens the shard, and a block's CRC when it reads the block; any mismatch is a :class:`CheckpointError`
naming the file and the block, which every restore path treats like a missing shard. CRC32 (``zlib``) of the
bytes as written: cheap next to the write itself, and enough to catch a flipped bit or a stale file (an
adversary who rewrites the index's digest too is out of scope)."""
from __future__ import annotations

import hashlib
import json
import zlib

import numpy as np

from .plan import CheckpointError

# the index attributes its digest covers, in this order (with every tensor's tables and the shard digests)
INDEX_ATTRS = ("format", "version", "layout", "ranks", "step", "optimizer_steps", "meta", "run_id", "ckpt_id")


def crc32(arr) -> int:
    """CRC32 of the bytes of ``arr`` in C order (as written to and read from HDF5, native byte order)."""
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) & 0xFFFFFFFF


def shard_digest(ident: dict, rows) -> str:
    """Digest of one shard: its identity and its (key, box, crc) rows in key order."""
    h = hashlib.sha256(json.dumps(ident, sort_keys=True).encode())
    for key, box, crc in sorted(rows, key=lambda r: r[0]):
        box = np.asarray(box, dtype=np.int64).tobytes()
        h.update(key.encode() + b"\0" + box + int(crc).to_bytes(4, "little"))
    return h.hexdigest()[:32]


def index_digest(attrs: dict, index: dict, shard_digests: dict) -> str:
    """Digest of an index: its attributes (:data:`INDEX_ATTRS`), every tensor's shape, box, shard and CRC
    tables, and each shard's digest. ``index`` maps key -> (global_shape, boxes, shards, crcs)."""
    h = hashlib.sha256(json.dumps({k: _plain(attrs[k]) for k in INDEX_ATTRS}, sort_keys=True).encode())
    for key in sorted(index):
        gshape, boxes, shards, crcs = index[key]
        h.update(key.encode() + b"\0")
        for arr in (gshape, boxes, shards, crcs):
            h.update(np.ascontiguousarray(np.asarray(arr, dtype=np.int64)).tobytes())
    for rank in sorted(shard_digests):
        h.update(f"{int(rank)}:{shard_digests[rank]};".encode())
    return h.hexdigest()[:32]


def _plain(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.generic):
        return v.item()
    return v


def check_block(arr, want: int, where: str) -> None:
    """Raise :class:`CheckpointError` unless the CRC32 of ``arr`` is ``want``."""
    got = crc32(arr)
    if got != int(want):
        raise CheckpointError(f"{where} fails its checksum (crc32 {got:08x}, the index says "
                              f"{int(want):08x}): the file is damaged")


def check_finite(arr, where: str) -> None:
    """Raise :class:`CheckpointError` when a floating-point block holds a NaN or an infinity (a checkpoint
    is written from finite values only; one that is not is damage). One pass, no temporary: a float64 sum
    is finite unless a value is not (or the values are near the largest float, then checked one by one)."""
    a = np.asarray(arr)
    if a.dtype.kind != "f" or a.size == 0:
        return
    if np.isfinite(a.sum(dtype=np.float64)) or np.isfinite(a).all():
        return
    first = int(np.argmax(~np.isfinite(a.reshape(-1))))
    raise CheckpointError(f"{where} holds non-finite values (the first at flat index {first}): the file is "
                          f"damaged")
