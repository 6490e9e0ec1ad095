"""PyTorch references of instance, group and layer norm (training mode: each sample's own statistics);
lbannpy's ``<layer>.scale``/``<layer>.bias`` are torch's ``weight``/``bias``."""
from __future__ import annotations

import torch.nn.functional as F


def _affine(layer, params):
    name = layer["name"]
    return params.get(f"{name}.scale"), params.get(f"{name}.bias")


def instancenorm(layer, ins, params):
    w, b = _affine(layer, params)
    return F.instance_norm(ins[0], weight=w, bias=b, use_input_stats=True, eps=layer.get("eps", 1e-5))


def groupnorm(layer, ins, params):
    w, b = _affine(layer, params)
    return F.group_norm(ins[0], layer["groups"], w, b, eps=layer.get("eps", 1e-5))


def layernorm(layer, ins, params):
    w, b = _affine(layer, params)
    return F.layer_norm(ins[0], tuple(ins[0].shape[1:]), w, b, eps=layer.get("eps", 1e-5))


REFS = {"instancenorm": instancenorm, "groupnorm": groupnorm, "layernorm": layernorm}
