"""Strict NumPy-backed stand-in for CuPy, visible only to tests that put ``tests/gpu_standin`` first on
``sys.path``. Device arrays refuse implicit host conversion, NumPy operands, and arrays of another device;
every kernel is checked for stream order; every host synchronisation is counted by call site."""
import types as _types

import numpy as _np

from cupy import _standin
from cupy import cuda
from cupy.cuda import _graph

__version__ = "13.99.0+standin"
_ITEM_SYNC = "host sync"


def _wrap_result(r, owners, stream, what, sink=None):
    """Wrap a NumPy result: a view of an input allocation stays a view, anything else is a new buffer.
    While capturing, ``sink`` collects the new buffers (None for a view) for the replay to fill."""
    if isinstance(r, tuple):
        return tuple(_wrap_result(x, owners, stream, what, sink) for x in r)
    if isinstance(r, list):
        return [_wrap_result(x, owners, stream, what, sink) for x in r]
    if isinstance(r, _np.ndarray):
        for a in owners:
            if _np.may_share_memory(r, a.buf):
                if sink is not None:
                    sink.append(None)
                return ndarray._view(r, a)
        out = ndarray._new(r.shape, r.dtype)
        _standin.launch(stream, writes=[out._alloc], what=what, covered=True)
        out._a[...] = r
        if sink is not None:
            sink.append(_graph.weak([out])[0])
        return out
    if isinstance(r, _np.generic):   # reductions return 0-d device arrays
        out = ndarray._new((), r.dtype)
        _standin.launch(stream, writes=[out._alloc], what=what, covered=True)
        out._a[...] = r
        if sink is not None:
            sink.append(_graph.weak([out])[0])
        return out
    return r


def _refill(r, sink, pos=None):
    """Replay of a captured NumPy call: its new-buffer results written into the buffers made at capture."""
    pos = [0] if pos is None else pos
    if isinstance(r, (tuple, list)):
        for x in r:
            _refill(x, sink, pos)
    elif isinstance(r, (_np.ndarray, _np.generic)):
        out = sink[pos[0]]
        pos[0] += 1
        if out is not None:
            if out._a.shape != _np.shape(r):
                raise RuntimeError(f"a captured operation's result changed shape at replay ({out._a.shape} "
                                   f"-> {_np.shape(r)}): data-dependent shapes cannot be captured")
            out._a[...] = r


def _unwrap(x, dev, allocs, what):
    if isinstance(x, ndarray):
        if x._alloc.device != dev:
            raise ValueError(f"{what}: array on device {x._alloc.device} used while device {dev} is current "
                             f"(CuPy: 'The device where the array resides ({x._alloc.device}) is different "
                             f"from the current device ({dev}).')")
        allocs.append(x._alloc)
        return x._a
    if isinstance(x, _np.ndarray):
        raise TypeError(f"{what}: unsupported type <class 'numpy.ndarray'>; upload with cupy.asarray first")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(y, dev, allocs, what) for y in x)
    if isinstance(x, dict):
        return {k: _unwrap(v, dev, allocs, what) for k, v in x.items()}
    return x


def _call(fn, args, kwargs, what, writes_out=True):
    if "out" in kwargs and kwargs["out"] is None:  # CuPy: out=None allocates the result, as no out does
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
    dev = _standin.local.device
    allocs = []
    a = _unwrap(args, dev, allocs, what)
    outs = []
    k = {}
    for key, v in kwargs.items():
        if key == "out":
            tmp = []
            k[key] = _unwrap(v, dev, tmp, what)
            outs += tmp
        else:
            k[key] = _unwrap(v, dev, allocs, what)
    stream = cuda.get_current_stream()
    if _standin.capturing(stream):
        sink = []
        if "out" in kwargs:
            replay = lambda: fn(*a, **k)  # noqa: E731
        else:
            replay = lambda: _refill(fn(*a, **k), sink)  # noqa: E731
        _standin.launch(stream, reads=allocs, writes=outs, what=what, replay=replay)
        state = _graph.before_call(stream, allocs)
        r = fn(*a, **k)
        _graph.after_call(stream, state)
        if "out" in kwargs:
            return kwargs["out"]
        return _wrap_result(r, allocs, stream, what, sink)
    _standin.launch(stream, reads=allocs, writes=outs, what=what)  # check stream order before running
    r = fn(*a, **k)
    if "out" in kwargs:
        return kwargs["out"]
    return _wrap_result(r, allocs, stream, what)


def _upload_index(key):
    """CuPy accepts NumPy index arrays (it uploads them)."""
    if isinstance(key, _np.ndarray):
        return asarray(key)
    if isinstance(key, tuple):
        return tuple(asarray(k) if isinstance(k, _np.ndarray) else k for k in key)
    return key


