"""Builders of the model-zoo specs; ``python -m lbannpy.zoo.generate`` rewrites ``src/zoo/*.yaml`` from them.

The YAML files are what users read, copy and edit; these builders exist so that the long ones (ResNet-50,
Inception-v3: hundreds of layers) are written once as code and cannot drift from their published structure.
``tests/test_zoo.py`` checks that every YAML file equals its builder's output.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from .zoo import MESH3D_CHANNELS, spec_data_command

HERE = Path(__file__).resolve().parent


def _spec(name: str, channels: int, spatial: list[int], layers: list[dict], loss: str, batch: int,
          data: str, lr: float = 0.01) -> dict[str, Any]:
    return {
        "model": {"name": name, "input": {"channels": channels, "spatial": spatial}, "layers": layers,
                  "loss": loss},
        "data": {"train": {"path": data, "inputs": "inputs", "labels": "labels"}},
        "trainer": {"batch_size": batch, "epochs": 1, "seed": 1},
        "optimizer": {"type": "sgd", "lr": lr, "momentum": 0.9},
    }


class _Net:
    """Appends layers; each helper returns the name of the layer it added."""

    def __init__(self):
        self.layers: list[dict[str, Any]] = []
        self.last = "x"

    def add(self, name: str, type: str, parents=None, **params) -> str:
        lay: dict[str, Any] = {"name": name, "type": type}
        lay.update(params)
        if parents is not None and parents != [self.last]:
            lay["parents"] = parents if isinstance(parents, list) else [parents]
        self.layers.append(lay)
        self.last = name
        return name

    def cbr(self, name: str, parent: str, filters: int, kernel, stride=1, padding: Any = 0, eps=None) -> str:
        """conv (no bias) + batchnorm + relu, as in ResNet and Inception."""
        self.add(name, "conv", [parent], filters=filters, kernel=kernel, stride=stride, padding=padding,
                 bias=False)
        self.add(f"{name}_bn", "batchnorm", **({"eps": eps} if eps else {}))
        return self.add(f"{name}_relu", "relu")


def lenet5() -> dict:
    n = _Net()
    n.add("conv1", "conv", filters=6, kernel=5)
    n.add("relu1", "relu")
    n.add("pool1", "pool", mode="max", kernel=2, stride=2)
    n.add("conv2", "conv", filters=16, kernel=5)
    n.add("relu2", "relu")
    n.add("pool2", "pool", mode="max", kernel=2, stride=2)
    n.add("fc1", "fc", units=120)
    n.add("relu3", "relu")
    n.add("fc2", "fc", units=84)
    n.add("relu4", "relu")
    n.add("fc3", "fc", units=10)
    return _spec("lenet5", 1, [32, 32], n.layers, "cross_entropy", 64, "lenet5.h5")


def alexnet() -> dict:
    """AlexNet as in torchvision (single-tower, 64-192-384-256-256 filters)."""
    n = _Net()
    n.add("conv1", "conv", filters=64, kernel=11, stride=4, padding=2)
    n.add("relu1", "relu")
    n.add("pool1", "pool", mode="max", kernel=3, stride=2)
    n.add("conv2", "conv", filters=192, kernel=5, padding=2)
    n.add("relu2", "relu")
    n.add("pool2", "pool", mode="max", kernel=3, stride=2)
    n.add("conv3", "conv", filters=384, kernel=3, padding=1)
    n.add("relu3", "relu")
    n.add("conv4", "conv", filters=256, kernel=3, padding=1)
    n.add("relu4", "relu")
    n.add("conv5", "conv", filters=256, kernel=3, padding=1)
    n.add("relu5", "relu")
    n.add("pool5", "pool", mode="max", kernel=3, stride=2)
    n.add("drop6", "dropout", rate=0.5)
    n.add("fc6", "fc", units=4096)
    n.add("relu6", "relu")
    n.add("drop7", "dropout", rate=0.5)
    n.add("fc7", "fc", units=4096)
    n.add("relu7", "relu")
    n.add("fc8", "fc", units=1000)
    return _spec("alexnet", 3, [224, 224], n.layers, "cross_entropy", 32, "imagenet224.h5")


def vgg16() -> dict:
    n = _Net()
    for b, (reps, f) in enumerate([(2, 64), (2, 128), (3, 256), (3, 512), (3, 512)], start=1):
        for i in range(1, reps + 1):
            n.add(f"conv{b}_{i}", "conv", filters=f, kernel=3, padding=1)
            n.add(f"relu{b}_{i}", "relu")
        n.add(f"pool{b}", "pool", mode="max", kernel=2, stride=2)
    n.add("fc6", "fc", units=4096)
    n.add("relu6", "relu")
    n.add("drop6", "dropout", rate=0.5)
    n.add("fc7", "fc", units=4096)
    n.add("relu7", "relu")
    n.add("drop7", "dropout", rate=0.5)
    n.add("fc8", "fc", units=1000)
    return _spec("vgg16", 3, [224, 224], n.layers, "cross_entropy", 32, "imagenet224.h5")


def resnet50() -> dict:
    """ResNet-50 (v1.5: the stride sits on the 3x3 conv), Caffe layer names as in Dryden et al."""
    n = _Net()
    n.add("conv1", "conv", filters=64, kernel=7, stride=2, padding=3, bias=False)
    n.add("bn_conv1", "batchnorm")
    n.add("conv1_relu", "relu")
    x = n.add("pool1", "pool", mode="max", kernel=3, stride=2, padding=1)
    for stage, (blocks, planes) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)], start=2):
        for b in range(blocks):
            tag = f"res{stage}{'abcdef'[b]}"
            stride = 2 if (b == 0 and stage > 2) else 1
            n.add(f"{tag}_branch2a", "conv", [x], filters=planes, kernel=1, bias=False)
            n.add(f"bn{tag[3:]}_branch2a", "batchnorm")
            n.add(f"{tag}_branch2a_relu", "relu")
            n.add(f"{tag}_branch2b", "conv", filters=planes, kernel=3, stride=stride, padding=1, bias=False)
            n.add(f"bn{tag[3:]}_branch2b", "batchnorm")
            n.add(f"{tag}_branch2b_relu", "relu")
            n.add(f"{tag}_branch2c", "conv", filters=4 * planes, kernel=1, bias=False)
            main = n.add(f"bn{tag[3:]}_branch2c", "batchnorm")
            short = x
            if b == 0:
                n.add(f"{tag}_branch1", "conv", [x], filters=4 * planes, kernel=1, stride=stride, bias=False)
                short = n.add(f"bn{tag[3:]}_branch1", "batchnorm")
            n.add(tag, "sum", [main, short])
            x = n.add(f"{tag}_relu", "relu")
    n.add("pool5", "pool", mode="avg", **{"global": True})
    n.add("fc1000", "fc", units=1000)
    return _spec("resnet50", 3, [224, 224], n.layers, "cross_entropy", 32, "imagenet224.h5", lr=0.1)


def inception_v3() -> dict:
    """Inception-v3 (Szegedy et al. 2016) with torchvision's module layout, without the auxiliary head."""
    n = _Net()
    c = _v3_cbr(n)
    x = c("conv_1a", "x", 32, 3, stride=2)
    x = c("conv_2a", x, 32, 3)
    x = c("conv_2b", x, 64, 3, padding=1)
    x = n.add("pool_1", "pool", [x], mode="max", kernel=3, stride=2)
    x = c("conv_3b", x, 80, 1)
    x = c("conv_4a", x, 192, 3)
    x = n.add("pool_2", "pool", [x], mode="max", kernel=3, stride=2)

    x = _inception_a(n, "mixed_5b", x, 32)
    x = _inception_a(n, "mixed_5c", x, 64)
    x = _inception_a(n, "mixed_5d", x, 64)
    x = _inception_b(n, "mixed_6a", x)
    for t, c7 in (("mixed_6b", 128), ("mixed_6c", 160), ("mixed_6d", 160), ("mixed_6e", 192)):
        x = _inception_c(n, t, x, c7)
    x = _inception_d(n, "mixed_7a", x)
    x = _inception_e(n, "mixed_7b", x)
    x = _inception_e(n, "mixed_7c", x)
    n.add("pool_3", "pool", [x], mode="avg", **{"global": True})
    n.add("dropout", "dropout", rate=0.5)
    n.add("fc", "fc", units=1000)
    return _spec("inception_v3", 3, [299, 299], n.layers, "cross_entropy", 32, "imagenet299.h5", lr=0.045)


