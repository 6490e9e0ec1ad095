"""Gradient synchronisation (t_S): the parameter-server term of Jia et al. (2018) §5.1 next to the ring
allreduce, its group, the machine setting that picks it, and what it does to VGG-16 on 4 P100s (Table 5)."""
from __future__ import annotations

import itertools
import math

import pytest

from lbannpy import zoo
from lbannpy.dist import Distribution
from lbannpy.strategy import cost
from lbannpy.strategy.graph import build_graph
from lbannpy.machine import PRESETS, Link, Machine, MachineError, load_machine
from lbannpy.strategy.planner import evaluate_strategy, plan

INTRA = Link(alpha_s=1e-5, beta_s_per_byte=1e-10)  # 10 µs, 10 GB/s
INTER = Link(alpha_s=2e-5, beta_s_per_byte=4e-10)  # 20 µs, 2.5 GB/s


def test_parameter_server_time_hand_computed():
    mb = 1e6  # bytes
    assert cost.parameter_server_time(mb, 1, 1, INTRA, INTER) == 0.0
    # 4 copies on one node: the server takes 3 gradients and sends 3 blocks back, one after another
    # 2 · 3 · (1e-5 s + 1e6 B · 1e-10 s/B) = 6.6e-4 s
    assert cost.parameter_server_time(mb, 4, 4, INTRA, INTER) == pytest.approx(6.6e-4, rel=1e-12)
    # 16 copies, 4 per node: 3 over NVLink (3.3e-4 s) while 12 come over the NIC (12 · 4.2e-4 = 5.04e-3 s)
    assert cost.parameter_server_time(mb, 16, 4, INTRA, INTER) == pytest.approx(2 * 5.04e-3, rel=1e-12)
    # 2 copies on different nodes: one transfer each way over the inter-node link
    assert cost.parameter_server_time(mb, 2, 1, INTRA, INTER) == pytest.approx(2 * 4.2e-4, rel=1e-12)


def test_parameter_server_grows_with_copies_unlike_ring():
    m = Machine("t", INTRA, INTRA, 64, 16, 1e-12, allreduce_threshold_bytes=0)
    mb = 1e8
    ps = [cost.parameter_server_time(mb, p, p, INTRA, INTRA) for p in (2, 4, 8)]
    ring = [cost.allreduce_time(mb, p, INTRA, m) for p in (2, 4, 8)]
    assert ps[1] / ps[0] == pytest.approx(3, rel=1e-3) and ps[2] / ps[0] == pytest.approx(7, rel=1e-3)
    assert ring[2] / ring[0] < 2  # 2 (p-1)/p: 1, 1.5, 1.75 times n β


def _conv_graph(batch=8):
    return build_graph({"name": "t", "input": {"channels": 8, "spatial": [16, 16]},
                        "layers": [{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1},
                                   {"name": "f", "type": "fc", "units": 8}]}, batch)


@pytest.mark.parametrize("dist, group", [
    (Distribution.make(4, 4, n=4), 4), (Distribution.make(4, 4, h=2, w=2), 4),
    (Distribution.make(4, 4, n=2), 2),  # on 2 of 4 ranks: the 2 replicas reduce in their own groups
    (Distribution.make(4, 4, n=2, c=2), 2), (Distribution.make(4, 4, c=4), 1), (Distribution.make(4, 4), 1),
], ids=str)
def test_sync_group_follows_the_runtime_block_group(dist, group):
    node = _conv_graph()["c"]
    assert cost.gradient_sync_group(node, dist) == group
    # the runtime sums a weight gradient over block_group(rank, non-channel dims): the same size
    assert len(dist.block_group(0, [d for d in dist.dim_names if d != "c"])) == group


def test_gradient_sync_time_by_scheme():
    node = _conv_graph()["c"]
    nb = (8 * 8 * 9 + 8) * 4  # weights and bias, float32: 2336 bytes
    p100 = load_machine("p100")
    assert p100.gradient_sync == "parameter_server"
    d = Distribution.make(4, 4, n=4)
    want = 2 * 3 * (p100.intra.alpha_s + nb * p100.intra.beta_s_per_byte)
    assert cost.gradient_sync_time(node, d, p100) == pytest.approx(want, rel=1e-12)
    ring = Machine.from_dict({**PRESETS["p100"], "gradient_sync": "allreduce"})
    assert cost.gradient_sync_time(node, d, ring) == pytest.approx(
        cost.allreduce_time(nb, 4, ring.intra, ring), rel=1e-12)
    assert cost.layer_cost(node, d, p100).t_s == pytest.approx(want, rel=1e-12)
    assert cost.gradient_sync_time(node, Distribution.make(4, 4, c=4), p100) == 0.0


