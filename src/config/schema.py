"""The config schema: the one definition of every section, key, default and allowed value.

Everything else in :mod:`lbannpy.config` is driven by the tree built here:

* parsing and default filling (:func:`normalize` walks :data:`SCHEMA`),
* structural validation (each :class:`Type` checks a value and returns its normal form),
* the YAML and HDF5 round trip (the normal form is the only thing written),
* documentation (:func:`schema_text`, printed by ``python -m lbannpy.config schema``),
* the layer types (:func:`layer_types`, :func:`layer_params`, :func:`layer_type`): a view of
  :mod:`lbannpy.layers.registry`, where each layer family declares its keys beside its implementation.

The normal form is a tree of plain ``dict``/``list``/``int``/``float``/``bool``/``str``; keys appear in
schema order, every key with a default is present, and a key that is unset and has no default is absent
(``None`` never appears, so the tree maps one to one onto HDF5 attributes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


from lbannpy.data.dataset import PRELOAD_AUTO_BYTES, PRELOAD_CHOICES
from lbannpy.layers.registry import INPUT_NAMES, LayerSpec, RegistryView, layer_specs, loss_specs

from ..config_errors import ConfigError, did_you_mean, join_path
from ..config_types import (MAX_SPATIAL_DIMS, NAME_RE, REQUIRED, UNSET, Bool, Float, Int, Key, ListOf, MapOf,
                            OneOf, Registered, Section, Str, Switch, Type, type_name)

INPUT_NAME = INPUT_NAMES[0]  # the name written where a parent defaults to the model input
DIMS = ("n", "c", "d", "h", "w")  # split dimensions of parallel degrees, as in lbannpy.dist.DIM_NAMES


# A layer type's entry is the :class:`lbannpy.layers.registry.LayerSpec` its module declares beside its
# implementation (name, doc, ``params`` keys, min/max parents): the schema holds no list of its own.
LayerType = LayerSpec


NAME_KEY = Key("name", Str(pattern=NAME_RE), REQUIRED, "unique layer name (letters, digits, '_', '-')")
TYPE_KEY = Key("type", Str(), REQUIRED, "layer type, one of the registry below")
PARENTS_KEY = Key("parents", ListOf(Str(pattern=NAME_RE)), UNSET,
                  f"names of the input layers ('{INPUT_NAME}' or 'input': the model input); default: the "
                  f"previous layer ('{INPUT_NAME}' for the first)")
COMMON_LAYER_KEYS = (NAME_KEY, TYPE_KEY, PARENTS_KEY)

_POS = Int(1)

#: layer type name -> :class:`LayerSpec`, a live view of the layer registry (families load on first use)
LAYER_TYPES = RegistryView(layer_specs)


def layer_types() -> list[str]:
    """Names of all layer types, in registry order."""
    return list(LAYER_TYPES)


def layer_type(name: str) -> LayerType:
    """The registry entry of a layer type; ConfigError (with did-you-mean) for an unknown one."""
    try:
        return LAYER_TYPES[name]
    except KeyError:
        raise ConfigError("type", f"unknown layer type {name!r}", did_you_mean(name, LAYER_TYPES, "types"))


def layer_params(name: str) -> dict[str, Key]:
    """The type-specific parameters of a layer type (not name/type/parents), in schema order."""
    return {k.name: k for k in layer_type(name).params}


@dataclass(frozen=True)
class LayerList(Type):
    """``model.layers``: a non-empty list of layers, each checked against its type's registry entry."""

    def check(self, value, path):
        if not isinstance(value, list) or not value:
            raise ConfigError(path, f"expected a non-empty list of layers, got {type_name(value)}",
                              "write one '- {name: ..., type: ...}' entry per layer")
        out = []
        for i, layer in enumerate(value):
            out.append(self.check_layer(layer, join_path(path, i), out[-1]["name"] if out else INPUT_NAME))
        return out

    @staticmethod
    def check_layer(layer, path, previous: str) -> dict:
        if not isinstance(layer, dict):
            raise ConfigError(path, f"expected a layer mapping, got {type_name(layer)} {layer!r}",
                              "write {name: ..., type: ..., ...}")
        if "type" not in layer or layer["type"] is None:
            raise ConfigError(join_path(path, "type"), "missing required key 'type'",
                              f"add type: one of {', '.join(LAYER_TYPES)}")
        ltype = layer["type"]
        if not isinstance(ltype, str) or ltype not in LAYER_TYPES:
            raise ConfigError(join_path(path, "type"), f"unknown layer type {ltype!r}",
                              did_you_mean(str(ltype), LAYER_TYPES, "types"))
        spec = LAYER_TYPES[ltype]
        keys = COMMON_LAYER_KEYS + spec.params
        names = [k.name for k in keys]
        accepted = names + [a for k in keys for a in k.aliases]
        for k in layer:
            if k not in accepted:
                owners = [t for t, lt in LAYER_TYPES.items() if any(p.name == k for p in lt.params)]
                hint = (f"{k!r} is a parameter of {', '.join(owners)}; {ltype} takes {', '.join(names)}"
                        if owners else did_you_mean(str(k), names, "keys"))
                raise ConfigError(join_path(path, str(k)), f"unknown key {str(k)!r} for a {ltype} layer",
                                  hint)
        section = Section(ltype, spec.doc, keys)
        out = section.check(layer, path)
        if "parents" not in out:
            out["parents"] = [previous]
            out = {k: out[k] for k in names if k in out}
        return out

    def describe(self):
        return "[layer]"


