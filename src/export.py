"""Export a checkpoint's weights for PyTorch: safetensors with ``state_dict`` names and layouts.

``python -m lbannpy.export CKPT -o model.safetensors [--config CONFIG.h5 --torch-module model.py]``

* Names: ``<layer>.weight`` / ``<layer>.bias`` for conv and fc, ``<layer>.weight``, ``.bias``,
  ``.running_mean``, ``.running_var``, ``.num_batches_tracked`` for batch norm (the layer name, made a
  Python identifier where it is not one: see :func:`attr_name`).
* Layouts are PyTorch's already: conv weight ``(F, C, kh, kw)``, fc weight ``(out, in)`` whose ``in`` is
  the flattened NCHW input, which is what ``torch.flatten(x, 1)`` feeds an ``nn.Linear``.
* The file format is written here (no pickle, no extra dependency): an 8-byte little-endian header length,
  a JSON header mapping each name to ``dtype``/``shape``/``data_offsets``, then the raw little-endian bytes.
* ``--torch-module FILE.py`` (with ``--config``) writes the source of an equivalent ``torch.nn.Module``
  (class ``Net``) whose ``load_state_dict`` takes the exported tensors.
* Reading the file back needs no extra package: :func:`read_safetensors` returns NumPy arrays (the
  ``safetensors`` package's ``safetensors.torch.load_file`` reads it too, where it is installed)::

      import torch
      from lbannpy.export import read_safetensors
      from net import Net                      # the file --torch-module wrote
      tensors, meta = read_safetensors("model.safetensors")
      net = Net()
      net.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
"""
from __future__ import annotations

import argparse
import json
import keyword
import os
import re
import struct
import sys

import numpy as np

from lbannpy import outputs
from lbannpy.training.errors import UserError

DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32"}
_NP = {v: np.dtype(k).newbyteorder("<") for k, v in DTYPES.items()}


class ExportError(UserError):
    """A file or name problem; a user error (the trainer reports it once, without a traceback)."""


def attr_name(layer: str) -> str:
    """The ``torch.nn.Module`` attribute (and ``state_dict`` prefix) of an lbannpy layer name."""
    name = re.sub(r"\W", "_", layer)
    if not name or name[0].isdigit() or keyword.iskeyword(name):
        name = "l_" + name
    return name


# ---------------------------------------------------------------------------------------------- safetensors
def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      label: str = ""):
    """``tensors`` (name -> array) into ``path`` in the safetensors format, atomically (tmp + rename; a
    failed write leaves no temporary and raises :class:`lbannpy.outputs.WriteError` naming ``label path``)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        kind = DTYPES.get(arr.dtype.name)
        if kind is None:
            raise ExportError(f"tensor {name}: dtype {arr.dtype} has no safetensors code here "
                              f"({sorted(DTYPES)})")
        raw = np.ascontiguousarray(arr, dtype=_NP[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with outputs.atomic(path, label) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def read_safetensors(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file (as written by any producer)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ExportError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ExportError(f"{path}: header length {n} is implausible; not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ExportError(f"{path}: the header is not JSON ({exc}); not a safetensors file") from exc
        data = f.read()
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, h in header.items():
        if h["dtype"] not in _NP:
            raise ExportError(f"{path}: tensor {name} has dtype {h['dtype']}; readable: {sorted(_NP)}")
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=_NP[h["dtype"]]).reshape(h["shape"]).copy()
    return out, meta


# ---------------------------------------------------------------------------------------------- checkpoint
def load_checkpoint(path: str) -> tuple[str, dict]:
    """``(file, data)`` of a checkpoint file, or of the newest in a directory. The only place this module
    touches :mod:`lbannpy.checkpoint`."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy import checkpoint

    if os.path.isdir(path) and checkpoint.candidates(path):  # the newest that verifies, with a note per skip
        found, data = checkpoint.load_newest(path, note=lambda msg: print(f"lbannpy.export: {msg}",
                                                                       file=sys.stderr, flush=True))
        return found, data
    found = checkpoint.resolve(path)
    if found is None:
        raise ExportError(f"{path}: no checkpoint there (no such file or directory, or an empty directory)")
    return found, checkpoint.load(found)


