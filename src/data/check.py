"""``python -m lbannpy.data check FILE``: scan a whole data file before a run, in chunks of bounded size.

Reports non-finite inputs (first sample and count), labels outside ``[0, classes)`` (first sample, value
and count), float targets (regression and binary losses) that are not finite or, for ``bce_with_logits``,
outside ``[0, 1]``, and a file that does not fit the model of a spec
(:func:`~lbannpy.data.dataset.validate_dataset` with the spec's input shape and the labels its loss reads).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .dataset import DataError, validate_dataset
from .integrity import check_complete, label_problem
from lbannpy.config import check_graph, load_config, validate

CHUNK_BYTES = 64 << 20


@dataclass
class Expect:
    """What the model of a spec needs from the file (all optional)."""

    inputs: str = "inputs"
    labels: str = "labels"
    channels: int | None = None
    spatial: tuple[int, ...] | None = None
    classes: int | None = None
    per_pixel: bool | None = None
    source: str = ""
    form: object = None     # the loss's LabelForm where it reads other labels than cross-entropy's


@dataclass
class Findings:
    samples: int = 0
    nonfinite: int = 0                  # values
    nonfinite_samples: int = 0
    nonfinite_first: tuple | None = None    # (sample, value)
    bad_labels: int = 0
    bad_label_samples: int = 0
    bad_label_first: tuple | None = None    # (sample, value, pixel or None)
    label_range: tuple[int, int] | None = None
    problems: list[str] = field(default_factory=list)
    targets: dict = field(default_factory=dict)  # problem -> [values, samples, (first sample, value)]
    unit_range: bool = False                     # float targets must lie in [0, 1] (bce_with_logits)


def spec_expectations(path: str) -> Expect:
    """The input shape, classes, loss and dataset names of the model in a spec or config (ConfigError when
    it is not a valid one)."""
    # late: the loss module loads the layer kernels, which the command's --help does not need
    from lbannpy.layers.loss import label_form

    cfg = validate(load_config(path), data=False, graph=False)
    graph = check_graph(cfg)
    train = (cfg.get("data") or {}).get("train") or {}
    out, loss = graph.nodes[-1].out_shape, cfg["model"].get("loss")
    spatial = tuple(int(s) for s in graph.input_shape[2:])
    form = None if loss in ("cross_entropy", "pixel_cross_entropy") else label_form(loss, spatial, out[1:])
    return Expect(inputs=train.get("inputs", "inputs"), labels=train.get("labels", "labels"),
                  channels=int(graph.input_shape[1]), spatial=spatial,
                  classes=None if form is not None and form.floating else int(out[1]),
                  per_pixel=None if form is not None else loss == "pixel_cross_entropy", source=path,
                  form=form)


def data_file_problem(path: str, exc: OSError | None = None) -> str | None:
    """Why ``path`` cannot be opened as an HDF5 data file (what a message after the file's name says), or
    None when it opens. ``exc``: the error opening it raised, when the caller already tried.

    Each cause is told apart, so the user knows what to do: no such file, a directory, not a regular file,
    an empty (0-byte) file, no permission, a file another process is writing (HDF5 locks a file open for
    writing), or not HDF5 at all."""
    import h5py

    if not os.path.lexists(path):
        return "no such file"
    if not os.path.exists(path):
        return f"a broken symbolic link (to {os.readlink(path)})"
    if os.path.isdir(path):
        return "is a directory, not an HDF5 file"
    if not os.path.isfile(path):
        return "is not a regular file"
    if os.path.getsize(path) == 0:
        return "is empty (0 bytes), not an HDF5 file"
    if exc is None:
        try:
            with h5py.File(path, "r"):
                return None
        except OSError as err:
            exc = err
    if isinstance(exc, BlockingIOError) or "unable to lock file" in f"{exc}":
        return ("is locked: another process has it open for writing; wait until it has finished (or set "
                "HDF5_USE_FILE_LOCKING=FALSE to read it anyway)")
    if isinstance(exc, PermissionError) or not os.access(path, os.R_OK) or "Permission denied" in f"{exc}":
        return "cannot be read: permission denied"
    return f"is not a readable HDF5 file ({f'{exc}'.splitlines()[0] if f'{exc}' else type(exc).__name__})"


def _chunk_samples(info, chunk_bytes: int) -> int:
    per = int(np.prod(info.sample_shape)) * info.input_dtype.itemsize
    per += int(np.prod(info.label_shape, dtype=np.int64)) * info.label_dtype.itemsize
    return max(1, int(chunk_bytes) // max(per, 1))


def _scan_inputs(x: np.ndarray, a: int, f: Findings) -> None:
    bad = ~np.isfinite(x)
    n = int(np.count_nonzero(bad))
    if not n:
        return
    per_sample = bad.reshape(len(x), -1).any(axis=1)
    if f.nonfinite_first is None:
        i = int(np.argmax(per_sample))
        f.nonfinite_first = (a + i, float(x[i][bad[i]][0]))
    f.nonfinite += n
    f.nonfinite_samples += int(np.count_nonzero(per_sample))


def _scan_labels(y: np.ndarray, a: int, classes: int | None, f: Findings) -> None:
    if y.size:
        lo, hi = int(y.min()), int(y.max())
        f.label_range = (lo, hi) if f.label_range is None else (min(lo, f.label_range[0]),
                                                               max(hi, f.label_range[1]))
    top = int(classes) - 1 if classes is not None else np.iinfo(np.int64).max
    found = label_problem(y, 0, top)
    if found is None:
        return
    index, value, count = found
    if f.bad_label_first is None:
        f.bad_label_first = (a + index[0], value, index[1:] if y.ndim > 1 else None)
    f.bad_labels += count
    f.bad_label_samples += int(np.count_nonzero(((y < 0) | (y > top)).reshape(len(y), -1).any(axis=1)))


def _scan_targets(y: np.ndarray, a: int, f: Findings) -> None:
    """Float targets: the range of the finite ones, the non-finite ones, and (``f.unit_range``) those
    outside ``[0, 1]``, each with its count of values and samples and its first sample and value."""
    finite = np.isfinite(y)
    if finite.any():
        lo, hi = float(y[finite].min()), float(y[finite].max())
        f.label_range = (lo, hi) if f.label_range is None else (min(lo, f.label_range[0]),
                                                               max(hi, f.label_range[1]))
    checks = [("non-finite", ~finite)]
    if f.unit_range:
        checks.append(("outside [0, 1]", finite & ((y < 0) | (y > 1))))
    for what, bad in checks:
        n = int(np.count_nonzero(bad))
        if n:
            per_sample = bad.reshape(len(y), -1).any(axis=1)
            i = int(np.argmax(per_sample))
            got = f.targets.setdefault(what, [0, 0, (a + i, float(y[i][bad[i]][0]))])
            got[0] += n
            got[1] += int(np.count_nonzero(per_sample))


def scan(info, classes: int | None, chunk_bytes: int = CHUNK_BYTES, progress=None,
         unit_range: bool = False) -> Findings:
    """Read the inputs and labels of a validated file in chunks of about ``chunk_bytes`` (at least one
    sample) and collect what is wrong with their values; ``progress(samples_done)`` after each chunk.
    Float labels are targets (``unit_range``: they must lie in ``[0, 1]``)."""
    import h5py

    f = Findings(samples=info.num_samples, unit_range=unit_range)
    floating = info.label_dtype.kind == "f"
    step = _chunk_samples(info, chunk_bytes)
    with h5py.File(info.path, "r") as fh:
        dx, dy = fh[info.inputs], fh[info.labels]
        for a in range(0, info.num_samples, step):
            b = min(info.num_samples, a + step)
            _scan_inputs(dx[a:b], a, f)
            if floating:
                _scan_targets(dy[a:b], a, f)
            else:
                _scan_labels(dy[a:b], a, classes, f)
            if progress is not None:
                progress(b)
    return f


def _shape_problems(path: str, info, want: Expect) -> list[str]:
    out = []
    form = want.form
    try:
        validate_dataset(path, want.inputs, want.labels, want.channels, want.spatial,
                         None if form is None else form.shape, form is not None and form.floating)
    except DataError as exc:
        out.append(f"{exc} (the model of {want.source})")
    if want.per_pixel is not None and want.per_pixel != info.per_pixel:
        need = "per-pixel labels (M, *spatial) for pixel_cross_entropy" if want.per_pixel \
            else "one label per sample (M,) for cross_entropy"
        out.append(f"{path}: dataset '{info.labels}' has shape {(info.num_samples,) + info.label_shape}; "
                   f"the model of {want.source} needs {need}")
    return out


def report_lines(info, f: Findings, classes: int | None) -> list[str]:
    """One line per problem class; empty when the file is clean."""
    lines = [f"shape: {'; '.join(f.problems)}"] if f.problems else []
    for what, (n, samples, (s, v)) in f.targets.items():
        lines.append(f"targets {what}: {n} values in {samples} samples of '{info.labels}'; the first in "
                     f"sample {s} ({v})")
    if f.nonfinite:
        s, v = f.nonfinite_first
        lines.append(f"non-finite inputs: {f.nonfinite} values in {f.nonfinite_samples} samples of "
                     f"'{info.inputs}'; the first in sample {s} ({v})")
    if f.bad_labels:
        s, v, pixel = f.bad_label_first
        at = f" at pixel ({', '.join(map(str, pixel))})" if pixel else ""
        allowed = f"0..{classes - 1} ({classes} classes)" if classes is not None else "0 and up"
        lines.append(f"labels out of range: {f.bad_labels} labels in {f.bad_label_samples} samples of "
                     f"'{info.labels}' outside {allowed}; the first: sample {s} has label {v}{at}")
    return lines


def summary(info, f: Findings, classes: int | None, want: Expect) -> str:
    shape = ", ".join(map(str, info.sample_shape))
    lo, hi = f.label_range if f.label_range is not None else (0, -1)
    fits = f"; fits the model of {want.source}" if want.source else ""
    if info.label_dtype.kind == "f":
        return (f"ok: {info.num_samples} samples in {info.path}, inputs ({shape}) {info.input_dtype} all "
                f"finite, float targets ({', '.join(map(str, info.label_shape))}) {info.label_dtype} in "
                f"[{lo:g}, {hi:g}] all finite{fits}")
    if classes is not None:
        labels = f"labels {lo}..{hi} within {classes} classes"
    else:
        labels = f"labels {lo}..{hi} (classes not checked: give --classes or --spec)"
    kind = "per-pixel" if info.per_pixel else "per-sample"
    return (f"ok: {info.num_samples} samples in {info.path}, inputs ({shape}) {info.input_dtype} all finite, "
            f"{kind} {labels}{fits}")


def _label_kwargs(path: str, want: Expect) -> dict:
    """How the first look at the file takes its labels: float ones as targets, and any a spec's loss reads
    other than cross-entropy's, as whatever shape and type they have: what the spec needs is checked next
    and reported as a problem of the file."""
    import h5py

    try:
        with h5py.File(path, "r") as fh:
            ds = fh.get(want.labels)
            shape, kind = (tuple(ds.shape[1:]), ds.dtype.kind) if ds is not None else ((), "")
    except OSError:  # not a readable HDF5 file: the validation says so
        return {}
    if kind == "f" or (want.form is not None and kind):
        return {"label_shape": shape, "float_labels": kind == "f"}
    return {}


class _Progress:
    """A bar on a terminal, else a plain line at each quarter (logs)."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.stream, self.done, self.bar = total, stream or sys.stderr, 0, None
        self.quarter = 0
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="sample", desc=label, file=self.stream, dynamic_ncols=True)
        self.label = label

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        else:
            q = 4 * done // max(self.total, 1)
            if q > self.quarter:
                self.quarter = q
                pct = 100 * done // self.total
                self.stream.write(f"{self.label}: {done}/{self.total} samples ({pct}%)\n")
                self.stream.flush()
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_file(path: str, want: Expect, chunk_bytes: int = CHUNK_BYTES, quiet: bool = False,
               out=None, stream=None) -> int:
    """The ``check`` command: 0 and one ``ok:`` line when the file is clean, 1 and one line per problem
    class otherwise (on ``out``); progress on ``stream`` (stderr)."""
    out = out or sys.stdout
    try:
        info = validate_dataset(path, want.inputs, want.labels, **_label_kwargs(path, want))
        check_complete(path, (want.inputs, want.labels))
    except DataError as exc:
        out.write(f"file: {exc}\n")
        return 1
    except OSError as exc:  # HDF5 could not open it (locked by a writer, unreadable): the file, named
        out.write(f"file: data file {path} {data_file_problem(path, exc) or exc}\n")
        return 1
    problems = _shape_problems(path, info, want) if want.source else []
    progress = None if quiet else _Progress(info.num_samples, "check", stream)
    try:
        f = scan(info, want.classes, chunk_bytes, progress, bool(getattr(want.form, "unit_range", False)))
    finally:
        if progress is not None:
            progress.close()
    f.problems = problems
    lines = report_lines(info, f, want.classes)
    if lines:
        out.write("".join(ln + "\n" for ln in lines))
        return 1
    out.write(summary(info, f, want.classes, want) + "\n")
    return 0
