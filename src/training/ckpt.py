"""The trainer's only calls into :mod:`lbannpy.checkpoint`: one small function each for save and resume,
so a new checkpoint storage changes these lines and nothing else."""
from __future__ import annotations

from .errors import UserError


def save(world, ckpt_dir: str, step: int, model, optimizer, reader, rows: list, evals: list) -> None:
    """Who calls: every rank (collective): each unique block of the parameters, optimizer state and layer
    state is written once, by the rank that holds replica 0 of it."""
    from lbannpy import checkpoint

    meta = {"reader": reader.state(), "rows": rows, "evals": evals}
    checkpoint.save(world, ckpt_dir, step, model.params, optimizer, meta, model.layers)


def resume(world, ckpt_dir: str, model, optimizer, reader, xp) -> tuple[str, int, dict]:
    """Who calls: every rank (collective). Parameters, optimizer state and layer state of the newest
    usable checkpoint, each rank reading only its own hyperslabs, then the reader position; returns
    ``(path, step, meta)``, or a :class:`UserError` when there is no checkpoint."""
    import glob
    import os
    import stat

    from lbannpy import checkpoint

    # only regular files (and checkpoint directories) are opened: opening a FIFO (or a device) named like a
    # checkpoint blocks forever
    for cand in sorted(glob.glob(os.path.join(ckpt_dir, "ckpt-*"))):
        mode = os.stat(cand).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"--resume: {cand} is not a regular file ({_kind(mode)}); move it out of "
                            f"{ckpt_dir}/ (checkpoint.dir)")
    path, data = checkpoint.resume(world, ckpt_dir, model.params, optimizer, model.layers, xp)
    if path is None:
        raise UserError(f"--resume: no checkpoint in {ckpt_dir}/ (checkpoint.dir); run without "
                        f"--resume to start from scratch")
    meta = data["meta"]
    reader.load_state(meta["reader"])
    return path, data["step"], meta


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"
