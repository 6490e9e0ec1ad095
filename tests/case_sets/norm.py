"""Instance, group and layer norm under every split they allow (sample, channel where defined, each spatial
dimension, pairs, a replicated split), uneven blocks (5 samples, 6 channels, 17x23 images), a 3-D image,
affine on and off, instance norm tracking running statistics (its running statistics themselves are
checked against PyTorch's in tests/mpi/test_norm_state.py). Group norm splits channels where every block
holds whole groups: one channel per group (6 channels in 2/2/1/1 at 4 ranks: uneven blocks of whole
groups), 8 channels in 4 groups (blocks of 2 or 4 channels), 3-D, mixed with samples, height, width and
depth, and behind a filter-split convolution."""
from __future__ import annotations

import os
import sys

N, C, H, W = 5, 6, 17, 23
SHAPE = (N, C, H, W)
SHAPE3 = (5, 4, 5, 7, 9)
SHAPE8 = (5, 8, 9, 7)


def _splits():
    try:
        from test_layers import splits
    except ImportError:  # run from outside tests/mpi
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi"))
        from test_layers import splits
    return splits


def _cuts_groups(layers, channels: int, parts: int) -> bool:
    """Whether a channel split in ``parts`` gives a group norm of ``layers`` a block that is not whole
    groups (its channels: the filters of the layer before it, else the input's)."""
    from lbannpy.dist import block_starts

    for i, layer in enumerate(layers):
        if layer["type"] != "groupnorm" or parts == 1:
            continue
        c = layers[i - 1].get("filters", channels) if i else channels
        size = c // layer["groups"]
        starts = block_starts(c, parts)
        if any(a % size or b % size for a, b in zip(starts, starts[1:])):
            return True
    return False


def cases(size):
    from layer_cases import Case

    splits = _splits()
    out = []

    def add(name, layers, shape, dims, own=None):
        # ``own``: the layer that must split as written (a per-layer entry: a default a type cannot split
        # would quietly leave it whole)
        for par in splits(size, dims):
            if _cuts_groups(layers, shape[1], par.get("c", 1)):
                continue  # a channel block that is not whole groups: refused (tests/test_split_groups.py)
            out.append(Case(name, layers, shape, {"default": par, **({"layers": {own: par}} if own else {})}))

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
    # channel splits of group norm whose blocks hold whole groups at 2 and 4 ranks
    add("groupnorm-c-per-channel", ({**grp, "groups": C},), SHAPE, ("c",), "g")
    add("groupnorm-c", ({**grp, "groups": 4},), SHAPE8, ("c",), "g")
    add("groupnorm-c-plain", ({**grp, "groups": 4, "affine": False, "eps": 1e-3},), SHAPE8, ("c",), "g")
    add("groupnorm3d-c", ({**grp, "groups": 4},), SHAPE3, ("c", "d"), "g")
    if size == 2:
        add("groupnorm-c-halves", ({**grp, "groups": 2},), SHAPE3, ("c",), "g")
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
        g4 = ({**grp, "groups": 4},)
        for dims in ({"c": 2, "h": 2}, {"n": 2, "c": 2}, {"c": 2, "w": 2}):
            out.append(Case("groupnorm-c-mixed", g4, SHAPE8, {"default": dims, "layers": {"g": dims}}))
        cw, cd = {"c": 2, "w": 2}, {"c": 2, "d": 2}
        out.append(Case("groupnorm-c-per-channel-mixed", ({**grp, "groups": C},), SHAPE,
                        {"default": cw, "layers": {"g": cw}}))
        out.append(Case("groupnorm3d-c-mixed", ({**grp, "groups": 2},), SHAPE3,
                        {"default": cd, "layers": {"g": cd}}))
        # n + c + w over the model: samples and width split around a channel- and width-split group norm
        out.append(Case("conv-groupnorm-c-relu",
                        ({"name": "cv", "type": "conv", "filters": 8, "kernel": 3, "padding": 1},
                         {**grp, "groups": 4, "parents": ["cv"]}, {"name": "r", "type": "relu"}),
                        SHAPE, {"default": {"n": 2, "w": 2}, "layers": {"g": {"c": 2, "w": 2}}}))
    # a convolution before, so the input gradient flows through a layer that needs it; a ReLU after, which
    # overwrites the norm's output in place (the norms' backward never reads it)
    conv = {"name": "cv", "type": "conv", "filters": C, "kernel": 3, "padding": 1}
    relu = {"name": "r", "type": "relu"}
    add("conv-groupnorm-relu", (conv, {**grp, "parents": ["cv"]}, relu), SHAPE, ("n", "h", "w"))
    add("instancenorm-relu", ({**inst, "affine": True}, relu), SHAPE, ("n", "c", "h", "w"))
    add("layernorm-relu", (ln, relu), SHAPE, ("n", "c", "h", "w"))
    # a filter-split convolution hands its channel blocks straight to a channel-split group norm
    conv8 = {**conv, "filters": 8}
    add("conv-c-groupnorm-c", (conv8, {**grp, "groups": 4, "parents": ["cv"]}, relu), SHAPE, ("c",), "g")
    return out
