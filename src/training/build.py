"""Set-up: config -> model, loss, readers, optimizer (no communication engine: :mod:`.gradsync`).

:func:`build_model` and :func:`build_readers` need no optimizer, so inference (a ``predict`` command) can
re-use them; :func:`build` adds the training-only parts.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from .errors import UserError
from lbannpy.machine import DEFAULT_MACHINE
from lbannpy.strategy.planner import PlanError, plan
from lbannpy.layers.loss import Loss
from lbannpy.model import Model
from lbannpy.data.dataset import split_indices, validate_dataset
from lbannpy.data.reader import HDF5Reader
from lbannpy.config import check_memory
from lbannpy.config.run import RunConfig, section_config
from lbannpy.optim import make_optimizer


@dataclass(frozen=True)
class Settings:
    """The trainer's scalar settings, read once from the validated config."""

    batch_size: int
    seed: int
    dtype: str
    out_dir: str
    log_every: int
    ckpt_dir: str
    ckpt_keep: int
    ckpt_every: int
    ckpt_at_end: bool
    total_steps: int
    steps_per_epoch: int
    eval_every: int


@dataclass(frozen=True)
class Parts:
    cfg: dict
    settings: Settings
    model: object
    loss: object
    reader: object
    val_reader: object
    optimizer: object
    memory: object = None  # the lbannpy.strategy.memory.MemoryEstimate set-up checked


def settings(run: RunConfig, train_samples: int) -> Settings:
    """The settings a run derives from its config and the training set's size (steps, directories)."""
    tr, out, ck = run.trainer, run.output, run.checkpoint
    steps_per_epoch = train_samples // tr.batch_size
    total = tr.steps if tr.steps else tr.epochs * steps_per_epoch
    return Settings(batch_size=tr.batch_size, seed=tr.seed, dtype=tr.dtype, out_dir=out.dir,
                    log_every=out.log_every, ckpt_dir=ck.dir or os.path.join(out.dir, "ckpt"),
                    ckpt_keep=ck.keep, ckpt_every=ck.every_steps, ckpt_at_end=True, total_steps=total,
                    steps_per_epoch=steps_per_epoch, eval_every=tr.eval_every or steps_per_epoch)


def auto_strategy(cfg: dict, world, batch_size: int, prog: str = "lbannpy.train") -> dict:
    """``parallel.strategy: auto``: rank 0 runs the selector (its search has a time budget, so ranks
    could disagree if each ran it) and broadcasts the per-layer degrees to every rank.

    Who calls: every rank (a broadcast)."""
    par = cfg["parallel"]
    typed = section_config("parallel", par)  # the schema's defaults (a raw spec may leave keys out)
    machine = typed.machine or DEFAULT_MACHINE
    layers, err = None, None
    if world.rank == 0:
        try:
            chosen = plan(cfg, world.size, machine, memory_gib=typed.memory_gib,
                          batch_size=batch_size, compare=False)
            layers = chosen.parallel_layers()
            sys.stderr.write(f"{prog}: strategy auto on {world.size} rank(s), machine "
                             f"{machine}: predicted step {chosen.chosen.step_s * 1e3:.1f} ms\n")
        except (PlanError, ValueError, OSError) as exc:
            err = f"parallel.strategy auto: {exc}"
    layers, err = world.bcast_obj((layers, err))
    if err:
        raise UserError(err)
    return dict(par, layers=layers, strategy="manual")


def build_model(cfg: dict, ctx, world, prog: str = "lbannpy.train"):
    """The model (each layer with its distribution) and the loss. Who calls: every rank (group
    communicators are created collectively). May replace ``cfg["parallel"]`` (strategy auto). ``prog``
    begins the notes it prints (the command that runs it)."""
    batch_size = int(cfg["trainer"]["batch_size"])
    if cfg["parallel"]["strategy"] == "auto":
        cfg["parallel"] = auto_strategy(cfg, world, batch_size, prog)
    mspec = cfg["model"]
    model = Model(mspec, batch_size, ctx, cfg.get("parallel"))
    if world.rank == 0 and world.size > 1:
        if all(max(layer.out_dist.parts) == 1 for layer in model.layers):
            note = model.rank_note or "as written"
            sys.stderr.write(f"{prog}: every layer is replicated on the {world.size} ranks (each "
                             f"computes the whole batch of {batch_size}): {note}\n")
        elif model.rank_note:
            sys.stderr.write(f"{prog}: {model.rank_note}\n")
    in_shape = model.input_shape
    loss_kind = mspec["loss"]
    label_shape = (batch_size,) + tuple(in_shape[2:]) if loss_kind == "pixel_cross_entropy" else None
    loss = Loss(loss_kind, ctx, model.output.out_shape, model.output.out_dist, label_shape)
    return model, loss


