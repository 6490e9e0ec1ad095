"""The Runtime: owns MPI set-up, device choice and teardown; nothing happens at import time.

    with Runtime(backend="auto", device="cpu") as rt:
        ... rt.world, rt.rank, rt.size, rt.local_rank, rt.xp ...

On a clean exit the communicators are freed in reverse order of creation (no barrier: MPI_Comm_free and
ncclCommDestroy do not need one, and a barrier would hang if ranks leave at different times for a good
reason). When an exception leaves the block on any rank, that rank prints
``lbannpy: rank R of P failed: <type>: <message>`` and its traceback to stderr and calls
``MPI_Abort(COMM_WORLD, 1)`` (KeyboardInterrupt included): the other ranks may be waiting in a collective
this rank will never enter, and aborting is the only way they do not hang.
"""
from __future__ import annotations

import os
import sys
import traceback
import types
from dataclasses import dataclass

from . import hoststaged
from .base import CommError, Communicator
from .single import SingleCommunicator
from lbannpy.backend import get_xp

BACKENDS = ("auto", "mpi", "single", "nccl")
DEVICES = ("cpu", "gpu")

# launcher variables that carry the node-local rank, in order of preference
_LOCAL_RANK_VARS = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")


def _mpi_module():
    """mpi4py's MPI module, or ``None`` when mpi4py (or its MPI library) cannot be loaded."""
    try:
        from mpi4py import MPI
    except Exception:  # ImportError, or a missing/broken libmpi raising while loading
        return None
    return MPI


def _env_local_rank() -> int | None:
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


# launcher variables that carry the number of ranks of the job
_WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE",
                    "SLURM_STEP_NUM_TASKS")


def launched_rank_size() -> tuple[int, int]:
    """``(rank, size)`` from the launcher's variables, for a failure before MPI starts (each rank then
    names itself and writes its own ``failure-rankR.log``); ``(0, 1)`` outside a known launcher."""
    size = launched_size()
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        value = os.environ.get(var, "").strip()
        if size and value.isdigit():
            return int(value), size
    return 0, 1


def launched_size() -> int | None:
    """Number of ranks the launcher (mpiexec, srun) started, read from its environment without starting
    MPI; ``None`` when this process was not started by a known launcher."""
    if "PMI_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ \
            and "PMIX_RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        return None
    for var in _WORLD_SIZE_VARS:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return None


def failure_message(rank: int, size: int, exc: BaseException) -> str:
    return f"lbannpy: rank {rank} of {size} failed: {type(exc).__name__}: {exc}"


# where report_and_abort writes tracebacks (one file per rank); None: to stderr after the one line
_failure_log_dir: str | None = None


def set_failure_log_dir(path: str | None) -> None:
    """Send the tracebacks of :func:`report_and_abort` to ``PATH/failure-rankR.log`` (named in the one line
    on stderr) instead of stderr. A program whose users read stderr (the trainer) calls it once it knows its
    run directory; ``""`` before that (the temporary directory, one file per process)."""
    global _failure_log_dir
    _failure_log_dir = path


