"""Checks that look across keys (names, parents, cycles), at the model graph, at a rank count and at the data.

:func:`lbannpy.config.schema.normalize` checks each value on its own; the functions here check how values
relate. All raise :class:`ConfigError` naming the key path of the problem.
"""
from __future__ import annotations

import os
import re

from ..dist import DIM_NAMES, Distribution, DistributionError
from ..stencil import Stencil
from ..config_errors import ConfigError, did_you_mean, join_path
from .schema import INPUT_NAMES, LAYER_TYPES, normalize
from ..data.dataset import DataError, check_storage, external_link_problem, validate_dataset
from ..zoo import data_command

_PER_DIM_KEYS = ("kernel", "stride", "dilation")


def check_references(cfg: dict) -> None:
    """Layer names unique, parents known, parent counts per type, no cycle, per-dimension lists as long as
    the input has spatial dimensions, and ``parallel.layers`` naming existing layers."""
    model = cfg["model"]
    layers = model["layers"]
    nsp = len(model["input"]["spatial"])
    index: dict[str, int] = {}
    for i, layer in enumerate(layers):
        name, path = layer["name"], f"model.layers[{i}]"
        if name in INPUT_NAMES:
            raise ConfigError(f"{path}.name", f"{name!r} names the model input and cannot name a layer",
                              "rename the layer")
        if name in index:
            raise ConfigError(f"{path}.name",
                              f"duplicate layer name {name!r} (also model.layers[{index[name]}])",
                              "give every layer a unique name")
        index[name] = i
    for i, layer in enumerate(layers):
        path = f"model.layers[{i}]"
        spec = LAYER_TYPES[layer["type"]]
        parents = layer["parents"]
        for j, p in enumerate(parents):
            if p not in INPUT_NAMES and p not in index:
                raise ConfigError(f"{path}.parents[{j}]", f"unknown parent {p!r} of layer {layer['name']!r}",
                                  did_you_mean(p, list(INPUT_NAMES) + list(index), "layers"))
        if len(set(parents)) != len(parents):
            raise ConfigError(f"{path}.parents", f"layer {layer['name']!r} lists a parent twice: {parents}",
                              "list each parent once")
        n = len(parents)
        if n < spec.min_parents or (spec.max_parents is not None and n > spec.max_parents):
            want = (f"exactly {spec.min_parents}" if spec.min_parents == spec.max_parents
                    else f"at least {spec.min_parents}")
            raise ConfigError(f"{path}.parents", f"a {layer['type']} layer takes {want} parent(s), got {n}",
                              f"give {want} parent(s)")
        if any(k.name == "kernel" for k in spec.params):  # a sliding window (conv, pool)
            _check_stencil(layer, path, nsp)
    _check_cycles(layers, index)
    for name in cfg["parallel"]["layers"]:
        if name not in index and name not in INPUT_NAMES:
            raise ConfigError(f"parallel.layers.{name}", f"no layer named {name!r}",
                              did_you_mean(name, list(INPUT_NAMES) + list(index), "layers"))


def _check_stencil(layer: dict, path: str, nsp: int) -> None:
    for key in _PER_DIM_KEYS:
        v = layer.get(key)
        if isinstance(v, list) and len(v) != nsp:
            raise ConfigError(f"{path}.{key}", f"{len(v)} entries for an input with {nsp} spatial "
                                               f"dimension(s)", f"give {nsp} entries or a single number")
    try:
        Stencil.conv(nsp + 2, layer["kernel"], layer["stride"], layer["padding"], layer.get("dilation", 1))
    except DistributionError as e:
        raise ConfigError(f"{path}.padding", str(e), f"give one padding entry per spatial dimension ({nsp})")


def _check_cycles(layers: list, index: dict) -> None:
    """Depth-first search; the first cycle found is reported as ``a -> b -> a``."""
    state = {}  # name -> 1 on the current path, 2 done

    for root in index:
        if state.get(root):
            continue
        stack = [(root, iter(layers[index[root]]["parents"]))]
        trail = [root]
        state[root] = 1
        while stack:
            name, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[name] = 2
                stack.pop()
                trail.pop()
                continue
            if nxt in INPUT_NAMES:
                continue
            if state.get(nxt) == 1:
                cyc = trail[trail.index(nxt):] + [nxt]
                # parents point backwards; show the data flow direction
                flow = " -> ".join(reversed(cyc))
                raise ConfigError(f"model.layers[{index[nxt]}].parents", f"cycle in the layer graph: {flow}",
                                  "a layer cannot (indirectly) feed itself; fix the parents")
            if not state.get(nxt):
                state[nxt] = 1
                trail.append(nxt)
                stack.append((nxt, iter(layers[index[nxt]]["parents"])))


