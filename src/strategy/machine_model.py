"""The names under which the strategy package has imported the machine model; the model itself, its parser
and its presets are defined once, in :mod:`lbannpy.machine`."""
from __future__ import annotations

from ..machine import PRESETS, Link, Machine, MachineError, load_machine, machines_dir

MachineModel = Machine
load_machine_model = load_machine

__all__ = ["PRESETS", "Link", "Machine", "MachineError", "MachineModel", "load_machine", "load_machine_model",
           "machines_dir"]
