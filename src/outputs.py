"""Every command's outputs, by one rule: checked against what the command reads before anything is opened
for writing, written under a temporary name and renamed, and the temporary removed on every failure and
signal.

Why one guard: each command used to check its outputs its own way, and the gaps lost data: ``export -o``
onto its own checkpoint's ``index.h5``, ``predict -o`` onto the config's training data or a sibling
checkpoint, ``--torch-module`` onto the config, all exited 0 having destroyed that file. :func:`check`
resolves every output (symlinks, ``..``) and refuses, in one line, one that is, or lies inside, any of the
command's inputs, the config's data files (:func:`config_inputs`), or any checkpoint directory
(:func:`checkpoint_home`); two outputs onto one file are refused alike.

Writing: :func:`atomic` (one process) and :class:`Pending` (one rank writes, every rank knows the
temporary's name) write ``PATH.tmp-PID`` and rename it over ``PATH`` once complete, so a reader sees the
old file or the new one, never half of one. HDF5 writes through a :class:`FileSink`: a write that fails
(a full disk) is recorded and reported instead of leaving the HDF5 library in a failed state that crashes
the process at exit. A failed write raises :class:`WriteError`, one line naming the file.

Signals: :func:`interrupt_on_signals` (one process: the signal raises :class:`Interrupted` in the main
thread, so every ``finally`` removes its temporary) and :class:`SignalCleanup` (several ranks: a rank may
sit in a collective, where no Python handler runs, so a thread of its own removes every pending temporary,
says one line and ends the job).
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import signal
import socket
import sys
import threading

from lbannpy.config_errors import ConfigError

EXIT_SIGNAL = 5  # a signal ended the command, nothing more was written (the trainer's EXIT_SIGNAL_ABORT)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# a checkpoint (version 2/3 directory, version 1 file, an interrupted write) by its name
CHECKPOINT_NAME = re.compile(r"^ckpt-\d+(\.h5|\.tmp)?$")
_HINT = "choose another output path"


class OutputError(ConfigError):
    """An output path that must not be written (it is an input, lies inside one, or inside a checkpoint
    directory), or that cannot be created; a user error, one line."""


class WriteError(OSError):
    """An output that could not be written (a full or read-only disk); ``str()`` is one line naming the
    file. The file at the final name is unchanged and no temporary is left."""

    def __init__(self, path: str, why: str, label: str = "", code: int = 0):
        super().__init__(code or errno.EIO, why, path)
        self.line = f"{label + ' ' if label else ''}{path} could not be written: {why} (any earlier file " \
                    f"of that name is kept, no temporary left)"

    def __str__(self) -> str:
        return self.line


# ------------------------------------------------------------------------------------------------ the check
def real(path: str) -> str:
    """``path`` with every symlink and ``..`` resolved (as far as it exists)."""
    return os.path.realpath(os.path.expanduser(str(path)))


def _holds_checkpoints(directory: str) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(CHECKPOINT_NAME.match(e.name) for e in entries)
    except OSError:  # not a directory, gone, unreadable: nothing to protect found there
        return False


def checkpoint_home(path: str, own=()) -> str | None:
    """The checkpoint, or directory of checkpoints, that the resolved ``path`` is or lies inside (a name
    ``ckpt-N``, or a directory holding such names), else None. ``own``: resolved checkpoint directories the
    command itself writes (the trainer's ``checkpoint.dir``), not counted."""
    p, own = real(path), {real(o) for o in own}
    while True:
        if p not in own and (CHECKPOINT_NAME.match(os.path.basename(p)) or _holds_checkpoints(p)):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # a hard link is the same file under another name
    except OSError:
        return False


def _shown(path: str, resolved: str) -> str:
    return path if os.path.abspath(path) == resolved else f"{path} (= {resolved})"


def check(outputs, inputs, own_checkpoints=(), directories=()) -> None:
    """Raise :class:`OutputError` (the output's option as its key) unless every output may be written.

    ``outputs`` and ``inputs``: ``(label, path)`` pairs (a ``None`` or empty path is skipped), the label the
    option or key a user set (``-o``, ``--data``, ``data.train.path``). An output is refused when it is an
    input (same resolved path or same file), lies inside an input directory, is or lies inside a checkpoint
    directory (:func:`checkpoint_home`; ``own_checkpoints`` excepted), or (unless its label is in
    ``directories``) is another output or an existing directory."""
    seen: dict[str, str] = {}
    ins = [(lab, p, real(p)) for lab, p in inputs if p]
    for label, path in outputs:
        if not path:
            continue
        out = real(path)
        if label not in directories:  # directories may coincide (checkpoint.dir = output.dir); files not
            if out in seen:
                raise OutputError(label, f"{path} is also {seen[out]}: one would overwrite the other", _HINT)
            seen[out] = f"{label} {path}"
        for ilabel, ipath, rin in ins:
            if out == rin or _same(path, ipath):
                raise OutputError(label, f"{_shown(path, out)} is {ilabel} {ipath}: writing it would destroy "
                                         f"an input", _HINT)
            if out.startswith(rin.rstrip(os.sep) + os.sep):
                raise OutputError(label, f"{_shown(path, out)} lies inside {ilabel} {ipath}", _HINT)
        home = checkpoint_home(out, own_checkpoints)
        if home is not None:
            kind = "checkpoint" if CHECKPOINT_NAME.match(os.path.basename(home)) else "checkpoint directory"
            what = f"is a {kind}" if home == out else f"lies inside the {kind} {home}"
            raise OutputError(label, f"{_shown(path, out)} {what}; writing there would damage or shadow "
                                     f"checkpoints", _HINT + " outside checkpoint directories")
        if label not in directories and os.path.isdir(out):
            raise OutputError(label, f"{path} is a directory; name a file", _HINT)


def config_inputs(cfg: dict) -> list[tuple[str, str]]:
    """What a config makes a command read or protect: its data files, ``model.init`` and its checkpoint
    directory (``checkpoint.dir``, by default ``ckpt/`` in ``output.dir``), as ``(key, path)`` pairs."""
    cfg = cfg or {}
    data = cfg.get("data") or {}
    found = [(f"data.{part}.path", (data.get(part) or {}).get("path")) for part in ("train", "validation")]
    found.append(("model.init", (cfg.get("model") or {}).get("init")))
    out = (cfg.get("output") or {}).get("dir") or "run"
    found.append(("checkpoint.dir", (cfg.get("checkpoint") or {}).get("dir") or os.path.join(out, "ckpt")))
    return [(k, str(v)) for k, v in found if isinstance(v, (str, os.PathLike)) and str(v)]


def check_trainer_outputs(cfg: dict, config: str) -> None:
    """The trainer's outputs (``output.dir`` with its metrics, summary and plot, ``checkpoint.dir``) against
    its config file, data files and initial weights; its own checkpoint directory is its to write."""
    out = str((cfg.get("output") or {}).get("dir") or "run")
    ins = config_inputs(cfg)
    ck = dict(ins)["checkpoint.dir"]
    outs = [("output.dir", out), ("checkpoint.dir", ck)]
    outs += [(f"output.dir ({name})", os.path.join(out, name)) for name in ("metrics.csv", "summary.json",
                                                                              "loss.png")]
    check(outs, [("the config", config)] + [(k, p) for k, p in ins if k != "checkpoint.dir"],
          own_checkpoints=[ck], directories=("output.dir", "checkpoint.dir"))


# ----------------------------------------------------------------------------------------------- writing
def reason(exc: BaseException, where: str = "") -> str:
    """One short clause: the system's words for an errno (h5py's message of a failed write runs to a dozen
    fields); an HDF5 error on a file system without room is called what it is."""
    if isinstance(exc, OSError) and exc.errno and not isinstance(exc, WriteError):
        return f"{os.strerror(exc.errno)} (errno {exc.errno})"
    text = " ".join(str(exc).split())
    if "No space left" in text or "errno = 28" in text or _nearly_full(where):
        return f"{os.strerror(errno.ENOSPC)} (errno {errno.ENOSPC})"
    return text if len(text) <= 240 else text[:240] + " ..."


def _nearly_full(where: str) -> bool:
    try:
        return bool(where) and shutil.disk_usage(os.path.dirname(os.path.abspath(where))).free < (1 << 20)
    except OSError:
        return False


def temporary_name(path: str, pid: int | None = None, keep_suffix: bool = False) -> str:
    """``PATH.tmp-PID`` beside ``path`` (``keep_suffix``: ``STEM.tmp-PID.EXT``, for writers that choose the
    format by the name's extension)."""
    pid = os.getpid() if pid is None else pid
    if keep_suffix:
        stem, ext = os.path.splitext(path)
        return f"{stem}.tmp-{pid}{ext}"
    return f"{path}.tmp-{pid}"


_pending: set[str] = set()  # temporaries of this process's unfinished outputs (removed on a signal)
_lock = threading.Lock()


def _register(tmp: str) -> None:
    with _lock:
        _pending.add(tmp)


def _forget(tmp: str) -> None:
    with _lock:
        _pending.discard(tmp)


def remove_pending() -> list[str]:
    """Remove every registered temporary (one another rank removed already is gone as well); returns them
    all."""
    with _lock:
        tmps = sorted(_pending)
        _pending.clear()
    for tmp in tmps:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return tmps


class FileSink(io.RawIOBase):
    """A binary file HDF5 writes through (``h5py.File(sink, "w")``) that never fails under it: the first
    failed write is kept in :attr:`error` and later writes are skipped, so the library stays consistent and
    closes cleanly; the caller reports the error and discards the file. (Written directly, a full disk
    leaves HDF5 with a file it cannot close, and the process crashes at exit.)"""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.error: OSError | None = None
        self._f = open(path, "r+b" if os.path.exists(path) else "w+b", buffering=0)

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buf) -> int:
        return self._f.readinto(buf)

    def write(self, buf) -> int:
        n = memoryview(buf).nbytes
        if self.error is None:
            try:
                done = self._f.write(buf)
                if done == n:
                    return n
                self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a short write: no room
            except OSError as exc:
                self.error = exc
        self._f.seek(n, 1)
        return n

    def truncate(self, size: int | None = None) -> int:
        try:
            return self._f.truncate(size)
        except OSError as exc:
            self.error = self.error or exc
            return self.tell() if size is None else size

    def flush(self) -> None:
        return None

    def close(self) -> None:
        """Flush to disk (a failure recorded) and close."""
        if not self._f.closed:
            try:
                if self.error is None:
                    os.fsync(self._f.fileno())
            except OSError as exc:
                self.error = exc
            finally:
                self._f.close()
        super().close()