def test_machine_setting():
    assert load_machine("lassen").gradient_sync == "allreduce"
    assert load_machine("h100").gradient_sync == "allreduce"
    assert Machine.from_dict(PRESETS["p100"]).gradient_sync == "parameter_server"
    with pytest.raises(MachineError, match="gradient_sync must be one of allreduce, parameter_server"):
        Machine.from_dict({**PRESETS["p100"], "gradient_sync": "gossip"})


def test_elimination_equals_brute_force_with_parameter_server():
    """Plan on a branchy graph (residual sum) under the p100 preset, and brute force over every combination
    of the kept candidates evaluated whole by evaluate_strategy: t_S stays a per-layer term, so the
    elimination's optimum is the true one."""
    spec = {"name": "res", "input": {"channels": 8, "spatial": [16, 16]},
            "layers": [{"name": "c1", "type": "conv", "filters": 16, "kernel": 3, "padding": 1},
                       {"name": "c2", "type": "conv", "filters": 16, "kernel": 3, "padding": 1},
                       {"name": "s", "type": "sum", "parents": ["c1", "c2"]},
                       {"name": "f", "type": "fc", "units": 512}]}
    mach = load_machine("p100")
    for batch in (8, 64):
        g = build_graph(spec, batch)
        p = plan(g, 4, mach, max_candidates=5, compare=False)
        assert p.result.method == "elimination" and p.result.complete
        names = [n.name for n in g]
        best = min(evaluate_strategy(g, dict(zip(names, combo)), mach).step_s
                   for combo in itertools.product(*[[c.dist for c in p.candidates[n]] for n in names]))
        assert p.chosen.step_s == pytest.approx(best, rel=1e-12)
        assert p.chosen.step_s == pytest.approx(p.result.cost, rel=1e-9)


@pytest.fixture(scope="module")
def vgg_p100():
    return plan(zoo.get_spec("vgg16", batch_size=128), 4, "p100")


def _sample_only(d: Distribution) -> bool:
    return d.split[0] == d.ranks and all(s == 1 for s in d.split[1:])


def test_vgg16_p100_early_layers_are_sample_parallel(vgg_p100):
    """Jia Table 5, rows 1-4: conv1_x .. conv4_x and their pools split the samples over all 4 devices."""
    early = [n.name for n in vgg_p100.graph if n.type in ("conv", "pool") and n.name[4] in "1234"]
    assert len(early) == 14
    assert all(_sample_only(vgg_p100.choice[n]) for n in early)


def test_vgg16_p100_fcs_split_channels_and_reduce_degree(vgg_p100):
    """Jia Table 5, fully-connected rows: model parallelism (fc6 c4), and the degree drops for a later fc."""
    fcs = [n.name for n in vgg_p100.graph if n.type == "fc"]
    assert fcs == ["fc6", "fc7", "fc8"]
    d6 = vgg_p100.choice["fc6"]
    assert d6.split[1] == 4 and d6.split[0] == 1
    assert any(math.prod(vgg_p100.choice[n].parts) < 4 for n in fcs)  # fewer than all ranks (replicas)
    assert all(vgg_p100.choice[n].split[0] == 1 for n in fcs)  # no sample split: no weight copies synced
    assert all(vgg_p100.chosen.layer[n].t_s == 0.0 for n in fcs)


CONV5_GAP = ("not reproduced: with a FLOP roofline for t_C, h/w splits of conv5_x do the same work per "
             "device as n4, keep 4 weight copies (same t_S) and add halos and a reshuffle; Jia et al. "
             "measure t_C")
FC8_GAP = ("not reproduced: fc8 is cheapest replicated on every rank (r4, degree 1), by tens of µs over c2 "
           "and c4; Jia et al. have fc8 {n=1, c=2}")


@pytest.mark.xfail(strict=True, reason=CONV5_GAP)
def test_vgg16_p100_some_conv5_layer_splits_space(vgg_p100):
    conv5 = [n for n in vgg_p100.choice if n.startswith("conv5")]
    assert any(vgg_p100.choice[n].split[2] * vgg_p100.choice[n].split[3] > 1 for n in conv5)


@pytest.mark.xfail(strict=True, reason=FC8_GAP)
def test_vgg16_p100_every_fc_splits_channels(vgg_p100):
    assert all(vgg_p100.choice[n].split[1] > 1 for n in ("fc6", "fc7", "fc8"))