def _v3_cbr(n: _Net):
    """Inception-v3's conv + batch-norm + ReLU: torchvision's batch-norm epsilon, 0.001."""
    return lambda *args, **kw: n.cbr(*args, eps=0.001, **kw)


def _inception_a(n: _Net, t: str, x: str, pool_features: int) -> str:
    c = _v3_cbr(n)
    b1 = c(f"{t}_1x1", x, 64, 1)
    b5 = c(f"{t}_5x5_1", x, 48, 1)
    b5 = c(f"{t}_5x5_2", b5, 64, 5, padding=2)
    b3 = c(f"{t}_3x3dbl_1", x, 64, 1)
    b3 = c(f"{t}_3x3dbl_2", b3, 96, 3, padding=1)
    b3 = c(f"{t}_3x3dbl_3", b3, 96, 3, padding=1)
    bp = n.add(f"{t}_pool", "pool", [x], mode="avg", kernel=3, stride=1, padding=1)
    bp = c(f"{t}_pool_proj", bp, pool_features, 1)
    return n.add(t, "concat", [b1, b5, b3, bp])



def _inception_b(n: _Net, t: str, x: str) -> str:
    c = _v3_cbr(n)
    b3 = c(f"{t}_3x3", x, 384, 3, stride=2)
    bd = c(f"{t}_3x3dbl_1", x, 64, 1)
    bd = c(f"{t}_3x3dbl_2", bd, 96, 3, padding=1)
    bd = c(f"{t}_3x3dbl_3", bd, 96, 3, stride=2)
    bp = n.add(f"{t}_pool", "pool", [x], mode="max", kernel=3, stride=2)
    return n.add(t, "concat", [b3, bd, bp])



