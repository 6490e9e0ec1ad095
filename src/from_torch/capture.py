"""Capture a module with ``torch.export`` and turn its ATen graph into lbannpy layers through :data:`TABLE`.

The graph is the one ``torch.export`` gives in training mode, decomposed by ``run_decompositions`` with the
default table minus every operator the importer's table names (those stay whole: a ``group_norm`` is one
layer, not its arithmetic), and functionalised (in-place ops gone; batch norm's running-statistics updates
are extra outputs, which only the trainer's own batch norm reproduces). Only the nodes the user's output
depends on are converted. Every node is either in the table or refused by name, with the module path it
came from; the shapes are static (``node.meta["val"]``) or the import is refused.
"""
from __future__ import annotations

import contextlib
import io
import logging
import operator
import os
import re
import warnings

from lbannpy.layers.registry import INPUT_NAMES, layer_specs

from .table import BY_NAME, supported_text
from .errors import Refused


def op_name(node) -> str:
    """``aten.name.overload`` of a call node (``getitem`` for tuple indexing)."""
    if node.target is operator.getitem:
        return "getitem"
    return str(node.target)


def module_of(node) -> tuple[str, str]:
    """(qualified module path, module type) of the innermost ``nn.Module`` a node was traced in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    return str(path), kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def source_of(node) -> str:
    """``file:line`` of the user's code that made a node, when ``torch.export`` recorded it."""
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lbannpy's calls into torch.export
    found = [f for f in found if "/torch/" not in f[0] and not os.path.abspath(f[0]).startswith(own + os.sep)]
    return f"{found[-1][0].rsplit('/', 1)[-1]}:{found[-1][1]}" if found else ""  # the user's line, if any


