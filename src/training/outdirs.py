"""The run's output and checkpoint directories, checked on rank 0 before any step and held by a lock file.

Checked at start, so a run never trains for hours and then fails at its first checkpoint: each directory
exists or can be created, is a directory, is writable, is not under ``/proc`` or ``/sys``, and (checkpoint
directory) has room for one checkpoint of the estimated size. A lock file in each (``flock``: released by the
kernel when the process ends, however it ends) names the run that holds it, so two runs writing into one
directory get one clear line instead of mixing their files.

A run owns its checkpoint directory: a fresh run (no ``--resume``) into a directory that holds another
run's checkpoints is refused in one line naming them and the choices (``--resume``, another directory, or
``--force-new-run``, which moves them aside into a subdirectory and never deletes them). Otherwise the new
run's checkpoints would sit among the old ones: ``predict`` and ``export`` would take the old run's newest.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time

from .errors import UserError

LOCK_NAME = ".lbannpy.lock"
_held: dict[str, int] = {}  # directory -> fd of its lock, held for the life of the process


def check_dir(path: str, key: str, need_bytes: int = 0) -> None:
    """Raise :class:`UserError` naming ``key`` unless ``path`` is (or can be made) a writable directory
    with ``need_bytes`` free."""
    real = os.path.realpath(path)
    if real == "/proc" or real.startswith(("/proc/", "/sys/")) or real == "/sys":
        raise UserError(f"{key}: {path} is in a virtual file system ({real}); choose a directory on disk")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{key}: {path} exists and is not a directory; choose another {key}")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{key}: cannot create {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}: {path} is not writable")
    if need_bytes:
        free = shutil.disk_usage(path).free
        if free < need_bytes:
            raise UserError(f"{key}: {path} has {free / 2**20:.1f} MiB free, one checkpoint needs about "
                            f"{need_bytes / 2**20:.1f} MiB; free space or choose another {key}")


def free_space_problem(path: str, need_bytes: int) -> str:
    """'' when ``path``'s file system has ``need_bytes`` free, else one clause saying how much it has (asked
    again before each checkpoint: the space a run had at start may have gone to other writers since)."""
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return f"{path}: the free space cannot be read ({exc.strerror or exc})"
    if free >= need_bytes:
        return ""
    return f"{path} has {_size(free)} free, the checkpoint needs about {_size(need_bytes)}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def lock_dir(path: str, key: str, run: str) -> None:
    """Hold ``path/.lbannpy.lock`` for this process; :class:`UserError` naming the holder when another run
    holds it."""
    real = os.path.realpath(path)
    if real in _held:
        return
    lock = os.path.join(path, LOCK_NAME)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another run"
        finally:
            os.close(fd)
        raise UserError(f"{key}: {path} is in use by {holder}; wait for it to end or choose another {key}") \
            from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{run}\n".encode(), 0)
    _held[real] = fd


def claim_checkpoint_dir(path: str, key: str, force_new_run: bool) -> str:
    """Rank 0, a run without ``--resume``, its lock on ``path`` held: :class:`UserError` when ``path``
    holds checkpoints (:func:`lbannpy.checkpoint.candidates`: another run's, since this run has written
    none); with ``force_new_run`` they are moved aside instead (a line says where). Returns that
    directory, '' when there was nothing to move."""
    # late: the checkpoint package (h5py) is loaded by the runs that write checkpoints
    from lbannpy import checkpoint

    found = checkpoint.candidates(path)
    if not found:
        return ""
    names = ", ".join(os.path.basename(p) for p in found[:3]) + (f" and {len(found) - 3} more"
                                                                   if len(found) > 3 else "")
    if not force_new_run:
        raise UserError(f"{key}: {path}/ holds {len(found)} checkpoint(s) of another run ({names}); continue "
                        f"that run with --resume, write to another output.dir (or {key}), or add "
                        f"--force-new-run to move them aside and start a new run")
    ident = checkpoint.verified_identity(found[0]) or {}
    try:
        dest = checkpoint.set_aside(path, found, f"run-{ident.get('run_id') or 'unknown'}")
    except OSError as exc:
        raise UserError(f"--force-new-run: cannot move the checkpoints in {path}/ aside: "
                        f"{exc.strerror or exc}") from None
    sys.stderr.write(f"lbannpy.train: --force-new-run: moved the {len(found)} checkpoint(s) of the earlier "
                     f"run in {path}/ ({names}) to {dest}/; nothing was deleted\n")
    sys.stderr.flush()
    return dest


def this_run(model: str) -> str:
    return (f"the run of model '{model}' started {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()} on "
            f"{socket.gethostname()})")


def checkpoint_bytes(model) -> int:
    """About the size of one checkpoint: every parameter in float64 (as the checkpoint writes them), three
    tensors per parameter (the value and up to two optimizer state tensors)."""
    import numpy as np

    return 3 * 8 * sum(int(np.prod(p.global_shape)) for p in model.params)