def state_dict(data: dict, dtype: str = "float32", model: dict | None = None) -> dict[str, np.ndarray]:
    """PyTorch ``state_dict`` tensors of a checkpoint's parameters and batch-norm statistics. With ``model``
    (the spec's model section) holding ``origin`` (a spec from :mod:`lbannpy.from_torch`), the names are
    the imported module's own ``state_dict`` keys, every one of them (:func:`_origin_names`)."""
    out, stats = {}, {}
    for key, arr in data["tensors"].items():
        if not key.startswith("params/"):
            continue
        layer, _, pname = key[len("params/"):].rpartition(".")
        out[(layer, pname)] = np.asarray(arr, dtype=dtype)
    stats = {layer: st for layer, st in (data["meta"].get("layers") or {}).items() if "running_mean" in st}
    for key, arr in data["tensors"].items():  # version 2: (sample groups, C) rows; torch has one set
        if key.startswith("state/") and key.endswith("/running_mean"):
            layer = key[len("state/"):-len("/running_mean")]
            var = data["tensors"][f"state/{layer}/running_var"]
            stats[layer] = {"running_mean": np.asarray(arr).reshape(-1, arr.shape[-1]).mean(axis=0),
                            "running_var": np.asarray(var).reshape(-1, var.shape[-1]).mean(axis=0)}
    for layer, st in stats.items():
        out[(layer, "running_mean")] = np.asarray(st["running_mean"], dtype=dtype)
        out[(layer, "running_var")] = np.asarray(st["running_var"], dtype=dtype)
        # torch counts training-mode forward passes: one per optimizer step here
        out[(layer, "num_batches_tracked")] = np.asarray(int(data["step"]), dtype=np.int64)
    if model and model.get("origin"):
        return _origin_names(out, model, int(data["step"]))
    return {f"{attr_name(layer)}.{ {'scale': 'weight'}.get(t, t) }": v for (layer, t), v in out.items()}


def _origin_names(tensors: dict, model: dict, step: int) -> dict[str, np.ndarray]:
    """``tensors`` ((layer, tensor) -> array) under the ``state_dict`` keys ``model.origin`` records. Only
    batch norm counts its forward passes (``num_batches_tracked``: the steps trained); instance norm's
    counter stays 0 as torch leaves it. A recorded key the checkpoint cannot fill is an error."""
    from lbannpy.layers.batchnorm import BatchNorm  # late: the layers load only when origin names are read

    types = {layer["name"]: layer["type"] for layer in model["layers"]}
    out = {}
    for layer, keys in model["origin"].items():
        for t, key in keys.items():
            if t == "num_batches_tracked":
                out[key] = np.asarray(step if types.get(layer) == BatchNorm.type else 0, dtype=np.int64)
            elif (layer, t) in tensors:
                out[key] = tensors[(layer, t)]
            else:
                raise ExportError(f"model.origin: the checkpoint has no {t} of layer {layer!r} for {key!r}")
    return out


def model_of(data: dict) -> dict | None:
    """The model section a checkpoint recorded (its computation record), or None."""
    comp = (data.get("meta") or {}).get("computation")
    return comp.get("model") if isinstance(comp, dict) else None


def init_from(path: str, model, xp) -> None:
    """Weights (and batch-norm statistics) of ``model`` from an lbannpy checkpoint or a safetensors file
    with this module's names (``model.init`` / ``train --init``); optimizer state is not taken. Every rank
    reads the file and keeps its own piece. Raises :class:`ExportError` naming the missing or mis-shaped
    tensor."""
    import h5py

    if os.path.isdir(path) or (os.path.isfile(path) and h5py.is_hdf5(path)):
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.predict import load_weights

        # collective: every rank verifies its blocks and all of them agree on the checkpoint they take
        load_weights(path, model, xp, getattr(getattr(model, "ctx", None), "comm", None))
        return
    if not os.path.isfile(path):
        raise ExportError(f"model.init {path}: no such file")
    tensors, _ = read_safetensors(path)
    origin = (getattr(model, "spec", None) or {}).get("origin") or {}

    def key_of(layer: str, t: str) -> str:  # the imported module's own key, else this module's naming
        return origin.get(layer, {}).get(t) or f"{attr_name(layer)}.{ {'scale': 'weight'}.get(t, t) }"

    for p in model.params:
        layer, _, pname = p.name.rpartition(".")
        key = key_of(layer, pname)
        if key not in tensors:
            raise ExportError(f"model.init {path}: no tensor {key!r} for parameter {p.name}; the file has "
                              f"{sorted(tensors)[:8]}{' ...' if len(tensors) > 8 else ''}")
        arr = tensors[key]
        if tuple(arr.shape) != tuple(p.global_shape):
            raise ExportError(f"model.init {path}: tensor {key!r} has shape {tuple(arr.shape)}; parameter "
                              f"{p.name} needs {tuple(p.global_shape)}")
        p.value[...] = xp.asarray(arr[tuple(slice(a, b) for a, b in p.box)], dtype=p.value.dtype)
    for layer in model.layers:
        if key_of(layer.name, "running_mean") in tensors and hasattr(layer, "running_mean"):
            # late: loaded when the command runs, so its --help and argument errors come without it
            from lbannpy.checkpoint import StateReader

            # torch keeps one set of statistics: one sample group (batch norm's rows), which every group
            # of this run takes; a layer whose state is one row (instance norm) takes it as it is
            shapes = {k: st.global_shape for k, st in layer.state().items()}
            rows = {k: tensors[key_of(layer.name, k)].astype(np.float64).reshape(
                (1, -1) if len(shapes.get(k, (1, 1))) == 2 else (-1,))
                for k in ("running_mean", "running_var")}
            layer.load_state({k: StateReader(k, v.shape, lambda key, box: rows[key][
                tuple(slice(lo, hi) for lo, hi in box)]) for k, v in rows.items()})


