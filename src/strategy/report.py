"""Text reports of a plan: the chosen strategy, ``--explain`` details and the ``--compare`` table."""
from __future__ import annotations

from collections import Counter

from ..local_machine import describe
from .cost import gradient_sync_group
from .planner import GIB, Plan, StrategyCost

SYNC_NAMES = {"allreduce": "allreduce", "parameter_server": "parameter server"}


def _ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def strategy_table(plan: Plan) -> str:
    g = plan.graph
    c = plan.chosen
    lines = [f"strategy for {g.name} (batch {g.batch_size}) on {plan.ranks} ranks, machine "
             f"{plan.machine.name}, memory limit {plan.memory_limit_bytes / GIB:.2f} GiB, gradient sync by "
             f"{SYNC_NAMES[plan.machine.gradient_sync]}",
             f"search: {plan.result.method}, {len(g)} layers, "
             f"{sum(len(v) for v in plan.candidates.values())} candidates, {plan.result.final_nodes} layers "
             f"left after eliminations; tables "
             f"{plan.table_seconds:.3f} s, search {plan.search_seconds:.3f} s",
             f"{'layer':28s} {'type':10s} {'distribution':14s} {'compute ms':>10s} {'comm ms':>9s} "
             f"{'t_X in ms':>9s} {'mem MiB':>9s}"]
    for node in g:
        lc = c.layer[node.name]
        lines.append(f"{node.name:28s} {node.type:10s} {str(c.dists[node.name]):14s} "
                     f"{_ms(lc.compute_s):>10s} {_ms(lc.comm_s):>9s} {_ms(c.transfer_in[node.name]):>9s} "
                     f"{lc.mem_persistent_bytes / 2 ** 20:9.1f}")
    lines.append(f"predicted step: {c.step_s * 1e3:.3f} ms (compute {c.compute_s * 1e3:.3f} ms, "
                 f"communication {c.comm_s * 1e3:.3f} ms), memory {c.memory_bytes / GIB:.2f} GiB per rank")
    lines.append(f"machine: {describe(plan.machine)}")
    lines += [f"note: {m}" for m in plan.messages]
    return "\n".join(lines)


def explain(plan: Plan, max_dropped: int = 8) -> str:
    """Per layer: the choice, its compute / communication / memory terms, the other candidates, and why the
    dropped ones were dropped."""
    c = plan.chosen
    out = []
    for node in plan.graph:
        lc = c.layer[node.name]
        d = c.dists[node.name]
        out.append(f"{node.name} ({node.type}) {node.in_shape} -> {node.out_shape}: chose {d}")
        copies = gradient_sync_group(node, d)
        out.append(f"    fwd {lc.fwd_s * 1e3:.3f} ms, bwd-data {lc.bwd_data_s * 1e3:.3f} ms, bwd-weights "
                   f"{lc.bwd_weights_s * 1e3:.3f} ms, halo {lc.halo_s * 1e3:.3f} ms, in-layer comm "
                   f"{lc.internal_comm_s * 1e3:.3f} ms, gradient sync t_S {lc.t_s * 1e3:.3f} ms "
                   f"({SYNC_NAMES[plan.machine.gradient_sync]} over {copies} "
                   f"rank{'' if copies == 1 else 's'} per weight block), "
                   f"redistribution in {c.transfer_in[node.name] * 1e3:.3f} ms; memory "
                   f"{lc.mem_persistent_bytes / 2 ** 20:.1f} MiB kept + "
                   f"{lc.mem_transient_bytes / 2 ** 20:.1f} MiB transient")
        others = [f"{k.dist} {k.cost.total_s * 1e3:.3f} ms"
                  + (f" (t_S {k.cost.t_s * 1e3:.3f})" if k.cost.t_s else "")
                  for k in plan.candidates[node.name] if k.dist != d]
        if others:
            out.append(f"    other candidates (own cost): {', '.join(others[:6])}"
                       + (f", ... {len(others) - 6} more" if len(others) > 6 else ""))
        drops = plan.dropped[node.name]
        if drops:
            kinds = Counter(x.reason.split(":")[0] for x in drops)
            out.append(f"    dropped {len(drops)}: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
            for x in drops[:max_dropped]:
                out.append(f"      {str(x.dist):14s} {x.reason}")
            if len(drops) > max_dropped:
                out.append(f"      ... {len(drops) - max_dropped} more")
    limit = plan.memory_limit_bytes
    for name, b in plan.baselines.items():
        if b.memory_bytes > limit:
            out.append(f"{name} does not fit: it needs {b.memory_bytes / GIB:.2f} GiB per rank > limit "
                       f"{limit / GIB:.2f} GiB (largest layer: {_largest(b)})")
    out += [f"note: {m}" for m in plan.messages]
    return "\n".join(out)


def _largest(s: StrategyCost) -> str:
    name, lc = max(s.layer.items(), key=lambda kv: kv[1].mem_persistent_bytes)
    return f"{name} keeps {lc.mem_persistent_bytes / GIB:.2f} GiB under {s.dists[name]}"


def compare(plan: Plan) -> str:
    """Predicted step time of the baselines and of the chosen strategy (Jia et al. §6 baselines)."""
    limit = plan.memory_limit_bytes
    rows = list(plan.baselines.items()) + [("chosen (layer-wise)", plan.chosen)]
    dp = plan.baselines.get("data-parallel")
    lines = [f"{'strategy':22s} {'step ms':>10s} {'compute ms':>10s} {'comm ms':>10s} {'t_S ms':>9s} "
             f"{'mem GiB':>8s} {'fits':>5s} {'vs data-parallel':>16s}"]
    for name, s in rows:
        speed = f"{dp.step_s / s.step_s:.2f}x" if dp else "-"
        lines.append(f"{name:22s} {s.step_s * 1e3:10.3f} {s.compute_s * 1e3:10.3f} {s.comm_s * 1e3:10.3f} "
                     f"{s.sync_s * 1e3:9.3f} {s.memory_bytes / GIB:8.2f} "
                     f"{'yes' if s.memory_bytes <= limit else 'NO':>5s} {speed:>16s}")
    lines.append(f"(comm includes t_S, the gradient sync by {SYNC_NAMES[plan.machine.gradient_sync]})")
    if plan.heuristic is not None:
        lines.append(f"Dryden longest-path heuristic: {plan.heuristic.cost * 1e3:.3f} ms "
                     f"(chosen by {plan.result.method}: {plan.chosen.step_s * 1e3:.3f} ms, same candidates)")
    return "\n".join(lines)
