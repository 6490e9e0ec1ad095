"""``python -m lbannpy.export``: safetensors with PyTorch names and layouts, and a torch.nn module source.

The reference is PyTorch itself: the generated module, loaded with the exported tensors (strict
``load_state_dict``: every name and shape must match torch's own), gives lbannpy's outputs in float64.
"""
from __future__ import annotations

import importlib.util
import json
import struct

import numpy as np
import pytest
import yaml

from lbannpy import checkpoint
from lbannpy.comm import SingleCommunicator
from lbannpy.export import attr_name, main, read_safetensors, write_safetensors
from lbannpy.layers.context import LayerContext
from lbannpy.model import Model
from lbannpy.optim import make_optimizer
from lbannpy.tensor import DistTensor
from lbannpy.zoo.zoo import get_spec

torch = pytest.importorskip("torch")


def trained_like_checkpoint(spec: dict, directory, seed: int):
    """An lbannpy model with non-trivial weights and batch-norm statistics, checkpointed as the trainer
    does."""
    ctx = LayerContext(SingleCommunicator(), np, "float64", seed=seed)
    model = Model(spec["model"], 2, ctx, {})
    rng = np.random.default_rng(seed)
    for p in model.params:
        p.value[...] += 0.1 * rng.standard_normal(p.value.shape)
    for layer in model.layers:
        if hasattr(layer, "running_mean"):  # batch norm (one sample group on one rank)
            c = layer.in_shapes[0][1]
            layer.running_mean = rng.standard_normal(c)
            layer.running_var = 0.5 + rng.random(c)
    opt = make_optimizer({"type": "sgd", "lr": 0.01, "momentum": 0.9}, model.params, 10)
    checkpoint.save(SingleCommunicator(), str(directory), 7, model.params, opt, {}, model.layers)
    return model


def load_module(path):
    sp = importlib.util.spec_from_file_location("exported_net", path)
    mod = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,size", [("mesh_tiny", 32), ("lenet5", None)])
def test_export_loads_into_pytorch_and_gives_lbannpy_outputs(tmp_path, name, size):
    spec = get_spec(name, input_size=size)
    cfg_path = tmp_path / "spec.yaml"
    cfg_path.write_text(yaml.safe_dump(spec))
    model = trained_like_checkpoint(spec, tmp_path / "ckpt", seed=5)
    out, src = tmp_path / "m.safetensors", tmp_path / "net.py"
    assert main([str(tmp_path / "ckpt"), "-o", str(out), "--dtype", "float64", "--config", str(cfg_path),
                 "--torch-module", str(src)]) == 0
    tensors, meta = read_safetensors(str(out))
    assert meta["step"] == "7"
    net = load_module(src).Net().double()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    net.eval()
    x = np.random.default_rng(1).standard_normal(model.input_shape)
    model.set_train(False)
    want = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0)).local
    with torch.no_grad():
        got = net(torch.from_numpy(x)).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    # the check can fail: one weight changed changes the output
    first = next(k for k in tensors if k.endswith(".weight"))
    with torch.no_grad():
        net.state_dict()[first].mul_(1.5)
        assert np.abs(net(torch.from_numpy(x)).numpy() - want).max() > 1e-6


def test_safetensors_layout_is_the_published_format(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array(3, dtype=np.int64)
    write_safetensors(str(tmp_path / "t.safetensors"), {"b": b, "a": a}, {"k": "v"})
    raw = (tmp_path / "t.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert header["b"] == {"dtype": "I64", "shape": [], "data_offsets": [24, 32]}
    assert header["__metadata__"] == {"k": "v"}
    assert np.frombuffer(raw[8 + n:8 + n + 24], "<f4").tolist() == a.ravel().tolist()
    got, meta = read_safetensors(str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(got["a"], a)
    assert got["b"].shape == () and int(got["b"]) == 3 and meta == {"k": "v"}


def test_names_are_identifiers_and_torch_module_needs_config(tmp_path, capsys):
    assert attr_name("conv1_1") == "conv1_1"
    assert attr_name("res2a.branch-1") == "res2a_branch_1"
    assert attr_name("1x1") == "l_1x1" and attr_name("class") == "l_class"
    assert main([str(tmp_path), "-o", str(tmp_path / "m.st"), "--torch-module", "n.py"]) == 2
    assert "--torch-module needs --config" in capsys.readouterr().err
