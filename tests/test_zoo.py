"""Zoo specs: all build, options work, the YAML files equal their builders, shapes match PyTorch."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import yaml

from lbannpy import zoo
from lbannpy.strategy.graph import build_graph
from lbannpy.zoo import generate

EXPECTED = {"lenet5", "alexnet", "vgg16", "resnet50", "inception_v3", "mesh1k", "mesh2k", "mesh_tiny"}


def test_names():
    assert EXPECTED <= set(zoo.names())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_spec_builds_at_default_size(name):
    spec = zoo.get_spec(name)
    g = build_graph(spec["model"], spec["trainer"]["batch_size"])
    assert g.nodes[-1].out_shape[0] == spec["trainer"]["batch_size"]
    assert g.loss == spec["model"]["loss"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_yaml_file_equals_builder(name):
    assert zoo.path(name).read_text() == generate.render(name)
    assert yaml.safe_load(generate.render(name)) == generate.BUILDERS[name]()


def test_known_parameter_counts():
    """Published parameter counts (torchvision; Inception-v3 without the auxiliary head)."""
    counts = {"vgg16": 138_357_544, "resnet50": 25_557_032, "alexnet": 61_100_840, "lenet5": 61_706}
    for name, n in counts.items():
        assert build_graph(zoo.get_spec(name)["model"], 1).total_params == n, name


def test_mesh_structure_follows_dryden():
    for name, per_block in (("mesh1k", 3), ("mesh2k", 5)):
        spec = zoo.get_spec(name)
        g = build_graph(spec["model"], 1)
        convs = [n for n in g if n.type == "conv"]
        assert len(convs) == 6 * per_block + 1
        assert all(n.stencil.dims[2].kernel == 3 for n in convs)
        strided = [n.name for n in convs if n.stencil.dims[2].stride == 2]
        assert strided == [f"conv{b}_1" for b in range(1, 7)]
        assert g.input_shape[1] == 18 and g.loss == "pixel_cross_entropy"
    assert zoo.get_spec("mesh2k")["model"]["input"]["spatial"] == [2048, 2048]


def test_options():
    s = zoo.get_spec("mesh_tiny", batch_size=3, input_size=128)
    assert s["trainer"]["batch_size"] == 3 and s["model"]["input"]["spatial"] == [128, 128]
    g = build_graph(s["model"], 3)
    assert g.nodes[-1].out_shape == (3, 2, 16, 16)
    assert zoo.get_spec("mesh_tiny", input_size=[64, 32])["model"]["input"]["spatial"] == [64, 32]
    assert zoo.get_spec("mesh_tiny") is not zoo.get_spec("mesh_tiny")
    with pytest.raises(zoo.ZooError, match="available"):
        zoo.get_spec("resnet51")
    with pytest.raises(zoo.ZooError, match="batch_size"):
        zoo.get_spec("lenet5", batch_size=0)
    with pytest.raises(zoo.ZooError, match="input_size"):
        zoo.get_spec("lenet5", input_size=[32, 32, 32])


# ---- shapes and parameter counts against PyTorch -------------------------------------------------------


@dataclass(frozen=True)
class TorchCase:
    name: str
    size: int
    batch: int = 2

    def __str__(self):
        return f"{self.name}@{self.size}"


TORCH_CASES = [TorchCase("lenet5", 32), TorchCase("alexnet", 96), TorchCase("vgg16", 32),
               TorchCase("resnet50", 64), TorchCase("inception_v3", 75), TorchCase("mesh_tiny", 64),
               TorchCase("mesh_tiny", 128, 1), TorchCase("mesh1k", 64, 1), TorchCase("mesh2k", 64, 1)]


def _pads(padding, kernel, nsp):
    """(lo, hi) per spatial dim, as dist.parse_padding reads the spec."""
    from lbannpy.stencil import Stencil
    st = Stencil.conv(nsp + 2, kernel, 1, padding, 1)
    return [(w.pad_lo, w.pad_hi) for w in st.dims[2:]]


def torch_forward(spec: dict, batch: int):
    """Run the spec's layers in PyTorch (modules built independently of build_graph); shapes and params."""
    torch = pytest.importorskip("torch")
    nn, F = torch.nn, torch.nn.functional
    m = spec["model"]
    # meta tensors: PyTorch's own shape rules, without allocating or computing anything
    x = torch.zeros((batch, m["input"]["channels"], *m["input"]["spatial"]), device="meta")
    out = {"x": x, "input": x}
    shapes, params = {}, {}
    prev = "x"
    torch.manual_seed(0)
    with torch.no_grad():
        for lay in m["layers"]:
            t, name = lay["type"], lay["name"]
            ins = [out[p] for p in lay.get("parents", [prev])]
            a = ins[0]
            nsp = a.dim() - 2
            mod = None
            if t == "conv":
                k = lay.get("kernel", 3)
                pads = _pads(lay.get("padding", 0), k, nsp)
                flat = [v for lo_hi in reversed(pads) for v in lo_hi]
                mod = nn.Conv2d(a.shape[1], lay["filters"], k, stride=lay.get("stride", 1),
                                bias=lay.get("bias", True), device="meta")
                y = mod(F.pad(a, flat))
            elif t == "pool":
                if lay.get("global"):
                    y = F.adaptive_avg_pool2d(a, 1) if lay["mode"] == "avg" else F.adaptive_max_pool2d(a, 1)
                else:
                    k, s, p = lay["kernel"], lay.get("stride", lay["kernel"]), lay.get("padding", 0)
                    y = (F.max_pool2d(a, k, s, p) if lay["mode"] == "max"
                         else F.avg_pool2d(a, k, s, p, count_include_pad=False))
            elif t == "batchnorm":
                mod = nn.BatchNorm2d(a.shape[1], device="meta").eval()
                y = mod(a)
            elif t in ("relu", "dropout"):
                y = F.relu(a) if t == "relu" else a
            elif t == "fc":
                mod = nn.Linear(a[0].numel(), lay["units"], bias=lay.get("bias", True), device="meta")
                y = mod(a.reshape(a.shape[0], -1))
            elif t == "sum":
                y = sum(ins)
            elif t == "concat":
                y = torch.cat(ins, dim=1)
            else:
                raise AssertionError(f"test translator lacks {t}")
            out[name] = y
            shapes[name] = tuple(y.shape)
            params[name] = sum(p.numel() for p in mod.parameters()) if mod is not None else 0
            prev = name
    return shapes, params


@pytest.mark.parametrize("case", TORCH_CASES, ids=str)
def test_shapes_and_params_match_pytorch(case):
    spec = zoo.get_spec(case.name, batch_size=case.batch, input_size=case.size)
    shapes, params = torch_forward(spec, case.batch)
    g = build_graph(spec["model"], case.batch)
    assert {n.name: n.out_shape for n in g} == shapes
    assert {n.name: n.n_params for n in g} == params