def check_graph(cfg: dict):
    """Shape inference by :func:`lbannpy.strategy.graph.build_graph`; its errors come back as ConfigError
    naming the layer's key path. Returns the graph."""
    from ..strategy import graph as G  # imported late: the config package must load without the strategy

    user_errors = tuple({ValueError, getattr(G, "ShapeError", ValueError)})
    model = cfg["model"]  # the graph and the schema read one registry: every key the schema passed is known
    try:
        return G.build_graph(model, cfg["trainer"]["batch_size"])
    except ConfigError:
        raise
    except user_errors as e:
        raise ConfigError(_layer_path(cfg, e), str(e),
                          "change the layer's parameters or parents so that the shapes agree") from None


def _layer_path(cfg: dict, err: Exception) -> str:
    names = [layer["name"] for layer in cfg["model"]["layers"]]
    name = getattr(err, "layer", None)
    if isinstance(name, str) and name in names:
        return f"model.layers[{names.index(name)}]"
    for quoted in re.findall(r"['\"]([^'\"]+)['\"]", str(err)):
        if quoted in names:
            return f"model.layers[{names.index(quoted)}]"
    return "model.layers"


def check_ranks(cfg: dict, ranks: int, graph=None) -> None:
    """Every set of degrees in ``parallel`` fits ``ranks`` (their product divides it) and names only
    dimensions that the tensors have: the input's for the default, and with a ``graph`` (from
    :func:`check_graph`) each layer's output for its own entry (an fc layer's output is (n, c))."""
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError("--ranks", f"rank count must be a positive integer, got {ranks!r}", "use e.g. 4")
    ndim = 2 + len(cfg["model"]["input"]["spatial"])
    par = cfg["parallel"]
    entries = [("parallel.default", par["default"], ndim)]
    for k, v in par["layers"].items():
        node_ndim = ndim if graph is None or k in INPUT_NAMES else len(graph[k].out_shape)
        entries.append((f"parallel.layers.{k}", v, node_ndim))
    for path, degrees, ndim in entries:
        names = DIM_NAMES[ndim]
        degrees = dict(degrees)
        replicas = int(degrees.pop("r", 1))  # parallel.default.r: written replicas
        if ranks % replicas:
            raise ConfigError(join_path(path, "r"), f"{replicas} replicas do not divide {ranks} ranks",
                              "choose r dividing the rank count")
        for d, v in degrees.items():
            if d not in names and v != 1:
                raise ConfigError(join_path(path, d), f"the model's tensors have no dimension {d!r} "
                                                      f"(they are {'·'.join(names)})",
                                  f"split only {', '.join(names)}")
        try:
            dist = Distribution.make(ndim, ranks // replicas,
                                     **{d: v for d, v in degrees.items() if d in names})
            layer = path[len("parallel.layers."):] if path.startswith("parallel.layers.") else None
            if graph is not None and layer is not None and layer not in INPUT_NAMES:
                # the check the layer makes when train builds it: no rank may hold an empty block
                dist.check_shape(tuple(graph[layer].out_shape), f"output of layer '{layer}'")
        except DistributionError as e:
            raise ConfigError(path, str(e), f"change {path} or the rank count") from None


def check_data(cfg: dict, base_dir: str | None = None) -> None:
    """The training (and validation) HDF5 files exist and hold datasets that fit the model input.

    Only metadata (names, shapes, dtypes) is read: no sample is loaded and nothing is allocated from a size
    found in the file.
    """
    data = cfg.get("data")
    if data is None:
        return
    train = data["train"]
    n = _check_dataset("data.train", train["path"], train, cfg, base_dir, is_train=True)
    val = data.get("validation")
    if val and "path" in val:
        _check_dataset("data.validation", val["path"], train, cfg, base_dir, is_train=False)
    elif val:
        held = int(n * val["fraction"])
        if held < 1 or n - held < 1:
            raise ConfigError("data.validation.fraction", f"holding out {val['fraction']} of {n} samples "
                                                          f"leaves {held} for validation and {n - held} for "
                                                          f"training", "choose a fraction that keeps both "
                                                                       "non-empty")


