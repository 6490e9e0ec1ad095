"""``lbannpy.from_torch``: a PyTorch module in, the same training step out, the user's state_dict back.

For each network of :mod:`torch_nets` (ResNet-18, 2-D U-Net, 3-D U-Net, SegResNet-style, PReLU residual
units): import it, train ONE SGD step in float64 with ``mpiexec -n 2 python -m lbannpy.train`` splitting the
height (``--init`` the importer's weights), export the checkpoint with ``--config``, and compare with the
same step in PyTorch: every parameter and every running statistic (``num_batches_tracked`` included) to
1e-8 relative, and the exported file loads strictly into the user's own class. Refusals: one per kind
(an unsupported op, an unsupported argument, data-dependent control flow, a data-dependent shape), each
exit 2 with its one line and nothing written.
"""
from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import torch_nets as T  # noqa: E402
from lbannpy.export import main as export_main, read_safetensors  # noqa: E402
from lbannpy.from_torch import Refused, import_module  # noqa: E402
from train_util import ENV, PY, sh  # noqa: E402

MPIEXEC = shutil.which("mpiexec")
HERE = Path(__file__).resolve().parent
LR = 0.1


@dataclass(frozen=True)
class NetCase:
    id: str
    make: Callable
    shape: tuple  # (N, C, spatial...)
    classes: int
    per_pixel: bool
    cli: str = ""  # MODEL for the command line (the case then imports through python -m lbannpy.from_torch)
    kwargs: str = "{}"


CASES = [
    NetCase("resnet18", lambda: T.ResNet18(3, 5, width=4), (2, 3, 64, 64), 5, False),
    NetCase("unet2d", lambda: T.UNet(2, 3, width=4, depth=2), (2, 2, 16, 16), 3, True,
            cli=f"{HERE / 'torch_nets.py'}:UNet", kwargs='{"in_channels": 2, "num_classes": 3, "width": 4}'),
    NetCase("unet3d", lambda: T.unet3d(in_channels=2, num_classes=3, width=2, depth=1), (2, 2, 8, 8, 8), 3,
            True),
    NetCase("segresnet", lambda: T.SegResNet(2, 3, width=4), (2, 2, 16, 16), 3, True),
    NetCase("prelu", lambda: T.PReLUNet(2, 3, width=4), (2, 2, 16, 16), 3, True),
]


def _data(case: NetCase, path: Path, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case.shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, case.classes, (case.shape[0],) + (case.shape[2:] if case.per_pixel else ()),
                      generator=g)
    with h5py.File(path, "w") as f:
        f["inputs"] = x.numpy()
        f["labels"] = y.numpy()
    return x, y


def _torch_step(net, x, y):
    """One SGD step (lr LR, no momentum) of the training-mode module on the cross-entropy of (x, y)."""
    net.train()
    F.cross_entropy(net(x), y).backward()
    with torch.no_grad():
        for p in net.parameters():
            p -= LR * p.grad
    return net


def _imported(case: NetCase, work: Path):
    """(module with the imported weights, spec path): through the command line or import_module."""
    weights, spec = work / "w.safetensors", work / "spec.yaml"
    if case.cli:
        p = sh([PY, "-m", "lbannpy.from_torch", case.cli, "--input-shape", ",".join(map(str, case.shape[1:])),
                "--kwargs", case.kwargs, "--batch-size", case.shape[0], "--dtype", "float64", "-o", spec,
                "--weights", weights, "--data", work / "data.h5"])
        assert "layers ->" in p.stdout, p.stdout
        net = case.make().double()
        tensors, _ = read_safetensors(str(weights))
        net.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
        return T.perturb(net, 1), spec  # the file is the module's state_dict: perturbed below, written again
    torch.manual_seed(0)
    net = T.perturb(case.make().double())
    imported = import_module(net, torch.zeros(case.shape, dtype=torch.float64), weights=str(weights),
                             data=str(work / "data.h5"))
    imported.write(str(spec), str(weights))
    return net, spec


