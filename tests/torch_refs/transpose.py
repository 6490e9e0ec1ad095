"""PyTorch references of the transposed convolution (``F.conv_transpose1d/2d/3d``) and of upsampling
(``F.interpolate`` with a scale factor: nearest, or linear/bilinear/trilinear by the spatial rank)."""
from __future__ import annotations

import torch.nn.functional as F


def _per_dim(v, nsp: int) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v] * nsp


def conv_transpose(layer, ins, params):
    x = ins[0]
    nsp = x.dim() - 2
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nsp - 1]
    name = layer["name"]
    return fn(x, params[f"{name}.weight"], params.get(f"{name}.bias"),
              stride=_per_dim(layer.get("stride", 1), nsp), padding=_per_dim(layer.get("padding", 0), nsp),
              output_padding=_per_dim(layer.get("output_padding", 0), nsp), groups=layer.get("groups", 1),
              dilation=_per_dim(layer.get("dilation", 1), nsp))


def upsample(layer, ins, params):
    x = ins[0]
    nsp = x.dim() - 2
    scale = tuple(float(s) for s in _per_dim(layer.get("scale", 2), nsp))
    if layer.get("mode", "nearest") == "nearest":
        return F.interpolate(x, scale_factor=scale, mode="nearest")
    mode = ("linear", "bilinear", "trilinear")[nsp - 1]
    corners = bool(layer.get("align_corners", False))
    return F.interpolate(x, scale_factor=scale, mode=mode, align_corners=corners)


REFS = {"conv_transpose": conv_transpose, "upsample": upsample}