def _inception_c(n: _Net, t: str, x: str, c7: int) -> str:
    c = _v3_cbr(n)
    b1 = c(f"{t}_1x1", x, 192, 1)
    b7 = c(f"{t}_7x7_1", x, c7, 1)
    b7 = c(f"{t}_7x7_2", b7, c7, [1, 7], padding=[[0, 0], [3, 3]])
    b7 = c(f"{t}_7x7_3", b7, 192, [7, 1], padding=[[3, 3], [0, 0]])
    bd = c(f"{t}_7x7dbl_1", x, c7, 1)
    bd = c(f"{t}_7x7dbl_2", bd, c7, [7, 1], padding=[[3, 3], [0, 0]])
    bd = c(f"{t}_7x7dbl_3", bd, c7, [1, 7], padding=[[0, 0], [3, 3]])
    bd = c(f"{t}_7x7dbl_4", bd, c7, [7, 1], padding=[[3, 3], [0, 0]])
    bd = c(f"{t}_7x7dbl_5", bd, 192, [1, 7], padding=[[0, 0], [3, 3]])
    bp = n.add(f"{t}_pool", "pool", [x], mode="avg", kernel=3, stride=1, padding=1)
    bp = c(f"{t}_pool_proj", bp, 192, 1)
    return n.add(t, "concat", [b1, b7, bd, bp])



def _inception_d(n: _Net, t: str, x: str) -> str:
    c = _v3_cbr(n)
    b3 = c(f"{t}_3x3_1", x, 192, 1)
    b3 = c(f"{t}_3x3_2", b3, 320, 3, stride=2)
    b7 = c(f"{t}_7x7x3_1", x, 192, 1)
    b7 = c(f"{t}_7x7x3_2", b7, 192, [1, 7], padding=[[0, 0], [3, 3]])
    b7 = c(f"{t}_7x7x3_3", b7, 192, [7, 1], padding=[[3, 3], [0, 0]])
    b7 = c(f"{t}_7x7x3_4", b7, 192, 3, stride=2)
    bp = n.add(f"{t}_pool", "pool", [x], mode="max", kernel=3, stride=2)
    return n.add(t, "concat", [b3, b7, bp])



