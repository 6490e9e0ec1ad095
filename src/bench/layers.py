"""``python -m lbannpy.bench layers``: forward+backward time of our local conv, pooling and batch-norm kernels
next to PyTorch CPU's, at one thread, on the mesh model's layer shapes.

Both sides get the same inputs and are timed interleaved (the order rotates every repeat) so that load from
other processes hits them alike; each number is the median of the repeats after one warm-up call (short
calls get more repeats, about ``MIN_TIMED_S`` of calls per contender, for a steadier median). PyTorch
runs in NCHW and in channels-last (inputs, filters and ``dy`` converted before timing); the faster one is
the reference. Our conv runs on the compiled kernels where they are built (``--conv-kernel numpy`` times
the NumPy fallback instead), with the buffers the Conv layer uses where it reads the model input (the
mesh model's 18-channel layers): its window and the window gradient workspace are allocated once and
reused, its output and input gradient are fresh arrays on every call (PyTorch allocates everything on
every call). Threads: the process re-executes itself with
``OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1`` before NumPy is imported (OpenBLAS reads them
at load), and calls ``torch.set_num_threads(1)``.

The layer types of the U-Net/ResNet family (transposed convolution, upsampling, instance/group/layer norm,
the activations, PReLU, softmax, multiply, the padding modes, global pooling, circular convolution) have
rows of their own (``--new`` runs only those): each is the registered layer itself, built on one rank and
called as a model calls it (forward, then backward with input and parameter gradients; convolutions on
the kernel set a run takes by default, ``runtime.kernels: auto``, unless ``--kernels`` says), against the
``torch.nn.functional`` op a PyTorch module runs for it, autograd forward and backward, NCHW and
channels-last as above. A type the registry does not know yet is skipped with a line saying so.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from .layer_shapes import CONV_OPS, MODEL_RUNS, QUICK_RUNS, LayerShape, conv_set_ops, model_shapes, time_pair  # noqa: F401
from .layers_new import NEW_KERNELS, run_new
from .timing import MAX_REPEATS, MIN_TIMED_S, measure_fns

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
TARGET_CONV_RATIO = 1.5
TARGET_MODEL_CONV_RATIO = 1.2  # --models: every conv shape and op


def _one_thread_or_reexec(argv) -> None:
    """Re-execute this benchmark with single-threaded BLAS unless the environment already asks for it."""
    if all(os.environ.get(v) == "1" for v in _THREAD_VARS):
        return
    env = dict(os.environ, **{v: "1" for v in _THREAD_VARS})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "lbannpy.bench.layers", *argv], env)


@dataclass(frozen=True)
class BenchCase:
    kind: str  # conv | maxpool | batchnorm
    batch: int
    channels: int
    size: int  # square images, size x size
    filters: int = 0
    kernel: int = 3
    stride: int = 1

    @property
    def id(self) -> str:
        shape = f"{self.batch}x{self.channels}x{self.size}x{self.size}"
        if self.kind == "conv":
            return f"conv {shape} ->{self.filters} k{self.kernel} s{self.stride}"
        if self.kind == "maxpool":
            return f"maxpool {shape} k{self.kernel} s{self.stride}"
        return f"batchnorm {shape}"


def default_cases(full: bool) -> list[BenchCase]:
    cases = [BenchCase("conv", 1, 18, 256, 16), BenchCase("conv", 4, 18, 256, 16),
             BenchCase("conv", 1, 18, 256, 32), BenchCase("conv", 1, 18, 256, 64),
             BenchCase("conv", 1, 18, 1024, 16),
             BenchCase("conv", 1, 18, 256, 16, stride=2), BenchCase("conv", 4, 18, 256, 32, stride=2),
             BenchCase("conv", 1, 18, 1024, 32, stride=2)]
    if full:
        cases += [BenchCase("conv", 4, 18, 1024, 16), BenchCase("conv", 1, 18, 1024, 64),
                  BenchCase("conv", 1, 18, 1024, 64, stride=2)]
    for n, size in ((1, 256), (4, 256), (1, 1024)):
        cases.append(BenchCase("maxpool", n, 16, size, kernel=2, stride=2))
    for n, size in ((1, 256), (4, 256), (1, 1024)):
        cases.append(BenchCase("batchnorm", n, 16, size))
    return cases


def _contenders(case: BenchCase, dtype, device: str = "cpu"):
    """``{name: zero-argument callable}`` doing forward + backward, all on the same inputs. ``device='gpu'``:
    ours on CuPy arrays, PyTorch on CUDA tensors; each call ends with a device synchronisation so that the
    wall time is the time of the work, not of its launch."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    host = rng.standard_normal((case.batch, case.channels, case.size, case.size)).astype(dtype)
    xp, tdev, done = _device(device)

    def tt(a):
        """A torch tensor on the benchmark's device from a host array."""
        return torch.from_numpy(a).to(tdev)

    pair = {"conv": _conv_pair, "maxpool": _maxpool_pair}.get(case.kind, _batchnorm_pair)
    ours, torch_fn = pair(case, dtype, rng, host, xp, tt, done)
    return {"ours": ours, "torch NCHW": torch_fn(torch.contiguous_format),
            "torch NHWC": torch_fn(torch.channels_last)}


