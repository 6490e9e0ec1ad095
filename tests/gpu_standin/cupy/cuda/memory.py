"""Stand-in for ``cupy.cuda.memory``: ``MemoryPool``, ``using_allocator`` / ``set_allocator`` /
``get_allocator`` with CuPy's names.

Without an allocator set, arrays get fresh stand-in allocations (never reused). With a pool's ``malloc`` as
the current allocator, arrays get pool blocks (rounded to 512 bytes): a block whose last array (or
``MemoryPointer``) is freed goes back to the pool and a later ``malloc`` of the same size on the same
device hands it out again, as CuPy's pool does. Stream capture uses this: the capture's pool is the one
current at ``begin_capture`` (see ``cupy.cuda._graph``).
"""
import contextlib
import threading
import weakref

from cupy import _standin

_ROUND = 512
_tls = threading.local()
_global = [None]


def _allocator():
    stack = getattr(_tls, "stack", None)
    if stack:
        return stack[-1]
    return _global[0]


def _current_pool():
    fn = _allocator()
    pool = getattr(fn, "__self__", None)
    return pool if isinstance(pool, MemoryPool) else None


def get_allocator():
    return _allocator()


def set_allocator(allocator=None):
    """The process-wide allocator (``None``: the stand-in's plain allocator)."""
    _global[0] = allocator


@contextlib.contextmanager
def using_allocator(allocator=None):
    """The allocator of the calling thread inside the block."""
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(allocator)
    try:
        yield
    finally:
        stack.pop()


class _Lease:
    """Held by every array and MemoryPointer over a pool block; its end returns the block to the pool."""
    __slots__ = ("__weakref__",)


class MemoryPool:
    def __init__(self, allocator=None):
        self._lock = threading.Lock()
        self._free = {}       # (device, rounded size, stream uid) -> [Allocation]
        self._blocks = []     # every block of the pool

    def malloc(self, size):
        from cupy.cuda import MemoryPointer
        size = int(size)
        dev = _standin.local.device
        rounded = max(-(-size // _ROUND) * _ROUND, _ROUND)
        cap = _standin.capture_allocation(size, dev, self)
        from cupy.cuda import get_current_stream
        key = (dev, rounded, get_current_stream()._uid)  # as CuPy's pool: blocks are reused per stream
        with self._lock:
            free = self._free.get(key)
            block = free[-1] if free else None
        if block is not None:
            from cupy.cuda import _graph
            _graph.on_reuse(block, self)
            with self._lock:
                free.pop()
        else:
            block = _standin.new_allocation(rounded, dev)
            block.pool = self
            block.pool_key = key
            with self._lock:
                self._blocks.append(block)
        block.nbytes = size
        lease = _Lease()
        block.lease = weakref.ref(lease)
        weakref.finalize(lease, self._release, block)
        if cap is not None:
            cap.born.add(block)
        return MemoryPointer(block, 0, lease=lease)

    def _release(self, block):
        block.lease = None
        with self._lock:
            self._free.setdefault(block.pool_key, []).append(block)

    def free_all_blocks(self, stream=None):
        with self._lock:
            dropped = {id(b) for bs in self._free.values() for b in bs}
            self._free.clear()
            self._blocks = [b for b in self._blocks if id(b) not in dropped]

    def used_bytes(self):
        with self._lock:
            free = sum(len(b.buf) for bs in self._free.values() for b in bs)
            return sum(len(b.buf) for b in self._blocks) - free

    def free_bytes(self):
        with self._lock:
            return sum(len(b.buf) for bs in self._free.values() for b in bs)

    def total_bytes(self):
        with self._lock:
            return sum(len(b.buf) for b in self._blocks)

    def n_free_blocks(self):
        with self._lock:
            return sum(len(bs) for bs in self._free.values())

    def __repr__(self):
        return f"<MemoryPool {id(self):#x}>"


def alloc(size):
    """CuPy's ``cupy.cuda.alloc``: memory from the current allocator."""
    fn = _allocator()
    if fn is not None:
        return fn(size)
    from cupy.cuda import MemoryPointer
    return MemoryPointer(_standin.allocate(int(size), _standin.local.device), 0)
