"""Transposed convolution and upsampling under every split they allow, odd and uneven sizes (blocks of
different extents on every rank count), 1-D to 3-D."""
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
