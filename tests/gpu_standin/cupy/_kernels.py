"""The stand-in's ``cupy.ElementwiseKernel``: CuPy's argument rules, the kernel body compiled by the host's
C++ compiler into a loop over the elements, one checked launch on the current stream.

A real ElementwiseKernel compiles its operation as CUDA C++ with each non-raw parameter bound to the
element at index ``i`` (``const T x`` for inputs, ``T &y`` for outputs); here the same text is compiled by
``g++`` with the same bindings, so a kernel's arithmetic is checked on every CI run, not only on a GPU.
Supported: type placeholders (one-letter or other non-dtype names, bound from the arguments' dtypes),
concrete dtypes (``float32``, ``int32``, ...), scalars, broadcasting of the non-raw arguments, outputs given
or allocated, ``raw`` parameters as flat pointers (``x[j]``), ``preamble``, ``size=``. CUDA's ``max``,
``min`` and ``rsqrt`` are provided; anything else of CUDA's (``_ind``, ``CArray`` methods, intrinsics) does
not compile, which fails the kernel's construction loudly rather than running something else.
"""
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading

import numpy as _np

from cupy import _standin

_DTYPES = {"bool": _np.bool_, "int8": _np.int8, "int16": _np.int16, "int32": _np.int32, "int64": _np.int64,
           "uint8": _np.uint8, "uint16": _np.uint16, "uint32": _np.uint32, "uint64": _np.uint64,
           "float16": _np.float16, "float32": _np.float32, "float64": _np.float64}
_CTYPE = {"bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
          "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
          "float32": "float", "float64": "double"}
_SCALAR = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16, "int32": ctypes.c_int32,
           "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16,
           "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64, "float32": ctypes.c_float,
           "float64": ctypes.c_double}
_HEADER = """#include <cmath>
#include <cstdint>
#include <algorithm>
using std::max; using std::min; using std::sqrt; using std::exp; using std::log; using std::abs;
static inline float rsqrt(float v) { return 1.0f / std::sqrt(v); }
static inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
"""
_lock = threading.Lock()
_libs: dict = {}


class _Param:
    __slots__ = ("raw", "type", "name")

    def __init__(self, text):
        words = text.split()
        if not 2 <= len(words) <= 3 or (len(words) == 3 and words[0] != "raw"):
            raise ValueError(f"ElementwiseKernel: bad parameter {text!r}")
        self.raw = len(words) == 3
        self.type, self.name = words[-2], words[-1]

    @property
    def placeholder(self):
        return self.type not in _DTYPES


def _params(text):
    return [_Param(p) for p in text.split(",") if p.strip()]