# --------------------------------------------------------------------------------------------------------
# the tree

_DEGREE_KEYS = tuple(Key(d, _POS, 1, f"split degree of dimension {d}") for d in DIMS)
DEGREES = Section("degrees", "split degree per tensor dimension; unset = 1", _DEGREE_KEYS)

SCHEMA = Section("spec", "an lbannpy run: model, data, training, parallelism and output", (
    Section("model", "the network", (
        Key("name", Str(), "model", "model name, used in logs and summaries"),
        Section("input", "shape of one input sample", (
            Key("channels", _POS, REQUIRED, "input channels"),
            Key("spatial", ListOf(_POS, 1, MAX_SPATIAL_DIMS), REQUIRED, "[H, W] or [D, H, W] (or [W])"),
        )),
        Key("layers", LayerList(), REQUIRED, "the layers; parents default to the previous layer"),
        Key("loss", Registered("loss", loss_specs), "cross_entropy",
            "cross_entropy (one label per sample), pixel_cross_entropy (one label per pixel), mse, l1 or "
            "bce_with_logits (float targets of the output's shape), dice (one label per output pixel)"),
        Key("init", Str(), UNSET, "initial weights: an lbannpy checkpoint or a safetensors file from "
                                  "python -m lbannpy.export (PyTorch names)"),
        Key("origin", MapOf(MapOf(Str())), UNSET,
            "where each layer's tensors came from: {layer: {weight|bias|scale|running_mean|...: state_dict "
            "key}}, written by python -m lbannpy.from_torch; export writes those keys back"),
    )),
    Section("data", "training and validation data (HDF5)", (
        Section("train", "the training set", (
            Key("path", Str(), REQUIRED, "HDF5 file with the samples"),
            Key("inputs", Str(), "inputs", "dataset of inputs, shape (N, C, *spatial)"),
            Key("labels", Str(), "labels", "dataset of labels: (N,) or, per pixel, (N, *spatial)"),
            Key("shuffle", Bool(), True, "a new sample order every epoch (seeded by trainer.seed)"),
        )),
        Section("validation", "the validation set: a file of its own or a fraction of the training set", (
            Key("path", Str(), UNSET, "HDF5 file with the same dataset names as train"),
            Key("fraction", Float(0.0, 1.0, True, True), UNSET, "share of training samples held out"),
        ), (OneOf(("path", "fraction"), required=True),), optional=True),
        Key("prefetch", Int(0), 2, "batches read ahead (a background thread; unused when preloaded)"),
        Key("preload", Str(PRELOAD_CHOICES), "auto",
            "keep each rank's part of the data in memory, read once at start (no reads while training): "
            f"always, never, or auto (when a rank's part is at most {PRELOAD_AUTO_BYTES >> 20} MiB)"),
    ), optional=True),
    Section("trainer", "the training loop", (
        Key("batch_size", _POS, 1, "global mini-batch size (samples per optimizer step)"),
        Key("epochs", _POS, UNSET, "passes over the training set"),
        Key("steps", _POS, UNSET, "optimizer steps in all"),
        Key("seed", Int(0), 0, "seed of initialization, shuffling and dropout"),
        Key("dtype", Str(("float32", "float64")), "float32", "floating-point type of tensors"),
        Key("eval_every", Int(0), 0, "validate every N steps; 0: at the end of every epoch"),
        Key("watchdog_s", Float(0.0), 600.0, "abort when one step takes longer (seconds); 0: off"),
    ), (OneOf(("epochs", "steps"), default=("epochs", 1)),)),
    Section("optimizer", "the optimizer", (
        Key("type", Str(("sgd", "adam")), "sgd", "sgd (with momentum) or adam"),
        Key("lr", Float(0.0, lo_open=True), 0.01, "learning rate", default_when=(("type", "adam", 1e-3),)),
        Key("momentum", Float(0.0, 1.0, hi_open=True), 0.0, "sgd momentum"),
        Key("nesterov", Bool(), False, "sgd with Nesterov momentum"),
        Key("weight_decay", Float(0.0), 0.0, "L2 penalty"),
        Key("betas", ListOf(Float(0.0, 1.0, hi_open=True), 2, 2), [0.9, 0.999], "adam decay rates"),
        Key("eps", Float(0.0, lo_open=True), 1e-8, "adam denominator term"),
        Key("shard_state", Bool(), False, "split the optimizer state of replicated parameters over their "
                                          "replicas (ZeRO stage 1): 1/g of it a rank, one more allgather a "
                                          "bucket and step; results unchanged"),
        Section("schedule", "learning-rate schedule", (
            Key("type", Str(("none", "step", "cosine")), "none", "none, step decay or cosine decay"),
            Key("warmup_steps", Int(0), 0, "linear warm-up steps"),
            Key("step_size", _POS, 1000, "steps between decays (step)"),
            Key("gamma", Float(0.0, 1.0, lo_open=True), 0.1, "decay factor (step)"),
        )),
    )),
    Section("parallel", "how tensors are split over ranks", (
        Section("default", "degrees of every layer without its own entry; unset = 1; ranks left free split "
                           "the samples when the batch divides, else replicate",
                _DEGREE_KEYS + (Key("r", _POS, UNSET, "replicas: ranks that hold copies instead of splitting "
                                                      "the samples (data-parallel groups stay r)"),)),
        Key("layers", MapOf(DEGREES), {}, "per-layer degrees {layer: {n, c, d, h, w}}; an entry replaces the "
                                          "default, its unset dimensions are 1"),
        Key("strategy", Str(("manual", "auto")), "manual", "manual: the degrees above; auto: run the "
                                                            "strategy selector at start-up"),
        Key("machine", Str(), "local",
            "machine model for strategy: auto, for runtime.kernels: auto's choice per conv shape and for "
            "ATen's host layout per conv shape (auto or aten; NCHW where it has none): local (this host: its "
            "python -m lbannpy.bench calibrate file, else a described CPU model), a preset name, or a file "
            "from python -m lbannpy.bench calibrate [--kernels MODEL ...]"),
        Key("memory_gib", Float(0.0, lo_open=True), None, "device (accelerator) memory per rank that "
                                                         "strategy: auto plans for (default: the machine "
                                                         "file's); host memory per rank: runtime.memory_gib"),
    )),
    Section("comm", "gradient communication", (
        Key("bucket_mb", Float(0.0, lo_open=True), 25.0, "gradient bucket size (MiB)"),
        Key("first_bucket_mb", Float(0.0, lo_open=True), 1.0, "size of the first bucket (MiB)"),
        Key("overlap", Bool(), True, "reduce gradients on a background thread during backprop (and compute "
                                     "a conv's interior while its halo exchange is in flight)"),
        Key("replicate_fc", Int(0), 0, "number of fc layers, from the first, whose gradients every rank "
                                       "computes for the whole batch from gathered inputs and errors "
                                       "instead of an allreduce (Lee et al. f)"),
        Section("chunks", "two-chunk mode (Lee et al. k)", (
            Key("k", Int(0), 0, "post the gradients of the last k layers (the first k of backprop) as one "
                                "chunk, the rest at the end; 0: buckets of bucket_mb instead"),
        )),
    )),
    Section("checkpoint", "checkpoints (written atomically)", (
        Key("dir", Str(), UNSET, "directory of checkpoints; default: ckpt/ in output.dir, so two runs with "
                                 "their own output directories never share one"),
        Key("keep", Int(0), 3, "keep the newest N complete checkpoints, delete older ones after each "
                               "write; 0: keep every one"),
        Key("every_steps", Int(0), 0, "write one every N steps; 0: only at the end"),
        Key("at_start", Bool(), False, "also write the step-0 checkpoint (the initial weights)"),
    )),
    Section("output", "what a run writes", (
        Key("dir", Str(), "run", "output directory (metrics.csv, summary.json, loss.png)"),
        Key("log_every", _POS, 1, "steps between metric rows"),
        Key("trace", Bool(), False, "write one Chrome-trace file per rank"),
    )),
    Section("runtime", "where it runs", (
        Key("backend", Str(("auto", "mpi", "single", "nccl")), "auto",
            "communication backend; auto: nccl on gpu under MPI, mpi under MPI, else single"),
        Key("device", Str(("cpu", "gpu")), "cpu", "array backend: NumPy (cpu) or CuPy (gpu)"),
        Key("share_gpu", Bool(), False,
            "gpu: allow more ranks on a node than GPUs (ranks share devices; for tests and small GPUs). "
            "Refused by default; NCCL cannot share a device, so use backend mpi (host-staged where MPI is "
            "not CUDA-aware)"),
        Key("kernels", Str(("auto", "own", "aten", "cudnn")), "auto",
            "convolution kernels: own (lbannpy's), aten (PyTorch's oneDNN/cuDNN through DLPack, zero-copy; "
            "a gpu step with them runs eagerly), cudnn (gpu: cuDNN through cuDNN Frontend on CuPy arrays, "
            "convolutions and batch-norm, planned once per layer shape, capturable in the step's CUDA "
            "graph; pip install nvidia-cudnn-frontend and the nvidia-cudnn-cuXX of your CUDA), auto: at "
            "each conv shape parallel.machine's calibration timed, the faster set there, elsewhere cudnn "
            "on a gpu where cuDNN Frontend and its library load, else aten where torch is installed (with "
            "CUDA on a gpu), else own"),
        Key("tf32", Bool(), False,
            "gpu, cudnn or ATen kernels: let cuDNN run float32 convolutions as TF32 (tensor cores, 10-bit "
            "mantissa products, on Ampere and later GPUs; PyTorch's own default is on). Off: float32 "
            "convolutions are float32, as the own kernels and the CPU compute them"),
        Key("cuda_graph", Switch(("auto", "on", "off")), "auto",
            "gpu: the training step as one CUDA graph, captured per input shape after warm-up steps and "
            "replayed (one launch a step); auto: where the run can be captured, else eager with one line "
            "naming what prevented it; on: refuse a run that cannot be captured, with that line; off: eager"),
        Key("threads", Int(0), 0, "BLAS/OpenMP threads per rank; 0: OMP_NUM_THREADS if set, else "
                                  "SLURM_CPUS_PER_TASK, else the node's cores / its ranks"),
        Key("memory_gib", Float(0.0, lo_open=True), UNSET,
            "host memory one rank may use (GiB): validate and the trainer's set-up refuse a run whose "
            "estimated peak per rank (model, batch buffers, sample ids) exceeds it; default: this machine's "
            "memory (or its cgroup limit when lower); give ranks sharing a node their share. Not "
            "parallel.memory_gib (the device memory strategy: auto plans for)"),
    )),
))


