"""Channel splits of layers whose channels come in groups: group norm (its statistics span a group of
channels) and the grouped transposed convolution (a rank's filter weights must be one box of
``(C_in, filters/groups, *k)``). Each says which splits it cannot make (``LayerSpec.split_check``), and
``validate`` (one line, exit 2, naming the layer and the key), the planner (never chooses one) and the layer
itself (at set-up) refuse them; the splits it can make are computed against PyTorch in
tests/case_sets/norm.py and tests/case_sets/transpose.py."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from lbannpy.dist import Distribution
from lbannpy.layers.registry import layer_classes, layer_spec, split_refusal


def _cut(typ, params, in_shape, **degrees):
    dist = Distribution.make(len(in_shape), int(np.prod(list(degrees.values()) or [1])), **degrees)
    return split_refusal(layer_spec(typ), params, in_shape, dist)


def test_group_norm_splits_channels_into_whole_groups_only():
    x6, x8 = (4, 6, 8, 8), (4, 8, 8, 8)
    assert _cut("groupnorm", {"groups": 6}, x6, c=4) is None  # 2/2/1/1 channels: uneven whole groups
    assert _cut("groupnorm", {"groups": 4}, x8, c=4) is None
    assert _cut("groupnorm", {"groups": 4}, x8, c=2) is None
    assert _cut("groupnorm", {"groups": 3}, x6, h=4) is None  # no channel split
    dim, why, fix = _cut("groupnorm", {"groups": 3}, x6, c=2)
    assert dim == "c" and "cuts its 3 groups of 2 channels" in why and "blocks of 3" in why
    assert "c in {1, 3}" in fix
    assert _cut("groupnorm", {"groups": 2}, x8, c=4)[0] == "c"  # blocks of 2 of groups of 4
    for typ in ("instancenorm", "layernorm"):  # statistics per channel, or over every channel
        assert "c" in layer_spec(typ).split_dims and _cut(typ, {}, x6, c=4) is None


def test_a_grouped_transposed_convolution_splits_filters_into_boxes_of_its_weights():
    x = (2, 4, 5, 5)
    ct = {"kernel": 3}
    assert _cut("conv_transpose", {**ct, "filters": 6}, x, c=4) is None  # ungrouped: any split
    assert _cut("conv_transpose", {**ct, "filters": 6, "groups": 2}, x, c=2) is None  # whole groups
    assert _cut("conv_transpose", {**ct, "filters": 12, "groups": 2}, x, c=4) is None  # inside one group
    dim, why, fix = _cut("conv_transpose", {**ct, "filters": 6, "groups": 2}, x, c=4)
    assert dim == "c" and "filters of two of its 2 groups of 3" in why and "c in {1, 2, 5, 6}" in fix


def _spec(layers, default, overrides=None):
    return {"model": {"name": "g", "input": {"channels": 4, "spatial": [8, 8]}, "layers": layers,
                      "loss": "pixel_cross_entropy"},
            "data": {"train": {"path": "none.h5"}}, "trainer": {"batch_size": 4, "steps": 1},
            "parallel": {"default": default, "layers": overrides or {}}}


GN = [{"name": "cv", "type": "conv", "filters": 6, "kernel": 3, "padding": 1},
      {"name": "g", "type": "groupnorm", "groups": 3}]
CT = [{"name": "t", "type": "conv_transpose", "filters": 6, "groups": 2, "kernel": 2, "stride": 2}]


@pytest.mark.parametrize("layers,default,overrides,ranks,key,name", [
    (GN, {"c": 2}, None, 2, "parallel.default.c", "layer 'g' (groupnorm)"),
    (GN, {"n": 2}, {"g": {"c": 2, "h": 2}}, 4, "parallel.layers.g.c", "layer 'g' (groupnorm)"),
    (CT, {"c": 4}, None, 4, "parallel.default.c", "layer 't' (conv_transpose)"),
], ids=["groupnorm-default", "groupnorm-layer", "conv_transpose"])
def test_validate_refuses_a_cut_group_in_one_line(tmp_path, layers, default, overrides, ranks, key, name):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec(layers, default, overrides)))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "lbannpy.config", "validate", str(path), "--ranks", str(ranks),
                        "--no-data"], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"lbannpy.config: error: {key}: {name}: ") and "(hint: split c" in lines[0]


def test_validate_takes_splits_of_whole_groups(tmp_path):
    from lbannpy.config import validate

    layers = [dict(GN[0], filters=8), dict(GN[1], groups=4),
              {"name": "t", "type": "conv_transpose", "filters": 12, "groups": 2, "kernel": 2, "stride": 2}]
    for default in ({"c": 4}, {"c": 2, "h": 2}, {"n": 2, "c": 2}):
        validate(_spec(layers, default), ranks=4, data=False, memory=False)


def test_the_layers_refuse_a_cut_group_at_set_up():
    from lbannpy.comm.single import SingleCommunicator
    from lbannpy.layers.base import LayerError
    from lbannpy.layers.context import LayerContext

    ctx = LayerContext(SingleCommunicator(), np, "float64")
    dist = Distribution.make(4, 2, c=2)
    gn = layer_classes()["groupnorm"]("g", groups=3)
    with pytest.raises(LayerError, match=r"layer 'g' \(groupnorm\) under c2: a channel split of 2 cuts"):
        gn.configure(ctx, [(4, 6, 8, 8)], [dist], dist)
    ct = layer_classes()["conv_transpose"]("t", filters=6, groups=2)
    dist = Distribution.make(4, 4, c=4)
    with pytest.raises(LayerError, match=r"layer 't' \(conv_transpose\) under c4: a filter split of 4"):
        ct.configure(ctx, [(4, 4, 8, 8)], [dist], dist)


def test_the_planner_never_cuts_a_group():
    from lbannpy.strategy.graph import build_graph
    from lbannpy.strategy.planner import baseline_strategies, filter_reason, layer_candidates, plan
    from lbannpy.machine import load_machine

    layers = GN + [dict(CT[0], parents=["g"]), {"name": "g8", "type": "groupnorm", "groups": 2}]
    spec = _spec(layers, {})
    graph = build_graph(spec["model"], 8)
    mach = load_machine("lassen")
    for ranks in (2, 4, 8):
        kept, dropped = layer_candidates(graph["g"], ranks, mach)
        assert all(c.dist.parts_of("c") in (1, 3) for c in kept)
        assert ranks == 8 or any("cuts its 3 groups" in d.reason for d in dropped)
        chosen = plan(spec, ranks, "lassen", compare=False).choice
        assert all(split_refusal(layer_spec(n.type), n.params, n.in_shape, chosen[n.name]) is None
                   for n in graph)
        mp = baseline_strategies(graph, ranks)["model-parallel"]
        assert all(split_refusal(layer_spec(n.type), n.params, n.in_shape, mp[n.name]) is None for n in graph)
    # splits of whole groups stay candidates: the channel split of an aligned group norm, of a transposed
    # convolution inside one group
    assert filter_reason(graph["g"], Distribution.make(4, 3, c=3), 0.25) is None
    assert filter_reason(graph["t"], Distribution.make(4, 2, c=2), 0.25) is None
    assert "filters of two" in filter_reason(graph["t"], Distribution.make(4, 4, c=4), 0.25)
    assert "cuts its 2 groups" in filter_reason(graph["g8"], Distribution.make(4, 4, c=4), 0.25)
