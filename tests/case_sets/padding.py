"""Padding modes of conv (zeros, reflect, replicate, circular), grouped convolutions (also under a filter
split whose blocks begin and end inside a group), the pad layer, and global average and max pooling, under
sample, channel and spatial splits (2-D and 3-D), mixed ones at 4 ranks, odd sizes and uneven blocks
(thin edge blocks included: 9 rows over 4 ranks with 3 rows of reflection)."""
from __future__ import annotations

from layer_cases import Case

MODES = ("zeros", "reflect", "replicate", "circular")


def _splits(size: int, dims) -> list[dict]:
    out = [{}] if size == 1 else [{d: size} for d in dims]
    if size == 4:
        mixed = [{"n": 2, "h": 2}, {"h": 2, "w": 2}, {"c": 2, "w": 2}, {"n": 2, "c": 2}]
        out += [m for m in mixed if set(m) <= set(dims)]
    return out


def _conv(**kw):
    return {"name": "c", "type": "conv", "filters": 4, **kw}


def cases(size: int) -> list:
    out = []
    img, vol = (4, 4, 9, 11), (4, 2, 7, 6, 5)
    for mode in MODES:
        for kw in (dict(kernel=3, padding=1), dict(kernel=5, stride=2, padding=2, bias=False),
                   dict(kernel=[7, 3], padding=[[3, 2], [1, 1]])):
            for par in _splits(size, ("n", "h", "w")):
                tag = "-".join(f"{k}{v}" for k, v in kw.items()).replace(" ", "")
                out.append(Case(f"padding-conv-{mode}-{tag}", (_conv(padding_mode=mode, **kw),), img,
                                {"default": par}))
        for par in _splits(size, ("n", "d", "h", "w")):
            out.append(Case(f"padding-conv3d-{mode}", (_conv(kernel=3, padding=1, padding_mode=mode),), vol,
                            {"default": par}))
        # a convolution that does not read the model input rebuilds its window in the backward (refill)
        for par in _splits(size, ("h", "w")):
            relu_conv = ({"name": "r", "type": "relu"},
                         _conv(kernel=3, stride=2, padding=1, padding_mode=mode))
            out.append(Case(f"padding-relu-conv-{mode}", relu_conv, img, {"default": par}))
    # groups: 2 groups of 2 channels and 3 filters; depthwise with a reflect boundary
    for par in _splits(size, ("n", "c", "h", "w")):
        out.append(Case("padding-conv-groups2", (_conv(filters=6, groups=2, kernel=3, padding=1),),
                        img, {"default": par}))
        out.append(Case("padding-conv-depthwise-reflect",
                        (_conv(filters=4, groups=4, kernel=3, padding=1, padding_mode="reflect"),),
                        img, {"default": par}))
    if size > 1:  # filters 6 over 4 ranks: blocks 2, 2, 1, 1 of groups of 3 (partial groups)
        out.append(Case("padding-conv-groups-filter-split",
                        (_conv(filters=6, groups=2, kernel=3, padding=1, padding_mode="circular"),),
                        img, {"layers": {"c": {"c": size}}}))
    # the pad layer, 1-D, 2-D and 3-D; a constant for zeros
    for mode in MODES:
        for par in _splits(size, ("n", "c", "h", "w")):
            out.append(Case(f"padding-pad-{mode}", ({"name": "p", "type": "pad", "mode": mode,
                                                     "padding": [[1, 2], [3, 0]]},), img, {"default": par}))
        for par in _splits(size, ("n", "d", "w")):
            out.append(Case(f"padding-pad3d-{mode}", ({"name": "p", "type": "pad", "mode": mode,
                                                       "padding": 2},), vol, {"default": par}))
        for par in ([{}] if size == 1 else [{"w": size}]):
            out.append(Case(f"padding-pad1d-{mode}", ({"name": "p", "type": "pad", "mode": mode,
                                                       "padding": [2, 3]},), (2, 3, 13), {"default": par}))
    for par in _splits(size, ("h", "w")):
        out.append(Case("padding-pad-value", ({"name": "p", "type": "pad", "padding": 1, "value": 0.5},), img,
                        {"default": par}))
    # thin edge blocks: 9 rows over 4 ranks (3, 2, 2, 2), 3 rows of padding
    if size == 4:
        for mode in ("reflect", "replicate", "circular"):
            out.append(Case(f"padding-conv-thin-{mode}", (_conv(kernel=7, padding=3, padding_mode=mode),),
                            (2, 2, 9, 8), {"default": {"h": 4}}))
    # global pooling
    for mode in ("avg", "max"):
        gp = {"name": "g", "type": "global_pool", "mode": mode}
        for par in _splits(size, ("n", "c", "h", "w")):
            out.append(Case(f"padding-global-{mode}", (gp,), (5, 5, 9, 11), {"default": par}))
        for par in _splits(size, ("c", "d")):
            out.append(Case(f"padding-global3d-{mode}", (gp,), (2, 4, 7, 6, 5), {"default": par}))
        # its replicated output read by a layer of another layout: the gradient comes back through the
        # redistribution
        fc = {"name": "f", "type": "fc", "units": 3}
        for par in _splits(size, ("h", "w")):
            out.append(Case(f"padding-global-fc-{mode}", (gp, fc), (5, 5, 9, 11), {"layers": {"g": par}}))
    return out
