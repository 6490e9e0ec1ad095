"""The trainer's only calls into :mod:`lbannpy.checkpoint`: one small function each for save, find and
restore, so a new checkpoint storage changes these lines and nothing else."""
from __future__ import annotations

from .errors import UserError


def save(world, ckpt_dir: str, step: int, model, optimizer, reader, rows: list, evals: list) -> None:
    """Who calls: every rank, walking the layers in the same order (collective)."""
    from lbannpy import checkpoint

    meta = {"reader": reader.state(), "rows": rows, "evals": evals, "layers": {}}
    for layer in model.layers:
        st = layer.state()
        if st:
            meta["layers"][layer.name] = st
    checkpoint.save(world, ckpt_dir, step, model.params, optimizer, meta)


def load_newest(ckpt_dir: str):
    """``(path, data)`` of the newest complete checkpoint; a :class:`UserError` when there is none."""
    import os
    import stat

    from lbannpy import checkpoint

    # only regular files are opened: opening a FIFO (or a device) named like a checkpoint blocks forever
    for cand in checkpoint.candidates(ckpt_dir):
        mode = os.stat(cand).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"--resume: {cand} is not a regular file ({_kind(mode)}); move it out of "
                            f"{ckpt_dir}/ (checkpoint.dir)")
    path, data = checkpoint.load_newest(ckpt_dir)
    if path is None:
        raise UserError(f"--resume: no checkpoint in {ckpt_dir}/ (checkpoint.dir); run without "
                        f"--resume to start from scratch")
    return path, data


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def restore(data, model, optimizer, reader, xp) -> tuple[int, dict]:
    """Parameters, optimizer state, reader position and layer state; returns ``(step, meta)``."""
    from lbannpy import checkpoint

    checkpoint.restore(data, model.params, optimizer, xp)
    meta = data["meta"]
    reader.load_state(meta["reader"])
    for layer in model.layers:  # running statistics and step counters that live in layers
        st = meta.get("layers", {}).get(layer.name)
        if st:
            layer.load_state(st)
    return data["step"], meta