class ndarray:
    """A device array: a NumPy view over a stand-in allocation of one device."""

    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        dtype = _np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(_np.prod(shape)) * dtype.itemsize
        if memptr is None and cuda.memory._allocator() is not None:
            memptr = cuda.memory.alloc(n)
        if memptr is not None:  # over given memory (a pool block): holds its lease
            a, off = memptr.mem, memptr.ptr - memptr.mem.ptr
            if off + n > a.nbytes:
                raise ValueError(f"ndarray of {n} bytes at offset {off} runs past the end of allocation "
                                 f"{a.ptr:#x} of {a.nbytes} bytes")
            self._alloc, self._lease = a, memptr._lease
            self._a = _np.ndarray(shape, dtype, buffer=a.buf, offset=off, order=order) if n else \
                _np.empty(shape, dtype)
            return
        self._alloc = _standin.allocate(n, _standin.local.device)
        self._a = _np.ndarray(shape, dtype, buffer=self._alloc.buf[:max(n, 1)] if n else None, order=order) \
            if n else _np.empty(shape, dtype)

    @classmethod
    def _new(cls, shape, dtype):
        return cls(shape, dtype)

    @classmethod
    def _view(cls, a, alloc, own=True):
        v = cls.__new__(cls)
        v._a = a
        v._alloc = alloc
        if own and alloc.lease is not None:  # a view keeps its pool block out of the pool, as its base does
            v._lease = alloc.lease()
        return v

    # --- identity and metadata
    shape = property(lambda s: s._a.shape)
    dtype = property(lambda s: s._a.dtype)
    ndim = property(lambda s: s._a.ndim)
    size = property(lambda s: s._a.size)
    itemsize = property(lambda s: s._a.itemsize)
    nbytes = property(lambda s: s._a.nbytes)
    strides = property(lambda s: s._a.strides)
    flags = property(lambda s: s._a.flags)

    @property
    def device(self):
        return cuda.Device(self._alloc.device)

    @property
    def data(self):
        if self._a.size == 0:
            return cuda.MemoryPointer(self._alloc, 0)
        off = self._a.__array_interface__["data"][0] - self._alloc.buf.__array_interface__["data"][0]
        return cuda.MemoryPointer(self._alloc, off)

    @property
    def base(self):
        return None

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"standin_device_array(shape={self.shape}, dtype={self.dtype}, device={self._alloc.device})"

    @property
    def __cuda_array_interface__(self):
        """CUDA Array Interface v3, for a CUDA-aware MPI (mpi4py reads it). Where real CuPy gives the device
        pointer, the stand-in gives the host address of the NumPy memory behind the array, so an MPI that
        is not CUDA-aware really moves the bytes; taking it is a host access of the allocation, checked
        like one (the producer's stream must have been synchronised)."""
        _standin.host_access([self._alloc], "__cuda_array_interface__ (MPI reading or writing the buffer)")
        a = self._a
        ptr = a.__array_interface__["data"][0] if a.size else 0
        stream = cuda.get_current_stream()
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (ptr, False), "version": 3,
                "strides": None if a.flags.c_contiguous else a.strides,
                "stream": stream.ptr if stream.ptr else 1}

    # --- refused implicit host conversions (CuPy raises TypeError)
    def __array__(self, *a, **k):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    # --- explicit host synchronisations
    def _sync(self, kind):
        _standin.count_sync(kind)
        s = cuda.get_current_stream()
        _standin.launch(s, reads=[self._alloc], what=kind)
        _standin.host_observes(s._clock)

    def _check_host(self, arr, what):
        # CuPy's checks of get(out=) and set(arr)
        if not isinstance(arr, _np.ndarray) or isinstance(arr, ndarray):
            raise TypeError(f"{what}: only numpy.ndarray can be copied to or from cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{what}: {arr.dtype} array cannot be copied to or from a {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"{what}: shape mismatch: {self.shape} and {arr.shape}")

    def get(self, stream=None, order="C", out=None, blocking=True):
        if out is not None:
            self._check_host(out, "ndarray.get(out=)")
        s = cuda.get_current_stream() if stream is None else stream
        if _standin._active and _standin.capturing(s):  # CuPy refuses every D2H copy on a capturing stream
            with s:
                _graph.on_host_sync("ndarray.get")
        if not blocking:  # CuPy: the copy runs on ``stream`` (or the current one); the host does not wait
            _standin.launch(s, reads=[self._alloc], what="ndarray.get (async)")
            snapshot = _np.array(self._a, order=order)
            dest = _np.empty_like(snapshot) if out is None else out

            def land():
                dest[...] = snapshot
            _standin.defer(s, land)
            return dest
        if stream is not None:
            _standin.count_sync("ndarray.get")
            _standin.launch(stream, reads=[self._alloc], what="ndarray.get")
            _standin.host_observes(stream._clock)
        else:
            self._sync("ndarray.get")
        if out is not None:
            out[...] = self._a
            return out
        return _np.array(self._a, order=order)

    def item(self):
        self._sync("ndarray.item")
        return self._a.item()

    def tolist(self):
        self._sync("ndarray.tolist")
        return self._a.tolist()

    def __float__(self):
        self._sync("float(ndarray)")
        return float(self._a)

    def __int__(self):
        self._sync("int(ndarray)")
        return int(self._a)

    def __index__(self):
        self._sync("index(ndarray)")
        return self._a.__index__()

    def __bool__(self):
        self._sync("bool(ndarray)")
        return bool(self._a)

    def set(self, arr, stream=None):
        if not isinstance(arr, _np.ndarray):
            raise TypeError("set() takes a numpy.ndarray")
        self._check_host(arr, "ndarray.set")
        s = cuda.get_current_stream() if stream is None else stream
        if _standin._active:
            _graph.on_host_to_device(s, "ndarray.set")
        _standin.launch(s, writes=[self._alloc], what="ndarray.set")
        self._a[...] = arr

    # --- NumPy protocols: operate on the NumPy views, keep results on the device
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if "out" in kwargs:
            kwargs["out"] = tuple(kwargs["out"]) if isinstance(kwargs["out"], tuple) else kwargs["out"]
            o = kwargs["out"]
            kwargs["out"] = o[0] if isinstance(o, tuple) and len(o) == 1 else o
        return _call(getattr(ufunc, method), inputs, kwargs, f"cupy.{ufunc.__name__}")

    def __array_function__(self, func, types, args, kwargs):
        return _call(func, args, kwargs, f"cupy.{func.__name__}")

    def __getitem__(self, key):
        return _call(lambda a, k: a[k], (self, _upload_index(key)), {}, "getitem")

    def __setitem__(self, key, value):
        def f(a, k, v):
            a[k] = v
        if isinstance(value, _np.ndarray):  # CuPy uploads a NumPy right-hand side of an assignment
            value = asarray(value)
        _call(f, (self, _upload_index(key), value), {}, "setitem")
        _standin.launch(cuda.get_current_stream(), writes=[self._alloc], what="setitem", covered=True)

    def _method(name):
        def m(self, *args, **kwargs):
            return _call(lambda a, *x, **k: getattr(a, name)(*x, **k), (self,) + args, kwargs,
                         f"ndarray.{name}")
        m.__name__ = name
        return m

    for _n in ("reshape", "astype", "copy", "sum", "mean", "max", "min", "argmax", "argmin", "ravel",
               "transpose", "view", "squeeze", "swapaxes", "prod", "std", "var", "any", "all", "dot",
               "clip", "cumsum", "flatten", "diagonal", "round", "conj", "nonzero", "take", "repeat"):
        locals()[_n] = _method(_n)
    del _n

    def fill(self, value):
        s = cuda.get_current_stream()
        dst = _graph.weak([self])[0] if _standin.capturing(s) else None
        _standin.launch(s, writes=[self._alloc], what="ndarray.fill",
                        replay=None if dst is None else lambda: dst._a.fill(value))
        self._a.fill(value)

    T = property(lambda s: s.transpose())
    real = property(lambda s: _call(lambda a: a.real, (s,), {}, "real"))

    def _binop(name, inplace=False):
        def op(self, other):
            if isinstance(other, _np.ndarray) and not isinstance(other, ndarray):
                raise TypeError("operand type <class 'numpy.ndarray'> is not a cupy.ndarray")
            r = _call(lambda a, b: getattr(a, name)(b), (self, other), {}, name)
            if inplace:
                _standin.launch(cuda.get_current_stream(), writes=[self._alloc], what=name, covered=True)
                return self
            return r
        op.__name__ = name
        return op

    for _n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
               "lshift", "rshift"):
        locals()[f"__{_n}__"] = _binop(f"__{_n}__")
        locals()[f"__r{_n}__"] = _binop(f"__r{_n}__")
        locals()[f"__i{_n}__"] = _binop(f"__i{_n}__", inplace=True)
    for _n in ("lt", "le", "gt", "ge", "eq", "ne"):
        locals()[f"__{_n}__"] = _binop(f"__{_n}__")
    del _n
    __hash__ = None

    def __neg__(self):
        return _call(lambda a: -a, (self,), {}, "negative")

    def __abs__(self):
        return _call(lambda a: abs(a), (self,), {}, "absolute")

    def __invert__(self):
        return _call(lambda a: ~a, (self,), {}, "invert")