def _run_config(spec: Path, work: Path) -> Path:
    """The imported spec set to one float64 SGD step on 2 ranks splitting the height, as config.h5."""
    from lbannpy.config import load_config, save_config

    cfg = load_config(str(spec))
    cfg["trainer"].pop("epochs", None)
    cfg["trainer"].update(steps=1, seed=0, dtype="float64")
    cfg["data"]["train"]["shuffle"] = False
    cfg["optimizer"] = {"type": "sgd", "lr": LR}
    # every layer as written by a user: a global pool reduces the split height whole (its one-pixel output
    # is a copy on both ranks), and the flatten and fc after it split the samples only
    cfg["parallel"] = {"default": {"h": 2}}
    cfg["checkpoint"] = {"dir": str(work / "ckpt")}
    cfg["output"] = {"dir": str(work / "run")}
    save_config(cfg, str(work / "config.h5"))  # HDF5: model.origin goes through the config file's round trip
    return work / "config.h5"


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow]) for c in CASES])
def test_one_step_on_two_ranks_equals_pytorch_and_exports_the_state_dict(tmp_path, case):
    net, spec = _imported(case, tmp_path)
    if case.cli:  # the command wrote the unperturbed weights: write the perturbed ones the run starts from
        from lbannpy.export import write_safetensors
        write_safetensors(str(tmp_path / "w.safetensors"),
                          {k: v.detach().numpy() for k, v in net.state_dict().items()})
    x, y = _data(case, tmp_path / "data.h5", seed=3)
    config = _run_config(spec, tmp_path)
    sh([MPIEXEC, "-n", "2", PY, "-m", "lbannpy.train", config, "--quiet", "--init",
        tmp_path / "w.safetensors"], timeout=300)
    assert export_main([str(tmp_path / "ckpt"), "-o", str(tmp_path / "out.safetensors"), "--config",
                        str(config), "--dtype", "float64"]) == 0
    ref = _torch_step(copy.deepcopy(net), x, y).state_dict()
    out, _ = read_safetensors(str(tmp_path / "out.safetensors"))
    assert sorted(out) == sorted(ref), "the export writes exactly the module's state_dict keys"
    # without --config the checkpoint's own record of the model names the keys
    assert export_main([str(tmp_path / "ckpt"), "-o", str(tmp_path / "bare.safetensors")]) == 0
    assert sorted(read_safetensors(str(tmp_path / "bare.safetensors"))[0]) == sorted(ref)
    for k, want in ref.items():
        got, want = out[k], want.numpy()
        assert got.shape == want.shape and got.dtype == want.dtype, k
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-300)
        assert err <= 1e-8, f"{case.id}: {k} differs from PyTorch's step by {err:.3g} relative"
    fresh = case.make().double()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in out.items()}, strict=True)


# ---------------------------------------------------------------------------------- the rest of the table
def _lbannpy_forward(imported, x: np.ndarray, weights: Path) -> np.ndarray:
    """The imported model's training-mode forward on one rank, from the importer's weights file."""
    from lbannpy.comm import SingleCommunicator
    from lbannpy.export import init_from
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    imported.write(str(weights.with_suffix(".yaml")), str(weights))
    ctx = LayerContext(SingleCommunicator(), np, "float64", 0)
    model = Model(imported.config["model"], x.shape[0], ctx, {})
    init_from(str(weights), model, np)
    model.set_train(True)
    return model.forward(DistTensor(x, model.input_shape, model.input_dist, 0)).local


@pytest.mark.parametrize("make,shape", [(T.Sink2d, (2, 2, 8, 8)), (T.Sink3d, (2, 2, 4, 4, 4))],
                         ids=["2d", "3d"])
def test_every_other_operator_computes_what_pytorch_computes(tmp_path, make, shape):
    """Reflect/replicate/circular padding folded into conv, pad, groups, dilation, instance/layer/group norm,
    GELU, SiLU, ELU, PReLU, leaky ReLU, sigmoid, tanh, mul, average and max pooling, transposed conv with
    output padding, nearest/bilinear/trilinear upsampling, softmax, global max and mean into a linear head."""
    torch.manual_seed(0)
    net = T.perturb(make().double())
    x = torch.randn(shape, dtype=torch.float64)
    imported = import_module(net, x)
    types = {layer["type"] for layer in imported.config["model"]["layers"]}
    assert {"conv", "upsample", "mul"} <= types
    got = _lbannpy_forward(imported, x.numpy(), tmp_path / "w.safetensors")
    with torch.no_grad():
        want = net.train()(x).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * np.abs(want).max())


# ------------------------------------------------------------------------------------------------ refusals
REFUSED_NETS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Warp(nn.Module):
    def __init__(self):
        super().__init__()
        self.grid = nn.Parameter(torch.zeros(2, 8, 8, 2))

    def forward(self, x):
        return F.grid_sample(x, self.grid, align_corners=False)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up1 = nn.Conv2d(2, 2, 3, padding=1)
        self.up2 = Warp()

    def forward(self, x):
        return self.up2(self.up1(x))


class GridNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder = Decoder()

    def forward(self, x):
        return self.decoder(x)


class FractionalUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.up = nn.Upsample(scale_factor=1.5)

    def forward(self, x):
        return self.up(self.conv(x))


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if y.sum() > 0:
            return y * 2
        return y


