"""Bring your own network: a PyTorch ``nn.Module`` becomes an lbannpy spec and its initial weights.

``python -m lbannpy.from_torch MODEL --input-shape C,H,W[,D] -o SPEC.yaml --weights W.safetensors``, or in
Python::

    from lbannpy.from_torch import import_module
    imported = import_module(net, torch.randn(2, 3, 64, 64))    # (N, C, spatial...): N is the batch size
    imported.write("net.yaml", "net.safetensors")

The module is captured with ``torch.export`` (torch is needed here only: training never imports it) and
every ATen operator of its graph goes through one table (:mod:`lbannpy.from_torch.table`, rendered into
``docs/from_torch.md``) to the registered layer types. An operator, or an argument, outside the table is
refused before anything is written: one line naming the module path, the operator, and what is supported.
The layers are named after the module's qualified names (``layer1.0.conv1`` -> ``layer1-0-conv1``); the
spec's ``model.origin`` maps each layer's tensors to the ``state_dict`` keys they came from, so
``python -m lbannpy.export`` writes the user's own ``state_dict`` back (every key, buffers included) and
``train --init`` reads the weights file, which is the module's ``state_dict`` itself.

Each layer's output shape is computed by lbannpy's shape inference and compared with the shape torch
recorded for the same node: a difference is refused, never trained.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import Refused

__all__ = ["Imported", "Refused", "import_module"]


@dataclass
class Imported:
    """An imported module: the spec (normal form) and the weights (``state_dict`` name -> array)."""

    config: dict
    tensors: dict

    def write(self, spec_path: str, weights_path: str) -> None:
        """The weights file, then the spec (atomically each); the spec's ``model.init`` names the weights."""
        # late: the config and export modules load when something is written
        from lbannpy.config import save_config
        from lbannpy.export import write_safetensors

        write_safetensors(weights_path, self.tensors, {"format": "pt", "lbannpy_importer": "from_torch"})
        save_config(self.config, spec_path)


def _arrays(module) -> dict:
    """``module.state_dict()`` as NumPy arrays, refused for a dtype the safetensors writer has no code for."""
    from lbannpy.export import DTYPES  # late: this package's import loads nothing but the table's names

    out = {}
    for key, value in module.state_dict().items():
        arr = value.detach().cpu().numpy()
        if arr.dtype.name not in DTYPES:
            raise Refused(f"{key} -> (state_dict): dtype {value.dtype} is not supported; supported: "
                          f"{', '.join(DTYPES)}")
        out[key] = np.ascontiguousarray(arr)
    return out


def _default_loss(out_shape: tuple) -> str:
    return "cross_entropy" if len(out_shape) == 2 else "pixel_cross_entropy"


def import_module(module, example_input, *, loss: str | None = None, name: str | None = None,
                  weights: str | None = None, data: str | None = None) -> Imported:
    """Import ``module`` (an ``nn.Module``) for inputs shaped like ``example_input`` (N, C, spatial...; N
    becomes ``trainer.batch_size``, float64 input makes a float64 run). ``loss``: a registered loss (default
    ``pixel_cross_entropy`` for an (N, K, spatial...) output, ``cross_entropy`` for (N, K)); ``weights``: the
    path written into ``model.init``; ``data``: ``data.train.path``. Raises :class:`Refused`."""
    # late: importing the package (its table, for the docs and --help) loads neither the config, the layer
    # families nor the capture module, whose callers need torch
    from lbannpy.config import ConfigError, check_graph, parse_spec
    from lbannpy.layers.registry import loss_specs
    from . import capture

    shape = tuple(int(d) for d in example_input.shape)
    what = name or type(module).__name__
    if not 3 <= len(shape) <= 5:
        raise Refused(f"{what} -> (input): an input of shape {shape} is not supported; supported: (N, C, W), "
                      f"(N, C, H, W) or (N, C, D, H, W)")
    frozen = [k for k, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise Refused(f"{frozen[0]} -> (requires_grad=False): a frozen parameter is not supported (lbannpy "
                      f"trains every parameter); supported: modules whose parameters all train")
    tensors = _arrays(module)
    ep = capture.export(module, example_input, what)
    b, out = capture.convert(ep, list(tensors))
    out_shape = b.shapes[out]
    loss = loss or _default_loss(out_shape)
    if loss not in loss_specs():
        raise Refused(f"--loss {loss}: not supported; supported: {', '.join(loss_specs())}")
    mname = "".join(c if c.isalnum() or c in "_-" else "-" for c in what.lower())
    model = {"name": mname, "input": {"channels": shape[1], "spatial": list(shape[2:])}, "layers": b.layers,
             "loss": loss, "origin": b.origin}
    if weights:
        model["init"] = weights
    spec = {"model": model, "data": {"train": {"path": data or f"{mname}.h5"}},
            "trainer": {"batch_size": shape[0], "epochs": 1,
                        "dtype": "float64" if str(example_input.dtype) == "torch.float64" else "float32"},
            "optimizer": {"type": "sgd", "lr": 0.01, "momentum": 0.9}}
    try:
        cfg = parse_spec(spec)
        graph = check_graph(cfg)
    except ConfigError as exc:
        raise Refused(f"{what}: the imported network does not check in lbannpy ({exc}); supported: networks "
                      f"whose layers lbannpy's shape inference accepts") from None
    for node in graph.nodes:
        if tuple(node.out_shape) != b.shapes[node.name]:
            raise Refused(f"{b.where(b.made_by[node.name])}: lbannpy's {node.type} gives {node.out_shape} "
                          f"where PyTorch gives {b.shapes[node.name]}, which is not supported; supported: "
                          f"layers whose shapes agree")
    return Imported(cfg, tensors)