@contextlib.contextmanager
def atomic(path: str, label: str = "", keep_suffix: bool = False, sink: bool = False):
    """``with atomic(path) as tmp``: write ``tmp``; when the block ends without an error it is flushed and
    renamed over ``path``; on any error or signal it is removed. ``sink``: yields a :class:`FileSink` on
    the temporary instead (for HDF5). An ``OSError`` of the write becomes :class:`WriteError`."""
    tmp = temporary_name(path, keep_suffix=keep_suffix)
    _register(tmp)
    target = None
    try:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        target = FileSink(tmp) if sink else tmp
        yield target
        if sink:
            target.close()
            if target.error is not None:
                raise target.error
        else:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        _drop(tmp, target)
        if isinstance(exc, WriteError):
            raise
        raise WriteError(path, reason(exc, tmp), label, exc.errno or 0) from None
    except BaseException:
        _drop(tmp, target)
        raise
    finally:
        _forget(tmp)


def _drop(tmp: str, target) -> None:
    if isinstance(target, FileSink):
        with contextlib.suppress(OSError):
            target.close()
    with contextlib.suppress(OSError):
        os.unlink(tmp)


@contextlib.contextmanager
def writing(path: str, label: str = ""):
    """``with writing(path)``: a writer that already writes atomically (and removes its own temporary on
    failure, as ``save_config`` does) has its ``OSError`` (or h5py's ``RuntimeError``) raised as
    :class:`WriteError`, one line naming ``path``."""
    try:
        yield
    except WriteError:
        raise
    except (OSError, RuntimeError) as exc:
        raise WriteError(path, reason(exc, path), label, getattr(exc, "errno", 0) or 0) from None


