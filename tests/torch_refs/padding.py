"""PyTorch references of the padding family: the pad layer (``F.pad``) and global pooling
(``F.adaptive_avg_pool{1,2,3}d(x, 1)`` and ``amax`` over space); conv's padding modes and groups are in
layer_cases' conv branch."""
from __future__ import annotations

import torch.nn.functional as F

from lbannpy.stencil import Stencil


def _flat_pads(x, padding) -> list[int]:
    """``padding`` as conv's key takes it, in ``F.pad``'s order (last dimension first, (lo, hi) each)."""
    st = Stencil.conv(x.dim(), 1, 1, padding, 1)
    flat = []
    for w in reversed(st.dims[2:]):
        flat += [w.pad_lo, w.pad_hi]
    return flat


def pad(layer, ins, params):
    mode = layer.get("mode", "zeros")
    flat = _flat_pads(ins[0], layer.get("padding", 0))
    if mode == "zeros":
        return F.pad(ins[0], flat, value=layer.get("value", 0.0))
    return F.pad(ins[0], flat, mode=mode)


def global_pool(layer, ins, params):
    x = ins[0]
    nsp = x.dim() - 2
    if layer.get("mode", "avg") == "max":
        return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)
    return (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[nsp - 1](x, 1)


REFS = {"pad": pad, "global_pool": global_pool}