def _device(device: str):
    """``(xp, torch device, done)``: the array module, PyTorch's device, and the call that waits for both
    (a no-op on the CPU)."""
    import numpy as np
    import torch

    if device == "gpu":
        import cupy

        def done():
            cupy.cuda.get_current_stream().synchronize()
            torch.cuda.synchronize()
        return cupy, torch.device("cuda"), done
    return np, torch.device("cpu"), lambda: None


def _conv_pair(case: BenchCase, dtype, rng, host, xp, tt, done):
    import torch
    import torch.nn.functional as F

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers import kernels as K

    x = xp.asarray(host)
    w_h = rng.standard_normal((case.filters, case.channels, case.kernel, case.kernel)) * 0.1
    w_h = w_h.astype(dtype)
    b_h = rng.standard_normal(case.filters).astype(dtype)
    pad, s = case.kernel // 2, case.stride
    y_shape = K.conv_forward(K.pad_spatial(host[:1], pad), w_h, b_h, s).shape[1:]
    dy_h = rng.standard_normal((case.batch,) + y_shape).astype(dtype)
    w, b, dy = xp.asarray(w_h), xp.asarray(b_h), xp.asarray(dy_h)

    # buffers as the Conv layer has them where it reads the model input, as these 18-channel mesh
    # layers do: its window (kept from step to step there) and the window gradient (a workspace
    # shared by all layers) are allocated once; the output and the input gradient are fresh arrays
    window = xp.empty((case.batch, case.channels) + tuple(n + 2 * pad for n in x.shape[2:]), dtype)
    dwindow = xp.empty_like(window)

    def ours():
        xw = K.pad_spatial(x, pad, out=window)
        K.conv_forward(xw, w, b, s)
        dxw = K.conv_backward_data(dy, w, xw.shape, s, out=dwindow)
        xp.ascontiguousarray(K.crop_spatial(dxw, pad))
        K.conv_backward_filter(xw, dy, w.shape, s)
        K.conv_backward_bias(dy)
        done()

    def torch_fn(fmt):
        xt = tt(host).contiguous(memory_format=fmt).requires_grad_()
        wt = tt(w_h).contiguous(memory_format=fmt).requires_grad_()
        bt = tt(b_h).requires_grad_()
        dyt = tt(dy_h).contiguous(memory_format=fmt)

        def run():
            yt = F.conv2d(xt, wt, bt, s, pad)
            torch.autograd.grad(yt, (xt, wt, bt), dyt)
            done()
        return run
    return ours, torch_fn


def _maxpool_pair(case: BenchCase, dtype, rng, host, xp, tt, done):
    import torch
    import torch.nn.functional as F

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers import kernels as K

    x = xp.asarray(host)
    k, s = case.kernel, case.stride
    y_shape = K.max_pool_forward(host[:1], k, s)[0].shape[1:]
    dy_h = rng.standard_normal((case.batch,) + y_shape).astype(dtype)
    dy = xp.asarray(dy_h)

    def ours():
        _, arg = K.max_pool_forward(x, k, s)
        K.max_pool_backward(dy, arg, x.shape, k, s)
        done()

    def torch_fn(fmt):
        xt = tt(host).contiguous(memory_format=fmt).requires_grad_()
        dyt = tt(dy_h).contiguous(memory_format=fmt)

        def run():
            torch.autograd.grad(F.max_pool2d(xt, k, s), (xt,), dyt)
            done()
        return run
    return ours, torch_fn