def _build_dir():
    d = os.environ.get("LBANNPY_STANDIN_KERNEL_DIR") or os.path.join(
        tempfile.gettempdir(), f"lbannpy-standin-kernels-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    return d


def _compile(source):
    """The shared library of ``source`` (compiled once per text: cached by hash on disk and in memory)."""
    key = hashlib.sha1(source.encode()).hexdigest()[:20]
    with _lock:
        lib = _libs.get(key)
        if lib is not None:
            return lib
        d = _build_dir()
        so = os.path.join(d, f"k{key}.so")
        if not os.path.exists(so):
            src = os.path.join(d, f"k{key}.{os.getpid()}.cpp")
            tmp = f"{so}.{os.getpid()}.tmp"
            with open(src, "w") as f:
                f.write(source)
            r = subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", tmp, src], capture_output=True,
                               text=True)
            os.unlink(src)
            if r.returncode:
                raise RuntimeError(f"ElementwiseKernel: the kernel does not compile:\n{r.stderr[-3000:]}\n"
                                   f"--- source ---\n{source}")
            os.replace(tmp, so)
        lib = _libs[key] = ctypes.CDLL(so)
        return lib


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True, preamble="",
                 no_return=False, return_tuple=False, **kwargs):
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        names = [p.name for p in self.in_params + self.out_params]
        if len(set(names)) != len(names):
            raise ValueError(f"ElementwiseKernel {name}: duplicate parameter names {names}")
        self.operation, self.name, self.preamble = operation, name, preamble
        self.no_return, self.return_tuple = no_return, return_tuple

    # -- types -------------------------------------------------------------------------------------------
    def _bind_types(self, args):
        from cupy import ndarray

        types = {}
        for p, a in zip(self.in_params + self.out_params, args):
            if p.placeholder and isinstance(a, ndarray):
                seen = types.setdefault(p.type, a.dtype)
                if seen != a.dtype:
                    raise TypeError(f"ElementwiseKernel {self.name}: type is mismatched: {p.type} is "
                                    f"{seen} and {a.dtype}")
        for p, a in zip(self.in_params, args):
            if p.placeholder and p.type not in types and a is not None:
                types[p.type] = _np.result_type(a)
        for p in self.in_params + self.out_params:
            if p.placeholder and p.type not in types:
                raise TypeError(f"ElementwiseKernel {self.name}: cannot determine the type of {p.type}")
        return {k: _np.dtype(v) for k, v in types.items()}

    def _dtype(self, p, types):
        return types[p.type] if p.placeholder else _np.dtype(_DTYPES[p.type])

    def _checked(self, args):
        """The arguments padded with None for outputs not given, after CuPy's checks (count, host arrays,
        device)."""
        from cupy import ndarray

        kind = type(self).__name__
        n_in, n_out = len(self.in_params), len(self.out_params)
        if len(args) not in (n_in, n_in + n_out):
            raise TypeError(f"Wrong number of arguments for {self.name!r}: {len(args)} given, "
                            f"{n_in} or {n_in + n_out} expected")
        dev = _standin.local.device
        for a in args:
            if isinstance(a, _np.ndarray):
                raise TypeError(f"{kind} {self.name}: unsupported type <class 'numpy.ndarray'>")
            if isinstance(a, ndarray) and a._alloc.device != dev:
                raise ValueError(f"{kind} {self.name}: array on device {a._alloc.device} used while device "
                                 f"{dev} is current")
        return list(args) + [None] * (n_in + n_out - len(args))

    def _outputs(self, full, types, shape, stream, run):
        """The outputs (given, checked against ``shape``, or allocated), after one launch on ``stream``
        that reads the inputs and writes them; ``run(inputs, outputs)`` is the kernel's work (a capture
        records it for the graph's launches)."""
        from cupy import cuda, ndarray

        n_in, outs = len(self.in_params), []
        for p, a in zip(self.out_params, full[n_in:]):
            dt = self._dtype(p, types)
            if a is None:
                a = ndarray(shape, dt)
            elif not isinstance(a, ndarray):
                raise TypeError(f"{type(self).__name__} {self.name}: output {p.name} must be an array")
            elif a.dtype != dt or (not p.raw and a.shape != shape):
                raise ValueError(f"{type(self).__name__} {self.name}: output {p.name} is {a.dtype}{a.shape}, "
                                 f"the kernel writes {dt}{shape}")
            outs.append(a)
        reads = [a._alloc for a in full[:n_in] if isinstance(a, ndarray)]
        s = stream or cuda.get_current_stream()
        replay = None
        if _standin.capturing(s):
            from cupy.cuda import _graph
            ins, wouts = _graph.weak(full[:n_in]), _graph.weak(outs)
            replay = lambda: run(ins, wouts)  # noqa: E731
        _standin.launch(s, reads=reads, writes=[o._alloc for o in outs], what=f"kernel {self.name}",
                        replay=replay)
        return outs

    # -- the call ----------------------------------------------------------------------------------------
    def __call__(self, *args, size=None, stream=None, block_size=None):
        from cupy import ndarray

        full = self._checked(args)
        n_in = len(self.in_params)
        types = self._bind_types(full)
        params = self.in_params + self.out_params
        shaped = [a._a.shape for p, a in zip(params, full) if isinstance(a, ndarray) and not p.raw]
        if shaped:
            shape = _np.broadcast_shapes(*shaped)
        elif size is not None:
            shape = (int(size),)
        else:
            raise ValueError(f"ElementwiseKernel {self.name}: no array argument; pass size=")
        outs = self._outputs(full, types, shape, stream, lambda i, o: self._run(i, o, shape, types))
        self._run(full[:n_in], outs, shape, types)
        if self.no_return:
            return None
        if len(outs) == 1 and not self.return_tuple:
            return outs[0]
        return tuple(outs)

    def _run(self, ins, outs, shape, types):
        n = int(_np.prod(shape))
        cargs, kinds, keep, back = self._cargs(ins, outs, shape, types)
        fn = getattr(_compile(self._source(types, kinds)), "standin_kernel")
        fn.restype = None
        fn(ctypes.c_int64(n), *cargs)
        for o, h in back:
            o._a[...] = h

    def _cargs(self, ins, outs, shape, types):
        """The C arguments (host copies of the inputs broadcast to ``shape``, the outputs' memory), their
        kinds (``ptr`` or a dtype name), the copies to keep alive, and (output, copy) pairs to write back."""
        from cupy import ndarray

        cargs, kinds, keep, back = [], [], [], []
        for p, a in zip(self.in_params, ins):
            dt = self._dtype(p, types)
            if isinstance(a, ndarray):
                h = a._a if p.raw else _np.broadcast_to(a._a, shape)
                if h.dtype != dt:
                    if not _np.can_cast(h.dtype, dt, "same_kind"):
                        raise TypeError(f"{type(self).__name__} {self.name}: cannot cast {p.name} from "
                                        f"{h.dtype} to {dt}")
                    h = h.astype(dt)
                h = _np.ascontiguousarray(h)
                keep.append(h)
                cargs.append(ctypes.c_void_p(h.ctypes.data))
                kinds.append("ptr")
            else:
                kind = _np.dtype(dt).name
                cargs.append(_SCALAR[kind](_np.asarray(a).astype(dt).item()))
                kinds.append(kind)
        for o in outs:
            h = o._a if o._a.flags.c_contiguous else _np.ascontiguousarray(o._a)
            if h is not o._a:
                back.append((o, h))
            cargs.append(ctypes.c_void_p(h.ctypes.data))
            kinds.append("ptr")
        return cargs, kinds, keep, back

    def _source(self, types, kinds):
        lines = [_HEADER]
        for k, dt in sorted(types.items()):
            if dt.name not in _CTYPE:
                raise TypeError(f"ElementwiseKernel {self.name}: the stand-in has no C type for {dt}")
            lines.append(f"typedef {_CTYPE[dt.name]} {k};")
        lines.append(self.preamble)
        sig, bind = ["int64_t _n"], []
        for p, kind in zip(self.in_params + self.out_params, kinds):
            ct = p.type if p.placeholder else _CTYPE[p.type]
            out = p in self.out_params
            if kind != "ptr":
                sig.append(f"const {ct} {p.name}")
            elif p.raw:
                sig.append(f"{'' if out else 'const '}{ct} *{p.name}")
            else:
                sig.append(f"{'' if out else 'const '}{ct} *_p_{p.name}")
                bind.append(f"{ct} &{p.name} = _p_{p.name}[i];" if out else
                            f"const {ct} {p.name} = _p_{p.name}[i];")
        lines.append(f'extern "C" void standin_kernel({", ".join(sig)}) {{')
        lines.append("  for (int64_t i = 0; i < _n; ++i) {")
        lines += ["    " + b for b in bind]
        lines.append("    " + self.operation)
        lines.append("  }\n}")
        return "\n".join(lines) + "\n"


