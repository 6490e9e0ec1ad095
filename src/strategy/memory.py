"""Peak host memory of one rank of a run, estimated before anything is allocated.

The model's part is the cost model's own accounting (:func:`lbannpy.strategy.planner.strategy_memory`:
Σ persistent bytes of every layer — outputs kept for backprop, gathered inputs, weights, gradients,
optimizer state — plus the largest transient bytes — error signals, halo buffers), under the
distributions the run will use: ``parallel.default`` and ``parallel.layers`` as the trainer applies them,
or the planner's choice for ``strategy: auto``. The data's part is what the reader holds: the prefetched
blocks of the mini-batch (depth queued + one in use + one being read) or, preloaded (``data.preload``), its
box of every sample and one block, one block of the validation reader,
and the sample ids (``indices``, an epoch's permutation and its order: three int64 arrays of the training
samples) and the class labels it reads whole. A constant covers the process itself (:data:`RUNTIME_BYTES`).

Every size here comes from the config or from a file's metadata (shapes and dtypes, nothing read), and the
arithmetic is on Python integers, so a ``filters: 2**62`` or a file declaring 10^10 samples gives an
exact, huge estimate rather than an overflow or a MemoryError.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from ..data.dataset import preloads, store_bytes
from .cost import max_local_shape
from ..hostmem import host_memory_bytes
from ..machine import load_machine
from .graph import build_graph
from .planner import strategy_memory
from lbannpy.layers.registry import ALL_DIMS, INPUT_NAMES, layer_spec
from lbannpy.model import effective_default, layer_dist

GIB = 1024 ** 3
# the process itself: interpreter, NumPy, h5py, MPI and plotting libraries (a tiny run's peak resident set,
# bench memory reproduces it)
RUNTIME_BYTES = 96 * 2 ** 20
# PyTorch's libraries and oneDNN's first workspaces, when the ATen kernels run (bench memory reproduces it)
ATEN_BYTES = 224 * 2 ** 20
INDEX_ARRAYS = 3  # indices, the epoch's permutation and the permuted order (int64 each)
def gib(nbytes: float) -> str:
    """Bytes as GiB, three significant digits (``2.5e+13 GiB`` for absurd sizes)."""
    return f"{nbytes / GIB:.3g} GiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes of one rank, by part."""

    ranks: int
    model_bytes: int  # the cost model: activations, weights, gradients, optimizer state, transients
    batch_bytes: int  # the readers' blocks of the mini-batch (prefetch queue included)
    index_bytes: int  # sample ids and class labels of every reader
    strategy: str  # where the distributions came from
    runtime_bytes: int = RUNTIME_BYTES  # the process before any of the above

    @property
    def total_bytes(self) -> int:
        return self.runtime_bytes + self.model_bytes + self.batch_bytes + self.index_bytes

    def as_dict(self) -> dict:
        return {"peak_bytes": self.total_bytes, "model_bytes": self.model_bytes,
                "batch_bytes": self.batch_bytes, "index_bytes": self.index_bytes,
                "runtime_bytes": self.runtime_bytes, "ranks": self.ranks}

    def text(self) -> str:
        return (f"peak {gib(self.total_bytes)} per rank on {self.ranks} rank(s) (model "
                f"{gib(self.model_bytes)}, batch buffers {gib(self.batch_bytes)}, sample ids and labels "
                f"{gib(self.index_bytes)}, runtime {gib(self.runtime_bytes)}; {self.strategy})")


def memory_limit(cfg: dict) -> tuple[int, str]:
    """``runtime.memory_gib`` in bytes and where it came from (the key, or this machine's memory)."""
    given = (cfg.get("runtime") or {}).get("memory_gib")
    if given is not None:
        return int(float(given) * GIB), f"runtime.memory_gib {gib(float(given) * GIB)}"
    return host_memory_bytes(), f"this machine's memory {gib(host_memory_bytes())} (runtime.memory_gib unset)"


def manual_dists(graph, cfg: dict, ranks: int):
    """The input's and every layer's output distribution as :class:`lbannpy.model.Model` builds them from
    ``parallel`` (the free ranks to the samples, per-layer entries replacing the default)."""
    par = cfg.get("parallel") or {}
    batch = int(graph.input_shape[0])
    default, _ = effective_default(par.get("default") or {}, ranks, batch)
    overrides = par.get("layers") or {}
    in_override = next((overrides[n] for n in INPUT_NAMES if n in overrides), None)
    input_dist = layer_dist("input", ALL_DIMS, len(graph.input_shape), ranks, default, in_override)
    dists = {n.name: layer_dist(n.type, layer_spec(n.type).split_dims, len(n.out_shape), ranks, default,
                                overrides.get(n.name)) for n in graph}
    return input_dist, dists