def _batchnorm_pair(case: BenchCase, dtype, rng, host, xp, tt, done):
    import torch
    import torch.nn.functional as F

    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers import kernels as K

    x = xp.asarray(host)
    gamma_h = rng.standard_normal(case.channels).astype(dtype)
    beta_h = rng.standard_normal(case.channels).astype(dtype)
    dy_h = rng.standard_normal(x.shape).astype(dtype)
    gamma, beta, dy = xp.asarray(gamma_h), xp.asarray(beta_h), xp.asarray(dy_h)
    eps = 1e-5

    def ours():
        total, total_sq, count = K.bn_local_stats(x)
        mean, var = K.bn_mean_var(total, total_sq, count)
        K.bn_forward(x, mean, var, gamma, beta, eps)
        sum_dy, sum_dy_xhat = K.bn_backward(dy, x, mean, var, gamma, eps)
        K.bn_backward_data(dy, x, mean, var, gamma, eps, sum_dy, sum_dy_xhat, count)
        done()

    def torch_fn(fmt):
        xt = tt(host).contiguous(memory_format=fmt).requires_grad_()
        gt, bt = tt(gamma_h).requires_grad_(), tt(beta_h).requires_grad_()
        dyt = tt(dy_h).contiguous(memory_format=fmt)

        def run():
            yt = F.batch_norm(xt, None, None, gt, bt, training=True, eps=eps)
            torch.autograd.grad(yt, (xt, gt, bt), dyt)
            done()
        return run
    return ours, torch_fn


# --------------------------------------------------------------------------------------------------------
# the new layer types: the registered layer against its torch.nn.functional op


def measure(case: BenchCase, dtype, repeats: int, adaptive: bool = True,
            device: str = "cpu") -> dict[str, float]:
    """Median seconds per forward+backward of every contender, timed interleaved: at least ``repeats``
    rounds, more for short calls (about ``MIN_TIMED_S`` of calls per contender, at most ``MAX_REPEATS``)."""
    return measure_fns(_contenders(case, dtype, device), repeats, adaptive)


def gpu_missing() -> str:
    """Why the GPU comparison cannot run here ('' when it can): it needs CuPy, a CUDA device and a PyTorch
    built with CUDA."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:  # ImportError, or CUDA's error when there is no driver
        return f"no CuPy GPU ({type(exc).__name__}: {exc})"
    import torch

    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} has no CUDA device"
    return ""


# --------------------------------------------------------------------------------------------------------
# --models: every distinct conv and batch-norm shape of the zoo models, as they train

KERNELS = ["own"]  # the conv kernel set of --models (--kernels)


def _model_conv_ops(shape: LayerShape, dtype):
    """``{op: (ours, torch)}``: zero-argument callables of the forward, the data and the filter gradient, ours
    from the kernel set of ``--kernels``."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels.select import conv_kernels

    import torch
    import torch.nn.functional as F

    ours, (x, w, b, dy) = conv_set_ops(shape, dtype, conv_kernels(KERNELS[0]))
    s, d = shape.stride, shape.dilation
    xt, wt, bt, dyt = (torch.from_numpy(a) for a in (x, w, b, dy))
    conv_bwd = torch.ops.aten.convolution_backward

    def t_bwd(mask):
        return lambda: conv_bwd(dyt, xt, wt, [shape.filters], list(s), list(shape.pad), list(d), False,
                                [0, 0], 1, mask)
    return {
        "forward": (ours["forward"], lambda: F.conv2d(xt, wt, bt, s, shape.pad, d)),
        "data grad": (ours["data grad"], t_bwd([True, False, False])),
        "filter grad": (ours["filter grad"], t_bwd([False, True, True])),
    }


def _model_bn_ops(shape: LayerShape, dtype):
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    case = BenchCase("batchnorm", shape.x_shape[0], shape.x_shape[1], shape.x_shape[2])
    host = rng.standard_normal(shape.x_shape).astype(dtype)
    ours, torch_fn = _batchnorm_pair(case, dtype, rng, host, np, torch.from_numpy, lambda: None)
    return {"fwd+bwd": (ours, torch_fn(torch.contiguous_format))}


