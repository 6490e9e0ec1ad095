"""Apply a trained model to the samples of an HDF5 file and write class probabilities (or its raw outputs).

``python -m lbannpy.predict CONFIG.h5 --checkpoint CKPT --data IN.h5 -o OUT.h5 [--png N]``, under
``mpiexec``/``srun`` on any number of ranks, or alone: the training split (``parallel.*`` in the config,
another via ``--set``) is used where it runs on the ranks, else :func:`choose_split` picks one that does
(the checkpoint reads on any split).

* The model and loss come from the trainer's set-up (:func:`lbannpy.training.build.build_model`); no
  optimizer and no gradient engine are built. Weights and layer state (batch-norm running statistics) come
  from a checkpoint (a file, or a directory whose newest checkpoint is used).
* Every rank reads only its hyperslab of each mini-batch (samples and spatial box of the model input).
* Output: rank 0 gathers each batch's logits (one batch, never the whole data set) and writes the softmax
  into ``OUT.h5``: ``probabilities`` ``(M, K)`` for classification or ``(M, K, *spatial_out)`` per-cell maps
  for segmentation, and ``sample_ids`` ``(M,)`` (rows of ``IN.h5``). Per loss (:func:`output_map`): the
  softmax over the classes for the cross-entropy losses and dice, the sigmoid for ``bce_with_logits``, and
  for the regression losses (``mse``, ``l1``) the raw outputs, as ``outputs``. ``M`` need not be a multiple
  of the batch size: the last batch is the last ``B`` samples, of which only the new ones are written.
* When ``IN.h5`` holds labels, the metrics are computed exactly as the trainer's evaluation does (mean over
  the full mini-batches of each batch's loss, accuracy and IoU) and printed and stored as attributes.
* ``--png N`` draws the first ``N`` samples (an input channel, the labels if present, the prediction side
  by side) into ``OUT.png``.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import numpy as np

from lbannpy import outputs
from lbannpy.dist import DIM_NAMES
from lbannpy.training.errors import EXIT_USER_ERROR, UserError, agree_on_data, agree_on_error, user_errors

SUBSETS = ("all", "train", "validation")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lbannpy.predict",
        description="Apply a trained model (config + checkpoint) to the samples of an HDF5 file and write "
                    "per-sample class probabilities, or per-cell probability maps for segmentation models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("config", help="the config.h5 (or YAML spec) the model was trained with")
    ap.add_argument("--checkpoint", required=True,
                    help="a checkpoint: its directory ckpt-<step>/ (or that directory's index.h5), a "
                         "version-1 file ckpt-<step>.h5, or checkpoint.dir (its newest is used)")
    ap.add_argument("--data", required=True,
                    help="HDF5 file with the inputs (and optionally labels) under the config's dataset names")
    ap.add_argument("-o", "--output", required=True, help="HDF5 file to write the probabilities to")
    ap.add_argument("--subset", choices=SUBSETS, default="all",
                    help="which samples of --data: all, or the training/validation part of the config's "
                         "data.validation.fraction split (when --data is the training file)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set parallel.default.h=4 (repeatable)")
    ap.add_argument("--png", type=int, default=0, metavar="N",
                    help="draw the first N samples (input channel, labels, prediction) into OUTPUT.png")
    ap.add_argument("--channel", type=int, default=0, help="the input channel --png draws")
    return ap


def parse_args(argv):
    ap = build_parser()
    return ap.parse_args(argv)


def load_weights(path: str, model, xp, world=None) -> tuple[str, int]:
    """Who calls: every rank of ``world`` (collective when given). Parameters and layer state of ``model``
    from a checkpoint, or from the newest usable one in a directory: each rank reads and verifies its own
    blocks, the ranks agree, and a checkpoint that fails on any rank (damaged, a shard missing) is noted
    and the previous one tried, as ``--resume`` does. The only place this module touches
    :mod:`lbannpy.checkpoint`. Returns ``(file, step)``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy import checkpoint

    # a directory of checkpoints: newest first, every rank reading the one rank 0 picked (listed again when
    # a live run prunes it); a checkpoint (file or directory, or a checkpoint directory's index.h5) itself:
    # that one alone
    rank = world.rank if world is not None else 0
    errors = []

    def failed(found, msg, more):
        errors.append(f"{found}: {msg}")
        if rank == 0 and more:
            sys.stderr.write(f"lbannpy.predict: checkpoint {found} cannot be used ({msg}); trying the "
                             f"previous one\n")
            sys.stderr.flush()

    try:
        found, step = checkpoint.restore_newest(world, path, model.params, model.layers, xp, failed)
    except checkpoint.CheckpointError as exc:
        raise UserError(f"--checkpoint {path}: no usable checkpoint: {path}: {exc}") from None
    if found is not None:
        return found, step
    if errors:
        raise UserError(f"--checkpoint {path}: no usable checkpoint: " + "; ".join(errors))
    raise UserError(f"--checkpoint {path}: no checkpoint there (no such file or directory, or an empty "
                    f"checkpoint directory)")