class Pending:
    """An output one rank writes while every rank knows its temporary (so a signal on any rank of a job on
    a shared file system can remove it): :meth:`create` on the writer, then :meth:`sink`, :meth:`commit`
    or :meth:`discard`; the other ranks :meth:`forget` it."""

    def __init__(self, label: str, path: str, tmp: str | None = None):
        self.label, self.path = label, path
        self.tmp = tmp or temporary_name(path)

    def create(self) -> None:
        """Create the temporary (and the output's directory): an output that cannot be written fails here,
        before any work."""
        _register(self.tmp)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))

    def sink(self) -> FileSink:
        return FileSink(self.tmp)

    def failed(self, exc: BaseException) -> WriteError:
        """The one-line error of a failed write of this output."""
        return WriteError(self.path, reason(exc, self.tmp), self.label, getattr(exc, "errno", 0) or 0)

    def commit(self) -> None:
        try:
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.discard()
            raise self.failed(exc) from None
        _forget(self.tmp)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
        _forget(self.tmp)

    def forget(self) -> None:
        _forget(self.tmp)


def claim(world, outputs, inputs, writer: int = 0) -> list[Pending]:
    """Who calls: every rank of ``world`` (collective: one ``allgather_obj``), before any other collective
    of the command. Every rank :func:`check` s the outputs; rank ``writer`` creates each one's temporary;
    the ranks agree, and all of them raise the same :class:`OutputError` when any rank found a problem (an
    output rank ``writer`` cannot create included), so none is left waiting in a collective. Returns the
    outputs, each with the writer's temporary name on every rank."""
    pend = [Pending(label, path) for label, path in outputs if path]
    err = None
    try:
        check(outputs, inputs)
    except OutputError as exc:
        err = str(exc)
    if err is None and world.rank == writer:
        for p in pend:
            try:
                p.create()
            except OSError as exc:
                why = _blocked(p.path) or reason(exc)
                err = f"{p.label}: {p.path} cannot be written there: {why}; {_HINT}"
                break
    votes = world.allgather_obj((err, [p.tmp for p in pend]))
    for p, tmp in zip(pend, votes[writer][1]):
        p.tmp = tmp
        if world.rank != writer:
            _register(tmp)
    bad = [e for e, _ in votes if e]
    if bad:
        for p in pend:
            p.discard() if world.rank == writer else p.forget()
        raise OutputError("", bad[0])
    return pend