def _inception_e(n: _Net, t: str, x: str) -> str:
    c = _v3_cbr(n)
    b1 = c(f"{t}_1x1", x, 320, 1)
    b3 = c(f"{t}_3x3_1", x, 384, 1)
    b3a = c(f"{t}_3x3_2a", b3, 384, [1, 3], padding=[[0, 0], [1, 1]])
    b3b = c(f"{t}_3x3_2b", b3, 384, [3, 1], padding=[[1, 1], [0, 0]])
    bd = c(f"{t}_3x3dbl_1", x, 448, 1)
    bd = c(f"{t}_3x3dbl_2", bd, 384, 3, padding=1)
    bda = c(f"{t}_3x3dbl_3a", bd, 384, [1, 3], padding=[[0, 0], [1, 1]])
    bdb = c(f"{t}_3x3dbl_3b", bd, 384, [3, 1], padding=[[1, 1], [0, 0]])
    bp = n.add(f"{t}_pool", "pool", [x], mode="avg", kernel=3, stride=1, padding=1)
    bp = c(f"{t}_pool_proj", bp, 192, 1)
    return n.add(t, "concat", [b1, b3a, b3b, bda, bdb, bp])


# Filter counts of the mesh model are not given by Dryden et al. (2019); these double every one to two blocks
# from 192, so that the 2K model with its activations exceeds a 16 GiB GPU even at one sample (as the paper
# reports) while the 1K model fits one sample on such a GPU.
MESH_FILTERS = (192, 256, 384, 512, 768, 1024)


def _mesh(name: str, size: int, per_block: int, filters=MESH_FILTERS, batch: int = 4) -> dict:
    """Dryden et al. (2019) §VI mesh-tangling model: blocks of conv-BN-ReLU (3x3), stride 2 at the first conv
    of each block, a final prediction conv (2 classes per pixel: relax the cell or not)."""
    n = _Net()
    for b, f in enumerate(filters, start=1):
        for i in range(1, per_block + 1):
            n.add(f"conv{b}_{i}", "conv", filters=f, kernel=3, stride=2 if i == 1 else 1, padding=1)
            n.add(f"bn{b}_{i}", "batchnorm")
            n.add(f"relu{b}_{i}", "relu")
    n.add("predict", "conv", filters=2, kernel=3, padding=1)
    return _spec(name, 18, [size, size], n.layers, "pixel_cross_entropy", batch, f"{name}.h5")


def mesh1k() -> dict:
    return _mesh("mesh1k", 1024, 3)


def mesh2k() -> dict:
    return _mesh("mesh2k", 2048, 5)


def mesh_tiny() -> dict:
    """Three blocks of two conv-BN-ReLU on 64x64 (try input_size 128 or 256): the mesh model at laptop
    size."""
    return _mesh("mesh_tiny", 64, 2, filters=(8, 16, 32), batch=8)


def _unet(name: str, channels: int, spatial: list[int], filters, batch: int, data: str) -> dict:
    """U-Net (Ronneberger et al. 2015; 3-D: Cicek et al. 2016) with padded convolutions, so the output has
    the input's resolution: at each level two conv-BN-ReLU (3x3 or 3x3x3), a 2x max-pool down to the next;
    up again by a transposed conv (kernel 2, stride 2) to the level's filters, concatenated with the skip of
    the same level, two conv-BN-ReLU; a 1x1 prediction conv (2 classes per pixel or voxel). The input's
    sides must divide by 2 ** (levels - 1)."""
    n = _Net()
    skips = []
    x = "x"
    for lvl, f in enumerate(filters, start=1):
        if lvl > 1:
            x = n.add(f"pool{lvl - 1}", "pool", [x], mode="max", kernel=2, stride=2)
        x = n.cbr(f"enc{lvl}_1", x, f, 3, padding=1)
        x = n.cbr(f"enc{lvl}_2", x, f, 3, padding=1)
        skips.append(x)
    for lvl in range(len(filters) - 1, 0, -1):
        f = filters[lvl - 1]
        up = n.add(f"up{lvl}", "conv_transpose", [x], filters=f, kernel=2, stride=2)
        x = n.add(f"cat{lvl}", "concat", [up, skips[lvl - 1]])
        x = n.cbr(f"dec{lvl}_1", x, f, 3, padding=1)
        x = n.cbr(f"dec{lvl}_2", x, f, 3, padding=1)
    n.add("predict", "conv", [x], filters=2, kernel=1)
    return _spec(name, channels, spatial, n.layers, "pixel_cross_entropy", batch, data)


# the U-Nets' filters per level: modest, so that a step at mesh1k's size trains in seconds on a GPU and the
# per-rank memory of a 1024² sample fits a laptop when split
UNET_FILTERS = (16, 32, 64, 128)


