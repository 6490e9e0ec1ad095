"""Instance, group and layer norm under every split they allow (sample, channel where defined, each spatial
dimension, pairs, a replicated split), uneven blocks (5 samples, 6 channels, 17x23 images), a 3-D image,
affine on and off, instance norm tracking running statistics (its running statistics themselves are
checked against PyTorch's in tests/mpi/test_norm_state.py)."""
from __future__ import annotations

import os
import sys

N, C, H, W = 5, 6, 17, 23
SHAPE = (N, C, H, W)
SHAPE3 = (5, 4, 5, 7, 9)


def _splits():
    try:
        from test_layers import splits
    except ImportError:  # run from outside tests/mpi
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi"))
        from test_layers import splits
    return splits


def cases(size):
    from layer_cases import Case

    splits = _splits()
    out = []

    def add(name, layers, shape, dims):
        for par in splits(size, dims):
            out.append(Case(name, layers, shape, {"default": par}))

    inst = {"name": "i", "type": "instancenorm"}
    add("instancenorm", (inst,), SHAPE, ("n", "c", "h", "w"))
    add("instancenorm-affine", ({**inst, "affine": True, "eps": 1e-3},), SHAPE, ("n", "c", "h", "w"))
    add("instancenorm-tracked", ({**inst, "affine": True, "track_running_stats": True, "momentum": 0.3},),
        SHAPE, ("n", "c", "h", "w"))
    add("instancenorm3d", ({**inst, "affine": True},), SHAPE3, ("n", "c", "d", "h", "w"))
    grp = {"name": "g", "type": "groupnorm", "groups": 3}
    add("groupnorm", (grp,), SHAPE, ("n", "h", "w"))
    add("groupnorm-plain", ({**grp, "affine": False, "groups": 2},), SHAPE, ("n", "h", "w"))
    add("groupnorm-one", ({**grp, "groups": 1},), SHAPE, ("n", "h", "w"))
    add("groupnorm-per-channel", ({**grp, "groups": C},), SHAPE, ("n", "h", "w"))
    add("groupnorm3d", ({**grp, "groups": 2},), SHAPE3, ("n", "d", "h", "w"))
    ln = {"name": "l", "type": "layernorm"}
    add("layernorm", (ln,), SHAPE, ("n", "c", "h", "w"))
    add("layernorm-plain", ({**ln, "affine": False},), SHAPE, ("n", "c", "h", "w"))
    add("layernorm3d", (ln,), SHAPE3, ("n", "c", "d", "h", "w"))
    if size == 4:  # mixed splits across channels and space
        for name, layers, shape in (("instancenorm-affine", ({**inst, "affine": True},), SHAPE),
                                    ("layernorm", (ln,), SHAPE),
                                    ("groupnorm", ({**grp, "groups": 2},), SHAPE3)):
            dims = {"c": 2, "w": 2} if name != "groupnorm" else {"d": 2, "w": 2}
            out.append(Case(name, layers, shape, {"default": dims}))
    # a convolution before, so the input gradient flows through a layer that needs it; a ReLU after, which
    # overwrites the norm's output in place (the norms' backward never reads it)
    conv = {"name": "cv", "type": "conv", "filters": C, "kernel": 3, "padding": 1}
    relu = {"name": "r", "type": "relu"}
    add("conv-groupnorm-relu", (conv, {**grp, "parents": ["cv"]}, relu), SHAPE, ("n", "h", "w"))
    add("instancenorm-relu", ({**inst, "affine": True}, relu), SHAPE, ("n", "c", "h", "w"))
    add("layernorm-relu", (ln, relu), SHAPE, ("n", "c", "h", "w"))
    return out
