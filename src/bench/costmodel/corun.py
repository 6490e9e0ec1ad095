"""The co-run: the ranks of one node timing their stand-in chains at once, each in a process of its own, as
``mpiexec -n P`` runs them, and what that sharing costs over each rank running alone."""
from __future__ import annotations

import time
from typing import Sequence

from .harness import Calls, TableRow, build_chains, run_chains


def _corun_worker(plans, rank, rounds, optimizer, overlap, barrier, conn) -> None:
    """One of the processes of :func:`corun_calls`: times rank ``rank``'s chains while the others time
    theirs."""
    try:
        chains, notes = build_chains(plans, lambda nodes: [rank], optimizer, overlap)
        barrier.wait(timeout=300)
        calls = run_chains(chains, rounds, lambda: barrier.wait(timeout=300))
        conn.send(("ok", calls, notes))
    except BaseException as exc:  # the parent raises it, with this rank named
        import traceback
        try:
            barrier.abort()
        except Exception:
            pass
        conn.send(("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}", []))
    finally:
        conn.close()


def corun_calls(plans, procs: int, rounds: int, optimizer, overlap: bool, timeout: float = 900
                 ) -> tuple[Calls, list[str]]:
    """Every rank 0..procs-1 runs its own chains in a process of its own, all at once (rounds start
    together, as a training step's ranks do); returns every rank's calls."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    workers = []
    for rank in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_corun_worker, name=f"lbannpy-table-r{rank}",
                        args=(plans, rank, rounds, optimizer, overlap, barrier, send), daemon=True)
        p.start()
        send.close()
        workers.append((rank, p, recv))
    calls: Calls = {}
    notes: list[str] = []
    errors = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p, recv in workers:
            if not recv.poll(max(0.0, deadline - time.monotonic())):
                errors.append(f"rank {rank}: no result within {timeout:.0f} s")
                continue
            try:
                status, got, n = recv.recv()
            except EOFError:
                errors.append(f"rank {rank}: the process ended without a result (exit code {p.exitcode})")
                continue
            if status != "ok":
                errors.append(got)
                continue
            if rank == 0:
                notes += n
            for key, per_rank in got.items():
                calls.setdefault(key, {})[rank] = per_rank[rank]
    finally:
        for _, p, recv in workers:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            recv.close()
    if errors:
        raise RuntimeError(f"timing the layer table with {procs} processes failed: " + "; ".join(errors))
    return calls, notes


def shared_node_factor(rows: Sequence[TableRow], calls: Calls) -> tuple[float, dict[int, float]]:
    """What running a node's ranks at once costs over each running alone: per rank, the sum of its co-run
    call times over the sum, for the same calls, of the alone-timed entries ``rows`` (forward, backward,
    backward without dL/dx); the factor is the largest (the slowest rank sets the pace). Sums over all of a
    rank's calls, because where ranks share a core a call either runs whole or takes a whole time slice of
    another rank longer: one key's few calls say little, their sum says what sharing costs."""
    by_key = {r.key: r for r in rows}
    per_rank: dict[int, list[float]] = {}
    for key, ranks in calls.items():
        row = by_key.get(key)
        if row is None:
            continue
        for rank, (f, b, w) in ranks.items():
            acc = per_rank.setdefault(rank, [0.0, 0.0])
            acc[0] += sum(f) + sum(b) + sum(w)
            acc[1] += len(f) * row.fwd_s + len(b) * row.bwd_s + len(w) * (row.bwd_s - row.bwd_data_s)
    factors = {r: t / a for r, (t, a) in per_rank.items() if a > 0}
    return (max(factors.values()) if factors else 1.0), factors
