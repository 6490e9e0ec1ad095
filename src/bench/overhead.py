"""``python -m lbannpy.bench overhead``: the fixed (Python) cost of a layer in a training step.

Each layer type runs as a chain of ``k`` layers on a tiny input (1 sample, 4 channels, 4x4), where the
arithmetic is negligible, on one rank: forward and backward through :class:`lbannpy.model.Model`, as the
trainer steps. The cost per layer is the slope between a chain of 1 and a chain of ``k``
(``(t_k - t_1) / (k - 1)``, both timed in every round, the median over rounds), so the model's own
per-step cost is not charged to the layers. A batch-norm followed by a ReLU is one pair (fused by the
model when nothing else reads the batch-norm). The step line is a whole model's forward and backward
(mesh_tiny at 16², batch 1, float32) and its time per layer, where the arithmetic of its convolutions is
included.

Times are medians over rounds of ``steps`` steps; per layer in microseconds, against the target.

``--device gpu`` runs the chains on the GPU (CuPy arrays, one device, the conv kernel set of ``--kernels``)
and prints the host time per layer of each pass, forward and backward apart, against
:data:`GPU_TARGET_US`: the time the step's thread spends issuing a layer (Python, DLPack and stream
wrapping, kernel launches). The device is synchronised after every step, outside the timed passes, so a
full launch queue never makes the host wait for kernels it timed. Without a GPU (CuPy, a CUDA device and
a CUDA build of PyTorch) it prints one line saying why and exits 0.
"""
from __future__ import annotations

from lbannpy.bench import describe

import argparse
import sys
import time

import numpy as np

TARGET_US = 60.0
GPU_TARGET_US = 20.0   # host microseconds per layer and pass on a GPU

# layer type -> the layers of one link of the chain (names are made unique per link)
LINKS: dict[str, tuple[dict, ...]] = {
    "conv": ({"type": "conv", "filters": 4, "kernel": 3, "padding": 1},),
    "pool": ({"type": "pool", "mode": "avg", "kernel": 3, "stride": 1, "padding": 1},),
    "batchnorm": ({"type": "batchnorm"},),
    "relu": ({"type": "relu"},),
    "batchnorm+relu": ({"type": "batchnorm"}, {"type": "relu"}),
    "sum": ({"type": "sum", "parents": ["@prev", "@prev2"]},),
}


def _chain(kind: str, k: int) -> list[dict]:
    layers, names = [], ["x", "x"]
    for i in range(k):
        for j, proto in enumerate(LINKS[kind]):
            spec = {key: v for key, v in proto.items() if key != "parents"}
            spec["name"] = f"l{i}_{j}"
            if "parents" in proto:
                spec["parents"] = [names[-1] if p == "@prev" else names[-2] for p in proto["parents"]]
            names.append(spec["name"])
            layers.append(spec)
    return layers


KERNELS = ["own"]  # the conv kernel set (--kernels); own: the framework's cost, not torch's per-call cost


def _stepper(model_spec: dict, batch: int, fuse: bool):
    """A closure running one forward and backward of the model (float32, one rank), and its layer count."""
    step, nlayers = _pass_stepper(model_spec, batch, fuse, "cpu")

    def whole():
        step()
    return whole, nlayers


