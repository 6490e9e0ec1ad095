"""The activation family (sigmoid, tanh, gelu exact and tanh, silu, elu, prelu, softmax, identity, mul)
under every split each type allows: sample, channel (not softmax's), height, width, the mixed and the
replicated splits of tests/mpi/test_layers.splits at 4 ranks, on 5x5x17x23 images (uneven blocks) and a
3-D volume; PReLU with one weight and with one per channel under a channel split; products of two and of
three parents (one of them the model input) and of one parent with itself; an identity whose parent's output
another layer reads."""
from __future__ import annotations

from layer_cases import Case
from test_layers import C, H, W, N, splits

IMAGE = (N, C, H, W)
VOLUME = (N, C, 7, 6, 9)

UNARY = (
    ("sigmoid", {}),
    ("tanh", {}),
    ("gelu", {}),
    ("gelu-tanh", {"approximate": "tanh"}),
    ("silu", {}),
    ("elu", {}),
    ("elu-alpha", {"alpha": 0.4}),
    ("prelu", {"init": -0.3}),
    ("prelu-channels", {"num_parameters": C, "init": 0.2}),
    ("softmax", {}),
    ("identity", {}),
)


def _type(name: str) -> str:
    return name.split("-")[0]


def _dims(t: str, ndim: int) -> tuple:
    dims = ("n", "c", "d", "h", "w") if ndim == 5 else ("n", "c", "h", "w")
    return tuple(d for d in dims if d != "c") if t == "softmax" else dims


def _layers(name: str, kw: dict) -> tuple:
    """The one-layer model of a case."""
    return ({"name": "a", "type": _type(name), **kw},)


def cases(size: int) -> list:
    out = []
    for name, kw in UNARY:
        t = _type(name)
        for par in splits(size, _dims(t, 4)):
            out.append(Case(f"act-{name}", _layers(name, kw), IMAGE, {"default": par}))
    # 3-D: every type under each single split and the mixed ones
    for name, kw in UNARY:
        for par in splits(size, _dims(_type(name), 5), allow_replication=False):
            out.append(Case(f"act3d-{name}", _layers(name, kw), VOLUME, {"default": par}))
    # products: of a layer and the input, of three parents (one the input twice over a chain)
    two = ({"name": "s", "type": "sigmoid"}, {"name": "m", "type": "mul", "parents": ["s", "x"]})
    three = ({"name": "t", "type": "tanh"}, {"name": "g", "type": "silu", "parents": ["x"]},
             {"name": "m", "type": "mul", "parents": ["t", "x", "g"]})
    square = ({"name": "s", "type": "silu"}, {"name": "m", "type": "mul", "parents": ["s", "s"]})
    for par in splits(size, ("n", "c", "h", "w")):
        out.append(Case("act-mul2", two, IMAGE, {"default": par}))
        out.append(Case("act-mul3", three, IMAGE, {"default": par}))
        out.append(Case("act-mul-square", square, IMAGE, {"default": par}))
    # the identity hands on its parent's array: a ReLU after it must not overwrite it in place while a sum
    # still reads the parent's output
    shared = ({"name": "c", "type": "conv", "filters": C, "kernel": 1}, {"name": "i", "type": "identity"},
              {"name": "r", "type": "relu"}, {"name": "s", "type": "sum", "parents": ["r", "c"]})
    for par in splits(size, ("n", "h", "w")):
        out.append(Case("act-identity-shared", shared, IMAGE, {"default": par}))
    # per-channel PReLU under a channel split fed by another split (a redistribution in between), and a
    # chain of several types whose splits change from layer to layer
    if size > 1:
        pre = ({"name": "t", "type": "tanh"},
               {"name": "p", "type": "prelu", "num_parameters": C, "init": 0.1})
        out.append(Case("act-prelu-channels-reshard", pre, IMAGE,
                        {"default": {"h": size}, "layers": {"p": {"c": size}}}))
        chain = ({"name": "g", "type": "gelu"}, {"name": "s", "type": "softmax"},
                 {"name": "e", "type": "elu", "alpha": 0.7}, {"name": "p", "type": "prelu"})
        out.append(Case("act-chain", chain, IMAGE,
                        {"layers": {"g": {"c": size}, "s": {"w": size}, "e": {"n": size}, "p": {"h": size}}}))
    return out
