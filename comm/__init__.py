"""lbannpy.comm: the only code that talks MPI or NCCL.

Nothing here touches MPI at import time; the backends are imported when first used, so that
``import lbannpy.comm`` works on a machine without mpi4py (single rank) or without CuPy.

    from lbannpy.comm import Runtime
    with Runtime(backend="auto", device="cpu") as rt:
        total = rt.world.allreduce(x)
"""
from __future__ import annotations

from .base import REDUCE_OPS, CommError, Communicator, Handle, wait_all
from .runtime import Runtime, install_abort_hook, launched_size, make_communicator
from .loopback import LoopbackCommunicator
from .single import SingleCommunicator

__all__ = [
    "REDUCE_OPS", "CommError", "Communicator", "Handle", "wait_all", "Runtime", "install_abort_hook",
    "make_communicator", "launched_size", "SingleCommunicator", "LoopbackCommunicator", "MPICommunicator",
    "NCCLCommunicator",
]


def __getattr__(name):
    # The MPI and NCCL classes load mpi4py (and MPI_Init) only when someone asks for them.
    if name == "MPICommunicator":
        # mpi4py starts MPI when imported: loaded on first use
        from .mpi import MPICommunicator
        return MPICommunicator
    if name == "NCCLCommunicator":
        # CuPy and NCCL: loaded on first use
        from .nccl import NCCLCommunicator
        return NCCLCommunicator
    raise AttributeError(f"module 'lbannpy.comm' has no attribute {name!r}")
