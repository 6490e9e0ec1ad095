"""PyTorch references of the activation family (float64 tensors): the smooth activations, PReLU (one
weight or one per channel, the parameter ``<layer>.weight``), softmax over the channels, identity and the
elementwise product of the parents."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _mul(layer, ins, params):
    y = ins[0]
    for x in ins[1:]:
        y = y * x
    return y


REFS = {
    "sigmoid": lambda layer, ins, params: torch.sigmoid(ins[0]),
    "tanh": lambda layer, ins, params: torch.tanh(ins[0]),
    "gelu": lambda layer, ins, params: F.gelu(ins[0], approximate=layer.get("approximate", "none")),
    "silu": lambda layer, ins, params: F.silu(ins[0]),
    "elu": lambda layer, ins, params: F.elu(ins[0], alpha=layer.get("alpha", 1.0)),
    "prelu": lambda layer, ins, params: F.prelu(ins[0], params[f"{layer['name']}.weight"]),
    "softmax": lambda layer, ins, params: F.softmax(ins[0], dim=1),
    "identity": lambda layer, ins, params: ins[0],
    "mul": _mul,
}