def _pass_stepper(model_spec: dict, batch: int, fuse: bool, device: str):
    """A closure running one forward and backward of the model (float32, one rank, on ``device``) that
    returns the host seconds of each pass ``(forward, backward)``, and the model's layer count. On a GPU
    the stream is synchronised after the backward, outside both timed passes."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.comm import SingleCommunicator
    from lbannpy.layers.context import LayerContext
    from lbannpy.layers.kernels.select import conv_kernels, gpu_math
    from lbannpy.model import Model
    from lbannpy.tensor import DistTensor

    if device == "gpu":
        import cupy as xp

        sync = xp.cuda.get_current_stream().synchronize
        gpu_math(KERNELS[0], device, False)  # float32 convolutions in float32, as runtime.tf32: false
    else:
        xp, sync = np, None
    ctx = LayerContext(SingleCommunicator(), xp, "float32", seed=0, fuse=fuse)
    ctx.conv_kernels = conv_kernels(KERNELS[0], device)
    model = Model(model_spec, batch, ctx, {})
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(model.input_shape).astype(np.float32))
    out = model.output
    dy = DistTensor(xp.asarray(rng.standard_normal(out.out_shape).astype(np.float32)), out.out_shape,
                    out.out_dist, 0)
    clock = time.perf_counter

    def step():
        t0 = clock()
        model.forward(DistTensor(x, model.input_shape, model.input_dist, 0))
        t1 = clock()
        model.backward(dy, input_grad=False)
        t2 = clock()
        if sync is not None:
            sync()
        return t1 - t0, t2 - t1
    return step, len(model.layers)


def _round(step, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def _time(step, steps: int, rounds: int) -> float:
    """Median seconds per step over ``rounds`` rounds of ``steps`` steps (after a warm-up round)."""
    for _ in range(max(steps // 4, 2)):
        step()
    return float(np.median([_round(step, steps) for _ in range(rounds)]))


def per_layer_us(kind: str, k: int, steps: int, rounds: int, fuse: bool = True) -> float:
    """Fixed cost of one layer (one link) of ``kind`` in microseconds per step, forward and backward: the
    median over rounds of the slope between the two chains, timed one after the other in each round (a
    machine whose speed drifts slows both alike)."""
    pair = []
    for n in (1, k):
        spec = {"input": {"channels": 4, "spatial": [4, 4]}, "layers": _chain(kind, n)}
        step, _ = _stepper(spec, 1, fuse)
        for _ in range(max(steps // 4, 2)):
            step()
        pair.append(step)
    slopes = []
    for _ in range(rounds):
        t1, tk = _round(pair[0], steps), _round(pair[1], steps)
        slopes.append((tk - t1) / (k - 1))
    return float(np.median(slopes)) * 1e6


def model_step(zoo: str, size: int, batch: int, steps: int, rounds: int, fuse: bool = True):
    """``(seconds per forward + backward, number of layers)`` of a zoo model."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.zoo import get_spec

    spec = get_spec(zoo, batch_size=batch, input_size=size)
    step, nlayers = _stepper(spec["model"], batch, fuse)
    return _time(step, steps, rounds), nlayers


def _round_passes(step, steps: int) -> np.ndarray:
    """Mean host seconds per step of each pass ``[forward, backward]`` over ``steps`` steps."""
    total = np.zeros(2)
    for _ in range(steps):
        total += step()
    return total / steps