class ReductionKernel(ElementwiseKernel):
    """``cupy.ReductionKernel``: ``map_expr`` of each element (the inputs broadcast together), folded by
    ``reduce_expr`` (``a``, ``b``) from ``identity`` in ``reduce_type``, then ``post_map_expr`` (``a``: the
    folded value) into the outputs, over ``axis`` (default: all axes). The fold runs in order over the
    reduced elements, where a GPU uses a tree: equal up to round-off for an associative ``reduce_expr``."""

    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                 name="reduce_kernel", reduce_type=None, reduce_dims=True, preamble="", **kwargs):
        super().__init__(in_params, out_params, "", name, preamble=preamble)
        if identity is None or not str(identity).strip():
            raise ValueError(f"ReductionKernel {name}: the stand-in needs an identity")
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.identity, self.reduce_type = str(identity), reduce_type

    def __call__(self, *args, axis=None, keepdims=False, stream=None):
        from cupy import ndarray

        full = self._checked(args)
        n_in = len(self.in_params)
        types = self._bind_types(full)
        shape = _np.broadcast_shapes(*[a._a.shape for p, a in zip(self.in_params, full[:n_in])
                                       if isinstance(a, ndarray) and not p.raw])
        nd = len(shape)
        axes = tuple(range(nd)) if axis is None else tuple(
            sorted({int(ax) % nd for ax in ((axis,) if isinstance(axis, int) else axis)}))
        kept = [d for d in range(nd) if d not in axes]
        out_shape = tuple(1 if d in axes else shape[d] for d in range(nd)) if keepdims else \
            tuple(shape[d] for d in kept)
        nred = int(_np.prod([shape[d] for d in axes]))
        nout = int(_np.prod([shape[d] for d in kept]))
        order = kept + list(axes)

        def run(args, outs):
            ins = []  # each non-raw input broadcast, the reduced axes last, flattened: i = _o * nred + _r
            for p, a in zip(self.in_params, args):
                if isinstance(a, ndarray) and not p.raw:
                    h = _np.ascontiguousarray(_np.transpose(_np.broadcast_to(a._a, shape), order)).reshape(-1)
                    a = ndarray._view(h, a._alloc, own=False)
                ins.append(a)
            cargs, kinds, keep, back = self._cargs(ins, outs, (nout * nred,), types)
            fn = getattr(_compile(self._source(types, kinds)), "standin_kernel")
            fn.restype = None
            fn(ctypes.c_int64(nout), ctypes.c_int64(nred), *cargs)
            for o, h in back:
                o._a[...] = h

        outs = self._outputs(full, types, out_shape, stream, run)
        run(full[:n_in], outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _source(self, types, kinds):
        src = super()._source(types, kinds)
        out0 = self.out_params[0]
        rtype = self.reduce_type or (out0.type if out0.placeholder else _CTYPE[out0.type])
        head, _, _ = src.partition("  for (int64_t i = 0; i < _n; ++i) {")
        head = head.replace("standin_kernel(int64_t _n,", "standin_kernel(int64_t _nout, int64_t _nred,")
        binds_in, binds_out = [], []
        for p, kind in zip(self.in_params + self.out_params, kinds):
            ct = p.type if p.placeholder else _CTYPE[p.type]
            if kind != "ptr" or p.raw:
                continue
            if p in self.out_params:
                binds_out.append(f"{ct} &{p.name} = _p_{p.name}[_o];")
            else:
                binds_in.append(f"const {ct} {p.name} = _p_{p.name}[i];")
        body = [f"  typedef {rtype} _type_reduce;",
                "  for (int64_t _o = 0; _o < _nout; ++_o) {",
                f"    _type_reduce _acc = (_type_reduce)({self.identity});",
                "    for (int64_t _r = 0; _r < _nred; ++_r) {",
                "      const int64_t i = _o * _nred + _r;"]
        body += ["      " + b for b in binds_in]
        body += [f"      const _type_reduce _m = (_type_reduce)({self.map_expr});",
                 f"      {{ const _type_reduce a = _acc, b = _m; _acc = ({self.reduce_expr}); }}",
                 "    }"]
        body += ["    " + b for b in binds_out]
        body += [f"    {{ const _type_reduce a = _acc; {self.post_map_expr}; }}", "  }", "}"]
        return head + "\n".join(body) + "\n"
