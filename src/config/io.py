"""Reading and writing specs (YAML) and config.h5 (HDF5); both hold the normal form of the schema tree.

config.h5 layout (read it with ``h5dump CONFIG.h5``):

* root attributes ``format = "lbannpy-config"`` and ``version = 1`` (int);
* a mapping is a group; its scalar values are attributes (int64, float64, HDF5 boolean enum, UTF-8
  variable-length string);
* a list of scalars of one kind is a 1-d attribute of that type (an empty list: an empty int64 attribute);
* any other list (the layers, a per-dimension padding mixing ints and pairs) is a group with attribute
  ``_kind = "list"`` whose items are attributes or groups named ``0``, ``1``, ...

Nothing is pickled or evaluated: attributes are read as plain numbers and strings, their sizes are checked
before they are read, and the tree then goes through the same schema checks as a YAML spec.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import yaml

from lbannpy import yamlsafe

from ..config_errors import ConfigError
from .schema import normalize
from .checks import check_references

FORMAT = "lbannpy-config"
VERSION = 1
LIST_KIND = "list"
MAX_FILE_BYTES = 64 << 20  # a config is a few KiB; anything this large is not one
MAX_ATTR_ELEMENTS = 4096  # a config list holds a few entries (per-dim sizes, parents)
MAX_DEPTH = 16
MAX_MEMBERS = 1 << 16


# --------------------------------------------------------------------------------------------------------
# YAML


def parse_yaml(text: str, source: str = "<spec>"):
    """:func:`lbannpy.yamlsafe.load` with the error turned into a ConfigError naming line and column.
    Aliases (``*name``: a few bytes could expand into a huge tree), nesting deeper than
    ``yamlsafe.MAX_DEPTH`` and duplicate keys are refused."""
    try:
        tree = yamlsafe.load(text)
    except yamlsafe.YamlLimitError as e:
        raise ConfigError(f"{source}:{e.where}", e.problem, "see the line and column named") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(where, f"invalid YAML: {problem}",
                          "check indentation, colons and brackets near that line") from None
    if tree is None:
        raise ConfigError(source, "the spec is empty", "start from `python -m lbannpy.config zoo lenet5 -o "
                                                       "spec.yaml`")
    return tree


def read_yaml(path: str):
    _check_size(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ConfigError(path, "not a UTF-8 text file", "give a YAML spec or a config.h5") from None
    return parse_yaml(text, path)


class _FlowMap(dict):
    """A mapping written on one line (each layer of ``model.layers``)."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):  # never write &anchors: parse_yaml refuses aliases
        return True


_Dumper.add_representer(
    _FlowMap, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=True))


def to_yaml(cfg: dict) -> str:
    """The YAML text of a tree: keys in schema order, one line per layer, short lists and mappings of
    scalars in flow style. ``yaml.safe_load`` reads it back to an equal tree."""
    tree = dict(cfg)
    if isinstance(tree.get("model"), dict) and isinstance(tree["model"].get("layers"), list):
        tree["model"] = dict(tree["model"], layers=[_FlowMap(x) if isinstance(x, dict) else x
                                                    for x in tree["model"]["layers"]])
    return yaml.dump(tree, Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=110,
                     allow_unicode=True)


# --------------------------------------------------------------------------------------------------------
# HDF5