# ---------------------------------------------------------------------------------------------- torch source
def _pads(layer) -> tuple[int, ...]:
    """``F.pad`` order (last dimension first) of a stencil layer's per-side padding."""
    out = []
    for w in reversed(layer.stencil.dims[2:]):
        out += [int(w.pad_lo), int(w.pad_hi)]
    return tuple(out)


def _conv_transpose_init(layer, a: str, nd: int) -> str:
    """The ``__init__`` line of a transposed convolution layer's ``nn.ConvTranspose``."""
    hp = layer.hparams
    per = {k: tuple(hp[k]) if isinstance(hp[k], (list, tuple)) else hp[k]
           for k in ("padding", "output_padding")}
    return (f"self.{a} = nn.ConvTranspose{nd}d({layer.in_shapes[0][1]}, {layer.out_shape[1]}, "
            f"kernel_size={layer.kernel}, stride={layer.stride}, padding={per['padding']}, "
            f"output_padding={per['output_padding']}, groups={layer.groups}, dilation={layer.dilation}, "
            f"bias={bool(hp['bias'])})")


def _module_head(name: str, title: str, sample: tuple) -> list[str]:
    """The generated module's lines up to ``Net.__init__``'s body."""
    return [f'"""PyTorch equivalent of the lbannpy model {name!r}{title}.', "",
            "The weights come from ``python -m lbannpy.export CKPT -o model.safetensors``; load them with",
            "(``safetensors.torch.load_file`` works as well where that package is installed)::", "",
            "    from lbannpy.export import read_safetensors",
            "    tensors, _ = read_safetensors('model.safetensors')   # NumPy arrays by state_dict name",
            "    net = Net()",
            "    net.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})", "",
            f"The input is {sample} per sample (N, C, H, W order).", '"""',
            "import torch", "import torch.nn.functional as F", "from torch import nn", "", "",
            "class Net(nn.Module):", "    def __init__(self):", "        super().__init__()"]


