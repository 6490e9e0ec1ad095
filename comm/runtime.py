"""The Runtime: owns MPI set-up, device choice and teardown; nothing happens at import time.

    with Runtime(backend="auto", device="cpu") as rt:
        ... rt.world, rt.rank, rt.size, rt.local_rank, rt.xp ...

On a clean exit the communicators are freed in reverse order of creation (no barrier: MPI_Comm_free and
ncclCommDestroy do not need one, and a barrier would hang if ranks leave at different times for a good
reason). When an exception leaves the block on any rank, that rank prints
``lbannpy: rank R of P failed: <type>: <message>`` and its traceback to stderr and calls
``MPI_Abort(COMM_WORLD, 1)``: the other ranks may be waiting in a collective this rank will never enter,
and aborting is the only way they do not hang.
"""
from __future__ import annotations

import os
import sys
import traceback
import types

from .base import CommError, Communicator
from .single import SingleCommunicator

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
_WORLD_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


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


def report_and_abort(exc_type, exc, tb, code: int = 1) -> None:
    """Print the failure of this rank (message and traceback) to stderr, flush, and end the whole job.

    Without MPI (or with one rank) it only prints; the caller then lets Python exit with an error.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    up = MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
    rank, size = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()) if up else (0, 1)
    text = failure_message(rank, size, exc) + "\n" + "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        sys.stdout.flush()
    except Exception:  # a closed stdout must not hide the failure
        pass
    sys.stderr.write(text)
    sys.stderr.flush()
    if up and size > 1:
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


def make_communicator(backend: str = "auto", *, device: str = "cpu", mpi_comm=None,
                      check: bool = False) -> Communicator:
    """Collective over ``mpi_comm`` (default a duplicate of ``COMM_WORLD``): a communicator of the given
    backend. ``auto`` picks ``single`` for one rank without MPI, ``nccl`` for GPUs when CuPy has NCCL,
    else ``mpi``. The result owns what it created; free it with ``free()``."""
    if backend not in BACKENDS:
        raise CommError(f"unknown communication backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise CommError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if backend == "single":
        return SingleCommunicator()
    MPI = _mpi_module()
    if MPI is None:
        if backend == "auto" and mpi_comm is None:
            return SingleCommunicator()
        raise CommError(f"backend {backend!r} needs mpi4py and an MPI library; install lbannpy[mpich] "
                        f"(pip install mpich mpi4py) or use backend 'single' for one process")
    base = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
    if backend == "auto":
        if base.Get_size() == 1 and mpi_comm is None:
            return SingleCommunicator()
        backend = "nccl" if device == "gpu" and _nccl_available() else "mpi"
    from .mpi import MPICommunicator
    if backend == "mpi":
        return MPICommunicator(base.Dup(), owned=True, check=check)
    if device != "gpu":
        raise CommError("backend 'nccl' needs device='gpu'")
    from .nccl import NCCLCommunicator
    return NCCLCommunicator(MPICommunicator(base.Dup(), owned=True, check=check))


def _nccl_available() -> bool:
    try:
        from cupy.cuda import nccl
    except Exception:
        return False
    return bool(getattr(nccl, "available", True))


class Runtime:
    """Set-up and teardown of one lbannpy process: MPI, thread level, node-local rank, device.

    Attributes after ``__enter__``: ``world`` (:class:`Communicator`), ``rank``, ``size``,
    ``local_rank`` (rank on this node), ``local_size``, ``xp`` (NumPy or CuPy), ``device`` ('cpu' or
    'gpu'), ``device_id`` (CUDA device or ``None``), ``thread_level`` ('single' ... 'multiple', or
    ``None`` without MPI), ``backend`` (the one chosen).
    """

    def __init__(self, backend: str = "auto", device: str = "cpu", *, check: bool = False,
                 abort_on_error: bool = True):
        if backend not in BACKENDS:
            raise CommError(f"unknown communication backend {backend!r}; use one of {', '.join(BACKENDS)}")
        if device not in DEVICES:
            raise CommError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
        self.requested_backend = backend
        self.device = device
        self.check = check
        self.abort_on_error = abort_on_error
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
        backend = self.requested_backend
        MPI = None if backend == "single" else _mpi_module()
        if MPI is None and backend in ("mpi", "nccl"):
            raise CommError(f"backend {backend!r} needs mpi4py and an MPI library; install lbannpy[mpich] "
                            f"(pip install mpich mpi4py) or use backend 'single' for one process")
        if MPI is not None:
            from .mpi import MPICommunicator, thread_level_name
            self.thread_level = thread_level_name(MPI.Query_thread())
            world_size = MPI.COMM_WORLD.Get_size()
            self.rank = MPI.COMM_WORLD.Get_rank()
            self.size = world_size
            self.local_rank, self.local_size = self._node_local(MPI)
        if self.device == "gpu":
            self._select_gpu()
        from lbannpy.backend import get_xp
        self.xp = get_xp("cupy" if self.device == "gpu" else "numpy")

        if MPI is None or backend == "single" or (backend == "auto" and self.size == 1):
            if self.size > 1:
                raise CommError(f"backend 'single' was asked for but this job has {self.size} ranks; use "
                                f"'mpi' or 'auto'")
            self.world = SingleCommunicator()
            self.backend = "single"
        else:
            if backend == "auto":
                backend = "nccl" if self.device == "gpu" and _nccl_available() else "mpi"
            mpi_world = MPICommunicator(MPI.COMM_WORLD.Dup(), owned=True, check=self.check)
            self._owned.append(mpi_world)
            if backend == "nccl":
                if self.device != "gpu":
                    raise CommError("backend 'nccl' needs device='gpu'")
                from .nccl import NCCLCommunicator
                # NCCL ops get their own duplicate so that its bootstrap traffic never mixes with MPI's.
                self.world = NCCLCommunicator(mpi_world.dup())
                self._owned.append(self.world)
            else:
                self.world = mpi_world
            self.backend = backend

    def _node_local(self, MPI) -> tuple[int, int]:
        local = _env_local_rank()
        if local is not None:
            size = None
            for var in ("SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
                v = os.environ.get(var, "")
                if v.isdigit():
                    size = int(v)
                    break
            if size is not None:
                return local, size
        # ranks that share memory share a node
        node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, MPI.COMM_WORLD.Get_rank())
        try:
            return (local if local is not None else node.Get_rank()), node.Get_size()
        finally:
            node.Free()

    def _select_gpu(self) -> None:
        from lbannpy.backend import get_xp
        cupy = get_xp("cupy")
        count = cupy.cuda.runtime.getDeviceCount()
        if count < 1:
            raise CommError(f"rank {self.rank} of {self.size}: device='gpu' but no CUDA device is visible "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        self.device_id = self.local_rank % count
        cupy.cuda.Device(self.device_id).use()

    # -- teardown -------------------------------------------------------------------------------------
    def _teardown(self) -> None:
        # newest first: an NCCL communicator goes before the MPI communicator it was bootstrapped over
        for comm in reversed(self._owned):
            comm.free()
        self._owned.clear()

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed = exc_type is not None and not (exc_type is SystemExit and exc.code in (0, None))
        if not failed:
            self._teardown()
            return False
        if self.abort_on_error and self.size > 1 and not issubclass(exc_type, KeyboardInterrupt):
            code = exc.code if exc_type is SystemExit and isinstance(exc.code, int) else 1
            report_and_abort(exc_type, exc, tb, code)
        return False

    def __repr__(self) -> str:
        return (f"<Runtime {self.backend} rank {self.rank} of {self.size} local {self.local_rank} "
                f"device {self.device}{'' if self.device_id is None else ':' + str(self.device_id)}>")
