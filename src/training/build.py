"""Set-up: config -> model, loss, readers, optimizer (no communication engine: :mod:`.gradsync`).

:func:`build_model` and :func:`build_readers` need no optimizer, so inference (a ``predict`` command) can
re-use them; :func:`build` adds the training-only parts.

What a run refuses at start-up is decided here once: :func:`start_checks` (the config, the rank count, the
data files, the device) and then :func:`build` itself. ``train`` runs both on its ranks; :func:`check_run`
(``config validate`` and the jobs' in-job check) runs the same two for a rank count it does not have, with
:func:`build` on a stand-in world, so a config one accepts the other accepts, and a refusal has the same
words in both.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from .errors import UserError
from lbannpy.backend import device_problem
from lbannpy.comm.loopback import LoopbackCommunicator
from lbannpy.config_errors import ConfigError
from lbannpy.data.dataset import DataError
from lbannpy.dist import DistributionError
from lbannpy.layers.base import LayerError
from lbannpy.layers.context import LayerContext
from lbannpy.layers.kernels.select import KernelChoiceError, conv_kernels
from lbannpy.machine import DEFAULT_MACHINE
from lbannpy.strategy.planner import PlanError, plan
from lbannpy.threads import threads_problem
from lbannpy.layers.loss import Loss
from lbannpy.model import Model, ModelError
from lbannpy.data.dataset import split_indices, validate_dataset
from lbannpy.data.reader import HDF5Reader
from lbannpy.config import check_memory, validate
from lbannpy.config.run import RunConfig, run_config, section_config
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


def build_readers(cfg: dict, model, loss, world, shuffle: bool = True, dry: bool = False):
    """The training reader and the validation reader (or None): every rank reads its own hyperslab.
    ``dry``: readers of the stand-in world of :func:`check_run`, which set up (every check of the real
    one) but read no sample, preload nothing and start no thread."""
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
    if dry:  # a stand-in world gathers nothing: each check raises its own error
        common.update(comm=None, preload="never", metadata_only=True)
        depth = 0
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


def build(run: RunConfig, ctx, world, dry: bool = False, data: bool = True,
          prog: str = "lbannpy.train") -> Parts:
    """Everything training needs but gradient synchronisation, from a run config. ``dry`` (from
    :func:`check_run`): the same set-up on a stand-in world, with readers that read nothing (none without
    ``data``) and no optimizer state."""
    cfg = run.spec
    auto = cfg["parallel"]["strategy"] == "auto"
    if auto:
        cfg["parallel"] = auto_strategy(cfg, world, run.trainer.batch_size, prog)
    # every rank refuses a run whose estimated peak exceeds runtime.memory_gib before allocating any of it
    est = check_memory(cfg, world.size, data=data, planned=False,
                       chosen_by="strategy auto: the planner's choice" if auto else "")
    model, loss = build_model(cfg, ctx, world, prog)
    if not data:
        return Parts(cfg=cfg, settings=None, model=model, loss=loss, reader=None, val_reader=None,
                     optimizer=None, memory=est)
    reader, val_reader = build_readers(cfg, model, loss, world, run.data.train.shuffle, dry)
    st = settings(run, len(reader.indices))
    optimizer = None if dry else make_optimizer(run.optimizer, model.params, st.total_steps)
    return Parts(cfg=cfg, settings=st, model=model, loss=loss, reader=reader, val_reader=val_reader,
                 optimizer=optimizer, memory=est)


def check_device(cfg: dict) -> None:
    """What this machine cannot run (``runtime.device``, ``backend``, ``share_gpu``, ``threads``; a
    ``runtime.kernels`` set named outright that cannot run here), refused in the words of the checks train
    makes (:func:`lbannpy.backend.device_problem` and :func:`lbannpy.threads.threads_problem` before MPI
    starts, :func:`lbannpy.layers.kernels.select.conv_kernels` at set-up), which name the key."""
    rt = cfg["runtime"]
    problem = device_problem(rt["device"], rt["backend"], rt["share_gpu"]) or threads_problem(rt["threads"])
    if problem:
        raise ConfigError("", problem)
    if rt["kernels"] in ("cudnn", "aten"):  # a set named outright must run here (auto and own always do)
        try:
            conv_kernels(rt["kernels"], rt["device"])
        except KernelChoiceError as exc:
            raise ConfigError("", str(exc)) from None


def start_checks(cfg: dict, ranks: int | None, data: bool = True, base_dir: str | None = None,
                 device: bool = True) -> dict:
    """The checks a run makes before it builds anything: the config (schema, references, shapes), the
    rank count, the data files (``data``) and this machine's device (``device``). Returns the normal
    form; raises :class:`ConfigError` naming the key. Train's set-up calls it on its rank count."""
    cfg = validate(cfg, ranks=ranks, data=data, base_dir=base_dir, memory=False)
    if device:
        check_device(cfg)
    return cfg


def check_run(cfg: dict, ranks: int | None, data: bool = True, base_dir: str | None = None,
              prog: str = "lbannpy.config") -> tuple[dict, object]:
    """Everything ``train`` checks at start-up on ``ranks`` ranks, here without them: :func:`start_checks`,
    then :func:`build` for rank 0 of ``ranks`` on a stand-in world (:class:`LoopbackCommunicator`, NumPy):
    the model's, the loss's and the readers' own set-up checks, the memory estimate. Returns the normal form
    and the memory estimate; a refusal is a :class:`ConfigError` with train's words. Without ``ranks``
    the set-up is tried on the ranks the written split needs, where that is one rank."""
    cfg = start_checks(cfg, ranks, data, base_dir)
    n = ranks if ranks is not None else 1
    if ranks is None and not _fits_one_rank(cfg):  # validate without --ranks: the config's own checks only
        return cfg, check_memory(cfg, 1, data=data, base_dir=base_dir)
    world = LoopbackCommunicator(n, 0)
    run = run_config(cfg)
    ctx = LayerContext(world, np, run.trainer.dtype, run.trainer.seed, overlap=False)
    try:
        parts = build(run, ctx, world, dry=True, data=data, prog=prog)
    except ConfigError:
        raise
    except (UserError, LayerError, ModelError, DataError, DistributionError) as exc:
        raise ConfigError("", f"{exc}") from None
    for reader in (parts.reader, parts.val_reader):
        if reader is not None:
            reader.close()
    return cfg, parts.memory


def _fits_one_rank(cfg: dict) -> bool:
    par = cfg["parallel"]
    splits = [par["default"]] + list(par["layers"].values())
    return par["strategy"] != "auto" and all(int(v) == 1 for d in splits for v in d.values())