def _write_traceback(rank: int, text: str) -> str | None:
    """The file the traceback went to, or None when none could be written."""
    import tempfile

    for d in (_failure_log_dir, tempfile.gettempdir()):
        if not d:  # "": no run directory known yet
            continue
        try:
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"failure-rank{rank}.log" if d == _failure_log_dir
                                else f"lbannpy-failure-{os.getpid()}-rank{rank}.log")
            with open(path, "a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return None


def report_and_abort(exc_type, exc, tb, code: int = 1) -> None:
    """Print the failure of this rank (message and traceback) to stderr, flush, and end the whole job.

    Without MPI (or with one rank) it only prints; the caller then lets Python exit with an error.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    up = MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
    rank, size = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()) if up else launched_rank_size()
    line = failure_message(rank, size, exc).splitlines()[0]  # one line even for a multi-line message
    tb_text = "".join(traceback.format_exception(exc_type, exc, tb))
    if _failure_log_dir is None:
        text = failure_message(rank, size, exc) + "\n" + tb_text
    else:
        where = _write_traceback(rank, line + "\n" + tb_text)
        text = line + (f" (traceback in {where})" if where else "") + "\n"
    try:
        exc.lbannpy_reported = True  # the entry point must not print it again
    except Exception:
        pass
    try:
        sys.stdout.flush()
    except Exception:  # a closed stdout must not hide the failure
        pass
    sys.stderr.write(text)
    sys.stderr.flush()
    if up and size > 1:
        # mpi4py starts MPI when imported: loaded where MPI runs
        from .mpi import abort_job
        abort_job(MPI.COMM_WORLD, code)


def install_abort_hook() -> None:
    """For scripts that do not use ``with Runtime()``: an uncaught exception on any rank prints
    ``lbannpy: rank R of P failed: ...`` and aborts every rank (instead of leaving the others hanging).
    Also covers exceptions escaping threads (e.g. a communication thread)."""
    import threading

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
        report_and_abort(exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        report_and_abort(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook


@dataclass(frozen=True)
class _Built:
    """What :func:`_build` set up for this process: the communicator and where the rank runs."""

    comm: Communicator
    backend: str  # the backend chosen ('single', 'mpi' or 'nccl')
    rank: int
    size: int
    local_rank: int
    local_size: int
    device_id: int | None  # the CUDA device selected for this rank (device 'gpu'), else None
    thread_level: str | None  # MPI's thread support level, None without MPI


def _refuse_single_under_launcher() -> None:
    n = launched_size()
    if n is not None and n > 1:
        raise CommError(f"backend 'single' runs one process, but the launcher started {n} ranks, each of "
                        f"which would train alone and write the same files; use backend 'mpi', 'nccl' or "
                        f"'auto', or launch one process")


def _build(backend: str, device: str, mpi_comm, check: bool, share_gpu: bool = False) -> _Built:
    """The one set-up path of :func:`make_communicator` and :class:`Runtime`: validate, find the node-local
    rank, select the rank's GPU (before anything touches CUDA, so no rank opens a context on GPU 0), build
    the communicator of the chosen backend. More ranks on a node than GPUs is refused unless
    ``share_gpu``; NCCL on a shared GPU is always refused."""
    if backend not in BACKENDS:
        raise CommError(f"unknown communication backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise CommError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if backend == "nccl" and device != "gpu":
        raise CommError("backend 'nccl' needs device='gpu'")
    if backend == "single":
        _refuse_single_under_launcher()
    MPI = None if backend == "single" else _mpi_module()
    if MPI is None and (backend != "auto" or mpi_comm is not None):
        if backend != "single":
            raise CommError(f"backend {backend!r} needs mpi4py and an MPI library; install lbannpy[mpich] "
                            f"(pip install mpich mpi4py) or use backend 'single' for one process")
    if MPI is None:
        device_id = _select_gpu(0, 0, 1) if device == "gpu" else None
        return _Built(SingleCommunicator(), "single", 0, 1, 0, 1, device_id, None)
    # mpi4py starts MPI when imported: loaded where MPI runs
    from .mpi import MPICommunicator, thread_level_name
    base = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    rank, size = base.Get_rank(), base.Get_size()
    local_rank, local_size = _node_local(MPI, base)
    shared = False
    if device == "gpu":
        shared = _gpus_shared(local_size, rank, size, share_gpu, backend)
        device_id = _select_gpu(local_rank, rank, size)
    else:
        device_id = None
    level = thread_level_name(MPI.Query_thread())
    if backend == "auto":
        if size == 1 and mpi_comm is None:
            return _Built(SingleCommunicator(), "single", rank, size, local_rank, local_size, device_id,
                          level)
        backend = "nccl" if device == "gpu" and not shared and _nccl_available() else "mpi"
    mpi = MPICommunicator(base.Dup(), owned=True, check=check)
    comm: Communicator = mpi
    if backend == "nccl":
        # CuPy and NCCL: loaded for backend nccl only
        from .nccl import NCCLCommunicator
        try:
            comm = NCCLCommunicator(mpi, device=device_id)  # owns ``mpi`` from here
        except BaseException:
            mpi.free()
            raise
    return _Built(comm, backend, rank, size, local_rank, local_size, device_id, level)


def make_communicator(backend: str = "auto", *, device: str = "cpu", mpi_comm=None,
                      check: bool = False, share_gpu: bool = False) -> Communicator:
    """Collective over ``mpi_comm`` (default a duplicate of ``COMM_WORLD``): a communicator of the given
    backend. ``auto`` picks ``single`` for one rank without MPI, ``nccl`` for GPUs when CuPy has NCCL,
    else ``mpi``. With ``device='gpu'`` it first makes the rank's GPU (node-local rank modulo the visible
    GPUs) the current device of the calling thread. ``single`` under a launcher that started more than
    one rank is refused, and so are more ranks on a node than GPUs unless ``share_gpu`` (see
    :func:`_gpus_shared`). The result owns what it created; free it with ``free()``."""
    return _build(backend, device, mpi_comm, check, share_gpu).comm


def _nccl_available() -> bool:
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    return bool(getattr(nccl, "available", True))


def _node_local(MPI, base) -> tuple[int, int]:
    """(rank on this node, ranks on this node): from the launcher's variables, else by shared memory
    (collective over the mpi4py communicator ``base``)."""
    local = _env_local_rank()
    if local is not None:
        for var in ("SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
            v = os.environ.get(var, "")
            if v.isdigit():
                return local, int(v)
    # ranks that share memory share a node
    node = base.Split_type(MPI.COMM_TYPE_SHARED, base.Get_rank())
    try:
        return (local if local is not None else node.Get_rank()), node.Get_size()
    finally:
        node.Free()


def _gpus_shared(local_size: int, rank: int, size: int, share_gpu: bool, backend: str) -> bool:
    """Whether this node's ranks share GPUs (more ranks than visible devices). That is a misconfiguration
    in production, refused unless ``share_gpu`` (tests, small GPUs); NCCL cannot run two ranks on one
    device at all, so it is refused even then, pointing at the host-staged MPI backend."""
    count = get_xp("cupy").cuda.runtime.getDeviceCount()
    if count < 1 or local_size <= count:
        return False
    where = f"rank {rank} of {size}: {local_size} ranks on this node but {count} GPU(s) visible"
    if not share_gpu:
        raise CommError(f"{where}: ranks would share a GPU; launch at most {count} rank(s) per node, or set "
                        f"runtime.share_gpu: true to allow it")
    if backend == "nccl":
        raise CommError(f"{where}: NCCL cannot run two ranks on one GPU; use runtime.backend: mpi, which "
                        f"stages GPU arrays through pinned host memory (host-staged) on an MPI that is not "
                        f"CUDA-aware (LBANNPY_CUDA_AWARE_MPI=0)")
    return True


def _select_gpu(local_rank: int, rank: int, size: int) -> int:
    """Make GPU ``local_rank % count`` this thread's current device; its id. Threads started later begin on
    device 0 and must select it themselves (the overlap engine's thread does)."""
    cupy = get_xp("cupy")
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise CommError(f"rank {rank} of {size}: device='gpu' but no CUDA device is visible "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    return device_id


def _device_count() -> int:
    return get_xp("cupy").cuda.runtime.getDeviceCount()


class Runtime:
    """Set-up and teardown of one lbannpy process: MPI, thread level, node-local rank, device.

    Attributes after ``__enter__``: ``world`` (:class:`Communicator`), ``rank``, ``size``,
    ``local_rank`` (rank on this node), ``local_size``, ``xp`` (NumPy or CuPy), ``device`` ('cpu' or
    'gpu'), ``device_id`` (CUDA device or ``None``), ``thread_level`` ('single' ... 'multiple', or
    ``None`` without MPI), ``backend`` (the one chosen).
    """

    def __init__(self, backend: str = "auto", device: str = "cpu", *, check: bool = False,
                 abort_on_error: bool = True, share_gpu: bool = False):
        if backend not in BACKENDS:
            raise CommError(f"unknown communication backend {backend!r}; use one of {', '.join(BACKENDS)}")
        if device not in DEVICES:
            raise CommError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
        self.requested_backend = backend
        self.device = device
        self.check = check
        self.abort_on_error = abort_on_error
        self.share_gpu = bool(share_gpu)
        self.host_staged = False  # GPU arrays over an MPI that is not CUDA-aware (comm/hoststaged.py)
        self.world: Communicator | None = None
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.device_id: int | None = None
        self.thread_level: str | None = None
        self.backend: str | None = None
        self.xp: types.ModuleType | None = None
        self._owned: list[Communicator] = []

    @property
    def thread_multiple(self) -> bool:
        return self.thread_level == "multiple"

    # -- set-up ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def _setup(self) -> None:
        built = _build(self.requested_backend, self.device, None, self.check, self.share_gpu)
        self.world = built.comm
        self._owned.append(built.comm)  # an NCCL world owns the MPI communicator it was bootstrapped over
        self.backend = built.backend
        self.rank, self.size = built.rank, built.size
        self.local_rank, self.local_size = built.local_rank, built.local_size
        self.device_id, self.thread_level = built.device_id, built.thread_level
        if self.device == "gpu" and self.backend == "mpi" and self.size > 1:
            from .mpi import cuda_aware_mpi  # late: importing comm.mpi starts MPI (mpi4py)
            self.host_staged = not cuda_aware_mpi()
            if self.host_staged and self.rank == 0:  # the one line at start that says what staging costs
                sys.stderr.write(f"lbannpy: runtime.backend mpi on GPUs with an MPI that is not CUDA-aware: "
                                 f"device arrays are staged through pinned host memory (host-staged)"
                                 f"{'; ranks share GPUs' if built.local_size > _device_count() else ''}\n")
                sys.stderr.flush()
        self.xp = get_xp("cupy" if self.device == "gpu" else "numpy")

    # -- teardown -------------------------------------------------------------------------------------
    def _teardown(self) -> None:
        # newest first: an NCCL communicator goes before the MPI communicator it was bootstrapped over
        for comm in reversed(self._owned):
            comm.free()
        self._owned.clear()
        if self.host_staged:  # the staging thread stopped and joined (every staged operation was waited for)
            hoststaged.finalize()

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed = exc_type is not None and not (exc_type is SystemExit and exc.code in (0, None))
        if not failed:
            self._teardown()
            return False
        # KeyboardInterrupt too: a Ctrl-C reaching one rank must not leave the others in a collective
        if self.abort_on_error and self.size > 1:
            code = exc.code if exc_type is SystemExit and isinstance(exc.code, int) else 1
            report_and_abort(exc_type, exc, tb, code)
        return False

    def __repr__(self) -> str:
        return (f"<Runtime {self.backend} rank {self.rank} of {self.size} local {self.local_rank} "
                f"device {self.device}{'' if self.device_id is None else ':' + str(self.device_id)}>")
