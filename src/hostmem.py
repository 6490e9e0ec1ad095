"""Host memory reuse for the training process: freed blocks stay with the process for the next step.

A training step allocates and frees the same arrays every step (activations, error signals, workspaces of
the compiled and ATen kernels). glibc's ``malloc`` serves blocks above its mmap threshold (128 KiB at start,
raised only as far as the largest block freed so far) with fresh ``mmap`` pages and gives the top of the heap
back to the kernel once more than twice that threshold is free there, so a step of a small network takes
hundreds of page faults, each a zeroed page from the kernel (LeNet-5 at batch 32: about 500 per step, a
fifth of its step time in system time here). :func:`keep_freed_blocks` sets the two thresholds once, at
start: blocks up to :data:`MMAP_BYTES` come from the heap and up to :data:`TRIM_BYTES` of free heap stay
mapped, so after the first step the same memory is reused without a fault (what a caching allocator such as
LBANN's or PyTorch's CUDA one does for device memory). Larger blocks are still mapped and unmapped per use,
and at most :data:`TRIM_BYTES` of free memory is kept beyond the peak. Nothing changes where the C library
has no ``mallopt`` (not glibc), or where the user set ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (glibc's own tunables, which then decide).

The price is memory: the kept blocks fragment differently from run to run, and on a model at its memory
limit the peak moves with them. ``MALLOC_MMAP_THRESHOLD_=4194304`` in the environment gives the lower,
steady end of that range at the cost of fresh pages for every block above 4 MiB, which slows a model whose
activations are made of such blocks (``python -m lbannpy.bench memory`` measures both; the figures are on
the benchmark page).
"""
from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_BYTES = 32 << 20   # glibc's own ceiling for its sliding threshold
TRIM_BYTES = 128 << 20
ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_blocks() -> bool:
    """Set the thresholds (see the module doc); True where they were set."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """This machine's memory: physical pages × page size, or the cgroup's limit when that is lower; 0 when
    neither can be read."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        phys = 0
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) and (phys == 0 or int(text) < phys):
            phys = int(text)
    return phys