@dataclass(frozen=True)
class DataSizes:
    """What the reader allocates from, read from a data file's metadata."""

    num_samples: int
    input_itemsize: int
    label_shape: tuple[int, ...]  # per sample: () for class labels
    label_itemsize: int


def data_sizes(path: str, inputs: str, labels: str) -> DataSizes:
    import h5py

    with h5py.File(path, "r") as f:
        x, y = f[inputs], f[labels]
        return DataSizes(int(x.shape[0]), x.dtype.itemsize, tuple(int(s) for s in y.shape[1:]),
                         y.dtype.itemsize)


def data_memory(cfg: dict, input_shape, input_dist, base_dir: str | None = None) -> tuple[int, int]:
    """(batch buffer bytes, sample-id and label bytes) of one rank's readers; (0, 0) without data."""
    data = cfg.get("data")
    if not data:
        return 0, 0

    def full(p):
        return p if os.path.isabs(p) or base_dir is None else os.path.join(base_dir, p)

    train, val = data["train"], data.get("validation") or {}
    local = max_local_shape(input_shape, input_dist)
    depth = int(data.get("prefetch", 2))
    files = [(full(train["path"]), depth + 2 if depth > 0 else 1)]  # depth queued + one in use + one read
    if val.get("path"):
        files.append((full(val["path"]), 1))
    batch = index = 0
    mode = data.get("preload", "auto")
    for i, (path, blocks) in enumerate(files):
        s = data_sizes(path, train["inputs"], train["labels"])
        label_local = (local[0],) + tuple(-(-e // p) for e, p in zip(s.label_shape, input_dist.parts[2:]))
        block = math.prod(local) * s.input_itemsize + math.prod(label_local) * s.label_itemsize
        # a preloaded reader holds its box of every sample (the readers of a held-out fraction share them)
        store = store_bytes(s.num_samples, local[1:], s.input_itemsize, label_local[1:], s.label_itemsize)
        if preloads(mode, store):
            blocks = 1
            batch += store
        batch += block * blocks
        readers = 2 if i == 0 and val.get("fraction") else 1  # a held-out fraction: a 2nd reader of the file
        index += INDEX_ARRAYS * 8 * s.num_samples
        if not s.label_shape:  # class labels are read whole by every reader of the file
            index += readers * s.num_samples * s.label_itemsize
        if readers == 2:
            batch += block
    return batch, index


def estimate(cfg: dict, ranks: int, graph=None, data: bool = True, base_dir: str | None = None,
             dists=None, strategy: str = "") -> MemoryEstimate:
    """The :class:`MemoryEstimate` of a validated config on ``ranks`` ranks (``dists``: the layers'
    distributions, default the manual ones from ``parallel``)."""
    if graph is None:
        graph = build_graph(cfg["model"], int(cfg["trainer"]["batch_size"]))
    input_dist, manual = manual_dists(graph, cfg, ranks)
    dists = dists or manual
    dtype_bytes = 8 if cfg["trainer"].get("dtype") == "float64" else 4
    machine = replace(load_machine(), dtype_bytes=dtype_bytes)
    optimizer = str((cfg.get("optimizer") or {}).get("type", "sgd"))
    model = strategy_memory(graph, dists, machine, optimizer)
    batch, index = data_memory(cfg, graph.input_shape, input_dist, base_dir) if data else (0, 0)
    runtime = RUNTIME_BYTES + (ATEN_BYTES if _uses_aten(cfg) else 0)
    return MemoryEstimate(ranks, model, batch, index, strategy or "parallel as written", runtime)


def _uses_aten(cfg: dict) -> bool:
    """Whether the run will load torch for its kernels (``runtime.kernels``: aten, or auto with torch
    installed and, on a GPU, assumed to see one); decided without importing torch."""
    import importlib.util

    kernels = (cfg.get("runtime") or {}).get("kernels", "auto")
    return kernels == "aten" or (kernels == "auto" and importlib.util.find_spec("torch") is not None)


def refusal(est: MemoryEstimate, cfg: dict) -> str | None:
    """The one-line message when ``est`` exceeds the limit, else None."""
    limit, source = memory_limit(cfg)
    if limit <= 0 or est.total_bytes <= limit:
        return None
    return f"the run needs {est.text()}, over the limit of {source}"


REFUSAL_HINT = ("use more ranks (or split the samples/spatial dimensions), a smaller batch or model, fewer "
                "or smaller data samples, or raise runtime.memory_gib if this machine really has the memory")