# ---------------------------------------------------------------- creation and transfers
def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    src = _np.asarray(a, dtype=dtype, order=order)
    if _standin._active:
        _graph.on_host_to_device(cuda.get_current_stream(), "cupy.asarray")
    out = ndarray(src.shape, src.dtype)
    out._a[...] = src
    # CUDA: a copy from pageable host memory to the device synchronises the stream before it starts (the
    # host waits for the device); seen on a real GPU, where uploading a batch's labels here stalled the step
    _standin.count_sync("upload from pageable host memory")
    _standin.launch(cuda.get_current_stream(), writes=[out._alloc], what="cupy.asarray (upload)")
    return out


def bincount(x, weights=None, minlength=0):
    # CuPy sizes the result from the input's maximum (and checks its minimum), read on the host
    _standin.count_sync("cupy.bincount reads its input's range")
    return _call(_np.bincount, (x,), {"weights": weights, "minlength": minlength}, "cupy.bincount")


def array(a, dtype=None, copy=True, order="K", ndmin=0):
    if isinstance(a, ndarray):
        r = a.astype(dtype or a.dtype, copy=True)
        return r
    return asarray(_np.array(a, dtype=dtype, ndmin=ndmin))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    return _np.asarray(a, order=order)


def get_array_module(*args):
    return _this if any(isinstance(a, ndarray) for a in args) else _np


