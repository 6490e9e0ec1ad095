"""BLAS/OpenMP threads per rank: the cores a rank may use, set once at start-up.

Without this every rank's BLAS starts one thread per core of the node, so ``P`` ranks on a node run ``P x
cores`` threads and a two-rank run on two cores is an order of magnitude slower than it should be. The
choice, in order of precedence:

1. ``runtime.threads`` in the config (a positive number);
2. ``OMP_NUM_THREADS`` when the user set it;
3. ``SLURM_CPUS_PER_TASK`` (the allocation's cores per task);
4. the cores this process may run on (its CPU affinity) divided by the ranks on this node, at least 1.

:func:`set_threads` applies it with threadpoolctl (every BLAS and OpenMP pool already loaded: NumPy's
OpenBLAS/MKL, the compiled kernels' OpenMP) and rank 0 prints the choice once.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

_LIMITS = None  # threadpoolctl's handle: kept so the limits stay in force for the life of the process


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str


def choose(configured: int | None, env: dict, cores: int, ranks_on_node: int) -> ThreadChoice:
    """Pure: the thread count and the reason, from the config value, the environment, the cores this
    process may use and the number of ranks on its node."""
    if configured:
        return ThreadChoice(int(configured), "runtime.threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    cpt = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if cpt.isdigit() and int(cpt) > 0:
        return ThreadChoice(int(cpt), "SLURM_CPUS_PER_TASK")
    ranks_on_node = max(1, int(ranks_on_node))
    n = max(1, int(cores) // ranks_on_node)
    return ThreadChoice(n, f"{cores} core(s) / {ranks_on_node} rank(s) on this node")


THREADS_PER_CPU = 4  # runtime.threads above this many per CPU of the node is refused


def threads_problem(configured: int | None, cpus: int | None = None) -> str | None:
    """Why ``runtime.threads`` cannot be used on this node (one line naming the key and the bound), or None.

    More BLAS/OpenMP threads than the node has CPUs only oversubscribes it; far more exhausts its memory
    maps and thread limits (100000 crashed the process with a segmentation fault), so a value above
    :data:`THREADS_PER_CPU` per CPU of the node is refused before any pool starts."""
    if not configured:
        return None
    cpus = cpus or os.cpu_count() or 1
    bound = THREADS_PER_CPU * cpus
    if int(configured) > bound:
        return (f"runtime.threads: {configured} is more than {THREADS_PER_CPU} per CPU of this node ({cpus} "
                f"CPUs: at most {bound}); set it to the cores one rank may use, or leave it out (the node's "
                f"cores divided among its ranks)")
    return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def ranks_on_node() -> int:
    """Ranks sharing this node. Who calls: every rank of MPI_COMM_WORLD (a communicator split), or a
    process without MPI (1)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 1
    node = mpi.COMM_WORLD.Split_type(mpi.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def set_threads(world, configured: int | None = None, prog: str = "lbannpy") -> ThreadChoice:
    """Limit this rank's BLAS/OpenMP pools and print the choice on rank 0. Who calls: every rank, once,
    before the first step (:func:`ranks_on_node` is collective over MPI_COMM_WORLD)."""
    global _LIMITS
    from threadpoolctl import threadpool_limits

    import numpy  # noqa: F401  (its BLAS must be loaded for threadpoolctl to see it)

    problem = threads_problem(configured)
    if problem is not None:  # a caller that did not check first: refused before any pool starts
        raise ValueError(problem)
    choice = choose(configured, os.environ, _cores(), ranks_on_node())
    _LIMITS = threadpool_limits(limits=choice.threads)
    # pools started later (a library imported after this call) read the variable
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    if world.rank == 0:
        s = "" if choice.threads == 1 else "s"
        sys.stderr.write(f"{prog}: {choice.threads} BLAS/OpenMP thread{s} per rank ({choice.why}; "
                         f"runtime.threads sets it)\n")
        sys.stderr.flush()
    return choice