def _outputs(cfg: dict, args) -> tuple[list, list]:
    """``(outputs, inputs)`` for :func:`lbannpy.outputs.claim`: ``-o`` and the drawing beside it, against
    ``--data``, the config, ``--checkpoint`` and what the config reads or keeps (its data files, initial
    weights and checkpoint directory)."""
    outs = [("-o", args.output)]
    if args.png:
        outs.append(("--png", os.path.splitext(args.output)[0] + ".png"))
    ins = [("--data", args.data), ("the config", args.config), ("--checkpoint", args.checkpoint)]
    return outs, ins + outputs.config_inputs(cfg)


def split_candidates(ndim: int, ranks: int) -> list[dict]:
    """Degrees to try on ``ranks`` ranks when the training split does not fit them: the height (what
    splits a huge image), the samples, then every two-way mix of samples and height, and last every rank
    holding the whole model (replicas)."""
    cands = [{"h": ranks}, {"n": ranks}]
    if ndim > 3:
        cands.append({"w": ranks})
    cands += [{"n": a, "h": ranks // a} for a in range(2, ranks) if ranks % a == 0]
    return cands + [{"r": ranks}]


def choose_split(cfg: dict, ranks: int) -> tuple[dict, str]:
    """``(cfg, note)``: the config with a split that runs on ``ranks`` ranks. The training split
    (``parallel.*``) is the default; when it does not fit the rank count (or leaves a block empty), the
    first of :func:`split_candidates` that does replaces it (``note`` says which). Any checkpoint reads on
    any split, as ``--resume`` does."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.config import ConfigError, check_graph, validate

    try:
        return validate(cfg, ranks=ranks, data=False, memory=False), ""
    except ConfigError as exc:
        if not str(exc.path).startswith("parallel"):
            raise
        why = str(exc)
    graph = check_graph(cfg)
    ndim = len(graph.input_shape)
    shapes = [graph.input_shape] + [tuple(n.out_shape) for n in graph if len(n.out_shape) == ndim]
    for degrees in split_candidates(ndim, ranks):
        # a spatial split must cut every map evenly: per-cell labels are read under the prediction's cells
        if any(s[DIM_NAMES[ndim].index(d)] % k for d, k in degrees.items() if d not in ("n", "r")
               for s in shapes):
            continue
        trial = copy.deepcopy(cfg)
        trial["parallel"].update(default=dict(degrees), layers={}, strategy="manual")
        try:
            trial = validate(trial, ranks=ranks, data=False, memory=False)
        except ConfigError:
            continue
        shown = "·".join(f"{k}{v}" for k, v in degrees.items()) if ranks > 1 else "(no split)"
        return trial, (f"the training split does not run on {ranks} rank(s) ({why}); predicting with "
                       f"parallel.default {shown} instead (--set parallel.default.KEY=V chooses another)")
    raise UserError(f"no split of the model runs on {ranks} rank(s): {why}")


def select_ids(cfg: dict, num_samples: int, subset: str) -> np.ndarray:
    """Sorted sample ids of ``--data`` to predict (the trainer's split for ``train``/``validation``)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.data.dataset import split_indices

    if subset == "all":
        return np.arange(num_samples, dtype=np.int64)
    frac = float((cfg["data"].get("validation") or {}).get("fraction") or 0)
    if not frac:
        raise UserError(f"--subset {subset}: the config has no data.validation.fraction to split by")
    train, val = split_indices(num_samples, frac, int(cfg["trainer"]["seed"]))
    return np.asarray(train if subset == "train" else val, dtype=np.int64)


def batches(ids: np.ndarray, batch_size: int):
    """``(batch_ids, first_new)`` for every batch: full batches in order, then (when ``len(ids)`` is not a
    multiple) the last ``batch_size`` ids, of which rows ``first_new:`` were not predicted yet."""
    n_full = len(ids) // batch_size
    for j in range(n_full):
        yield ids[j * batch_size:(j + 1) * batch_size], 0
    rest = len(ids) - n_full * batch_size
    if rest:
        yield ids[-batch_size:], batch_size - rest


def _read(ds, ids: np.ndarray, box) -> np.ndarray:
    """This rank's block: samples ``ids`` (increasing) restricted to ``box`` (the non-sample dimensions)."""
    sel = tuple(slice(a, b) for a, b in box)
    if len(ids) and ids[-1] - ids[0] + 1 == len(ids):
        return ds[(slice(int(ids[0]), int(ids[-1]) + 1),) + sel]
    return ds[(list(map(int, ids)),) + sel]


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0, e) / (1.0 + e)


def output_map(kind: str):
    """``(dataset name, function)``: what predict writes of the model's outputs under loss ``kind``."""
    if kind in ("mse", "l1"):  # regression: the outputs are the predictions
        return "outputs", lambda z: z
    return "probabilities", sigmoid if kind == "bce_with_logits" else softmax


def _open_data(cfg: dict, path: str, model, loss):
    """``(num_samples, has_labels)``; the inputs checked against the model's input."""
    import h5py

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.data.check import data_file_problem
    from lbannpy.data.dataset import DataError, validate_dataset

    train = cfg["data"]["train"]
    problem = data_file_problem(path)  # missing, a directory, empty, unreadable, locked, not HDF5
    if problem is not None:
        raise UserError(f"--data {path}: {problem}")
    with h5py.File(path, "r") as f:
        has_labels = train["labels"] in f
        if train["inputs"] not in f:
            raise UserError(f"--data {path}: no dataset '{train['inputs']}' (data.train.inputs); found "
                            f"{sorted(f.keys())}")
        xs, xdt = f[train["inputs"]].shape, f[train["inputs"]].dtype
    shape = model.input_shape
    if has_labels:
        try:
            validate_dataset(path, train["inputs"], train["labels"], expected_channels=shape[1],
                             expected_spatial=shape[2:], label_shape=loss.label_shape,
                             float_labels=loss.targets)
        except DataError as exc:
            raise UserError(str(exc)) from exc
    elif tuple(xs[1:]) != tuple(shape[1:]):
        raise UserError(f"--data {path}: dataset '{train['inputs']}' has samples of shape {tuple(xs[1:])}; "
                        f"the model expects {tuple(shape[1:])}")
    elif xdt.kind != "f":  # as with labels: bytes, booleans and complex numbers (the model's real dtype
        # would drop the imaginary part) are refused, not converted
        raise UserError(f"--data {path}: dataset '{train['inputs']}' has dtype {xdt}; expected floating "
                        f"point (float32 or float64)")
    return int(xs[0]), has_labels


def predict(cfg: dict, rt, args) -> dict:
    """Who calls: every rank (the model's communicators, the per-batch gather and metrics are collective).
    Returns the metrics (empty without labels)."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.config import validate
    from lbannpy.training.watchdog import Watchdog

    world = rt.world
    # before any other collective: every rank agrees that the outputs may be written and that rank 0
    # created their temporaries (an output rank 0 cannot create ends every rank here, not in a gather)
    pending = outputs.claim(world, *_outputs(cfg, args))
    try:
        cfg = validate(cfg, memory=False)  # the estimate prices training
        cfg, note = choose_split(cfg, world.size)
        if note and world.rank == 0:
            sys.stdout.write(f"lbannpy.predict: {note}\n")
            sys.stdout.flush()
        tr = cfg["trainer"]
        # as in training: a rank that makes no progress (a peer gone, a file system stuck) aborts every rank
        watchdog = Watchdog(float(tr["watchdog_s"] or 0), world.rank, world.abort).start()
        try:
            return _predict(cfg, rt, args, watchdog, pending)
        finally:
            watchdog.stop()
    finally:  # a temporary not renamed by now is removed (rank 0 writes them; the others only knew them)
        for p in pending:
            p.discard() if world.rank == 0 else p.forget()


def _predict(cfg: dict, rt, args, watchdog, pending) -> dict:
    import h5py

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.backend import to_numpy
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.timer import Timer
    from lbannpy.tensor import DistTensor
    from lbannpy.training.build import build_model

    world = rt.world
    tr = cfg["trainer"]
    ctx = LayerContext(world, rt.xp, tr["dtype"], int(tr["seed"]),
                       overlap=False, timer=Timer(events=[]))
    watchdog.progress("building the model")
    model, loss = build_model(cfg, ctx, world, "lbannpy.predict")
    watchdog.progress("reading the checkpoint")
    ckpt_path, step = load_weights(args.checkpoint, model, rt.xp, world)
    model.set_train(False)
    num, has_labels = _open_data(cfg, args.data, model, loss)
    ids = select_ids(cfg, num, args.subset)
    bsz = model.input_shape[0]
    if len(ids) < bsz:
        raise UserError(f"--data {args.data}: {len(ids)} samples selected, fewer than the model's batch size "
                        f"{bsz}; --set trainer.batch_size={len(ids)} (with a rank layout that divides it)")
    names = cfg["data"]["train"]
    in_box = model.input_dist.box(model.input_shape, world.rank)
    lab_box = loss.label_box()
    totals, n_full = {}, 0
    out_fn = output_map(loss.kind)[1]
    # rank 0 writes the temporary and renames it when complete: a failed run leaves no half file, and
    # never truncates an existing one
    out = _Out(pending[0], world.rank == 0)
    try:
        out.open(h5py, output_map(loss.kind)[0], (len(ids),) + tuple(model.output.out_shape)[1:], ctx.dtype,
                 ids)
        with h5py.File(args.data, "r") as fin:
            dx = fin[names["inputs"]]
            dy = fin[names["labels"]] if has_labels else None
            for bids, first_new in batches(ids, bsz):
                watchdog.progress(f"predicting the batch of samples from {int(bids[0])}")
                x = _read(dx, bids[in_box[0][0]:in_box[0][1]], in_box[1:])
                xt = DistTensor(rt.xp.asarray(x, dtype=ctx.dtype), model.input_shape, model.input_dist,
                                world.rank)
                logits = model.forward(xt)
                if dy is not None and first_new == 0:
                    lab = _read(dy, bids[lab_box[0][0]:lab_box[0][1]], lab_box[1:])
                    _, m = loss.forward(logits, lab)
                    for k, v in m.items():
                        totals[k] = totals.get(k, 0.0) + v
                    n_full += 1
                full = logits.gather(world, root=0)
                # a failed write (a full disk) stops every rank at this batch, with one line naming the file
                agree_on_data(world, out.add(lambda: out_fn(to_numpy(full).astype(np.float64))[first_new:]))
        metrics = {k: v / n_full for k, v in totals.items()} if n_full else {}
        out.finish(lambda fout: _provenance(fout, cfg, args, ckpt_path, step, metrics, n_full))
    finally:
        out.close()
    if world.rank == 0:
        _report(cfg, args, ckpt_path, step, len(ids), world.size, metrics, n_full, bsz, pending[1:])
    return metrics


class _Out:
    """Rank 0's output file (HDF5 through an :class:`lbannpy.outputs.FileSink` on the claimed temporary);
    on the other ranks every method does nothing. Write failures come back as one line, never as h5py's
    traceback or a crash at exit."""

    def __init__(self, pending, writer: bool):
        self.pending, self.writer = pending, writer
        self.sink = self.fout = self.probs = None
        self.row = 0

    def _problem(self) -> str | None:
        err = self.sink.error if self.sink is not None else None
        return str(self.pending.failed(err)) if err is not None else None

    def open(self, h5py, name: str, shape: tuple, dtype, ids) -> None:
        if self.writer:
            self.sink = self.pending.sink()
            self.fout = h5py.File(self.sink, "w")
            self.probs = self.fout.create_dataset(name, shape=shape, dtype=dtype, chunks=(1,) + shape[1:])
            self.fout.create_dataset("sample_ids", data=ids)

    def add(self, rows) -> str | None:
        """Rank 0: append ``rows()``; the write's problem, if any (every rank: None otherwise)."""
        if not self.writer:
            return None
        p = rows()
        self.probs[self.row:self.row + len(p)] = p
        self.row += len(p)
        return self._problem()

    def finish(self, attrs) -> None:
        """Rank 0: ``attrs(file)``, close, and rename the temporary over the output."""
        if self.writer:
            attrs(self.fout)
            self.close()
            if self.sink.error is not None:
                raise self.pending.failed(self.sink.error)
            self.pending.commit()

    def close(self) -> None:
        if self.fout is not None:
            fout, self.fout = self.fout, None
            try:
                fout.close()
            except (OSError, RuntimeError):
                if self.sink.error is None:  # else HDF5 stumbles on what the sink could not write:
                    raise  # the sink's error is the one to report
        if self.sink is not None:
            self.sink.close()


def _provenance(fout, cfg: dict, args, ckpt_path: str, step: int, metrics: dict, n_full: int) -> None:
    """Rank 0: where the probabilities come from (checkpoint, step, data, subset, model) and the metrics, as
    attributes of the output file."""
    fout.attrs["checkpoint"] = os.path.abspath(ckpt_path)
    fout.attrs["step"] = step
    fout.attrs["data"] = os.path.abspath(args.data)
    fout.attrs["subset"] = args.subset
    fout.attrs["model"] = str(cfg["model"]["name"])
    for k, v in metrics.items():
        fout.attrs[f"metric_{k}"] = v
    fout.attrs["metric_batches"] = n_full


def _report(cfg: dict, args, ckpt_path: str, step: int, n_ids: int, ranks: int, metrics: dict, n_full: int,
            bsz: int, pngs=()) -> None:
    """Rank 0: what was predicted, the metrics, and the drawing when ``--png`` asks for one."""
    where = f"{n_ids} sample(s) of {args.data} ({args.subset})"
    sys.stdout.write(f"lbannpy.predict: {cfg['model']['name'] or 'model'} at step {step} from "
                     f"{ckpt_path} on {where}, {ranks} rank(s) -> {args.output}\n")
    if metrics:
        sys.stdout.write("lbannpy.predict: " + ", ".join(f"{k} {v:.6f}" for k, v in metrics.items())
                         + f" (mean over {n_full} full batch{'es' if n_full != 1 else ''} of {bsz}, "
                           f"as the trainer's validation)\n")
    for png in pngs:  # the claimed drawing: drawn into its temporary, renamed when complete
        try:
            draw(args.data, cfg["data"]["train"], args.output, png.tmp, args.png, args.channel)
        except OSError as exc:
            png.discard()
            raise png.failed(exc) from None
        png.commit()
        sys.stdout.write(f"lbannpy.predict: {min(args.png, n_ids)} sample(s) drawn in {png.path}\n")
        sys.stdout.write(f"lbannpy.predict: {resolution_line(args.output, cfg)}\n")
    sys.stdout.flush()


def resolution_line(out: str, cfg: dict) -> str:
    """What the drawing's prediction map is against the input, e.g. ``prediction 8×8 per pixel, 1/8 of the
    input's resolution 64×64``: a map coarser than the labels beside it is said to be, not left to guess."""
    import h5py

    with h5py.File(out, "r") as fo:
        shape = fo["outputs" if "outputs" in fo else "probabilities"].shape  # regression: raw outputs
    ins = [int(s) for s in cfg["model"]["input"]["spatial"]]
    if len(shape) == 2:
        return f"prediction per sample ({shape[1]} classes) for inputs of {'×'.join(map(str, ins))}"
    outs = list(shape[2:])
    what = {1: "point", 2: "pixel", 3: "voxel"}.get(len(outs), "cell")
    head = f"prediction {'×'.join(map(str, outs))} per {what}"
    if outs == ins:
        return f"{head} at the input's resolution {'×'.join(map(str, ins))}"
    factors = {i / o for i, o in zip(ins, outs)}
    f = factors.pop() if len(factors) == 1 else None
    rel = (f"1/{f:g}" if f is not None and f >= 1 else
           "×".join(f"{o}/{i}" for o, i in zip(outs, ins)))
    return f"{head}, {rel} of the input's resolution {'×'.join(map(str, ins))}"


def draw(data: str, names: dict, out: str, png: str, n: int, channel: int) -> None:
    """Rank 0: one row per sample: input channel, labels (if present), prediction (positive class
    probability for two classes, else the argmax class; for classification the class probabilities; raw
    outputs and float targets: their first channel)."""
    import h5py
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with h5py.File(out, "r") as fo:
        ids = fo["sample_ids"][:n]
        raw = "outputs" in fo  # a regression model's raw outputs
        probs = fo["outputs" if raw else "probabilities"][:n]
    with h5py.File(data, "r") as fi:
        x = np.stack([fi[names["inputs"]][int(i), channel] for i in ids])
        y = np.stack([fi[names["labels"]][int(i)] for i in ids]) if names["labels"] in fi else None
    seg = probs.ndim > 2
    if y is not None and y.ndim == probs.ndim:  # float targets of the output's shape: the first channel
        y = y[:, 0]
    if seg and (raw or probs.shape[1] == 1):  # one map to draw: the first channel as it is
        probs = probs[:, :1]
    top = probs.shape[1] - 1
    cols = 3 if (seg and y is not None) else 2
    fig, axes = plt.subplots(len(ids), cols, figsize=(3.2 * cols, 3.0 * len(ids)), squeeze=False)
    for r, i in enumerate(ids):
        ax = axes[r]
        img = x[r] if x[r].ndim == 2 else x[r][x[r].shape[0] // 2] if x[r].ndim == 3 else x[r][None]
        ax[0].imshow(img, cmap="viridis")
        ax[0].set_title(f"sample {int(i)}: input channel {channel}", fontsize=9)
        if seg:
            if y is not None:
                ax[1].imshow(y[r] if y[r].ndim == 2 else y[r][y[r].shape[0] // 2], cmap="viridis" if raw
                             else "gray", vmin=None if raw else 0, vmax=None if raw else max(1, top))
                ax[1].set_title("labels", fontsize=9)
            p = probs[r]
            pm = p[1] if p.shape[0] == 2 else p[0] if p.shape[0] == 1 else p.argmax(axis=0)
            pm = pm if pm.ndim == 2 else pm[pm.shape[0] // 2]
            im = ax[cols - 1].imshow(pm, cmap="viridis" if raw else "gray", vmin=None if raw else 0,
                                     vmax=None if raw else max(1, top))
            title = ("prediction: output channel 0" if raw else "prediction: P(class 1)" if p.shape[0] <= 2
                     else "prediction: class")
            ax[cols - 1].set_title(title, fontsize=9)
            fig.colorbar(im, ax=ax[cols - 1], fraction=0.046)
        else:
            ax[1].bar(range(probs.shape[1]), probs[r])
            lab = f", label {y[r]:g}" if y is not None else ""
            what = "output" if raw else f"class probabilities (argmax {int(probs[r].argmax())}"
            ax[1].set_title(f"{what}{lab}{'' if raw else ')'}", fontsize=9)
            if not raw:
                ax[1].set_ylim(0, 1)
        for a in ax[:cols if seg else 1]:
            a.set_xticks([])
            a.set_yticks([])
    fig.tight_layout()
    fig.savefig(png, dpi=80, format="png")  # png: the drawing's temporary, whose name ends .tmp-PID
    plt.close(fig)


def _traceback_file(args, rank: int) -> str:
    """Rank ``rank``'s traceback of an unexpected error, written beside the output; where it went."""
    import traceback

    path = f"{os.path.splitext(args.output)[0]}.rank{rank}.traceback.txt"
    try:
        with open(path, "w") as fh:
            traceback.print_exc(file=fh)
    except OSError as exc:
        return f"its traceback could not be written to {path}: {exc.strerror or exc}"
    return f"traceback in {path}"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import Runtime
    from lbannpy.config import ConfigError, apply_overrides, load_config
    from lbannpy.backend import device_problem, launched_ranks_on_node
    from lbannpy.config.run import launch_sections
    from lbannpy.threads import threads_problem
    from lbannpy.training.errors import refuse_before_mpi

    try:
        cfg = apply_overrides(load_config(args.config), args.overrides)
        early = None
    except ConfigError as exc:
        cfg, early = None, exc
    runtime, _ = launch_sections(cfg)
    if cfg is not None:  # a config this machine cannot run: one line, exit 2, before MPI starts (as train)
        problem = device_problem(runtime.device, runtime.backend, runtime.share_gpu,
                                 launched_ranks_on_node()) or threads_problem(runtime.threads)
        if problem is not None:
            return refuse_before_mpi("lbannpy.predict", f"{args.config}: {problem}")
    with Runtime(backend=runtime.backend, device=runtime.device, share_gpu=runtime.share_gpu) as rt:
        world = rt.world
        err = f"{args.config}: {early}" if early is not None else None
        if err is None:
            # late: loaded when the command runs, so its --help and argument errors come without it
            from lbannpy.threads import set_threads

            set_threads(world, runtime.threads, "lbannpy.predict")
            try:
                # a signal on any rank: the temporaries removed, one line, every rank ended
                with outputs.SignalCleanup("lbannpy.predict", world.rank, world.size, world.abort):
                    predict(cfg, rt, args)
            except user_errors() as exc:
                err = f"{exc}"
            except Exception as exc:  # agreed on and said in one line; the traceback goes to a file
                err = f"{type(exc).__name__}: {exc} ({_traceback_file(args, world.rank)})"
        # every rank took the same path up to the first collective a user error can stop; agree on exit
        if agree_on_error(world, err, "lbannpy.predict"):
            return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