def run_models(dtype, repeats: int, quick: bool, max_size: int = 0, only: str | None = None) -> int:
    """The ``--models`` table: one row per shape and op, then per kind the geometric mean and worst ratio."""
    import numpy as np

    shapes = model_shapes(QUICK_RUNS if quick else MODEL_RUNS, max_size)
    if only:
        shapes = [(m, s) for m, s in shapes if s.kind == only]
    n_conv = sum(s.kind == "conv" for _, s in shapes)
    runs = ", ".join(f"{m} {sz}^2 batch {b}" for m, sz, b in (QUICK_RUNS if quick else MODEL_RUNS)
                     if not max_size or sz <= max_size)
    print(f"zoo model layer shapes: {n_conv} conv, {len(shapes) - n_conv} batchnorm (runs: {runs})")
    head = f"{'model':<20} {'shape':<42} {'op':<12} {'ours ms':>10} {'torch ms':>10} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    ratios: dict[str, list[tuple[float, str]]] = {}
    for model, shape in shapes:
        ops = _model_conv_ops(shape, dtype) if shape.kind == "conv" else _model_bn_ops(shape, dtype)
        for op, (ours, theirs) in ops.items():
            # large calls (seconds each) get fewer rounds
            t_ours, t_torch = time_pair(ours, theirs, repeats, adaptive=not quick)
            ratio = t_ours / t_torch
            ratios.setdefault(shape.kind, []).append((ratio, f"{shape.id} {op}"))
            print(f"{model:<20} {shape.id:<42} {op:<12} {t_ours * 1e3:10.2f} {t_torch * 1e3:10.2f} "
                  f"{ratio:6.2f}", flush=True)
    print()
    for kind, rs in ratios.items():
        geo = float(np.exp(np.mean(np.log([r for r, _ in rs]))))
        worst = max(rs)
        line = (f"{kind:<10} ratio ours/torch over {len(rs)} rows: geometric mean {geo:.2f}, "
                f"worst {worst[0]:.2f} ({worst[1]})")
        if kind == "conv":
            verdict = "met" if worst[0] <= TARGET_MODEL_CONV_RATIO else "NOT met"
            line += f"; target <= {TARGET_MODEL_CONV_RATIO} on every shape: {verdict}"
        print(line)
    return 0


def _models_main(args, dtype) -> int:
    import torch

    repeats = min(args.repeats, 3) if args.quick else args.repeats
    print(f"lbannpy layer kernels vs PyTorch {torch.__version__} CPU (torch.nn.functional / aten), "
          f"{args.dtype}, 1 thread (torch threads {torch.get_num_threads()}), interleaved, median of "
          f">= {repeats} after 1 warm-up")
    only = None if args.only == "maxpool" else args.only
    return run_models(dtype, repeats, args.quick, args.max_size, only)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lbannpy.bench layers",
        description="Forward+backward time of our local conv / max-pool / batch-norm kernels against PyTorch "
                    "CPU, at one thread, interleaved, median of repeats.")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per contender (default 7)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="floating-point type (default float32)")
    parser.add_argument("--kernels", choices=("own", "aten", "auto"), default=None,
                        help="lbannpy's conv kernel set timed against PyTorch, with --models and in the new "
                             "layer types' rows (runtime.kernels; aten: PyTorch's own kernels through "
                             "DLPack, so the ratio is lbannpy's wrapping; auto: aten where torch is "
                             "installed) (default: own with --models; auto, a run's default, in the new "
                             "rows)")
    parser.add_argument("--only", choices=("conv", "maxpool", "batchnorm"),
                        help="run one layer kind (default: all)")
    parser.add_argument("--full", action="store_true", help="add the large (1024^2, 64 filters) conv shapes")
    parser.add_argument("--quick", action="store_true",
                        help="256^2 shapes only and 3 repeats (smoke test); with --models: tiny inputs")
    parser.add_argument("--models", action="store_true",
                        help="every distinct conv (forward, data grad, filter grad) and batch-norm shape of "
                             "lenet5, alexnet, mesh_tiny and mesh1k at their training sizes")
    parser.add_argument("--max-size", type=int, default=0,
                        help="with --models: skip model inputs larger than this (e.g. 256 leaves out mesh1k "
                             "at 1024^2)")
    parser.add_argument("--conv-kernel", choices=("default", "numpy"), default="default",
                        help="numpy: time the NumPy im2col conv path even where the compiled kernels "
                             "are built")
    parser.add_argument("--new", action="store_true",
                        help="only the rows of the new layer types (transposed conv, upsampling, instance/"
                             "group/layer norm, activations, PReLU, softmax, mul, padding modes, global "
                             "pooling, circular conv); without it they follow the conv/pool/batch-norm rows")
    parser.add_argument("--size", type=int, default=0,
                        help="spatial size of the new layer types' rows (default 256, 128 with --quick)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: our kernels on CuPy against PyTorch CUDA on this node's GPU (exits 0 with "
                             "one line when there is none)")
    return parser


