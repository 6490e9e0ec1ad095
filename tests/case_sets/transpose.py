"""Transposed convolution and upsampling under every split they allow, odd and uneven sizes (blocks of
different extents on every rank count), 1-D to 3-D. The transposed convolution's filter split: 6 filters
(2/2/1/1 at 4 ranks), grouped filters whose blocks hold whole groups or lie inside one group, mixed with
samples, height, width and depth, and in a decoder step whose layers split differently."""
from __future__ import annotations

from layer_cases import Case
from test_layers import splits

N, C, H, W = 5, 4, 9, 11


def _ct(**kw):
    return {"name": "t", "type": "conv_transpose", "filters": 6, **kw}


CONV_TRANSPOSE = [
    dict(kernel=3),
    dict(kernel=3, stride=2, padding=1, output_padding=1),
    dict(kernel=2, stride=2),  # the U-Net up-convolution
    dict(kernel=3, stride=3, padding=[1, 0], bias=False),
    dict(kernel=4, stride=2, padding=1, dilation=2, output_padding=[1, 0]),
    dict(kernel=[3, 5], stride=[2, 1], padding=[0, 2]),
    dict(kernel=3, stride=2, groups=2),
    dict(kernel=2, stride=3, output_padding=2),  # rows no input writes: bias only
]

UPSAMPLE = [
    dict(mode="nearest"),
    dict(mode="nearest", scale=3),
    dict(mode="nearest", scale=[2, 3]),
    dict(mode="linear"),
    dict(mode="linear", scale=3),
    dict(mode="linear", align_corners=True),
    dict(mode="linear", align_corners=True, scale=[3, 2]),
]


#: filter splits (c at 2 and 4 ranks): (keys, input channels) whose blocks are boxes of the weights
CONV_TRANSPOSE_FILTERS = [
    (dict(kernel=3), C),
    (dict(kernel=3, stride=2, padding=1, output_padding=1, bias=False), C),
    (dict(kernel=2, stride=2), C),
    (dict(kernel=3, stride=2, groups=2, filters=12), C),  # 3 filters a rank at 4: inside one group
    (dict(kernel=3, stride=2, padding=1, groups=4, filters=8), C),  # whole groups at 2 and 4
    (dict(kernel=3, groups=2, filters=6), 6),  # 3 and 3 at 2 ranks: whole groups
]


def _own(par):
    """The split as the default and as the transposed convolution's own entry, which it must take as
    written (a default a type cannot split would quietly leave it whole)."""
    return {"default": par, "layers": {"t": par}}


def _cuts_a_group(filters: int, groups: int, parts: int) -> bool:
    """Whether a filter split in ``parts`` gives some rank a block that is neither inside one group nor
    whole groups (the transposed convolution refuses it)."""
    from lbannpy.dist import block_starts

    size = filters // groups
    starts = block_starts(filters, parts)
    return any(a // size != (b - 1) // size and (a % size or b % size) for a, b in zip(starts, starts[1:]))


def _name(kind, kw):
    return kind + "".join(f"-{k}{v}" for k, v in kw.items()).replace(" ", "")


def cases(size: int) -> list:
    out = []
    for kw in CONV_TRANSPOSE:
        for par in splits(size, ("n", "h", "w")):
            out.append(Case(_name("convT", kw), (_ct(**kw),), (N, C, H, W), {"default": par}))
    for par in splits(size, ("n", "d", "h", "w")):
        out.append(Case("convT3d-k2s2", (_ct(kernel=2, stride=2),), (5, 3, 5, 7, 6), {"default": par}))
        out.append(Case("convT3d-k3s2p1op1", (_ct(kernel=3, stride=2, padding=1, output_padding=1),),
                        (5, 3, 5, 7, 6), {"default": par}))
    for par in splits(size, ("n", "w")):
        out.append(Case("convT1d-k3s2p1op1", (_ct(kernel=3, stride=2, padding=1, output_padding=1),),
                        (5, 3, 13), {"default": par}))
    for kw, cin in CONV_TRANSPOSE_FILTERS:
        for par in splits(size, ("c",)):
            if _cuts_a_group(kw.get("filters", 6), kw.get("groups", 1), par.get("c", 1)):
                continue  # e.g. 2/2/1/1 of 6 filters in 2 groups: refused (tests/test_split_groups.py)
            out.append(Case(_name("convT-filters", kw), (_ct(**kw),), (N, cin, H, W), _own(par)))
    if size == 4:  # the filter split mixed with samples and space, uneven blocks everywhere
        for dims, kw in (({"c": 2, "h": 2}, dict(kernel=3, stride=2, padding=1, output_padding=1)),
                         ({"c": 2, "h": 2}, dict(kernel=3, groups=2, filters=6)),
                         ({"n": 2, "c": 2}, dict(kernel=2, stride=2)),
                         ({"c": 2, "w": 2}, dict(kernel=3, stride=2, padding=1, output_padding=1)),
                         ({"c": 2, "w": 2}, dict(kernel=2, stride=2, groups=4, filters=8))):
            out.append(Case(_name("convT-filters", kw), (_ct(**kw),), (N, C, H, W), _own(dims)))
        for kw in (dict(kernel=2, stride=2), dict(kernel=3, stride=2, padding=1, output_padding=1)):
            out.append(Case(_name("convT3d-filters", kw), (_ct(**kw),), (5, 3, 5, 7, 6),
                            _own({"c": 2, "d": 2})))
        # n + c + w over a model: samples and width around a filter- and width-split transposed convolution
        out.append(Case("convT-filters-between", ({"name": "a", "type": "conv", "filters": 4, "kernel": 1},
                                                  _ct(kernel=3, stride=2, padding=1, output_padding=1),
                                                  {"name": "r", "type": "relu"}),
                        (N, C, H, W), {"default": {"n": 2, "w": 2}, "layers": {"t": {"c": 2, "w": 2}}}))
    elif size == 2:
        out.append(Case("convT3d-filters-k2s2", (_ct(kernel=2, stride=2),), (5, 3, 5, 7, 6), _own({"c": 2})))
    for kw in UPSAMPLE:
        for par in splits(size, ("n", "c", "h", "w")):
            out.append(Case(_name("upsample", kw), ({"name": "u", "type": "upsample", **kw},), (N, C, H, W),
                            {"default": par}))
    for kw in (dict(mode="nearest"), dict(mode="linear"), dict(mode="linear", align_corners=True, scale=3)):
        for par in splits(size, ("n", "d", "h", "w")):
            out.append(Case(_name("upsample3d", kw), ({"name": "u", "type": "upsample", **kw},),
                            (5, 2, 5, 7, 6), {"default": par}))
        for par in splits(size, ("n", "w")):
            out.append(Case(_name("upsample1d", kw), ({"name": "u", "type": "upsample", **kw},), (5, 2, 13),
                            {"default": par}))
    # a decoder step: upsample, then a transposed convolution, then a convolution, split differently
    dec = ({"name": "u", "type": "upsample", "mode": "linear"}, _ct(kernel=2, stride=2, filters=3),
           {"name": "c", "type": "conv", "filters": 2, "kernel": 3, "padding": 1})
    if size > 1:
        out.append(Case("decoder", dec, (2, 3, 5, 7), {"default": {"h": size}, "layers": {"t": {"w": size}}}))
    else:
        out.append(Case("decoder", dec, (2, 3, 5, 7), {}))
    return out