def _blocked(path: str) -> str:
    """'X is a file, not a directory' when the nearest existing folder on the way to ``path`` is a file."""
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(d):
        d = os.path.dirname(d)
    return "" if os.path.isdir(d) else f"{d} is a file, not a directory"


# ----------------------------------------------------------------------------------------------- signals
def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(BaseException):
    """A signal ended a one-process command (raised in the main thread, so each ``finally`` removes its
    temporary on the way out)."""

    def __init__(self, signum: int):
        super().__init__(f"{signal_name(signum)} received")
        self.signum = signum


def _raise(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupt_on_signals():
    """One-process commands: SIGTERM, SIGINT, SIGHUP and SIGUSR1 raise :class:`Interrupted` while the block
    runs (the previous handlers come back after it)."""
    previous = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class SignalCleanup:
    """Several ranks: on any of :data:`SIGNALS` a thread (the main thread may be inside a collective, where
    no Python handler runs) removes every pending temporary, prints one line ``PROG: rank R of P: SIGNAL
    received; ...`` and calls ``end(EXIT_SIGNAL)`` (``Communicator.abort``; one rank: the process exits).
    Installed from the main thread for the block of a ``with``."""

    def __init__(self, prog: str, rank: int, size: int, end):
        self.prog, self.rank, self.size, self.end = prog, rank, size, end
        self._previous: dict = {}
        self._socks = None
        self._wakeup = -1

    def __enter__(self) -> "SignalCleanup":
        r, w = socket.socketpair()
        w.setblocking(False)
        self._socks = (r, w)
        # the Python-level handler does nothing (the thread acts); setting one keeps the default (death)
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, _quiet)
        self._wakeup = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="lbannpy-output-signals", daemon=True).start()
        return self

    def __exit__(self, *exc) -> bool:
        signal.set_wakeup_fd(self._wakeup)
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._socks[1].close()  # the thread reads end of file and returns
        return False

    def _run(self) -> None:
        r = self._socks[0]
        try:
            data = r.recv(64)
        except OSError:
            return
        finally:
            r.close()
        if data:
            self._on(data[0])

    def _on(self, signum: int) -> None:
        removed = remove_pending()
        done = (f"; no output written, the unfinished {', '.join(removed)} removed" if removed else "")
        try:
            sys.stderr.write(f"{self.prog}: rank {self.rank} of {self.size}: {signal_name(signum)} received; "
                             f"ending the job{done}\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not stop the ending
            pass
        if self.size > 1:
            self.end(EXIT_SIGNAL)
        os._exit(EXIT_SIGNAL)


def _quiet(signum, frame) -> None:
    return None