class Rolled(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return torch.roll(self.conv(x), 1, 2)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y[y > 0]
'''

REFUSALS = [
    ("GridNet", "decoder.up2 -> aten.grid_sampler_2d", "supported: ops "),
    ("Rolled", "(top level) -> aten.roll (nets.py:", "supported: ops "),  # not a piece of its decomposition
    ("FractionalUp", "up -> aten.upsample_nearest2d.vec", "supported: integer scale factors"),
    ("Branchy", "data-dependent control flow", "Branchy at nets.py:"),
    ("Masked", "dynamic shape", "supported: static shapes"),
]


@pytest.mark.parametrize("name,where,supported", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, name, where, supported):
    """In this process (torch is loaded once); the command's own process: the next test."""
    from lbannpy.from_torch.__main__ import main

    (tmp_path / "nets.py").write_text(REFUSED_NETS)
    rc = main([f"{tmp_path / 'nets.py'}:{name}", "--input-shape", "2,8,8", "-o", str(tmp_path / "s.yaml"),
               "--weights", str(tmp_path / "w.safetensors")])
    out = capsys.readouterr()
    assert rc == 2, out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lbannpy.from_torch: error: "), out.err
    assert where in lines[0] and supported in lines[0], lines[0]
    assert not (tmp_path / "s.yaml").exists() and not (tmp_path / "w.safetensors").exists()


def test_the_command_refuses_in_one_line_on_stderr(tmp_path):
    (tmp_path / "nets.py").write_text(REFUSED_NETS)
    p = subprocess.run([PY, "-m", "lbannpy.from_torch", f"{tmp_path / 'nets.py'}:GridNet", "--input-shape",
                        "2,8,8", "-o", str(tmp_path / "s.yaml"), "--weights",
                        str(tmp_path / "w.safetensors")], env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "decoder.up2 -> aten.grid_sampler_2d" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "s.yaml").exists()


# ------------------------------------------------------------------------------------------------ the spec
def test_names_origin_and_loss_come_from_the_module():
    net = T.ResNet18(3, 5, width=2).double()
    imported = import_module(net, torch.zeros(2, 3, 32, 32, dtype=torch.float64))
    model = imported.config["model"]
    names = [layer["name"] for layer in model["layers"]]
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert "layer2-0-downsample-0" in names and names[-1] == "fc"
    assert model["loss"] == "cross_entropy" and imported.config["trainer"]["dtype"] == "float64"
    assert model["origin"]["layer1-0-bn1"] == {
        "scale": "layer1.0.bn1.weight", "bias": "layer1.0.bn1.bias",
        "running_mean": "layer1.0.bn1.running_mean", "running_var": "layer1.0.bn1.running_var",
        "num_batches_tracked": "layer1.0.bn1.num_batches_tracked"}
    covered = sorted(k for keys in model["origin"].values() for k in keys.values())
    assert covered == sorted(net.state_dict()) == sorted(imported.tensors)
    seg = import_module(T.UNet(2, 3, width=2, depth=1), torch.zeros(2, 2, 8, 8), loss=None)
    assert seg.config["model"]["loss"] == "pixel_cross_entropy"
    with pytest.raises(Refused, match="loss cross_entropy needs a"):  # --loss is taken, and checked
        import_module(T.UNet(2, 3, width=2, depth=1), torch.zeros(2, 2, 8, 8), loss="cross_entropy")


def test_an_unknown_loss_and_shared_weights_are_refused():
    with pytest.raises(Refused, match="--loss nope: not supported"):
        import_module(T.PReLUNet(2, 3, width=2), torch.zeros(2, 2, 8, 8), loss="nope")

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(self.conv(x))

    with pytest.raises(Refused, match=r"conv -> aten.convolution.*shared weights"):
        import_module(Shared(), torch.zeros(2, 2, 8, 8))
    frozen = Shared()
    frozen.conv.bias.requires_grad_(False)
    with pytest.raises(Refused, match=r"conv.bias -> \(requires_grad=False\)"):
        import_module(frozen, torch.zeros(2, 2, 8, 8))


def test_the_module_is_left_as_it_was():
    net = T.perturb(T.PReLUNet(2, 3, width=2)).eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    import_module(net, torch.zeros(2, 2, 8, 8))
    assert not net.training
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


def _types():
    from lbannpy.layers.registry import layer_specs
    return layer_specs()


def test_the_docs_page_lists_the_table():
    from lbannpy.docs import from_torch_page
    from lbannpy.from_torch.table import TABLE

    page = from_torch_page()
    for op in TABLE:
        for name in op.aten:
            assert f"`{name}`" in page
    assert (HERE.parent / "docs" / "from_torch.md").read_text() == page, "regenerate: python -m lbannpy.docs"


def test_help_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None; from lbannpy.from_torch.__main__ import main; "
            "main(['--help'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--input-shape" in p.stdout, p.stderr
