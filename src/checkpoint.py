"""Checkpoints: distribution-independent, atomic, resumable on another rank count or distribution.

A checkpoint is one HDF5 file ``ckpt-<step>.h5`` written by rank 0: every parameter and optimizer state
tensor in its *global* shape (gathered from the pieces the ranks hold), the step, epoch, optimizer step
count and the data reader's position, as plain datasets and attributes (nothing pickled). It is written
to ``ckpt-<step>.h5.tmp`` and renamed, so a write killed half-way never leaves a corrupt file under a final
name; the newest *complete* file wins on resume, and a file that fails to open is reported and skipped.
"""
from __future__ import annotations

import glob
import json
import os
import re

import h5py
import numpy as np

from lbannpy.backend import to_numpy

FORMAT = "lbannpy-checkpoint"
VERSION = 1
_NAME = re.compile(r"ckpt-(\d{8})\.h5$")


class CheckpointError(RuntimeError):
    pass


def assemble(comm, global_shape, box, local) -> np.ndarray | None:
    """Collective over ``comm``: the global tensor from every rank's (box, piece), on every rank.
    Used for weights and optimizer state (small next to activations)."""
    pieces = comm.allgather_obj((box, to_numpy(local)))
    out = np.zeros(global_shape, dtype=np.float64)
    for b, arr in pieces:
        out[tuple(slice(a, e) for a, e in b)] = arr
    return out


def save(comm, directory: str, step: int, params, optimizer, meta: dict) -> str | None:
    """Collective over ``comm``: gather every tensor, rank 0 writes atomically. Returns the path on rank 0."""
    tensors = {}
    for p in params:
        tensors[f"params/{p.name}"] = assemble(comm, p.global_shape, p.box, p.value)
        for key, val in sorted(optimizer.state[p.name].items()):
            tensors[f"optim/{p.name}/{key}"] = assemble(comm, p.global_shape, p.box, val)
    path = None
    if comm.rank == 0:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"ckpt-{step:08d}.h5")
        tmp = path + ".tmp"
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["version"] = VERSION
            f.attrs["step"] = int(step)
            f.attrs["optimizer_steps"] = int(optimizer.t)
            f.attrs["meta"] = json.dumps(meta, sort_keys=True)
            for name, arr in tensors.items():
                f.create_dataset(name, data=arr)
            f.flush()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    comm.barrier()
    return path


def candidates(directory: str) -> list[str]:
    """Complete checkpoint files, newest first (temporary files of interrupted writes are ignored)."""
    files = [f for f in glob.glob(os.path.join(directory, "ckpt-*.h5")) if _NAME.search(f)]
    return sorted(files, key=lambda f: int(_NAME.search(f).group(1)), reverse=True)


def _read(path: str) -> dict:
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an lbannpy checkpoint (format {f.attrs.get('format')!r})")
        version = int(f.attrs.get("version", -1))
        if version != VERSION:
            raise CheckpointError(f"{path} has checkpoint version {version}; this lbannpy reads {VERSION}")
        out = {"step": int(f.attrs["step"]), "optimizer_steps": int(f.attrs["optimizer_steps"]),
               "meta": json.loads(str(f.attrs["meta"])), "tensors": {}}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out["tensors"][name] = obj
        f.visititems(visit)
        out["tensors"] = {k: v[()] for k, v in out["tensors"].items()}
    return out


def load_newest(directory: str) -> tuple[str, dict] | tuple[None, None]:
    """Newest readable checkpoint in ``directory`` (every rank reads it), skipping broken ones with a note."""
    errors = []
    for path in candidates(directory):
        try:
            return path, _read(path)
        except (OSError, KeyError, ValueError, CheckpointError) as exc:
            errors.append(f"{path}: {exc}")
    if errors:
        raise CheckpointError("no readable checkpoint in " + directory + ": " + "; ".join(errors))
    return None, None


def restore(data: dict, params, optimizer, xp) -> None:
    """Put each tensor's piece (this rank's box of the global array) into params and optimizer state."""
    tensors = data["tensors"]
    for p in params:
        key = f"params/{p.name}"
        if key not in tensors:
            raise CheckpointError(f"checkpoint has no tensor for parameter {p.name}; was it written for "
                                  f"another model?")
        arr = tensors[key]
        if tuple(arr.shape) != tuple(p.global_shape):
            raise CheckpointError(f"parameter {p.name}: checkpoint shape {arr.shape} != model shape "
                                  f"{p.global_shape}")
        sl = tuple(slice(a, e) for a, e in p.box)
        p.value[...] = xp.asarray(arr[sl], dtype=p.value.dtype)
        st = optimizer.state[p.name]
        st.clear()
        prefix = f"optim/{p.name}/"
        for k, v in tensors.items():
            if k.startswith(prefix):
                st[k[len(prefix):]] = xp.asarray(v[sl], dtype=p.value.dtype)
    optimizer.t = data["optimizer_steps"]