def _scalar_kind(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return None


def _attr_value(v):
    """The attribute for a scalar or a list of scalars of one kind, or None when ``v`` needs a group."""
    import h5py

    kind = _scalar_kind(v)
    if kind == "int":
        return np.int64(v)
    if kind == "float":
        return np.float64(v)
    if kind == "bool":
        return np.bool_(v)
    if kind == "str":
        return v
    if isinstance(v, list):
        kinds = {_scalar_kind(x) for x in v}
        if not v:
            return np.zeros(0, dtype=np.int64)
        if len(kinds) == 1 and None not in kinds:
            dtype = {"int": np.int64, "float": np.float64, "bool": np.bool_,
                     "str": h5py.string_dtype("utf-8")}[kinds.pop()]
            return np.array(v, dtype=dtype)
    return None


def _write_tree(group, tree) -> None:
    items = enumerate(tree) if isinstance(tree, list) else tree.items()
    if isinstance(tree, list):
        group.attrs["_kind"] = LIST_KIND
    for k, v in items:
        k = str(k)
        a = _attr_value(v)
        if a is not None:
            group.attrs[k] = a
        elif isinstance(v, (dict, list)):
            _write_tree(group.create_group(k), v)
        else:
            raise ConfigError(k, f"cannot store a value of type {type(v).__name__} in config.h5",
                              "normalize the tree first")


def write_h5(cfg: dict, path: str) -> None:
    """Write ``cfg`` to ``path`` atomically (a temporary file in the same directory, then a rename)."""
    import h5py

    def write(tmp):
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["version"] = np.int64(VERSION)
            _write_tree(f, cfg)

    _atomic(path, write)


def _read_attr(attrs, name: str, where: str):
    import h5py

    aid = attrs.get_id(name)
    shape = aid.shape
    if shape is None:  # an empty (null) dataspace: h5py.Empty, no value at all
        raise ConfigError(where, "attribute has an empty dataspace (no value)",
                          "rebuild the file with python -m lbannpy.config build")
    size = int(np.prod(shape)) if shape else 1
    if len(shape) > 1 or size > MAX_ATTR_ELEMENTS:
        raise ConfigError(where, f"attribute of shape {shape} is not a config value",
                          "rebuild the file with python -m lbannpy.config build")
    dtype = aid.dtype
    is_str = h5py.check_string_dtype(dtype) is not None
    if not is_str and dtype.kind not in "iufb":
        raise ConfigError(where, f"attribute of type {dtype} is not a config value",
                          "rebuild the file with python -m lbannpy.config build")
    value = attrs[name]

    def plain(x):
        if isinstance(x, bytes):
            return x.decode("utf-8", errors="replace")
        if isinstance(x, np.bool_):
            return bool(x)
        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, np.floating):
            return float(x)
        return x

    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            return plain(value[()])
        return [plain(x) for x in value.tolist()] if not is_str else [plain(x) for x in value]
    return plain(value)


def _read_tree(group, where: str, depth: int):
    import h5py

    if depth > MAX_DEPTH:
        raise ConfigError(where, "groups nested too deeply for a config", "rebuild the file")
    attrs = group.attrs
    names = list(attrs.keys())
    members = list(group.keys())
    if len(names) + len(members) > MAX_MEMBERS:
        raise ConfigError(where, "too many entries for a config", "rebuild the file")
    kind = attrs["_kind"] if "_kind" in names else None
    if isinstance(kind, bytes):
        kind = kind.decode()
    out = {}
    for n in names:
        if n == "_kind" or (depth == 0 and n in ("format", "version")):
            continue
        out[n] = _read_attr(attrs, n, f"{where}/{n}" if where else n)
    for n in members:
        p = f"{where}/{n}" if where else n
        link = group.get(n, getlink=True)
        at = f"{group.file.filename}:/{p}"
        if isinstance(link, h5py.ExternalLink):  # checked before anything follows it
            raise ConfigError(at, f"is an external link to {link.filename}:{link.path}; a config holds its "
                                 f"settings itself", "rebuild the file with python -m lbannpy.config build")
        if isinstance(link, h5py.SoftLink):
            raise ConfigError(at, f"is a soft link to {link.path}; a config holds each setting once",
                              "rebuild the file with python -m lbannpy.config build")
        obj = group.get(n, getlink=False)
        if not isinstance(obj, h5py.Group):
            raise ConfigError(p, "unexpected dataset in a config file", "rebuild the file")
        out[n] = _read_tree(obj, p, depth + 1)
    if kind is None:
        return out
    if kind != LIST_KIND:
        raise ConfigError(where, f"unknown group kind {kind!r}", "rebuild the file")
    try:
        idx = sorted((int(k), k) for k in out)
    except ValueError:
        raise ConfigError(where, "list group with non-numeric entries", "rebuild the file") from None
    if [i for i, _ in idx] != list(range(len(idx))):
        raise ConfigError(where, "list group with missing entries", "rebuild the file")
    return [out[k] for _, k in idx]