def _creator(name):
    f = getattr(_np, name)

    def create(*args, **kwargs):
        r = f(*args, **kwargs)
        out = ndarray(r.shape, r.dtype)
        s = cuda.get_current_stream()
        dst = _graph.weak([out])[0] if _standin.capturing(s) and name != "empty" else None
        _standin.launch(s, writes=[out._alloc], what=f"cupy.{name}", covered=name == "empty",
                        replay=None if dst is None else lambda: dst._a.__setitem__(Ellipsis, r))
        out._a[...] = r
        return out
    create.__name__ = name
    return create


for _n in ("zeros", "ones", "empty", "full", "arange", "linspace", "eye", "identity"):
    globals()[_n] = _creator(_n)


def _like(name):
    def create(a, dtype=None, *args, **kwargs):
        if not isinstance(a, ndarray):
            raise TypeError(f"cupy.{name}: unsupported type {type(a)}")
        dt = dtype or a.dtype
        if name == "full_like":
            return globals()["full"](a.shape, args[0] if args else kwargs.pop("fill_value"), dtype=dt)
        return globals()[name[:-5]](a.shape, *args, dtype=dt, **kwargs)
    return create


for _n in ("zeros_like", "ones_like", "empty_like", "full_like"):
    globals()[_n] = _like(_n)
del _n


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"cupy.ascontiguousarray: unsupported type {type(a)}")
    return _call(_np.ascontiguousarray, (a,), {"dtype": dtype}, "cupy.ascontiguousarray")


class _StrideTricks(_types.ModuleType):
    @staticmethod
    def as_strided(x, shape=None, strides=None):
        return _call(lambda a: _np.lib.stride_tricks.as_strided(a, shape, strides), (x,), {}, "as_strided")


lib = _types.ModuleType("cupy.lib")
lib.stride_tricks = _StrideTricks("cupy.lib.stride_tricks")


from cupy._kernels import ElementwiseKernel as ElementwiseKernel  # noqa: E402  (compiled on the host)
from cupy._kernels import ReductionKernel as ReductionKernel  # noqa: E402


_default_pool = cuda.MemoryPool()


def get_default_memory_pool():
    """A pool with CuPy's name; the stand-in's default allocator is not a pool (fresh allocations), so this
    one serves arrays only where its ``malloc`` is made the allocator (``cupy.cuda.set_allocator``)."""
    return _default_pool


class RawKernel:
    def __init__(self, *a, **k):
        raise NotImplementedError("the stand-in has no RawKernel (CUDA source with thread indices)")


def __getattr__(name):
    """Any other NumPy name: dtypes and constants as is, functions wrapped to require device operands."""
    try:
        obj = getattr(_np, name)
    except AttributeError:
        raise AttributeError(f"module 'cupy' (stand-in) has no attribute {name!r}") from None
    if isinstance(obj, type) or not callable(obj):
        return obj
    if isinstance(obj, _np.ufunc):
        def uf(*args, **kwargs):
            return _call(obj, args, kwargs, f"cupy.{name}")

        def at(a, indices, b=None):  # in place on ``a`` (CuPy >= 12: an atomic scatter)
            extra = () if b is None else (b,)
            _call(lambda i, *v, out: obj.at(out, i, *v), (indices,) + extra, {"out": a}, f"cupy.{name}.at")
        uf.__name__, uf.at = name, at
        return uf

    def fn(*args, **kwargs):
        return _call(obj, args, kwargs, f"cupy.{name}")
    fn.__name__ = name
    return fn


import sys as _sys  # noqa: E402
_this = _sys.modules[__name__]
