"""The node ``bench calibrate`` runs on: its compute slots and the memory of one rank's device."""
from __future__ import annotations

import os


def compute_slots(comm, xp, hosts: list[str]) -> int:
    """Compute slots of rank 0's node. GPU: the devices it has. CPU: ``SLURM_CPUS_ON_NODE`` inside a SLURM
    job (its allocation), else the union of the CPUs that the ranks on the node may run on (a launcher that
    binds ranks to cores shows only those), else ``os.cpu_count()``. Collective over ``comm``."""
    if xp.__name__ == "cupy":
        return int(xp.cuda.runtime.getDeviceCount())
    try:
        mine = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = []
    every = comm.allgather_obj(mine)
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    if slurm.isdigit() and int(slurm) > 0:
        return int(slurm)
    cpus = set()
    for host, c in zip(hosts, every):
        if host == hosts[0]:
            cpus.update(c)
    return len(cpus) or os.cpu_count() or 1


def memory_gib(xp, ranks_per_node: int) -> float:
    """Memory of one device (GPU), or of the node's share of one rank (CPU), GiB."""
    if xp.__name__ == "cupy":
        return round(xp.cuda.runtime.memGetInfo()[1] / 2 ** 30, 2)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return round(total / max(ranks_per_node, 1) / 2 ** 30, 2)


SHARED_CHUNK = 6  # 128x128x128 GEMMs a chunk: about 0.25 ms of a core, the time of a small layer's kernel


def _chunk_loop(comm, xp, a, n: int, active: bool, sync: bool, alone: bool = False) -> float:
    """Wall seconds of ``n`` chunks on this rank (none where not ``active``), an allreduce of 4 bytes after
    each where ``sync``; the ranks start together. ``alone``: rank 0 computes, the others sleep."""
    import time

    buf, res = xp.ones(1, dtype=xp.float32), xp.empty(1, dtype=xp.float32)
    comm.barrier()
    t0 = time.perf_counter()
    if active:
        for _ in range(n):
            for _ in range(SHARED_CHUNK):
                a @ a
            if sync:
                comm.allreduce(buf, "sum", out=res)
    t = time.perf_counter() - t0
    if alone:  # the others sleep (a waiting MPI rank spins, taking a core a rank alone would not share)
        done = xp.zeros(1, dtype=xp.float32)
        if comm.rank == 0:
            for peer in range(1, comm.size):
                comm.isend(done, peer, tag=71).wait()
        else:
            req = comm.irecv(done, 0, tag=71)
            while not req.test():
                time.sleep(1e-3)
            req.wait()
    return t


def measure_sharing(comm, xp, seconds: float = 0.2, repeats: int = 3) -> tuple[list[dict], list[str]]:
    """``compute.shared`` rows (:meth:`lbannpy.machine.Machine.shared_at`) of 1 rank and of every rank of
    the node computing: the wall time of about ``seconds`` of chunks of small GEMMs over the median time of
    one chunk with every rank computing (what the per-call rates are), for rank 0 alone (the others wait)
    and for every rank at once (``factor``: the time slices other work takes, memory bandwidth shared);
    and, every rank at once with an allreduce after each chunk, the time per allreduce beyond that
    (``sync_s``: the wait for a partner that lost a slice). Medians of ``repeats``. Collective."""
    import time

    import numpy as np

    a = xp.asarray(np.random.default_rng(comm.rank).standard_normal((128, 128), dtype=np.float32))
    calls = []
    comm.barrier()
    for _ in range(60):
        t0 = time.perf_counter()
        for _ in range(SHARED_CHUNK):
            a @ a
        calls.append(time.perf_counter() - t0)
    chunk = max(comm.allgather_obj(float(np.median(calls[10:]))))
    n = comm.bcast_obj(int(min(max(seconds / chunk, 50), 5000)), root=0)
    solo, free, lock = [], [], []
    for _ in range(repeats):
        solo.append(comm.bcast_obj(_chunk_loop(comm, xp, a, n, comm.rank == 0, False, alone=True), root=0))
        free.append(max(comm.allgather_obj(_chunk_loop(comm, xp, a, n, True, False))))
        lock.append(max(comm.allgather_obj(_chunk_loop(comm, xp, a, n, True, True))))
    f1, fp = (max(1.0, float(np.median(t)) / (n * chunk)) for t in (solo, free))
    sync = max(0.0, (float(np.median(lock)) - float(np.median(free))) / n)
    rows = [{"procs": 1, "factor": round(f1, 3), "sync_s": 0.0}]
    if comm.size > 1:
        rows.append({"procs": comm.size, "factor": round(fp, 3), "sync_s": sync})
    lines = [f"lockstep: {n} chunks of {chunk * 1e3:.3f} ms (median, every rank at once): 1 rank alone "
             f"x{f1:.2f}, {comm.size} at once x{fp:.2f}, an allreduce after each chunk waits "
             f"{sync * 1e6:.1f} us more (runs: alone {[round(t * 1e3, 1) for t in solo]} ms, at once "
             f"{[round(t * 1e3, 1) for t in free]}, in lockstep {[round(t * 1e3, 1) for t in lock]})"]
    return rows, lines