def torch_module_source(model_spec: dict, title: str = "") -> str:
    """Source of a ``torch.nn.Module`` ``Net`` computing what the lbannpy model computes (evaluation and
    training mode alike; batch norm statistics are per batch in training as in lbannpy's ``sync: global``)."""
    from lbannpy.comm import SingleCommunicator  # late: the layers load only when a module is written
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.batchnorm import BatchNorm
    from lbannpy.layers.conv import Conv
    from lbannpy.layers.conv_transpose import ConvTranspose
    from lbannpy.layers.fc import FullyConnected
    from lbannpy.layers.pool import Pool
    from lbannpy.layers.registry import INPUT_NAMES
    from lbannpy.layers.simple import Concat, Dropout, Flatten, LeakyReLU, ReLU, Sum
    from lbannpy.model import Model

    model = Model(model_spec, 1, LayerContext(SingleCommunicator(), np, "float64", seed=0), {})
    nd = len(model.input_shape) - 2
    init, fwd = [], []
    var = {n: "x" for n in INPUT_NAMES}
    for layer in model.layers:
        t, a = type(layer), attr_name(layer.name)
        ins = [var[p] for p in model.parents[layer.name]]
        v = f"h_{a}"
        x = ins[0]
        if t is Conv:
            cin = layer.in_shapes[0][1]
            init.append(f"self.{a} = nn.Conv{nd}d({cin}, {layer.filters}, kernel_size={layer.kernel}, "
                        f"stride={layer.stride}, dilation={layer.dilation}, bias={layer.use_bias})")
            pads = _pads(layer)
            xin = f"F.pad({x}, {pads})" if any(pads) else x
            fwd.append(f"{v} = self.{a}({xin})")
        elif t is ConvTranspose:  # the U-Nets' up-sampling (weight laid out as torch's)
            init.append(_conv_transpose_init(layer, a, nd))
            fwd.append(f"{v} = self.{a}({x})")
        elif t is BatchNorm:
            init.append(f"self.{a} = nn.BatchNorm{nd}d({layer.in_shapes[0][1]}, eps={layer.eps!r}, "
                        f"momentum={layer.momentum!r})")
            fwd.append(f"{v} = self.{a}({x})")
        elif t is FullyConnected:
            init.append(f"self.{a} = nn.Linear({layer.features}, {layer.out_shape[1]}, "
                        f"bias={layer.use_bias})")
            fwd.append(f"{v} = self.{a}(torch.flatten({x}, 1))")
        elif t is ReLU:
            fwd.append(f"{v} = F.relu({x})")
        elif t is LeakyReLU:
            # the slope from the spec: the layer sets its own attribute only in a forward pass
            fwd.append(f"{v} = F.leaky_relu({x}, {float(layer.hparams['slope'])!r})")
        elif t is Dropout:
            init.append(f"self.{a} = nn.Dropout({float(layer.hparams['p'])!r})")
            fwd.append(f"{v} = self.{a}({x})")
        elif t is Flatten:
            fwd.append(f"{v} = torch.flatten({x}, 1)")
        elif t is Sum:
            fwd.append(f"{v} = " + " + ".join(ins))
        elif t is Concat:
            fwd.append(f"{v} = torch.cat([{', '.join(ins)}], dim={int(layer.hparams['axis'])})")
        elif t is Pool:
            pads = _pads(layer)
            if layer.mode == "max":
                xin = f"F.pad({x}, {pads}, value=float('-inf'))" if any(pads) else x
                fwd.append(f"{v} = F.max_pool{nd}d({xin}, {layer.kernel}, {layer.stride})")
            else:
                if any(pads):
                    raise ExportError(f"layer '{layer.name}': a padded average pool has no torch.nn "
                                      f"equivalent written here; export the weights only (without "
                                      f"--torch-module)")
                fwd.append(f"{v} = F.avg_pool{nd}d({x}, {layer.kernel}, {layer.stride})")
        else:
            raise ExportError(f"layer '{layer.name}': type {layer.spec.name!r} has no torch.nn translation "
                              f"here; export the weights only (without --torch-module)")
        var[layer.name] = v
    lines = _module_head(model_spec.get("name", "model"), title, tuple(model.input_shape[1:]))
    lines += [f"        {s}" for s in init] or ["        pass"]
    lines += ["", "    def forward(self, x):"] + [f"        {s}" for s in fwd]
    lines += [f"        return {var[model.output.name]}", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m lbannpy.export",
        description="Write a checkpoint's weights as a safetensors file with PyTorch state_dict names and "
                    "layouts, and optionally the source of the equivalent torch.nn module.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint: its directory ckpt-<step>/ (or that directory's "
                                       "index.h5), a version-1 file ckpt-<step>.h5, or checkpoint.dir (its "
                                       "newest is used)")
    ap.add_argument("-o", "--output", required=True, help="the safetensors file to write")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="floating-point type of the exported tensors")
    ap.add_argument("--config", help="config.h5 or YAML spec of the model (needed for --torch-module)")
    ap.add_argument("--torch-module", metavar="FILE.py",
                    help="also write the source of an equivalent torch.nn.Module (class Net) here")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.checkpoint import CheckpointError
    from lbannpy.config import ConfigError

    try:
        with outputs.interrupt_on_signals():
            path, data, tensors, source = _export(args)
    except (UserError, CheckpointError, ConfigError, OSError) as exc:
        sys.stderr.write(f"lbannpy.export: error: {exc}\n")
        return 2
    except outputs.Interrupted as exc:
        sys.stderr.write(f"lbannpy.export: {exc}; {args.output} not written (no temporary left)\n")
        return outputs.EXIT_SIGNAL
    print(f"lbannpy.export: {len(tensors)} tensor(s) from {path} (step {data['step']}) -> {args.output}"
          + (f"; module source -> {args.torch_module}" if source is not None else ""))
    return 0


def _export(args):
    """``(checkpoint, data, tensors, module source or None)``, the outputs checked before the checkpoint is
    read and written each under a temporary name."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.config import load_config

    if args.torch_module and not args.config:
        raise ExportError("--torch-module needs --config (the checkpoint holds weights, not the model)")
    cfg = load_config(args.config) if args.config else None
    outputs.check([("-o", args.output), ("--torch-module", args.torch_module)],
                  [("the checkpoint", args.checkpoint), ("--config", args.config)]
                  + (outputs.config_inputs(cfg) if cfg is not None else []))
    path, data = load_checkpoint(args.checkpoint)
    spec = cfg["model"] if cfg is not None else model_of(data)
    tensors = state_dict(data, args.dtype, spec)
    source = None
    if args.torch_module:
        source = torch_module_source(spec, f" (exported from {os.path.basename(path)})")
    write_safetensors(args.output, tensors, {"format": "pt", "lbannpy_checkpoint": os.path.abspath(path),
                                             "step": str(data["step"])}, label="-o")
    if source is not None:
        with outputs.atomic(args.torch_module, "--torch-module") as tmp, open(tmp, "w") as f:
            f.write(source)
    return path, data, tensors, source


if __name__ == "__main__":
    sys.exit(main())
