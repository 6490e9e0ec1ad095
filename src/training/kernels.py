"""The run's convolution kernels: the set of ``runtime.kernels``, per local shape the set a calibration of
``parallel.machine`` found faster there (``auto``), the line that says which set each layer took, and the
kernels each layer computed with (``summary.json``'s ``layers.<name>.kernels``)."""
from __future__ import annotations

import collections

from .errors import UserError
from lbannpy.layers.kernels.select import KernelChoiceError, conv_kernels, gpu_math, kernel_table, layer_set
from lbannpy.machine import DEFAULT_MACHINE, MachineError, load_machine


def choose(run, ctx, device: str) -> str | None:
    """Sets ``ctx.conv_kernels`` (and cuDNN's float32 arithmetic) from ``runtime.kernels``, and for ``auto``
    ``ctx.conv_kernel_table`` from the calibration of ``parallel.machine`` (a preset has none: the rule of
    ``runtime.kernels`` everywhere; for ``aten`` only the host layouts it calibrated). Returns the name of
    the machine that chose the set by shape, or None. A set that cannot run here (``aten`` without torch,
    ``cudnn`` off a GPU or without cuDNN Frontend) is a :class:`UserError` naming the key."""
    choice = run.runtime.kernels
    try:
        ctx.conv_kernels = conv_kernels(choice, device)
    except KernelChoiceError as exc:
        raise UserError(str(exc)) from None
    gpu_math(choice, device, run.runtime.tf32)
    if choice not in ("auto", "aten"):
        return None
    try:
        machine = load_machine(run.parallel.machine or DEFAULT_MACHINE)
    except MachineError as exc:
        raise UserError(str(exc)) from None
    ctx.conv_kernel_table = kernel_table(choice, device, machine)
    return machine.name if choice == "auto" else None


def say(model, ctx, machine: str | None) -> None:
    """Prints which set each conv layer took, where a calibrated machine chose by shape (nothing else)."""
    if not ctx.conv_kernel_table or machine is None:
        return
    counts = collections.Counter(lay.kern.name for lay in model.layers if hasattr(lay, "kern"))
    print("lbannpy.train: conv kernels: " + ", ".join(f"{name} at {n} layer(s)" for name, n in
                                                    sorted(counts.items()))
          + f" (by shape where machine {machine} measured it; {ctx.conv_kernels.name} elsewhere)", flush=True)


def layer_sets(model) -> dict:
    """``{layer name: kernel set}`` of this rank (``cudnn``, ``aten``, ``own``, ``c`` or ``numpy``)."""
    return {lay.name: layer_set(lay) for lay in model.layers}