def _data_hint(cfg: dict, file: str) -> str:
    """", e.g. with `python -m lbannpy.data ...`" for a generator that makes data of this model's shape."""
    model = cfg["model"]
    last = model["layers"][-1] if model.get("layers") else {}
    classes = int(last.get("units", last.get("filters", 0)) or 0)
    batch = int((cfg.get("trainer") or {}).get("batch_size") or 1)
    loss = model.get("loss", "cross_entropy")
    # the generators write class labels at the input's resolution: none of them fits another loss
    cmd = data_command(int(model["input"]["channels"]), model["input"]["spatial"], classes, loss, file,
                       4 * batch) if loss in ("cross_entropy", "pixel_cross_entropy") else None
    return f" with the shape this model reads: {cmd}" if cmd else " in the shape the model reads"


def _check_dataset(path: str, file: str, names: dict, cfg: dict, base_dir, is_train: bool) -> int:
    import h5py  # imported late: only data checks need it

    full = file if os.path.isabs(file) or base_dir is None else os.path.join(base_dir, file)
    where = f"{path}.path"
    if not os.path.exists(full):
        raise ConfigError(where, f"dataset file {full!r} does not exist",
                          "check the path (relative paths are taken from the working directory) or create "
                          "the data" + _data_hint(cfg, file))
    if not os.path.isfile(full) or not h5py.is_hdf5(full):
        raise ConfigError(where, f"{full!r} is not an HDF5 file", "point data paths at .h5 files")
    model = cfg["model"]
    channels, spatial = model["input"]["channels"], tuple(model["input"]["spatial"])
    try:
        with h5py.File(full, "r") as f:
            for key in ("inputs", "labels"):
                name = names[key]
                linked = external_link_problem(f, full, name, key)
                if linked:  # named as what it is, not as a corrupt file
                    raise ConfigError(f"{path}.{key}", linked, "restore the linked file")
                try:
                    obj = f[name] if name in f else None
                except (KeyError, OSError) as e:  # the link is there, the object's header is not usable
                    raise ConfigError(f"{path}.{key}", f"dataset {name!r} in {full!r} cannot be opened: {e}",
                                      "the file is corrupt; regenerate it") from None
                if not isinstance(obj, h5py.Dataset):
                    found = [k for k in f if isinstance(f.get(k), h5py.Dataset)]
                    raise ConfigError(f"data.train.{key}", f"{full!r} has no dataset {name!r}",
                                      did_you_mean(name, found, "datasets"))
            x, y = f[names["inputs"]], f[names["labels"]]
            for key, ds in (("inputs", x), ("labels", y)):
                try:
                    check_storage(ds, full, key)
                except DataError as e:
                    raise ConfigError(f"{path}.{key}", str(e), "regenerate the data file") from None
            xshape, xdtype, yshape, ydtype = tuple(x.shape or ()), x.dtype, tuple(y.shape or ()), y.dtype
    except OSError as e:
        raise ConfigError(where, f"cannot read {full!r}: {e}", "regenerate the data file") from None
    want = ("N", channels) + spatial
    if len(xshape) != len(want) or xshape[1:] != want[1:]:
        raise ConfigError("data.train.inputs", f"dataset {names['inputs']!r} in {full!r} has shape {xshape}, "
                                                f"the model input needs (N, C, *spatial) = "
                                                f"{'(' + ', '.join(map(str, want)) + ')'}",
                          "make model.input match the data, or use matching data")
    if xdtype.kind not in "fiu":
        raise ConfigError("data.train.inputs", f"dataset {names['inputs']!r} in {full!r} has dtype {xdtype}, "
                                                "not a numeric type", "store inputs as float32/float64")
    n = xshape[0]
    if n < 1:
        raise ConfigError(where, f"dataset {names['inputs']!r} in {full!r} holds no samples",
                          "use a non-empty dataset")
    form = _label_form(cfg)
    _check_labels(names["labels"], full, model["loss"], form, n, spatial, yshape, ydtype)
    try:  # the reader's own checks, the ones train's set-up makes, with its words
        validate_dataset(full, names["inputs"], names["labels"], channels, spatial,
                         None if form is None else form.shape, form is not None and form.floating)
    except DataError as e:
        raise ConfigError(where, str(e), "make the data match what the reader takes") from None
    if is_train and n < cfg["trainer"]["batch_size"]:
        raise ConfigError(where, f"{full!r} holds {n} samples, fewer than trainer.batch_size = "
                                 f"{cfg['trainer']['batch_size']}", "lower the batch size or add samples")
    return n


