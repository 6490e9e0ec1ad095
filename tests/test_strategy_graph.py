"""Shape inference errors name the layer, the shapes and the fix; FLOPs and parameter counts."""
from __future__ import annotations

import pytest

from lbannpy.strategy.graph import ShapeError, build_graph


def _model(layers, spatial=(16, 16), channels=3):
    return {"name": "t", "input": {"channels": channels, "spatial": list(spatial)}, "layers": layers}


def test_design_example_builds_with_defaults_and_residual():
    g = build_graph(_model([
        {"name": "c1", "type": "conv", "filters": 3, "kernel": 3, "stride": 1, "padding": 1},
        {"name": "b1", "type": "batchnorm"},
        {"name": "r1", "type": "relu"},
        {"name": "s1", "type": "sum", "parents": ["r1", "x"]},
        {"name": "p1", "type": "pool", "mode": "max", "kernel": 2, "stride": 2},
        {"name": "f1", "type": "fc", "units": 10},
    ]), 4)
    assert [n.name for n in g] == ["c1", "b1", "r1", "s1", "p1", "f1"]
    assert g["s1"].in_shapes == ((4, 3, 16, 16), (4, 3, 16, 16))
    assert g["p1"].out_shape == (4, 3, 8, 8) and g["f1"].out_shape == (4, 10)
    assert g["c1"].flops_fwd == 2 * 4 * 3 * 16 * 16 * 3 * 9
    assert g["c1"].n_params == 3 * 3 * 9 + 3 and g["f1"].n_params == 192 * 10 + 10
    assert g.outputs == ["f1"]


def test_padding_forms():
    for pad, out in ((0, 14), (1, 16), ("same", 16), ("valid", 14), ([[2, 0], [0, 2]], 16)):
        g = build_graph(_model([{"name": "c", "type": "conv", "filters": 1, "kernel": 3, "padding": pad}]), 1)
        assert g["c"].out_shape[2:] == (out, out), pad
    g = build_graph(_model([{"name": "c", "type": "conv", "filters": 1, "kernel": 3, "stride": 2,
                             "padding": "same"}], spatial=(15, 15)), 1)
    assert g["c"].out_shape[2:] == (8, 8)


def test_3d_input():
    g = build_graph(_model([{"name": "c", "type": "conv", "filters": 2, "kernel": 3, "padding": 1}],
                           spatial=(4, 8, 8)), 1)
    assert g["c"].out_shape == (1, 2, 4, 8, 8) and g["c"].n_params == 2 * 3 * 27 + 2


def test_out_of_order_parents_are_sorted_topologically():
    g = build_graph(_model([
        {"name": "s", "type": "sum", "parents": ["a", "b"]},
        {"name": "a", "type": "relu", "parents": ["x"]},
        {"name": "b", "type": "relu", "parents": ["x"]},
    ]), 1)
    assert [n.name for n in g] == ["a", "b", "s"]


@pytest.mark.parametrize("layers,match", [
    ([{"name": "c", "type": "conv", "filters": 4, "kernel": 3, "stride": 2},
      {"name": "s", "type": "sum", "parents": ["c", "x"]}],
     r"layer 's' \(sum\): input 'x' has shape 1×3×16×16 but 'c' has 1×4×7×7.*1x1 conv"),
    ([{"name": "c", "type": "conv", "filters": 4, "kernel": 3},
      {"name": "k", "type": "concat", "parents": ["c", "x"]}],
     r"layer 'k' \(concat\): input 'x' has shape 1×3×16×16 but 'c' has 1×4×14×14"),
    ([{"name": "c", "type": "conv", "filters": 4, "kernel": 32}], r"layer 'c'.*too small.*larger input"),
    ([{"name": "f", "type": "fc", "units": 4}, {"name": "c", "type": "conv", "filters": 1}],
     r"layer 'c' \(conv\) needs an image input.*1×4 from 'f'"),
    ([{"name": "q", "type": "convolution"}], r"layer 'q': unknown type 'convolution'; use one of"),
    ([{"name": "c", "type": "conv", "filter": 3}],
     r"layer 'c' \(conv\): unknown parameter\(s\) \['filter'\]"),
    ([{"name": "c", "type": "conv", "kernel": 3}], r"layer 'c' \(conv\) needs 'filters'"),
    ([{"name": "r", "type": "relu", "parents": ["nope"]}], r"parent 'nope' is not a layer"),
    ([{"name": "a", "type": "relu", "parents": ["b"]}, {"name": "b", "type": "relu", "parents": ["a"]}],
     r"cycle"),
    ([{"name": "a", "type": "relu"}, {"name": "a", "type": "relu"}], r"two layers are named 'a'"),
    ([{"name": "x", "type": "relu"}], r"reserved"),
    ([{"name": "s", "type": "sum"}], r"needs at least two parents"),
], ids=["sum", "concat", "too-small", "conv-after-fc", "type", "param", "missing", "parent", "cycle", "dup",
        "reserved", "sum-one-parent"])
def test_errors_name_layer_shapes_and_fix(layers, match):
    with pytest.raises(ShapeError, match=match):
        build_graph(_model(layers), 1)


def test_loss_checks_and_bad_input():
    with pytest.raises(ShapeError, match="cross_entropy needs a \\(N, classes\\) output.*end with an fc"):
        build_graph({**_model([{"name": "c", "type": "conv", "filters": 2}]), "loss": "cross_entropy"}, 1)
    with pytest.raises(ShapeError, match="pixel_cross_entropy needs"):
        build_graph({**_model([{"name": "f", "type": "fc", "units": 2}]), "loss": "pixel_cross_entropy"}, 1)
    with pytest.raises(ShapeError, match="input"):
        build_graph({"layers": [{"name": "r", "type": "relu"}]}, 1)
    with pytest.raises(ShapeError, match="batch_size"):
        build_graph(_model([{"name": "r", "type": "relu"}]), 0)
