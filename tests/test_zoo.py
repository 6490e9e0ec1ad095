"""Zoo specs: all build, options work, the YAML files equal their builders, shapes match PyTorch."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import yaml

from lbannpy import zoo
from lbannpy.strategy.graph import build_graph
from lbannpy.zoo import generate

EXPECTED = {"lenet5", "alexnet", "vgg16", "resnet50", "inception_v3", "mesh1k", "mesh2k", "mesh_tiny",
            "mesh_unet", "unet3d"}


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


@pytest.mark.parametrize("name,channels,spatial", [("mesh_unet", 18, [1024, 1024]),
                                                    ("unet3d", 14, [128, 128, 128])])
def test_unets_predict_at_the_input_resolution(name, channels, spatial):
    spec = zoo.get_spec(name)
    g = build_graph(spec["model"], 1)
    assert g.input_shape[1:] == (channels, *spatial) and g.loss == "pixel_cross_entropy"
    assert g.nodes[-1].out_shape == (1, 2, *spatial)
    ups = [n for n in g if n.type == "conv_transpose"]
    assert [n.name for n in ups] == ["up3", "up2", "up1"]
    assert all(n.stencil.dims[2].kernel == 2 and n.stencil.dims[2].stride == 2 for n in ups)
    cats = {n.name: list(n.parents) for n in g if n.type == "concat"}
    assert cats == {f"cat{i}": [f"up{i}", f"enc{i}_2_relu"] for i in (3, 2, 1)}
    assert sum(n.type == "pool" for n in g) == 3
    assert zoo.spec_data_command(spec).startswith(
        f"python -m lbannpy.data {'mesh3d' if len(spatial) == 3 else 'mesh'} --size {spatial[-1]} ")
    small = build_graph(zoo.get_spec(name, input_size=8)["model"], 1)   # sides divisible by 8
    assert small.nodes[-1].out_shape == (1, 2) + (8,) * len(spatial)


@pytest.mark.parametrize("name", ["mesh_unet", "unet3d"])
def test_strategy_auto_plans_the_unets_from_4_to_4096_ranks(name):
    """Every layer gets a distribution over all ranks, found by the complete search (not cut short by the
    planner's time budget), from 4 to 4096 ranks."""
    from lbannpy.strategy.planner import plan

    for ranks in (4, 64, 4096):
        p = plan(zoo.get_spec(name), ranks, compare=False)
        assert p.result.complete, (name, ranks, p.messages)
        assert set(p.choice) == {n.name for n in p.graph}
        assert all(d.ranks == ranks for d in p.choice.values()), (name, ranks)


def test_strategy_and_validate_commands_plan_mesh_unet(tmp_path):
    """The two commands a user runs before a job (4096 ranks: the planner test above)."""
    import subprocess
    import sys

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(zoo.get_spec("mesh_unet", batch_size=1), sort_keys=False))
    p = subprocess.run([sys.executable, "-m", "lbannpy.strategy", str(spec), "--ranks", "16"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "up1 " in p.stdout and "predicted step" in p.stdout, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-m", "lbannpy.config", "validate", str(spec), "--ranks", "4",
                        "--no-data", "--set", "parallel.strategy=auto"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "ok on 4 ranks" in p.stdout, p.stdout + p.stderr
    assert "strategy auto: the planner's choice" in p.stdout, p.stdout


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
               TorchCase("mesh_tiny", 128, 1), TorchCase("mesh1k", 64, 1), TorchCase("mesh2k", 64, 1),
               TorchCase("mesh_unet", 64), TorchCase("mesh_unet", 1024, 1), TorchCase("unet3d", 16, 1)]


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
                mod = getattr(nn, f"Conv{nsp}d")(a.shape[1], lay["filters"], k, stride=lay.get("stride", 1),
                                                 bias=lay.get("bias", True), device="meta")
                y = mod(F.pad(a, flat))
            elif t == "conv_transpose":
                mod = getattr(nn, f"ConvTranspose{nsp}d")(a.shape[1], lay["filters"], lay.get("kernel", 3),
                                                          stride=lay.get("stride", 1), device="meta")
                y = mod(a)
            elif t == "pool":
                if lay.get("global"):
                    y = F.adaptive_avg_pool2d(a, 1) if lay["mode"] == "avg" else F.adaptive_max_pool2d(a, 1)
                else:
                    k, s, p = lay["kernel"], lay.get("stride", lay["kernel"]), lay.get("padding", 0)
                    y = (getattr(F, f"max_pool{nsp}d")(a, k, s, p) if lay["mode"] == "max"
                         else F.avg_pool2d(a, k, s, p, count_include_pad=False))
            elif t == "batchnorm":
                mod = getattr(nn, f"BatchNorm{nsp}d")(a.shape[1], device="meta").eval()
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
