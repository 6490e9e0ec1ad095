"""Which convolution kernels a run uses: lbannpy's own (:mod:`.conv`), PyTorch's ATen (:mod:`.aten`) or
cuDNN's through cuDNN Frontend on CuPy arrays (:mod:`.cudnn`).

``runtime.kernels``: ``own``; ``aten`` (an error where torch cannot run them); ``cudnn`` (an error but on a
GPU with cuDNN Frontend installed); ``auto``: on a GPU, cuDNN Frontend's where it imports (its plans and
outputs live in CuPy's memory, so the step can still be captured as one CUDA graph), else ATen where torch
imports (and, for ``runtime.device: gpu``, sees a GPU), else own; and at every layer shape that a
calibration of the run's machine (``parallel.machine``, written by ``python -m lbannpy.bench calibrate
--kernels``) timed, the set it found faster there (:func:`kernel_table`). Every rank applies the same rule
to the same installation and machine file, so all ranks of a layer agree. The sets compute the same
convolutions (equal to float32 round-off, float64 to 1e-10: ``tests/test_kernels_aten.py``,
``tests/gpu/test_cudnn_gpu.py``). A CPU run never imports ``cudnn``. Where the run's set is ``cudnn``, the
batch-norm layers take cuDNN Frontend's batch-norm plans too (:mod:`.cudnn_bn`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy

from . import _conv_small, conv
from .padding import padded_shape, symmetric_pads
from . import aten
from . import cudnn

CHOICES = ("auto", "own", "aten", "cudnn")


class KernelChoiceError(ValueError):
    pass


@dataclass(frozen=True)
class ConvKernels:
    """The convolution kernels of one set."""

    name: str
    #: ``(x_window, w, b, stride, dilation, padding=0) -> y``
    conv_forward: Callable
    #: ``(dy, w, x_window, stride, dilation, out=None, padding=0) -> dx_window``: given the input itself
    conv_backward_input: Callable
    #: ``(x_window, dy, w, bias: bool, stride, dilation, padding=0) -> (dw, db or None)``: given the filter
    #: itself, and the bias gradient from the same pass over ``dy`` where the set can
    conv_backward_params: Callable
    #: the kernels allocate their results themselves, so an ``out`` buffer only adds a copy (and, for a
    #: layer's workspace, memory that stays)
    allocates: bool = False
    #: the kernels take ``padding=`` (per spatial dimension, both sides) and pad inside, so a layer with
    #: nothing to exchange hands them its input block instead of a padded window (:attr:`Conv.kernel_pads`):
    #: always (True), or where ``pads(local input shape, filter shape, stride, dilation, padding, xp)`` holds
    pads: bool | Callable = False
    #: ``(x_shape, w_shape, stride, dilation, padding, dtype) -> plan or None``: for a convolution the set
    #: pads (:attr:`pads`), an object whose ``forward(x, w, b)``, ``backward_data(dy, w)`` and
    #: ``backward_params(x, dy, bias, dw=None, db=None)`` run its passes with every argument worked out
    #: once, and whose ``takes(x)`` says whether an input block is the one it was made for
    plan: Callable | None = None
    #: the host layout a layer hands the ATen set its window and output gradient in where it builds one:
    #: ``channels_last`` only from a calibrated row that names it (:func:`kernel_table`), else ``nchw``
    layout: str = "nchw"


def own() -> ConvKernels:
    return ConvKernels("own", conv.conv_forward, _own_backward_input, _own_backward_params, pads=_own_pads,
                       plan=_own_plan)


def _own_backward_input(dy, w, x_window, stride=1, dilation=1, out=None, padding=0):
    return conv.conv_backward_data(dy, w, x_window.shape, stride, dilation, out=out, padding=padding)


def _own_backward_params(x_window, dy, w, bias=False, stride=1, dilation=1, padding=0):
    dw = conv.conv_backward_filter(x_window, dy, w.shape, stride, dilation, padding=padding)
    return dw, (conv.conv_backward_bias(dy) if bias else None)


def _own_pads(x_shape, w_shape, stride, dilation, padding, xp) -> bool:
    """lbannpy's kernels pad inside where each pass is one compiled call (:mod:`._conv_small`: host arrays,
    few multiply-adds); elsewhere the layer's window is as cheap, and it is what the halo exchange fills."""
    if getattr(xp, "__name__", "") != "numpy" or not conv.USE_COMPILED:
        return False
    pads = symmetric_pads(padding, len(x_shape) - 2)
    shape = tuple(x_shape) if pads is None else padded_shape(tuple(x_shape), pads)
    return _conv_small.fits(conv.geometry(shape, tuple(w_shape), stride, dilation))


def _own_plan(x_shape, w_shape, stride, dilation, padding, dtype):
    """The small path's plan (:class:`._conv_small.Plan`) of a float convolution it takes, else None."""
    if numpy.dtype(dtype).char not in "fd" or not _own_pads(x_shape, w_shape, stride, dilation, padding,
                                                            numpy):
        return None
    geo, pads = conv.padded_geometry(tuple(x_shape), tuple(w_shape), stride, dilation, padding)
    return _conv_small.Plan(geo, pads, x_shape, dtype)