def per_layer_pass_us(kind: str, k: int, steps: int, rounds: int, fuse: bool, device: str) -> np.ndarray:
    """Host microseconds of one layer (one link) of ``kind`` per pass ``[forward, backward]`` on
    ``device``: the median over rounds of the slope between a chain of 1 and a chain of ``k``."""
    pair = []
    for n in (1, k):
        spec = {"input": {"channels": 4, "spatial": [4, 4]}, "layers": _chain(kind, n)}
        step, _ = _pass_stepper(spec, 1, fuse, device)
        for _ in range(max(steps // 4, 2)):
            step()
        pair.append(step)
    slopes = []
    for _ in range(rounds):
        t1, tk = _round_passes(pair[0], steps), _round_passes(pair[1], steps)
        slopes.append((tk - t1) / (k - 1))
    return np.median(np.array(slopes), axis=0) * 1e6


def report_gpu(kinds, k: int, steps: int, rounds: int, fuse: bool, zoo: str, size: int) -> list[str]:
    """The GPU table: host time per layer and pass (see the module's docstring)."""
    import cupy

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels.select import conv_kernels

    dev = cupy.cuda.Device().id
    props = getattr(cupy.cuda.runtime, "getDeviceProperties", None)  # absent from the test suite's stand-in
    name = props(dev)["name"] if props is not None else f"device {dev}"
    name = name.decode() if isinstance(name, bytes) else str(name)
    lines = [f"host time per layer and pass on the GPU ({name}), 1 rank, float32, input 1x4x4x4, chains of 1 "
             f"and {k} (target {GPU_TARGET_US:.0f} us per layer and pass{'' if fuse else ', fusion off'}; "
             f"conv kernels {conv_kernels(KERNELS[0], 'gpu').name})",
             f"{'layer':<16} {'forward':>9} {'backward':>9}  target"]
    for kind in kinds:
        fwd, bwd = per_layer_pass_us(kind, k, steps, rounds, fuse, "gpu")
        per = 2 if kind == "batchnorm+relu" else 1
        ok = max(fwd, bwd) / per <= GPU_TARGET_US
        note = f" (a pair: {fwd / 2:.1f} / {bwd / 2:.1f} us per layer)" if per == 2 else ""
        lines.append(f"{kind:<16} {fwd:>9.1f} {bwd:>9.1f}  {'ok' if ok else 'over'}{note}")
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.zoo import get_spec

    spec = get_spec(zoo, batch_size=1, input_size=size)
    step, nlayers = _pass_stepper(spec["model"], 1, fuse, "gpu")
    for _ in range(max(steps // 4, 2)):
        step()
    fwd, bwd = np.median([_round_passes(step, steps) for _ in range(rounds)], axis=0)
    lines.append(f"step: {zoo} {size}x{size} batch 1: host {fwd * 1e3:.3f} ms forward, {bwd * 1e3:.3f} ms "
                 f"backward, {nlayers} layers, {fwd * 1e6 / nlayers:.1f} / {bwd * 1e6 / nlayers:.1f} us per "
                 f"layer")
    return lines


def report(kinds, k: int, steps: int, rounds: int, fuse: bool, zoo: str, size: int) -> list[str]:
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels.select import conv_kernels

    lines = [f"per-layer fixed cost, forward + backward, 1 rank, float32, input 1x4x4x4, chains of 1 and {k} "
             f"(target {TARGET_US:.0f} us per layer{'' if fuse else ', fusion off'}; conv kernels "
             f"{conv_kernels(KERNELS[0]).name})",
             f"{'layer':<16} {'us/layer':>9}  target"]
    for kind in kinds:
        us = per_layer_us(kind, k, steps, rounds, fuse)
        pair = kind == "batchnorm+relu"
        per = us / 2 if pair else us
        note = f" (a pair: {per:.1f} us per layer)" if pair else ""
        lines.append(f"{kind:<16} {us:>9.1f}  {'ok' if per <= TARGET_US else 'over'}{note}")
    t, nlayers = model_step(zoo, size, 1, steps, rounds, fuse)
    lines.append(f"step: {zoo} {size}x{size} batch 1: {t * 1e3:.3f} ms forward + backward, {nlayers} layers, "
                 f"{t * 1e6 / nlayers:.1f} us per layer (arithmetic included)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lbannpy.bench overhead", description=describe(__doc__))
    ap.add_argument("--quick", action="store_true", help="few steps (a format check, not a timing)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round (default 200)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    ap.add_argument("--chain", type=int, default=9, help="layers in the long chain (default 9)")
    ap.add_argument("--kinds", default=",".join(LINKS),
                    help="comma-separated layer types (default: %(default)s)")
    ap.add_argument("--no-fuse", action="store_true", help="every layer on its own (no fusion)")
    ap.add_argument("--model", default="mesh_tiny", help="zoo model of the step line (default mesh_tiny)")
    ap.add_argument("--size", type=int, default=16, help="its input size (default 16)")
    ap.add_argument("--kernels", choices=("auto", "own", "aten", "cudnn"), default="own",
                    help="conv kernel set, as runtime.kernels (default own: lbannpy's fixed cost; ATen adds "
                         "torch's own per-call cost, about 15-30 us per convolution call at these sizes; "
                         "cudnn: cuDNN Frontend's, with --device gpu)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                    help="gpu: the host time per layer and pass on this node's GPU (CuPy; exits 0 with one "
                         "line where there is none)")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    KERNELS[0] = args.kernels
    if args.kernels == "cudnn" and args.device != "gpu":
        print("overhead: --kernels cudnn runs on a GPU only; add --device gpu", file=sys.stderr)
        return 2
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in LINKS]
    if unknown:
        print(f"overhead: unknown layer type(s) {unknown}; choose from {sorted(LINKS)}", file=sys.stderr)
        return 2
    if args.chain < 2:
        print("overhead: --chain must be at least 2", file=sys.stderr)
        return 2
    steps, rounds = (10, 1) if args.quick else (args.steps, args.rounds)
    chain = 3 if args.quick else args.chain
    table = report
    if args.device == "gpu":
        # late: loaded when the command runs, so its --help and argument errors come without it
        from .layers import gpu_missing

        why = gpu_missing()
        if why:
            print(f"bench overhead --device gpu: skipped, {why}")
            return 0
        # late: loaded when the command runs, so its --help and argument errors come without it
        from lbannpy.layers.kernels.select import KernelChoiceError, conv_kernels
        try:
            conv_kernels(args.kernels, "gpu")
        except KernelChoiceError as exc:  # cudnn asked for where cuDNN Frontend is not installed
            print(f"overhead: {exc}", file=sys.stderr)
            return 2
        table = report_gpu
    for line in table(kinds, chain, steps, rounds, not args.no_fuse, args.model, args.size):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