def bind(node) -> dict:
    """The node's arguments by the operator schema's names, defaults filled; ``input`` also names ``self``."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return {}
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    if "self" in out and "input" not in out:
        out["input"] = out["self"]
    return out


class Builder:
    """The layers, their origin (lbannpy tensor -> ``state_dict`` key) and torch's shape of each, built node
    by node; the converters' whole interface."""

    def __init__(self, ep, state_keys):
        sig = ep.graph_signature
        self.params = dict(sig.inputs_to_parameters)
        self.buffers = dict(sig.inputs_to_buffers)
        self.constants = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
        self.state_keys = list(state_keys)
        self.layers: list[dict] = []
        self.origin: dict[str, dict[str, str]] = {}
        self.shapes: dict[str, tuple] = {}
        self.made_by: dict[str, object] = {}
        self.env: dict = {}
        self.used: set[str] = set()
        self.names = set(INPUT_NAMES)
        self.pending_pad: dict = {}
        self.outputs_used: dict = {}
        self.specs = layer_specs()

    # -------------------------------------------------------------------------------------- facts
    @staticmethod
    def shape(node) -> tuple[int, ...]:
        val = node.meta["val"]
        val = val[0] if isinstance(val, (tuple, list)) else val  # batch norm, dropout: the output first
        return tuple(int(d) for d in val.shape)

    @staticmethod
    def opname(node) -> str:
        name = op_name(node)
        return name[:-len(".default")] if name.endswith(".default") else name

    @staticmethod
    def is_tensor(x) -> bool:
        return hasattr(x, "op")

    def where(self, node, op: str = "") -> str:
        path = module_of(node)[0] or "(top level)"
        src = source_of(node)
        return f"{path} -> {op or self.opname(node)}" + (f" ({src})" if src else "")

    def refuse(self, node, what: str, supported: str, op: str = ""):
        raise Refused(f"{self.where(node, op)}: {what} is not supported; supported: {supported}")

    # -------------------------------------------------------------------------------------- values
    def input(self, node, x) -> str:
        """The layer that computes tensor ``x`` (or the model input)."""
        if x in self.env:
            return self.env[x]
        name = getattr(x, "name", None)
        if name in self.params or name in self.buffers:
            key = self.params.get(name) or self.buffers[name]
            self.refuse(node, f"using {key!r} as data",
                        "parameters and buffers as the weights and statistics of conv, fc, norms and prelu")
        if name in self.constants:
            self.refuse(node, "a tensor made inside forward", "tensors computed from the input")
        self.refuse(node, f"an input computed by {self.opname(x) if hasattr(x, 'target') else x!r}",
                    "inputs computed by supported ops")

    def param(self, node, arg) -> str | None:
        """The ``state_dict`` key of a parameter or buffer argument (None for None); each is taken once."""
        if arg is None:
            return None
        key = self.params.get(getattr(arg, "name", None)) or self.buffers.get(getattr(arg, "name", None))
        if key is None:
            self.refuse(node, f"a weight computed by {self.opname(arg) if hasattr(arg, 'target') else arg!r}",
                        "weights that are the module's own parameters")
        if key in self.used:
            self.refuse(node, f"{key!r} used by a second layer (shared weights)", "one layer per parameter")
        self.used.add(key)
        return key

    def alias(self, node, x) -> None:
        self.env[node] = self.input(node, x)

    # -------------------------------------------------------------------------------------- layers
    def emit(self, node, kind: str, params: dict, parents: list[str], origin: dict | None = None,
             counter: bool = False, suffix: str = "", shape: tuple | None = None) -> str:
        spec = self.specs.get(kind)
        if spec is None:
            self.refuse(node, f"its lbannpy layer type {kind!r} (not in this installation)",
                        f"layer types {', '.join(self.specs)}")
        accepted = spec.accepts()
        for key, value in params.items():
            if key not in accepted:
                self.refuse(node, f"{key}={value!r} (lbannpy's {kind} has no key {key!r} here)",
                            f"{kind} keys {', '.join(accepted) or '(none)'}")
        keys = {k: self.param(node, v) for k, v in (origin or {}).items()}
        keys = {k: v for k, v in keys.items() if v is not None}
        if counter:
            count = keys["running_mean"].rpartition(".")[0] + ".num_batches_tracked"
            if count in self.state_keys:
                keys["num_batches_tracked"] = count
                self.used.add(count)
        name = self._name(node, keys, suffix)
        self.layers.append({"name": name, "type": kind, "parents": list(parents), **params})
        if keys:
            self.origin[name] = keys
        self.shapes[name] = tuple(shape) if shape is not None else self.shape(node)
        self.made_by[name] = node
        self.env[node] = name
        return name

    def global_pool(self, node, mode: str, x, keep: bool) -> str:
        """Pooling over the whole spatial extent: ``global_pool``, or ``pool`` with ``global: true`` (the
        same arithmetic) where this installation has no ``global_pool`` yet; then a flatten unless kept."""
        kind, params = (("global_pool", {"mode": mode}) if "global_pool" in self.specs
                        else ("pool", {"mode": mode, "global": True}))
        pooled = self.shape(x)[:2] + (1,) * (len(self.shape(x)) - 2)
        name = self.emit(node, kind, params, [self.input(node, x)], suffix="" if keep else "pool",
                         shape=pooled)
        if not keep:
            name = self.emit(node, "flatten", {}, [name])
        return name

    def _name(self, node, keys: dict, suffix: str) -> str:
        """A valid, unique lbannpy name from the module's qualified name: the owning module of the layer's
        parameters, else the module the op ran in (plus the op's name where that module is not a leaf)."""
        short = op_name(node).split(".")[1].strip("_") if "." in op_name(node) else "op"
        if keys:
            base = next(iter(keys.values())).rpartition(".")[0] or short
        else:
            path, kind = module_of(node)
            owns = bool(path) and any(k.startswith(path + ".") for k in self.state_keys)
            leaf = kind.startswith("torch.nn.modules.") and not owns
            base = path if (leaf and path) else ".".join(p for p in (path, short) if p)
        if suffix:
            base = f"{base}.{suffix}"
        name = re.sub(r"[^A-Za-z0-9_]+", "-", base).strip("-") or short
        if not name[0].isalpha():
            name = "m" + name
        unique, i = name, 2
        while unique in self.names:
            unique, i = f"{name}-{i}", i + 1
        self.names.add(unique)
        return unique