def normalize(spec) -> dict:
    """Check ``spec`` (a parsed YAML or HDF5 tree) against :data:`SCHEMA` and return its normal form."""
    return SCHEMA.check(spec, "")


def lookup(path: list[str]):
    """The schema node (Section, Key or MapOf value) at a path of section/key names, or None."""
    node: Any = SCHEMA
    for part in path:
        if isinstance(node, Key):
            node = node.type
        if isinstance(node, MapOf):
            node = node.value
            continue
        if not isinstance(node, Section):
            return None
        node = node.field(part)
        if node is None:
            return None
    return node


# --------------------------------------------------------------------------------------------------------
# documentation




def schema_text() -> str:
    """The schema as indented text: ``key: type = default  # doc``, then the layer registry."""
    lines = ["# lbannpy config schema (spec YAML and config.h5 hold this tree)", ""]

    def walk(sec: Section, indent: int):
        pad = "  " * indent
        for rule in sec.rules:
            lines.append(f"{pad}# {rule.describe()}")
        for k in sec.keys:
            if isinstance(k, Section):
                opt = " (optional section)" if k.optional else ""
                lines.append(f"{pad}{k.name}:{' ' * max(1, 38 - len(pad) - len(k.name))}# {k.doc}{opt}")
                walk(k, indent + 1)
            else:
                head = f"{pad}{k.name}: {k.type.describe()} = {k.default_text()}"
                lines.append(f"{head}{' ' * max(1, 40 - len(head))}# {k.doc}{_alias_text(k)}")

    walk(SCHEMA, 0)
    lines += ["", "# layer types (model.layers[i]); every layer also takes:"]
    for k in COMMON_LAYER_KEYS:
        lines.append(f"#   {k.name}: {k.type.describe()} = {k.default_text()}  # {k.doc}")
    for t in LAYER_TYPES.values():
        arity = (f"{t.min_parents}" if t.min_parents == t.max_parents
                 else f">= {t.min_parents}" if t.max_parents is None else f"{t.min_parents}..{t.max_parents}")
        lines.append(f"{t.name}:{' ' * max(1, 38 - len(t.name))}# {t.doc}; parents: {arity}")
        for k in t.params:
            head = f"  {k.name}: {k.type.describe()} = {k.default_text()}"
            lines.append(f"{head}{' ' * max(1, 40 - len(head))}# {k.doc}{_alias_text(k)}")
    return "\n".join(lines) + "\n"


def _alias_text(k: Key) -> str:
    return f" (also spelled {', '.join(k.aliases)})" if k.aliases else ""


__all__ = ["SCHEMA", "LAYER_TYPES", "COMMON_LAYER_KEYS", "INPUT_NAME", "INPUT_NAMES", "NAME_RE", "DIMS",
           "LayerType", "LayerList", "layer_types", "layer_type", "layer_params", "normalize", "lookup",
           "schema_text"]