def read_h5(path: str):
    """The raw tree stored in a config.h5 (not yet normalized). Refuses files that are not lbannpy configs,
    are of a newer version, or are damaged."""
    import h5py

    _check_size(path)
    if not h5py.is_hdf5(path):
        raise ConfigError(path, "not an HDF5 file (garbage or truncated)",
                          "give a config.h5 written by python -m lbannpy.config build, or a YAML spec")
    try:
        with h5py.File(path, "r") as f:
            fmt = f.attrs.get("format")
            if isinstance(fmt, bytes):
                fmt = fmt.decode(errors="replace")
            if fmt != FORMAT:
                raise ConfigError(path, f"not an lbannpy config (format attribute {fmt!r}, expected "
                                        f"{FORMAT!r})", "build one with python -m lbannpy.config build")
            version = f.attrs.get("version")
            if not isinstance(version, (int, np.integer)) or isinstance(version, (bool, np.bool_)):
                raise ConfigError(path, f"version attribute {version!r} is not an integer",
                                  "rebuild the file")
            if version > VERSION:
                raise ConfigError(path, f"config version {int(version)} is newer than this lbannpy reads "
                                        f"(version {VERSION})", "upgrade lbannpy, or rebuild the config from "
                                                                "its YAML spec")
            if version < 1:
                raise ConfigError(path, f"invalid config version {int(version)}", "rebuild the file")
            return _read_tree(f, "", 0)
    except ConfigError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        raise ConfigError(path, f"cannot read config (truncated or damaged file): {e}",
                          "rebuild it with python -m lbannpy.config build") from None


# --------------------------------------------------------------------------------------------------------
# files


def _check_size(path: str) -> None:
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ConfigError(path, f"cannot read: {e.strerror or e}", "check the path") from None
    if not os.path.isfile(path):
        raise ConfigError(path, "not a regular file", "give a YAML spec or a config.h5")
    if size > MAX_FILE_BYTES:
        raise ConfigError(path, f"{size} bytes is far too large for a config",
                          "give a YAML spec or config.h5")


def _is_h5_path(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".h5", ".hdf5", ".hdf")


def read_raw(path: str):
    """The raw tree of a spec (.yaml/.yml) or config (.h5); other names are sniffed by content."""
    import h5py

    if _is_h5_path(path):
        return read_h5(path)
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        _check_size(path)
        if h5py.is_hdf5(path):
            return read_h5(path)
    return read_yaml(path)


def load_config(path: str) -> dict:
    """Read a spec or config.h5 and return its normal form, with names, parents and cycles checked.
    Shape, rank-count and data checks are :func:`lbannpy.config.validate`'s."""
    cfg = normalize(read_raw(path))
    check_references(cfg)
    return cfg


def save_config(cfg: dict, path: str) -> None:
    """Write the normal form of ``cfg`` atomically, as config.h5 (.h5) or a YAML spec (any other name)."""
    cfg = normalize(cfg)
    check_references(cfg)
    if _is_h5_path(path):
        write_h5(cfg, path)
    else:
        text = to_yaml(cfg)
        _atomic(path, lambda tmp: _write_text(tmp, text))


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _atomic(path: str, write) -> None:
    """Call ``write(tmp)`` on a temporary name beside ``path``, flush it to disk, then rename over ``path``:
    a reader sees the old file or the new one, never half of one."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        raise ConfigError(path, f"directory {d} does not exist", "create it first or write elsewhere")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=d)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
