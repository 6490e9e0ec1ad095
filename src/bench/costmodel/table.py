"""The measured compute table: every (layer, distribution) the strategies give a model, timed by the stand-in
harness (alone, then scaled by the co-run), the input read, and a machine with the table added."""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from lbannpy.dist import Distribution
from lbannpy.machine import Machine
from lbannpy.strategy.cost import max_local_shape, required_input
from lbannpy.strategy.graph import INPUT_NAMES, ModelGraph

from .corun import corun_calls, shared_node_factor
from .harness import TableRow, block_ranks, build_chains, chains_plan, run_chains


def measure_compute_table(graph: ModelGraph, strategies: Sequence[Mapping[str, Distribution]],
                          reps: int = 5, optimizer: Mapping[str, Any] | None = None,
                          log: Callable[[str], None] | None = None, overlap: bool = False, procs: int = 1
                          ) -> tuple[list[TableRow], list[str]]:
    """Time every (layer, distribution) that ``strategies`` give the layers of ``graph``, Jia et al.'s t_C:
    a :class:`StandIn` per layer, strategy and block-holding rank (:func:`block_ranks`), a rank's stand-ins
    run as a training step runs them (forward in order, backward in reverse), so that between two uses of a
    tensor the caches see the traffic of the other layers, as in the real step. ``reps`` rounds go through
    every chain in turn after a warm-up round (a burst of other load on the machine spoils one call of many
    entries rather than every call of a few). A rank's time for a key is the median of its calls; the
    entry's is that of the slowest rank, forward and backward apart (ranks meet at every halo exchange and
    reduction, so the slowest rank sets the pace of each phase). These rows, keyed (type, in, out, split),
    are times of a rank with a core to itself.

    ``procs > 1`` (every strategy then on ``procs`` ranks): besides, ``procs`` processes run ranks
    0..procs-1 at once (:func:`corun_calls`), as ``mpiexec -n procs`` runs them on this node, and every row
    is scaled by :func:`shared_node_factor`: the rows, keyed (type, in, out, split, procs), are times of a
    rank among ``procs`` on the node, sharing its cores, caches and memory bandwidth, which
    :func:`lbannpy.strategy.cost.compute_times` then uses unscaled. Returns the rows and notes on entries left
    to the roofline (layers a stand-in cannot reproduce, or two layers of different parameters sharing a
    key)."""
    if procs > 1:
        bad = sorted({d.ranks for dists in strategies for d in dists.values()} - {procs})
        if bad:
            raise ValueError(f"measure_compute_table: procs={procs} times strategies on {procs} ranks, got "
                             f"some on {bad}")
    plans, names, notes = chains_plan(graph, strategies)

    def ranks_of(nodes):
        return sorted({r for _, d, _ in nodes for r in block_ranks(d)}) or [0]

    chains, n = build_chains(plans, ranks_of, optimizer, overlap)
    notes += n
    calls = run_chains(chains, reps)
    del chains
    rows = []
    for key, per_rank in calls.items():
        fwd = max(statistics.median(f) for f, _, _ in per_rank.values())
        total = max(statistics.median(b) for _, b, _ in per_rank.values())
        weights = [statistics.median(w) for _, _, w in per_rank.values() if w]
        data = max(0.0, total - max(weights)) if weights else 0.0
        rows.append(TableRow(key, fwd, total, data))
    factor = 1.0
    if procs > 1:
        co, _ = corun_calls(plans, procs, max(reps, 1), optimizer, overlap)
        factor, per_rank_f = shared_node_factor(rows, co)
        rows = [TableRow(r.key + (procs,), r.fwd_s * factor, r.bwd_s * factor, r.bwd_data_s * factor)
                for r in rows]
        if log:
            log(f"  {procs} ranks at once on this node: each rank's calls took "
                + ", ".join(f"{per_rank_f[r]:.2f}" for r in sorted(per_rank_f))
                + f" times its alone-timed entries; the table keeps {factor:.2f} times them")
    if log:
        for row, (key, per_rank) in zip(rows, calls.items()):
            split = "x".join(str(x) for x in key[3]) if len(key) > 3 else "-"
            log(f"  {names[key]:8s} {key[0]:9s} {split:9s} in {str(key[1]):22s} out {str(key[2]):20s} "
                f"fwd {row.fwd_s * 1e3:8.3f} ms  bwd {row.bwd_s * 1e3:8.3f} ms  ({len(per_rank)} rank(s))")
    return rows, notes


def time_input_read(path: str, graph: ModelGraph, dists: Mapping[str, Distribution], reps: int = 5
                    ) -> TableRow:
    """A table row for reading the slowest rank's block of one mini-batch of ``path``, in the distribution
    the layer reading the model input needs (what the trainer's reader reads, labels included, with no
    prefetch: h5py holds the GIL while it reads, so on the CPU the read does not hide behind NumPy work):
    the median of ``reps`` reads after one."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.data.reader import HDF5Reader

    first = next(n for n in graph if any(p in INPUT_NAMES for p in n.parents))
    in_dist = required_input(first, dists[first.name], graph.input_shape)
    block = max_local_shape(graph.input_shape, in_dist)
    reader = HDF5Reader(path, dist=in_dist, rank=0, batch_size=graph.batch_size, seed=1, shuffle=True,
                        prefetch=False)  # rank 0 holds the largest block
    times = []
    try:
        for i in range(max(reps, 1) + 1):
            t0 = time.perf_counter()
            reader.next()
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        reader.close()
    return TableRow(("input", block, block), statistics.median(times), 0.0)


def with_table(machine: Machine, rows: Sequence[TableRow]) -> Machine:
    """``machine`` with ``rows`` added to its measured table (see :meth:`TableRow.to_yaml`)."""
    measured = dict(machine.measured)
    for r in rows:
        measured[r.key] = (r.fwd_s, r.bwd_data_s, r.bwd_s - r.bwd_data_s)
    return replace(machine, measured=measured)
