"""Stand-in for ``cupy.cuda.pinned_memory``: page-locked host memory as CuPy names it.

``alloc_pinned_memory(size)`` returns a :class:`PinnedMemoryPointer` that NumPy can wrap
(``numpy.ndarray(shape, dtype, buffer=mem)``, as ``cupyx.empty_pinned`` does). An asynchronous copy into
it (``ndarray.get(stream=s, out=..., blocking=False)``) lands only when the host observes the copy's stream
(a synchronisation, or ``Event.done`` on an event recorded after it): a reader that does not wait for the
copy reads the buffer's old bytes, as it would on a GPU.
"""
import itertools

_ptrs = itertools.count(1)


class PinnedMemoryPointer(bytearray):
    """Host memory NumPy can wrap; ``ptr`` is an int, ``size`` its bytes."""

    def __init__(self, size):
        super().__init__(max(int(size), 1))
        self.size = int(size)
        self.ptr = 0x3000_0000_0000 + next(_ptrs) * 4096

    @property
    def mem(self):
        return self


def alloc_pinned_memory(size):
    """``size`` bytes of pinned host memory (CuPy: from the current pinned memory allocator)."""
    if int(size) < 0:
        raise ValueError(f"alloc_pinned_memory: negative size {size}")
    return PinnedMemoryPointer(size)


class PinnedMemoryPool:
    """CuPy's pool interface (``malloc``, ``n_free_blocks``, ``free_all_blocks``); the stand-in keeps
    nothing."""

    def malloc(self, size):
        return alloc_pinned_memory(size)

    def n_free_blocks(self):
        return 0

    def free_all_blocks(self):
        pass