def build_readers(cfg: dict, model, loss, world, shuffle: bool = True):
    """The training reader and the validation reader (or None): every rank reads its own hyperslab."""
    data, tr = cfg["data"], cfg["trainer"]
    train = data["train"]
    batch_size, seed = tr["batch_size"], tr["seed"]
    in_shape = model.input_shape
    info = validate_dataset(train["path"], train["inputs"], train["labels"],
                            expected_channels=in_shape[1], expected_spatial=in_shape[2:],
                            label_shape=loss.label_shape, float_labels=loss.targets)
    # train/validation split: a fraction of the file (same on every rank), or a file of its own
    val = data.get("validation") or {}  # an optional section: absent when not given
    if val.get("fraction"):
        train_idx, val_idx = split_indices(info.num_samples, float(val["fraction"]), seed)
    else:
        train_idx, val_idx = np.arange(info.num_samples), None
    if len(train_idx) < batch_size:
        raise UserError(f"data.train: {len(train_idx)} training samples in {train['path']} are fewer than "
                        f"trainer.batch_size {batch_size}; lower the batch size")
    common = dict(inputs=train["inputs"], labels=train["labels"], dist=model.input_dist,
                  rank=world.rank, batch_size=batch_size, label_dist=loss.label_dist,
                  comm=world, expected_channels=in_shape[1], expected_spatial=in_shape[2:],
                  num_classes=loss.label_classes, preload=data["preload"],
                  label_factors=loss.factors,  # per-pixel labels reduced to prediction cells once, as read
                  label_shape=loss.label_shape, targets=loss.targets)  # float targets, dice labels
    depth = data["prefetch"]
    reader = HDF5Reader(train["path"], seed=seed, shuffle=shuffle, indices=train_idx,
                        prefetch=depth > 0, depth=max(depth, 1), name=f"data.train ({train['path']})",
                        **common)
    val_reader = None
    if val.get("path"):
        val_reader = HDF5Reader(val["path"], seed=seed, shuffle=False, prefetch=False,
                                name=f"data.validation ({val['path']})", **common)
    elif val_idx is not None and len(val_idx) >= batch_size:
        val_reader = HDF5Reader(train["path"], seed=seed, shuffle=False, indices=val_idx,
                                prefetch=False, name=f"data.validation ({train['path']})", **common)
    elif val_idx is not None:
        raise UserError(f"data.validation.fraction holds out {len(val_idx)} samples, fewer than "
                        f"trainer.batch_size {batch_size}; raise the fraction or lower the batch size")
    return reader, val_reader


def build(run: RunConfig, ctx, world) -> Parts:
    """Everything training needs but gradient synchronisation, from a run config."""
    cfg = run.spec
    if cfg["parallel"]["strategy"] == "auto":
        cfg["parallel"] = auto_strategy(cfg, world, run.trainer.batch_size)
    # every rank refuses a run whose estimated peak exceeds runtime.memory_gib before allocating any of it
    est = check_memory(cfg, world.size, planned=False)
    model, loss = build_model(cfg, ctx, world)
    reader, val_reader = build_readers(cfg, model, loss, world, run.data.train.shuffle)
    st = settings(run, len(reader.indices))
    optimizer = make_optimizer(run.optimizer, model.params, st.total_steps)
    return Parts(cfg=cfg, settings=st, model=model, loss=loss, reader=reader, val_reader=val_reader,
                 optimizer=optimizer, memory=est)
