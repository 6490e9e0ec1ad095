"""Which convolution kernels a run uses: lbannpy's own (:mod:`.conv`) or PyTorch's ATen (:mod:`.aten`).

``runtime.kernels``: ``own``; ``aten`` (an error where torch cannot run them); ``auto``: ATen where torch
imports (and sees a GPU, for ``runtime.device: gpu``), else own; and at every layer shape that a calibration
of the run's machine (``parallel.machine``, written by ``python -m lbannpy.bench calibrate --kernels``)
timed, the set it found faster there (:func:`kernel_table`). Every rank applies the same rule to the same
installation and machine file, so all ranks of a layer agree. Both sets compute the same convolutions
(equal to float32 round-off, float64 to 1e-10: ``tests/test_kernels_aten.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy

from . import _conv_small, conv
from .padding import padded_shape, symmetric_pads
from . import aten

CHOICES = ("auto", "own", "aten")


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
    if not aten.available(device):
        if choice == "aten":
            raise KernelChoiceError("runtime.kernels: aten needs PyTorch (pip install torch)"
                                    + (" with CUDA" if device == "gpu" else "") + "; use own or auto")
        return own()
    return ConvKernels("aten", aten.conv_forward, aten.conv_backward_input, aten.conv_backward_params,
                       allocates=True, pads=True)


def gpu_math(choice: str, device: str, tf32: bool) -> bool:
    """Set cuDNN's float32 arithmetic for a run whose convolutions may take ATen on a GPU (``runtime.tf32``);
    nothing where they cannot (own kernels, a CPU, no CUDA torch: torch is not imported for it). Returns
    whether it was set."""
    if device != "gpu" or choice == "own":
        return False
    if not aten.available(device):
        return False
    aten.set_tf32(tf32)
    return True


def kernel_table(choice: str, device: str, machine) -> dict[tuple, ConvKernels]:
    """``{(layer type, local input shape, local output shape): kernels}`` of the shapes ``machine`` (a
    :class:`lbannpy.machine.Machine`) names a faster set for; empty unless ``choice`` is ``auto``. A shape
    whose set cannot run here (ATen without torch) is left to the rule of :func:`conv_kernels`."""
    if choice != "auto" or not getattr(machine, "kernels", None):
        return {}
    sets = {"own": own()}
    aten_set = conv_kernels("auto", device)
    if aten_set.name == "aten":
        sets["aten"] = aten_set
    return {key: sets[name] for key, name in machine.kernels.items() if name in sets}
