"""Cost model, candidate filtering and planning (pure; no MPI)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from lbannpy import zoo
from lbannpy.dist import Distribution
from lbannpy.strategy import cost
from lbannpy.strategy.graph import build_graph
from lbannpy.machine import MachineError, Machine, load_machine
from lbannpy.strategy.planner import (PlanError, baseline_strategies, evaluate_strategy, filter_reason,
                                      layer_candidates, plan)

M = load_machine("p100")


def _graph(layers, spatial=(32, 32), channels=8, batch=8):
    return build_graph({"name": "t", "input": {"channels": channels, "spatial": list(spatial)},
                        "layers": layers}, batch)


def test_allreduce_switches_algorithm_at_threshold():
    link = M.allreduce_link or M.intra  # a machine file may give allreduce its own α, β
    small = M.allreduce_threshold_bytes - 1
    want = 3 * (link.alpha_s + small * link.beta_s_per_byte)
    assert cost.allreduce_time(small, 8, link, M) == pytest.approx(want)
    big = 10 * M.allreduce_threshold_bytes
    assert cost.allreduce_time(big, 8, link, M) == pytest.approx(
        14 * link.alpha_s + 2 * 7 / 8 * big * link.beta_s_per_byte)
    assert cost.allreduce_time(big, 1, link, M) == 0.0


@pytest.mark.parametrize("dist", [Distribution.make(4, 8, n=2, h=2),
                                  Distribution.make(4, 8, c=2, replicate=["c"]),
                                  Distribution.make(4, 12, n=3, w=2), Distribution.make(2, 4, c=4)], ids=str)
def test_boxes_match_dist(dist):
    shape = (5, 7, 9, 11)[:dist.ndim]
    boxes = cost._boxes(dist, shape)
    for r in range(dist.ranks):
        assert tuple(map(tuple, boxes[r])) == dist.box(shape, r)


def test_shuffle_volumes():
    shape = (4, 2, 8, 8)
    n4 = Distribution.make(4, 4, n=4)
    hw = Distribution.make(4, 4, h=2, w=2)
    assert not cost.shuffle_volume(shape, n4, n4).any()
    # each rank holds one sample and needs a quarter of every sample: 3 of its 4 pieces come from others
    assert (cost.shuffle_volume(shape, n4, hw) == 3 * 2 * 4 * 4).all()
    gathered = Distribution((4, 1, 1, 1), 4).with_ranks(4)
    rep = Distribution((1, 1, 1, 1), 4)
    assert (cost.shuffle_volume(shape, gathered, rep) == 3 * 2 * 64).all()
    assert cost.redistribution_time(shape, n4, n4, M) == 0.0
    assert cost.redistribution_time(shape, n4, hw, M) > 0


def test_halo_widths_and_dryden_terms():
    g = _graph([{"name": "c", "type": "conv", "filters": 8, "kernel": 3, "padding": 1}])
    node = g["c"]
    d = Distribution.make(4, 4, h=2, w=2)
    assert cost.halo_widths(node.stencil.dims, node.in_shape, d.split)[2:] == ((1, 1), (1, 1))
    # forward: 2 SR(O·N·C·W) + 2 SR(O·N·C·H) + 4 SR(O²·N·C) with local H = W = 16 (one side each way)
    link = M.intra
    sr = lambda elems: link.alpha_s + elems * 4 * link.beta_s_per_byte  # noqa: E731
    fp = 2 * sr(8 * 8 * 16) + 2 * sr(8 * 8 * 16) + 4 * sr(8 * 8)
    assert cost.halo_time(node, d, M, needs_dx=False) == pytest.approx(fp)
    assert cost.halo_time(node, Distribution.make(4, 4, n=4), M) == 0.0
    one = _graph([{"name": "c", "type": "conv", "filters": 8, "kernel": 1}])["c"]
    assert cost.halo_time(one, d, M) == 0.0


def test_fc_decomposition_matches_gholami_eq8_bandwidth_terms():
    """Layer-wise terms of a chain of fc layers on Pr x Pc equal eq. 8 (bandwidth part; α set to 0)."""
    mach = Machine.from_dict({**_p100_tree(), "intra": {"alpha_s": 0, "beta_s_per_byte": 1e-9},
                                   "inter": {"alpha_s": 0, "beta_s_per_byte": 1e-9},
                                   "allreduce": {"threshold_bytes": 0},
                                   "gradient_sync": "allreduce"})  # eq. 8 reduces dL/dW by allreduce
    B, dims, pr, pc = 16, [64, 32, 48, 16], 2, 2
    g = build_graph({"name": "f", "input": {"channels": dims[0], "spatial": [1]},
                     "layers": [{"name": f"f{i}", "type": "fc", "units": d, "bias": False}
                                for i, d in enumerate(dims[1:], 1)]}, B)
    P = pr * pc
    dists = {n.name: Distribution.make(2, P, n=pc, c=pr) for n in g}
    sc = evaluate_strategy(g, dists, mach)
    ours = sum(sc.transfer_in.values()) + sum(c.internal_comm_s + c.allreduce_s for c in sc.layer.values())
    # eq. 8's first sum starts at the first layer's output; the last layer's output all-gather (to the loss)
    # is not an edge of our graph, so add it; its third sum skips layer 1's gradient, ours does not
    last_gather = B / pc * (pr - 1) / pr * dims[-1] * 4e-9
    first_grad = 2 * (pc - 1) / pc * dims[0] * dims[1] / pr * 4e-9
    first_dx = 0.0  # layer 1 reads the model input: no dL/dx (eq. 8 starts its second sum at i = 2 too)
    expected = cost.fc_15d_comm_time(B, dims, pr, pc, mach.intra) - last_gather + first_grad + first_dx
    # the backward of the all-gather of a replicated tensor needs no data (each rank keeps its own slice)
    assert ours == pytest.approx(expected, rel=1e-9)


def _p100_tree():
    from lbannpy.machine import PRESETS
    return dict(PRESETS["p100"])


def test_machine_model_errors_and_yaml(tmp_path):
    with pytest.raises(MachineError, match="intra"):
        Machine.from_dict({"compute": {"gamma_s_per_flop": 1e-12}})
    with pytest.raises(MachineError, match="unknown machine"):
        load_machine("nonexistent-machine")
    import yaml
    tree = _p100_tree()
    tree["compute"] = {**tree["compute"], "measured": [
        {"type": "relu", "in": [2, 8, 32, 32], "out": [2, 8, 32, 32], "fwd_s": 0.5, "bwd_data_s": 0.25}]}
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump(tree))
    m = load_machine(str(f))
    node = _graph([{"name": "r", "type": "relu", "parents": ["x"]}], batch=8)["r"]
    assert cost.compute_times(node, Distribution.make(4, 4, n=4), m) == (0.5, 0.25, 0.0)
    assert cost.compute_times(node, Distribution.make(4, 4, n=4), M)[0] < 0.01


def test_candidate_filters_record_reasons():
    g = _graph([{"name": "c", "type": "conv", "filters": 8, "kernel": 7, "padding": 3}], spatial=(8, 8),
               batch=2)
    node = g["c"]
    assert "empty blocks" in filter_reason(node, Distribution.make(4, 4, n=4), 0.25)
    assert "smaller than its halo" in filter_reason(node, Distribution.make(4, 4, h=4), 0.25)
    assert "load imbalance" in filter_reason(
        _graph([{"name": "c", "type": "conv", "filters": 8, "kernel": 1}], batch=5)["c"],
        Distribution.make(4, 4, n=4), 0.25)
    assert filter_reason(node, Distribution.make(4, 4, n=2, h=2), 0.25) is None
    kept, dropped = layer_candidates(node, 4, M, memory_limit_bytes=1000, max_candidates=4)
    assert not kept and any("memory" in d.reason for d in dropped)
    kept, dropped = layer_candidates(node, 16, M, max_candidates=3)
    assert 3 <= len(kept) <= 4 and any(d.reason.startswith("pruned") for d in dropped)
    assert all(math.prod(k.dist.split) <= 16 and 16 % math.prod(k.dist.split) == 0 for k in kept)


def test_plan_chain_and_branches_agree_with_evaluation():
    spec = zoo.get_spec("mesh_tiny", batch_size=4)
    p = plan(spec, 4, "p100", heuristic=True)
    assert p.result.method == "shortest-path"
    assert p.chosen.step_s == pytest.approx(p.result.cost)
    assert p.chosen.step_s <= min(b.step_s for b in p.baselines.values()) + 1e-12
    assert p.heuristic.cost >= p.result.cost - 1e-12
    assert set(p.parallel_layers()) == {n.name for n in p.graph}
    r = plan(zoo.get_spec("resnet50", batch_size=8, input_size=64), 4, "p100")
    assert r.result.method == "elimination" and r.result.complete
    assert r.chosen.step_s == pytest.approx(r.result.cost)


def test_memory_limit_forces_spatial_parallelism():
    """mesh2k at 4 samples on 16 ranks with 16 GiB: sample parallelism keeps a whole sample per rank and does
    not fit; the plan fits by splitting samples spatially, and a too-small limit fails clearly."""
    spec = zoo.get_spec("mesh2k", batch_size=4, input_size=1024)
    small = plan(spec, 16, "lassen", memory_gib=4)
    assert small.baselines["data-parallel"].memory_bytes > small.memory_limit_bytes
    assert small.chosen.memory_bytes <= small.memory_limit_bytes
    assert any(d.split[2] * d.split[3] > 1 for d in small.choice.values())
    with pytest.raises(PlanError,
                       match="no usable distribution on 16 ranks.*memory: .* GiB per rank for this layer"):
        plan(spec, 16, "lassen", memory_gib=0.05)


def test_baselines_shapes():
    g = build_graph(zoo.get_spec("alexnet")["model"], 32)
    b = baseline_strategies(g, 4)
    assert str(b["data-parallel"]["conv1"]) == "n4" and str(b["owt"]["fc6"]) == "c4"
    assert str(b["owt"]["conv1"]) == "n4" and str(b["model-parallel"]["conv1"]) == "c4"
    with pytest.raises(PlanError, match="ranks"):
        plan(zoo.get_spec("lenet5"), 0)
    assert np.isfinite(evaluate_strategy(g, b["owt"], M).step_s)


def test_a_measured_redistribution_link_prices_shuffles():
    """``redistribution`` in a machine file (what ``bench calibrate`` measures of lbannpy's shuffles) replaces
    the point-to-point link in t_X: ⌈log2 peers⌉·α + received bytes·β of the slowest rank."""
    from lbannpy.strategy import cost
    from lbannpy.machine import MachineError, Machine, PRESETS
    base = dict(PRESETS["p100"])
    m = Machine.from_dict({**base, "redistribution": {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9}})
    src = Distribution.make(4, 2, c=2)
    dst = Distribution.make(4, 2, replicate=["c"], c=2)
    shape = (2, 4, 3, 5)
    received = 2 * 2 * 3 * 5 * 4  # the other rank's two channels, float32
    assert cost.shuffle_time(shape, src, dst, m) == pytest.approx(1e-3 + received * 1e-9, rel=1e-12)
    assert cost.shuffle_time(shape, dst, src, m) == 0.0  # every rank already holds its piece
    plain = Machine.from_dict(base)
    assert plain.redistribution_link is None
    assert cost.shuffle_time(shape, src, dst, plain) == pytest.approx(
        plain.intra.alpha_s + received * plain.intra.beta_s_per_byte, rel=1e-12)
    with pytest.raises(MachineError, match="'redistribution' must be a mapping"):
        Machine.from_dict({**base, "redistribution": {"alpha_s": 1e-3}})


@pytest.mark.parametrize("name", ["p100", "lassen", "h100"])
def test_presets_are_the_shipped_files_and_price_memory_bound_layers(name):
    """One definition per preset (src/machines/NAME.yaml), and a roofline with a memory term: a ReLU moves its
    input and output once each, so on a GPU preset it costs bytes · mem_s_per_byte plus the kernel overhead,
    not the nothing its FLOPs alone would give."""
    from lbannpy.machine import PRESETS, machines_dir
    import yaml
    tree = yaml.safe_load((machines_dir() / f"{name}.yaml").read_text())
    assert PRESETS[name] == tree and name in set(PRESETS)
    m = load_machine(name)
    assert m == Machine.from_dict(tree, name=name) and m.mem_s_per_byte > 0 and m.kernel_overhead_s > 0
    g = build_graph({"name": "r", "input": {"channels": 64, "spatial": [224, 224]},
                     "layers": [{"name": "a", "type": "relu"}]}, 32)
    node = g["a"]
    nbytes = 2 * 32 * 64 * 224 * 224 * 4  # read x, write y: float32
    fwd, bwd_data, bwd_w = cost.compute_times(node, Distribution.make(4, 4, n=4), m)
    want = nbytes / 4 * m.mem_s_per_byte + m.kernel_overhead_s
    assert fwd == pytest.approx(want, rel=1e-12) and bwd_data == pytest.approx(want, rel=1e-12) and bwd_w == 0


# --------------------------------------------------------------------------------------------------------
# the facts the new layer types are priced by (declared by toy types here, so each rule is tested on its own
# whatever the shipped types declare)

_A, _B = 2e-6, 1e-9  # α (s), β (s/B) of every link of the test machine below


def _ab_machine(**compute):
    """A machine with one α-β everywhere, recursive doubling for every allreduce, no cores shared."""
    tree = {**_p100_tree(), "intra": {"alpha_s": _A, "beta_s_per_byte": _B},
            "inter": {"alpha_s": _A, "beta_s_per_byte": _B},
            "allreduce": {"threshold_bytes": 1 << 30}, "gradient_sync": "allreduce"}
    tree["compute"] = {**tree["compute"], **compute}
    return Machine.from_dict(tree)


def _toy(monkeypatch, name, infer, **facts):
    """Register a layer type for one test (the registry is restored afterwards)."""
    from lbannpy.layers import registry
    registry.layer_specs()
    monkeypatch.setitem(registry._LAYERS, name, registry.LayerSpec(name, "toy", (), infer, **facts))
    return name


def _node(typ, in_shape, out_shape, stencil=None, halo="window", n_params=0, flops=0, params=None):
    from lbannpy.strategy.graph import Node
    return Node("t", typ, dict(params or {}), ("x",), (tuple(in_shape),), tuple(out_shape), flops, n_params,
                stencil, halo)


def test_statistics_are_one_allreduce_per_pass_of_their_numbers(monkeypatch):
    from lbannpy.layers.registry import Statistics, elementwise
    m = _ab_machine()
    shape = (4, 8, 16, 16)
    # per sample and channel over space (instance norm): n2·h2 leaves 2 samples × 8 channels a rank, 2 numbers
    # each, float32, over the 2 ranks of the h group: 1 step of recursive doubling per pass
    inst = _toy(monkeypatch, "t_inst", elementwise(5), statistics=Statistics(per=("n", "c")))
    d = Distribution.make(4, 4, n=2, h=2)
    node = _node(inst, shape, shape)
    assert cost.internal_comm_time(node, d, m) == pytest.approx(2 * (_A + 2 * 2 * 8 * 4 * _B), rel=1e-12)
    assert cost.internal_comm_time(node, d, m, needs_dx=False) == pytest.approx(_A + 2 * 2 * 8 * 4 * _B)
    assert cost.internal_comm_time(node, Distribution.make(4, 4, n=4), m) == 0.0  # nothing split to reduce
    # per sample over (C, space) (layer norm): c2·h2 is a group of 4 (2 steps), 4 samples × 2 numbers
    lay = _toy(monkeypatch, "t_layer", elementwise(5), statistics=Statistics(("c", "d", "h", "w"), ("n",)))
    d = Distribution.make(4, 4, c=2, h=2)
    assert cost.internal_comm_time(_node(lay, shape, shape), d, m) == pytest.approx(
        2 * 2 * (_A + 2 * 4 * 4 * _B), rel=1e-12)
    # per sample and group (group norm, 4 groups of 2 channels): a block of 8 channels holds all 4 groups
    grp = _toy(monkeypatch, "t_group", elementwise(5),
               statistics=Statistics(per=("n", "c"), groups="groups"))
    node = _node(grp, shape, shape, params={"groups": 4})
    d = Distribution.make(4, 2, w=2)
    assert cost.internal_comm_time(node, d, m) == pytest.approx(2 * (_A + 2 * 4 * 4 * 4 * _B), rel=1e-12)
    # a global average pool's sums: one number per sample and channel, forward only
    gp = _toy(monkeypatch, "t_gpool", elementwise(1), statistics=Statistics(per=("n", "c"), forward=1,
                                                                             backward=0))
    assert cost.internal_comm_time(_node(gp, shape, (4, 8, 1, 1)), Distribution.make(4, 2, n=2), m) == 0.0
    d = Distribution.make(4, 4, h=2, w=2)
    assert cost.internal_comm_time(_node(gp, shape, (4, 8, 1, 1)), d, m) == pytest.approx(
        2 * (_A + 4 * 8 * 4 * _B), rel=1e-12)
    # a type declaring both: statistics replaces spatial_statistics (not priced twice)
    both = _toy(monkeypatch, "t_both", elementwise(5), spatial_statistics=True,
                statistics=Statistics(per=("n", "c")))
    d = Distribution.make(4, 4, n=2, h=2)
    assert cost.internal_comm_time(_node(both, shape, shape), d, m) == pytest.approx(
        2 * (_A + 2 * 2 * 8 * 4 * _B), rel=1e-12)


def test_periodic_padding_is_a_halo_around_the_process_grid(monkeypatch):
    """Explicit circular padding of 1 on a height split in two: zero padding is made locally (no halo), a
    periodic one brings the far end's row to each end rank, one message a side each way."""
    from lbannpy.layers.registry import Inferred
    from lbannpy.stencil import Stencil
    m = _ab_machine()
    st = Stencil.conv(4, 1, 1, 1)  # kernel 1, padding 1: output n + 2
    shape, out = (2, 3, 16, 16), (2, 3, 18, 18)
    typ = _toy(monkeypatch, "t_pad", lambda lay: Inferred(out, 0, 0, st))
    d = Distribution.make(4, 2, h=2)
    assert cost.halo_time(_node(typ, shape, out, st), d, m) == 0.0
    assert cost.halo_widths(st.dims, shape, d.split, periodic=True) == ((0, 0), (0, 0), (1, 1), (0, 0))
    face_x, face_dy = 2 * 3 * 16, 2 * 3 * 18  # one row of the input block, one of the output block
    want = 2 * (_A + face_x * 4 * _B) + 2 * (_A + face_dy * 4 * _B)
    assert cost.halo_time(_node(typ, shape, out, st, "periodic"), d, m) == pytest.approx(want, rel=1e-12)
    # a dimension held whole wraps around on the rank itself
    assert cost.halo_time(_node(typ, shape, out, st, "periodic"), Distribution.make(4, 2, n=2), m) == 0.0
    # a 3x3 'same' convolution's interior blocks already exchange both sides: circular costs what zeros
    # cost at the slowest rank, both sides each way
    conv = Stencil.conv(4, 3, 1, 1)
    assert cost.halo_widths(conv.dims, shape, (1, 1, 4, 1), True) == cost.halo_widths(
        conv.dims, shape, (1, 1, 4, 1))


def test_an_adjoint_halo_is_exchanged_on_output_blocks(monkeypatch):
    """A transposed convolution k3 s2 p1 (output padding 1) from 8² to 16², split h2: its adjoint, the
    convolution k3 s2 p1 on the 16² output, reads one output row beyond the upper block's: forward the
    lower rank's ghost contributions (one output row, 4 channels), backward the same row of dL/dy."""
    from lbannpy.layers.registry import Inferred
    from lbannpy.stencil import Stencil
    m = _ab_machine()
    st = Stencil.conv(4, 3, 2, 1)
    shape, out = (2, 6, 8, 8), (2, 4, 16, 16)
    typ = _toy(monkeypatch, "t_convt", lambda lay: Inferred(out, 0, 0, st, "adjoint"))
    node = _node(typ, shape, out, st, "adjoint")
    d = Distribution.make(4, 2, h=2)
    widths, fwd, bwd = cost.halo_geometry(node, d)
    assert widths[2] == (1, 0) and fwd == bwd == (2, 4, 8, 16)
    row = 2 * 4 * 16
    assert cost.halo_time(node, d, m) == pytest.approx(2 * (_A + row * 4 * _B), rel=1e-12)
    assert cost.halo_time(node, d, m, needs_dx=False) == pytest.approx(_A + row * 4 * _B, rel=1e-12)
    # k2 s2 (the U-Net's up-convolution): each input row makes its own two output rows, no halo
    st2 = Stencil.conv(4, 2, 2, 0)
    assert cost.halo_time(_node(typ, shape, out, st2, "adjoint"), d, m) == 0.0
    # its window in the memory estimate: the output block and its halo row, and its gradient
    pers, trans = cost.layer_memory(node, d, m)
    assert trans == (2 * 4 * 8 * 16 + 2 * 6 * 4 * 8 + 2 * 2 * 4 * 9 * 16) * 4


def test_weights_cut_like_the_output_sync_over_the_samples_only(monkeypatch):
    from lbannpy.layers.registry import elementwise
    m = _ab_machine()
    shape = (4, 8, 16, 16)
    params = 2 * 8 * 16 * 16  # a scale and a shift per element of (C, H, W)
    typ = _toy(monkeypatch, "t_ln", elementwise(7), weights_spatial=True)
    node = _node(typ, shape, shape, n_params=params)
    d = Distribution.make(4, 8, n=2, h=2, w=2)
    assert cost.weight_split(node, d) == 4 and cost.gradient_sync_group(node, d) == 2
    assert cost.gradient_sync_time(node, d, m) == pytest.approx(_A + params // 4 * 4 * _B, rel=1e-12)
    assert cost.gradient_sync_time(node, Distribution.make(4, 4, h=2, w=2), m) == 0.0


def test_calibrated_rates_price_their_types(monkeypatch):
    """A rate row: seconds per output element (or per forward FLOP) of the rank's block plus the fixed
    cost of a call; the row whose parameters the layer has wins over the row without; a machine without a
    row for the type keeps the roofline."""
    from lbannpy.layers.registry import elementwise
    from lbannpy.config_types import Key, Str
    rates = [{"type": "t_act", "per": "element", "fwd_s": 2e-9, "bwd_data_s": 3e-9},
             {"type": "t_act", "params": {"mode": "b"}, "per": "element", "fwd_s": 5e-9, "bwd_data_s": 7e-9},
             {"type": "t_gemm", "per": "flop", "fwd_s": 1e-11, "bwd_data_s": 2e-11, "bwd_weights_s": 3e-11}]
    m = _ab_machine(rates=rates, kernel_overhead_s=1e-5)
    from lbannpy.layers import registry
    registry.layer_specs()
    monkeypatch.setitem(registry._LAYERS, "t_act", registry.LayerSpec(
        "t_act", "toy", (Key("mode", Str(("a", "b")), "a", "which"),), elementwise(1), pointwise=True))
    gemm = _toy(monkeypatch, "t_gemm", elementwise(1), reduces_channels=True)
    shape = (4, 8, 16, 16)
    d = Distribution.make(4, 4, n=2, h=2)
    local = 2 * 8 * 8 * 16
    a = _node("t_act", shape, shape)
    assert cost.compute_times(a, d, m) == pytest.approx((1e-5 + 2e-9 * local, 1e-5 + 3e-9 * local, 0.0))
    b = _node("t_act", shape, shape, params={"mode": "b"})
    assert cost.compute_times(b, d, m) == pytest.approx((1e-5 + 5e-9 * local, 1e-5 + 7e-9 * local, 0.0))
    assert cost.compute_times(b, d, m, needs_dx=False)[1] == 0.0
    flops = 10 ** 9
    g = _node(gemm, shape, shape, flops=flops)
    assert cost.compute_times(g, d, m) == pytest.approx((1e-5 + 1e-11 * flops / 4, 1e-5 + 2e-11 * flops / 4,
                                                         1e-5 + 3e-11 * flops / 4))
    plain = _ab_machine(kernel_overhead_s=1e-5)
    assert cost.compute_times(a, d, plain)[0] == pytest.approx(
        max(local * plain.gamma_s_per_flop, 2 * local * 4 * plain.mem_s_per_byte) + 1e-5)
    # the planner's cache tells the two parameter sets apart
    from lbannpy.strategy.planner import _cached_cost
    assert _cached_cost(a, d, m, False, "sgd").fwd_s != _cached_cost(b, d, m, False, "sgd").fwd_s


def test_a_global_reduction_splits_its_input(monkeypatch):
    """A layer that reduces space whole (output (N, C, 1, 1)) may split space: the split cuts its input, each
    rank reduces its share and the statistics complete it (no 'empty blocks' refusal)."""
    from lbannpy.layers.registry import Inferred, Statistics
    m = _ab_machine(kernel_overhead_s=0.0, mem_s_per_byte=0.0)
    shape, out = (4, 8, 16, 16), (4, 8, 1, 1)
    typ = _toy(monkeypatch, "t_global", lambda lay: Inferred(out, math.prod(shape)),
               statistics=Statistics(per=("n", "c"), forward=1, backward=0))
    node = _node(typ, shape, out, flops=math.prod(shape))
    d = Distribution.make(4, 4, h=2, w=2)
    assert cost.reduced_dims(node, d) == (2, 3) and filter_reason(node, d, 0.25) is None
    assert cost.compute_times(node, d, m)[0] == pytest.approx(math.prod(shape) / 4 * m.gamma_s_per_flop)
    assert "empty blocks" in filter_reason(node, Distribution.make(4, 32, h=32), 0.25)


# the shipped types of the U-Net/ResNet family: each gives the cost model the facts its pricing needs
_FAMILY = {
    "conv_transpose": {"filters": 4, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
    "upsample": {"mode": "linear"},
    "pad": {"padding": 1, "mode": "circular"},
    "instancenorm": {}, "groupnorm": {"groups": 2}, "layernorm": {}, "global_pool": {},
    "sigmoid": {}, "tanh": {}, "gelu": {}, "silu": {}, "elu": {}, "prelu": {}, "softmax": {}, "identity": {},
}


@pytest.mark.parametrize("typ", list(_FAMILY))
def test_the_new_types_declare_what_they_are_priced_by(typ):
    from lbannpy.layers.registry import layer_specs
    if typ not in layer_specs():
        pytest.skip(f"{typ} is not registered in this build")
    spec = layer_specs()[typ]
    m = _ab_machine()
    node = _graph([{"name": "a", "type": typ, **_FAMILY[typ]}], spatial=(16, 16), channels=4, batch=2)["a"]
    h2 = Distribution.make(4, 2, h=2)
    if typ in ("conv_transpose", "upsample", "pad"):  # a halo under a height split, none between samples
        assert cost.halo_time(node, h2, m) > 0 and cost.halo_time(node, Distribution.make(4, 2, n=2), m) == 0
        assert node.halo == {"conv_transpose": "adjoint", "pad": "periodic"}.get(typ, "window")
    if typ in ("instancenorm", "groupnorm", "layernorm", "global_pool"):  # statistics over the split space
        assert spec.statistics is not None and cost.internal_comm_time(node, h2, m) > 0
        assert cost.internal_comm_time(node, Distribution.make(4, 2, n=2), m) == 0
    if typ == "layernorm":
        assert spec.weights_spatial and cost.gradient_sync_group(node, h2) == 1
    if typ == "global_pool":
        assert cost.reduced_dims(node, h2) == (2,)
    if typ in ("sigmoid", "tanh", "gelu", "silu", "elu", "prelu", "softmax"):  # elementwise, memory-bound
        assert spec.pointwise and node.stencil is None and node.flops_fwd > 0
        f, bd, bw = cost.compute_times(node, h2, m)
        assert f > m.kernel_overhead_s and bd == f and bw == 0
    if typ == "identity":
        assert cost.compute_times(node, h2, m) == (0.0, 0.0, 0.0)
