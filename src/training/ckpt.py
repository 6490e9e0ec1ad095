"""The trainer's only calls into :mod:`lbannpy.checkpoint`: one small function each for save and resume,
so a new checkpoint storage changes these lines and nothing else.

Resume identity: every checkpoint records what changes the computation (:func:`computation`: the model's
layers, loss and input, the optimizer and its settings, the floating-point type) and its digest. ``--resume``
refuses a checkpoint whose record differs from the run's, with one line saying what changed; ``--resume
--force`` continues anyway (a note names the changes). What may change on resume without notice: the rank
count and splits (``parallel``), data paths, the number of steps or epochs, output and checkpoint settings.
"""
from __future__ import annotations

import hashlib
import json
import sys
import uuid

from .errors import UserError
from lbannpy.checkpoint import CheckpointError
from lbannpy import checkpoint

_CHANGES_SHOWN = 4  # changes named in the refusal line; the rest are counted
# checkpoint directory -> the run id its checkpoints carry: one per run, kept across --resume
_RUN_IDS: dict[str, str] = {}


def computation(cfg: dict) -> dict:
    """The part of a validated config that changes what a step computes (not where or how often)."""
    model = {k: v for k, v in cfg["model"].items() if k not in ("name", "init")}
    # shard_state changes where the optimizer state lives, not a bit of what a step computes
    optimizer = {k: v for k, v in cfg["optimizer"].items() if k != "shard_state"}
    return {"model": model, "optimizer": optimizer,
            "trainer": {"dtype": cfg["trainer"]["dtype"]}}


def digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _flat(value, path: str, out: dict) -> dict:
    """``{dotted path: scalar}``; layers are keyed by name, so an inserted layer is one change."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(v, f"{path}.{k}" if path else str(k), out)
    elif path == "model.layers" and isinstance(value, list):
        out["model.layers (order)"] = " ".join(str(layer.get("name")) for layer in value)
        for layer in value:
            name = layer.get("name")
            out[f"model.layers.{name}"] = f"a {layer.get('type')} layer"
            _flat({k: v for k, v in layer.items() if k != "name"}, f"model.layers.{name}", out)
    else:
        out[path] = json.dumps(value) if isinstance(value, (list, tuple)) else value
    return out


def changes(old: dict, new: dict) -> list[str]:
    """``path: old -> new`` for every difference between two :func:`computation` records."""
    a, b = _flat(old, "", {}), _flat(new, "", {})
    out = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "(none)") == b.get(k, "(none)"):
            continue
        if k == "model.layers (order)" and set(a[k].split()) != set(b[k].split()):
            continue  # added or removed layers are named on their own
        base = k.rsplit(".", 1)[0]
        if base.startswith("model.layers.") and (base not in a or base not in b):
            continue  # a key of a layer that is wholly added or removed
        out.append(f"{k}: {a.get(k, '(none)')} -> {b.get(k, '(none)')}")
    return out


def changed(meta: dict, record: dict) -> str | None:
    """What changed between the run that wrote a checkpoint with ``meta`` and a run whose record is
    ``record``, in one line (None: nothing, or a checkpoint from before records were kept); raises
    :class:`~lbannpy.checkpoint.CheckpointError` for a checkpoint that cannot be resumed at all."""
    if not isinstance(meta.get("reader"), dict):
        raise CheckpointError("it has no reader position (meta 'reader'); it was not written by "
                              "lbannpy.train")
    old = meta.get("computation")
    if not isinstance(old, dict) or meta.get("computation_digest") == digest(record):
        return None
    diff = changes(old, record) or ["(the records differ in form)"]
    more = f" and {len(diff) - _CHANGES_SHOWN} more" if len(diff) > _CHANGES_SHOWN else ""
    return "; ".join(diff[:_CHANGES_SHOWN]) + more


def _note(msg: str) -> None:
    sys.stderr.write(f"lbannpy.train: {msg}\n")
    sys.stderr.flush()


def save(world, ckpt_dir: str, step: int, model, optimizer, reader, rows: list, evals: list,
         record: dict, keep: int) -> None:
    """Who calls: every rank (collective): each unique block of the parameters, optimizer state and layer
    state is written once, by the rank that holds replica 0 of it; then rank 0 deletes this run's older
    checkpoints beyond the newest ``keep`` (:func:`lbannpy.checkpoint.prune`: never another run's, never
    one it cannot read)."""
    if ckpt_dir not in _RUN_IDS:  # the first checkpoint of a fresh run: rank 0's id on every rank
        _RUN_IDS[ckpt_dir] = world.bcast_obj(uuid.uuid4().hex[:16] if world.rank == 0 else None)
    run_id = _RUN_IDS[ckpt_dir]
    meta = {"reader": reader.state(), "rows": rows, "evals": evals, "computation": record,
            "computation_digest": digest(record), "run_id": run_id}
    optimizer.unshard_state()  # collective where the state is sharded: checkpoints hold it whole
    try:
        final = checkpoint.save(world, ckpt_dir, step, model.params, optimizer, meta, model.layers,
                                run_id=run_id)
    finally:
        optimizer.reshard_state()
    if world.rank == 0:
        try:  # only this run's checkpoints older than the one just written, each read back first
            checkpoint.prune(ckpt_dir, keep, run_id=run_id, newest=final)
        except OSError as exc:  # the new checkpoint is complete; an old one that stays is no failure
            _note(f"warning: could not delete an old checkpoint in {ckpt_dir}/ (checkpoint.keep {keep}): "
                  f"{exc}")


def resume(world, ckpt_dir: str, model, optimizer, reader, xp, record: dict,
           force: bool = False) -> tuple[str, int, dict]:
    """Who calls: every rank (collective). Parameters, optimizer state and layer state of the newest
    usable checkpoint, each rank reading only its own hyperslabs, then the reader position; returns
    ``(path, step, meta)``, or a :class:`UserError` when there is none or it belongs to another
    computation (unless ``force``)."""
    import glob
    import os
    import stat

    # only regular files (and checkpoint directories) are opened: opening a FIFO (or a device) named like a
    # checkpoint blocks forever; a dangling link is skipped with a note (the checkpoint it named is gone)
    for cand in sorted(glob.glob(os.path.join(ckpt_dir, "ckpt-*"))):
        if os.path.islink(cand) and os.path.exists(cand) and not cand.endswith(".tmp"):
            if world.rank == 0:  # what a link names may be anything, anywhere: not a checkpoint here
                _note(f"--resume: skipping {cand}: a symbolic link; a checkpoint is read from a directory "
                      f"of {ckpt_dir}/ itself (copy it in to resume from it)")
            continue
        try:
            mode = os.stat(cand).st_mode
        except OSError as exc:
            if world.rank == 0:
                _note(f"--resume: skipping {cand}: {exc.strerror or exc}"
                      f"{' (a dangling link)' if os.path.islink(cand) else ''}")
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"--resume: {cand} is not a regular file ({_kind(mode)}); move it out of "
                            f"{ckpt_dir}/ (checkpoint.dir)")
    forced = {}

    def check(meta):
        what = changed(meta, record)
        if what and force:
            forced[meta.get("computation_digest")] = what
            return None
        return what and (f"it was written by a run that computed something else: {what}; resume with the "
                         f"checkpoint's settings, or add --force to continue with the new ones")

    try:
        path, data = checkpoint.resume(world, ckpt_dir, model.params, optimizer, model.layers, xp, check)
    except checkpoint.CheckpointRefused as exc:
        raise UserError(f"--resume: {exc}") from None
    optimizer.reshard_state()  # the state was read whole: keep this rank's part
    if path is None:
        raise UserError(f"--resume: no checkpoint in {ckpt_dir}/ (checkpoint.dir); run without "
                        f"--resume to start from scratch")
    meta = data["meta"]
    if meta.get("run_id"):  # later checkpoints of this run carry the run id of the one it resumed
        _RUN_IDS[ckpt_dir] = str(meta["run_id"])
    what = forced.get(meta.get("computation_digest"))
    if what and world.rank == 0:
        _note(f"--resume --force: {path} was written by a run that computed something else ({what}); "
              f"continuing with this run's settings")
    reader.load_state(meta["reader"])
    return path, data["step"], meta


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"