# ------------------------------------------------------------------------------------------------ capture
@contextlib.contextmanager
def _quiet():
    """torch.export's own warnings and log lines off: a refusal is one line."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _capture_error(exc: Exception, what: str) -> Refused:
    text = str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    at = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)', text)
    where = f" at {at.group(1).rsplit('/', 1)[-1]}:{at.group(2)} `{at.group(4).strip()}`" if at else ""
    data = "data-dependent" in text or "GuardOnDataDependent" in type(exc).__name__
    kind = ("data-dependent control flow or a data-dependent shape" if data else "code torch.export cannot "
            "capture")
    return Refused(f"{what}{where}: {kind} is not supported ({type(exc).__name__}: {first[:200]}); "
                   f"supported: one static graph for the given input shape (no branches on tensor values)")


def export(module, example, what: str):
    """``torch.export`` of ``module`` in training mode on ``example``, decomposed as described above. The
    module's state and mode are left as they were."""
    import torch

    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    was_training = module.training
    module.train()
    try:
        with _quiet():
            ep = torch.export.export(module, (example,), strict=False)
            table = torch.export.default_decompositions()
            for name in BY_NAME:
                parts = name.split(".")
                op = getattr(getattr(torch.ops.aten, parts[1], None), parts[-1], None) if len(parts) == 3 \
                    else None
                if op is not None:
                    table.pop(op, None)
            ep = ep.run_decompositions(table)
    except Refused:
        raise
    except Exception as exc:  # torch.export's many error types: each becomes the one refusal line
        raise _capture_error(exc, what) from None
    finally:
        module.load_state_dict(saved)
        module.train(was_training)
    return ep


def convert(ep, state_keys) -> tuple[Builder, str]:
    """Every node the user output depends on, through the table. Returns the builder and the output layer."""
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    inputs = [s.arg.name for s in sig.input_specs if s.kind.name == "USER_INPUT"]
    outputs = [s.arg.name for s in sig.output_specs if s.kind.name == "USER_OUTPUT"]
    b = Builder(ep, state_keys)
    by_name = {n.name: n for n in graph.nodes}
    if len(inputs) != 1 or len(outputs) != 1:
        raise Refused(f"forward takes {len(inputs)} tensor(s) and returns {len(outputs)}: not supported; "
                      f"supported: one input tensor and one output tensor")
    b.env[by_name[inputs[0]]] = INPUT_NAMES[0]
    needed, todo = set(), [by_name[outputs[0]]]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    nodes = [n for n in graph.nodes if n in needed and n.op != "placeholder"]
    for node in nodes:  # first: a shape that depends on the data is the problem, whatever makes it
        val = node.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val
        if hasattr(val, "shape") and not all(isinstance(d, int) for d in val.shape):
            b.refuse(node, f"an output shape {tuple(val.shape)} that depends on the data (dynamic shape)",
                     "static shapes")
    for node in nodes:
        if node.op != "call_function":
            b.refuse(node, f"a {node.op} node", "ATen operator calls")
        op = BY_NAME.get(op_name(node))
        if op is None:  # named as the user called it, not as the piece of its decomposition met first
            orig = str(node.meta.get("original_aten") or op_name(node))
            orig = orig[:-len(".default")] if orig.endswith(".default") else orig
            b.refuse(node, "this operator", supported_text(), op=orig)
        op.convert(b, node, bind(node))
    out = by_name[outputs[0]]
    if b.env.get(out, INPUT_NAMES[0]) in INPUT_NAMES:
        raise Refused("forward returns its input unchanged: not supported; supported: a network with layers")
    unused = [k for k in state_keys if k not in b.used]
    if unused:
        raise Refused(f"{unused[0]} -> (unused): a state_dict entry forward does not use is not supported "
                      f"(lbannpy would neither train nor export it"
                      f"{f'; {len(unused) - 1} more' if len(unused) > 1 else ''}); supported: modules whose "
                      f"every parameter and buffer forward uses")
    return b, b.env[out]