def conv_kernels(choice: str = "own", device: str = "cpu") -> ConvKernels:
    """The kernel set for ``runtime.kernels`` = ``choice`` on ``device``."""
    if choice not in CHOICES:
        raise KernelChoiceError(f"runtime.kernels: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "own":
        return own()
    if choice == "cudnn" or (choice == "auto" and device == "gpu"):
        if cudnn.available(device):
            return cudnn_set()
        if choice == "cudnn":
            raise KernelChoiceError("runtime.kernels: cudnn needs "
                                    + (f"cuDNN Frontend with its cuDNN library (pip install "
                                       f"nvidia-cudnn-frontend and the nvidia-cudnn-cuXX of your CUDA, or "
                                       f"lbannpy's gpu extra): {cudnn.missing()}" if device == "gpu"
                                       else "runtime.device: gpu")
                                    + "; use own or auto")
    if not aten.available(device):
        if choice == "aten":
            raise KernelChoiceError("runtime.kernels: aten needs PyTorch (pip install torch)"
                                    + (" with CUDA" if device == "gpu" else "") + "; use own or auto")
        return own()
    return ConvKernels("aten", aten.conv_forward, aten.conv_backward_input, aten.conv_backward_params,
                       allocates=True, pads=True)


def cudnn_set() -> ConvKernels:
    """cuDNN Frontend's kernels (:mod:`.cudnn`): they pad inside and honour an ``out`` buffer."""
    return ConvKernels("cudnn", cudnn.conv_forward, cudnn.conv_backward_input, cudnn.conv_backward_params,
                       pads=True)


def gpu_math(choice: str, device: str, tf32: bool) -> bool:
    """Set cuDNN's float32 arithmetic for a run whose convolutions may take cuDNN on a GPU
    (``runtime.tf32``): cuDNN Frontend's plans where that set is the run's (torch is not imported then), else
    ATen's; nothing where neither can run (own kernels, a CPU, no CUDA torch: torch is not imported for it).
    Returns whether it was set."""
    if device != "gpu" or choice == "own":
        return False
    if choice in ("auto", "cudnn") and cudnn.available(device):
        cudnn.set_tf32(tf32)
        return True
    if choice == "cudnn":
        return False
    if not aten.available(device):
        return False
    aten.set_tf32(tf32)
    return True


def kernel_table(choice: str, device: str, machine) -> dict[tuple, ConvKernels]:
    """``{(layer type, local input shape, local output shape): kernels}`` of the shapes ``machine`` (a
    :class:`lbannpy.machine.Machine`) names a faster set for; empty unless ``choice`` is ``auto`` (or
    ``aten``: only its calibrated layouts). A shape whose set cannot run here (ATen without torch) is left
    to the rule of :func:`conv_kernels`. Where the run's set is cuDNN Frontend's, a shape calibrated faster
    on ATen takes it too: on a GPU ATen's convolutions are cuDNN's, and this set keeps the step capturable.
    Where the ATen set is the run's, a row's ``layout: channels_last`` gives it that layout there."""
    if choice not in ("auto", "aten") or not getattr(machine, "kernels", None):
        return {}
    sets = {"own": own()}
    auto_set = conv_kernels(choice, device)
    if auto_set.name in ("aten", "cudnn"):
        sets["aten"] = sets[auto_set.name] = auto_set
    table = {key: sets[name] for key, name in machine.kernels.items() if name in sets and choice == "auto"}
    if auto_set.name == "aten":
        cl = replace(auto_set, layout="channels_last")
        table.update({key: cl for key, lay in getattr(machine, "layouts", {}).items() if lay == cl.layout})
    return table


# -- which kernels a layer runs, for summary.json (``layers.<name>.kernels``)
#: the names :func:`layer_set` gives
SET_NAMES = ("cudnn", "aten", "own", "c", "numpy")
_FAMILY: dict = {}


def layer_set(layer) -> str:
    """The kernels ``layer`` computes with: a convolution its set's (``cudnn``, ``aten``; lbannpy's own is
    ``own`` on a GPU, on the host ``c`` where its compiled kernels are built, else ``numpy``); a layer
    with a ``kernel_set`` that says one, that set (batch-norm on cuDNN Frontend); any other
    layer ``own`` on a GPU (lbannpy's CuPy kernels) and on the host ``c`` where a kernel module its code
    calls has its compiled kernels built (``USE_COMPILED``), else ``numpy``."""
    named = getattr(layer, "kernel_set", None)  # a layer that says its set (batch-norm on cuDNN)
    if named is not None:
        return named
    host = getattr(layer.ctx.xp, "__name__", "") == "numpy"
    kern = getattr(layer, "kern", None)
    if kern is not None and kern.name != "own":
        return kern.name
    if not host:
        return "own"
    if kern is not None:
        return "c" if conv.USE_COMPILED else "numpy"
    return "c" if any(getattr(m, "USE_COMPILED", False) for m in _kernel_modules(type(layer))) else "numpy"


def _kernel_modules(cls) -> tuple:
    """The kernel modules (``lbannpy.layers.kernels.*``) the code of ``cls``'s module names: module objects
    bound there, and the modules of kernel functions it calls directly or through the kernels package."""
    import sys
    import types

    hit = _FAMILY.get(cls)
    if hit is not None:
        return hit
    mod = sys.modules[cls.__module__]
    pkg = sys.modules[__package__]
    names, codes = set(), [v.__code__ for v in vars(mod).values() if isinstance(v, types.FunctionType)]
    for klass in cls.__mro__:
        if klass.__module__ == cls.__module__:
            for v in vars(klass).values():
                f = getattr(v, "fget", getattr(v, "__func__", v))
                if isinstance(f, types.FunctionType):
                    codes.append(f.__code__)
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    found = set()
    for name in names:
        pkg_fn = getattr(pkg, name, None)  # a function the kernels package exports (not a submodule)
        for obj in (vars(mod).get(name), pkg_fn if isinstance(pkg_fn, types.FunctionType) else None):
            where = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
            if isinstance(where, str) and where.startswith(__package__ + ".") and where in sys.modules:
                found.add(sys.modules[where])
    hit = _FAMILY[cls] = tuple(sorted(found, key=lambda m: m.__name__))
    return hit