def _label_form(cfg: dict):
    """What the model's loss reads as labels where it is not a cross-entropy (their own rules below), from
    the output shape of the model's graph; None for the cross-entropy losses."""
    if cfg["model"]["loss"] in ("cross_entropy", "pixel_cross_entropy"):
        return None
    # late: the loss module loads the layer kernels, which loading a config must not
    from lbannpy.layers.loss import label_form

    out = tuple(check_graph(cfg).nodes[-1].out_shape)
    return label_form(cfg["model"]["loss"], cfg["model"]["input"]["spatial"], out[1:])


def _check_labels(name: str, full: str, loss: str, form, n: int, spatial: tuple, yshape: tuple,
                  ydtype) -> None:
    """The labels dataset's shape and type against what the loss reads (ConfigError at data.train.labels)."""
    if form is not None:  # float targets or classes at the output's resolution
        ok_shape, want_y = yshape == (n,) + form.shape, form.text.replace("(M,", f"({n},", 1)
    elif loss == "pixel_cross_entropy":  # the reader takes class indices only (no probabilities)
        ok_shape = yshape in ((n,) + spatial, (n, 1) + spatial)
        want_y = f"(N, *spatial) = ({n}, {', '.join(map(str, spatial))})"
    else:
        ok_shape = yshape in ((n,), (n, 1))
        want_y = f"({n},) class indices"
    if not ok_shape:
        raise ConfigError("data.train.labels", f"dataset {name!r} in {full!r} has shape {yshape}, "
                                               f"{loss} needs {want_y}",
                          "make the labels match the inputs and the loss")
    floating = form is not None and form.floating
    if ydtype.kind not in ("f" if floating else "iu"):
        want_t = f"{loss} targets must be floating point" if floating else "class labels must be integers"
        raise ConfigError("data.train.labels", f"dataset {name!r} in {full!r} has dtype {ydtype}; {want_t}",
                          "store targets as float32/float64" if floating else
                          "store labels as int64 class indices (the reader takes no probabilities)")


def check_memory(cfg: dict, ranks: int, graph=None, data: bool = True, base_dir: str | None = None,
                 planned: bool = True, chosen_by: str = ""):
    """The per-rank memory estimate of :mod:`lbannpy.strategy.memory` (the cost model's accounting, the
    readers' buffers and sample ids) against ``runtime.memory_gib``; returns the estimate, raises
    ConfigError when it exceeds the limit. ``strategy: auto`` is estimated under the planner's choice
    (``planned``), else under ``parallel`` as written (``chosen_by`` says who wrote it, where the planner
    already did). Nothing is allocated from the sizes."""
    from ..strategy import memory as M  # imported late, as check_graph

    dists, how = None, chosen_by
    if planned and cfg["parallel"].get("strategy") == "auto":
        # imported late, as check_graph
        from ..strategy.planner import PlanError, plan

        par = cfg["parallel"]
        try:
            chosen = plan(cfg, ranks, par.get("machine") or "local", memory_gib=par.get("memory_gib"),
                          compare=False)
        except (PlanError, ValueError, OSError) as e:
            raise ConfigError("parallel.strategy", f"auto: {e}", "see python -m lbannpy.strategy") from None
        dists, how = chosen.chosen.dists, "strategy auto: the planner's choice"
    try:
        est = M.estimate(cfg, ranks, graph, data, base_dir, dists, how)
    except (ValueError, OSError, KeyError) as e:  # distributions check_ranks refuses; unreadable data
        raise ConfigError("parallel", f"cannot estimate the memory per rank: {e}",
                          "validate with --ranks to see the distribution problem") from None
    msg = M.refusal(est, cfg)
    if msg:
        raise ConfigError("runtime.memory_gib", msg, M.REFUSAL_HINT)
    return est


def validate(cfg, ranks: int | None = None, data: bool = True, graph: bool = True,
             base_dir: str | None = None, memory: bool = True) -> dict:
    """All checks: schema, references, shapes (``graph``), a rank count (``ranks``), the data files
    (``data``) and the memory per rank (``memory``, with ``graph``; on ``ranks`` or 1). Returns the normal
    form; raises ConfigError naming the first problem."""
    cfg = normalize(cfg)
    check_references(cfg)
    model_graph = check_graph(cfg) if graph else None
    if ranks is not None:
        check_ranks(cfg, ranks, model_graph)
        if model_graph is not None:
            # late: blocks loads the layer registry and the model, which import lbannpy.config
            from .blocks import check_blocks

            check_blocks(cfg, ranks, model_graph)
    if data:
        check_data(cfg, base_dir)
    if memory and graph:
        check_memory(cfg, ranks or 1, model_graph, data, base_dir)
    return cfg