def mesh_unet() -> dict:
    """The mesh-tangling task at full resolution: 18 channels of 1024² in, a 2-class map of 1024² out."""
    return _unet("mesh_unet", 18, [1024, 1024], UNET_FILTERS, 2, "mesh_unet.h5")


def unet3d() -> dict:
    """The 3-D mesh-tangling task (``lbannpy.data mesh3d``): 14 channels of 128³ in, per-voxel classes."""
    return _unet("unet3d", MESH3D_CHANNELS, [128, 128, 128], UNET_FILTERS, 1, "unet3d.h5")


BUILDERS: dict[str, Callable[[], dict]] = {
    "lenet5": lenet5,
    "alexnet": alexnet,
    "vgg16": vgg16,
    "resnet50": resnet50,
    "inception_v3": inception_v3,
    "mesh1k": mesh1k,
    "mesh2k": mesh2k,
    "mesh_tiny": mesh_tiny,
    "mesh_unet": mesh_unet,
    "unet3d": unet3d,
}

_HEADER = {
    "lenet5": "LeNet-5 (LeCun et al. 1998) on 32x32 single-channel images, 10 classes.",
    "alexnet": "AlexNet (Krizhevsky et al. 2012), single-tower torchvision variant, ImageNet 224x224.",
    "vgg16": "VGG-16 (Simonyan & Zisserman 2014), ImageNet 224x224; Jia et al. (2018) Table 5 "
             "parallelises it.",
    "resnet50": "ResNet-50 v1.5 (He et al. 2016), ImageNet 224x224, Caffe layer names as in Dryden et al.",
    "inception_v3": "Inception-v3 (Szegedy et al. 2016), ImageNet 299x299, no auxiliary classifier.",
    "mesh1k": "Mesh-tangling segmentation model (Dryden et al. 2019, section VI), 18 channels, 1024x1024: "
              "six blocks of three conv-BN-ReLU (3x3, stride 2 first), final prediction conv. Filter counts "
              "are not given in the paper; see lbannpy/zoo/generate.py.",
    "mesh2k": "Mesh-tangling segmentation model (Dryden et al. 2019, section VI), 18 channels, 2048x2048: "
              "six blocks of five conv-BN-ReLU (3x3, stride 2 first), final prediction conv. Too large for a "
              "16 GiB GPU even at one sample: needs spatial parallelism.",
    "mesh_tiny": "A small mesh-tangling model for laptops and CI: 64x64 input (128 and 256 also work).",
    "mesh_unet": "Mesh-tangling segmentation at full resolution: a 2-D U-Net (Ronneberger et al. 2015), 18 "
                 "channels, 1024x1024 in, 2 classes per pixel out at 1024x1024; four levels of two "
                 "conv-BN-ReLU (16-32-64-128 filters), max-pool down, transposed conv up, skip concats. "
                 "Sides must divide by 8 (64 trains in seconds on a laptop).",
    "unet3d": "3-D U-Net (Cicek et al. 2016) on mesh-tangling volumes (lbannpy.data mesh3d): 14 channels, "
              "128x128x128 in, 2 classes per voxel out at 128x128x128; four levels (16-32-64-128 filters), "
              "transposed conv up, skip concats. Sides must divide by 8.",
}


def render(name: str) -> str:
    """The YAML text of zoo model ``name``: one flow mapping per layer, so that a layer reads as one line."""
    spec = BUILDERS[name]()
    model = spec["model"]

    def flow(obj) -> str:
        return yaml.safe_dump(obj, default_flow_style=True, sort_keys=False, width=10_000).strip()

    lines = [f"# {_HEADER[name]}", "# Generated by `python -m lbannpy.zoo.generate`; "
             "options: lbannpy.zoo.get_spec(name, batch_size=, input_size=).",
             f"# Data: {spec_data_command(spec)}", "model:",
             f"  name: {model['name']}", f"  input: {flow(model['input'])}", "  layers:"]
    lines += [f"    - {flow(lay)}" for lay in model["layers"]]
    lines.append(f"  loss: {model['loss']}")
    for key in spec:
        if key != "model":
            lines.append(f"{key}: {flow(spec[key])}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    for name in BUILDERS:
        (HERE / f"{name}.yaml").write_text(render(name))
        print(f"wrote {HERE / f'{name}.yaml'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