def _numpy_conv_kernels() -> None:
    """``--conv-kernel numpy``: the conv and pool modules take their NumPy paths in this process."""
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import conv as kconv, pool as kpool

    kconv.set_compiled(False)
    kpool.set_compiled(False)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    KERNELS[0] = args.kernels or "own"
    NEW_KERNELS[0] = args.kernels or "auto"
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    _one_thread_or_reexec(argv)
    if args.conv_kernel == "numpy":
        _numpy_conv_kernels()

    import numpy as np
    import torch

    if args.device == "gpu":
        why = gpu_missing()
        if why:
            print(f"bench layers --device gpu: skipped, {why}")
            return 0
    torch.set_num_threads(1)
    dtype = np.dtype(args.dtype)
    if args.models:
        return _models_main(args, dtype)
    new_size = args.size or (128 if args.quick else 256)
    if args.new:
        repeats = min(args.repeats, 3) if args.quick else args.repeats
        print(f"lbannpy layers vs PyTorch {torch.__version__} CPU, {args.dtype}, 1 thread (torch threads "
              f"{torch.get_num_threads()}), interleaved, median of >= {repeats} after 1 warm-up, conv "
              f"kernels {NEW_KERNELS[0]}")
        return run_new(dtype, repeats, new_size, adaptive=not args.quick)
    cases = default_cases(args.full)
    if args.only:
        cases = [c for c in cases if c.kind == args.only]
    repeats = args.repeats
    if args.quick:
        cases = [c for c in cases if c.size <= 256][:6]
        repeats = min(repeats, 3)
    # late: loaded when the command runs, so its --help and argument errors come without it
    from lbannpy.layers.kernels import conv as kconv

    if args.device == "gpu":  # CuPy arrays always take the GEMM path
        conv_path = "CuPy im2col + GEMM (cuBLAS)"
    else:
        conv_path = kconv.cpu_path()
    print(f"lbannpy layer kernels vs PyTorch {torch.__version__} {args.device.upper()}, {args.dtype}, "
          f"forward+backward, "
          f"1 thread (torch threads {torch.get_num_threads()}, "
          + ", ".join(f"{v}={os.environ.get(v)}" for v in _THREAD_VARS)
          + f"), median of {repeats} after 1 warm-up"
          + ("" if args.quick else f" (more for short calls: about {MIN_TIMED_S} s of calls each, at most "
                                   f"{MAX_REPEATS})"))
    print(f"our conv kernels: {conv_path}")
    head = (f"{'case':<36} {'ours ms':>9} {'torch ms':>9} {'ratio':>6}  {'torch layout':<12} "
            f"{'NCHW ms':>9} {'NHWC ms':>9}")
    print(head)
    print("-" * len(head))
    ratios: dict[str, list[float]] = {}
    for case in cases:
        t = measure(case, dtype, repeats, adaptive=not args.quick, device=args.device)
        layout = min(("torch NCHW", "torch NHWC"), key=lambda k: t[k])
        ratio = t["ours"] / t[layout]
        ratios.setdefault(case.kind, []).append(ratio)
        print(f"{case.id:<36} {t['ours'] * 1e3:9.2f} {t[layout] * 1e3:9.2f} {ratio:6.2f}  {layout[6:]:<12} "
              f"{t['torch NCHW'] * 1e3:9.2f} {t['torch NHWC'] * 1e3:9.2f}", flush=True)
    print()
    for kind, rs in ratios.items():
        geo = float(np.exp(np.mean(np.log(rs))))
        line = f"{kind:<10} ratio ours/torch: geometric mean {geo:.2f}, worst {max(rs):.2f}"
        if kind == "conv":
            verdict = "met" if max(rs) <= TARGET_CONV_RATIO else "NOT met"
            line += f"  (target <= {TARGET_CONV_RATIO} on every shape: {verdict})"
        print(line)
    if args.device == "cpu" and not args.only:
        print()
        run_new(dtype, repeats, new_size, adaptive=not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
