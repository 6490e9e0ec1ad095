"""cuDNN's convolutions on CuPy arrays through cuDNN Frontend (the ``cudnn`` module of PyPI
``nvidia-cudnn-frontend``, lbannpy's ``gpu`` extra).

Same signatures and semantics as the own kernels of :mod:`.conv` and the ATen set of :mod:`.aten` (valid
convolutions of the window a layer hands over, or of its block padded inside the kernel with ``padding``;
1, 2 or 3 spatial dimensions, a line run as a plane of one row; groups read from the filter's shape;
float32 or float64), so a layer can take this set (:mod:`.select`). Each pass of each convolution shape is
one cuDNN Frontend graph (fprop for the forward, dgrad for the data gradient, wgrad for the filter
gradient), built once and kept, keyed by its shapes, geometry, type and device: the graph, cuDNN's choice
of engine and its workspace (a CuPy buffer of the size the plan asks, allocated with the plan and reused
by every call) come into being on the first call of a shape, which in a training run is an eager warm-up
step, never a captured one. A call is then a host call that sets the handle's stream to CuPy's current
stream and enqueues the plan's kernels on it: ordered with the surrounding CuPy work without a host
synchronisation, and recorded like any CuPy kernel when that stream is being captured into the step's
CUDA graph (:mod:`lbannpy.training.graphstep`). The results are CuPy arrays from CuPy's allocator (the
capture's pool under a capture), unlike ATen's, whose outputs come from torch's allocator.

Float32 stays float32 (cuDNN's engines that round operands to TF32 or run tensor-core approximations are
left out) unless ``runtime.tf32`` (:func:`set_tf32`); float64 runs in double. Engines cuDNN marks
non-deterministic are left out too, so that a step replayed from a graph computes what the eager step
computed, bit for bit. The bias is added, and its gradient summed, by CuPy kernels. ``cudnn`` is imported
on first use only, and only for a GPU run (:func:`available`).
"""
from __future__ import annotations

_cudnn = None
#: whether float32 convolutions may run as TF32 (``runtime.tf32``); part of each plan's key
TF32 = False
_HANDLES: dict = {}  # device id -> cuDNN handle
_PLANS: dict = {}    # (pass, device, shapes, geometry, dtype, tf32) -> Plan


def module():
    """The ``cudnn`` module, imported once."""
    global _cudnn
    if _cudnn is None:
        import cudnn  # optional dependency (the gpu extra): imported for GPU runs only

        _cudnn = cudnn
    return _cudnn


def available(device: str = "gpu") -> bool:
    """Whether this set can run here: a GPU run, cuDNN Frontend imports and its cuDNN library answers (a
    CPU run never imports it)."""
    return device == "gpu" and missing() is None


def missing() -> str | None:
    """Why cuDNN Frontend cannot run here, or None: not installed, or installed without the cuDNN library
    it loads (the frontend imports without it and fails at its first call into cuDNN, so that call is made
    here, once: the library's version)."""
    global _MISSING
    if _MISSING is False:
        try:
            module().backend_version()
            _MISSING = None
        except ImportError as exc:
            _MISSING = f"cuDNN Frontend is not installed ({exc})"
        except Exception as exc:  # noqa: BLE001 - the library's own error, whatever its class
            _MISSING = f"cuDNN Frontend cannot load the cuDNN library ({exc})"
    return _MISSING


_MISSING: str | None | bool = False  # False: not asked yet


def set_tf32(on: bool) -> None:
    """Whether float32 convolutions may run on TF32 tensor cores (``runtime.tf32``); plans made before
    keep what they were made with (the flag is part of their key)."""
    global TF32
    TF32 = bool(on)


def _tuple(v, nd: int) -> tuple:
    return tuple(int(s) for s in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


def row_major(shape) -> list:
    """Row-major (C-contiguous) element strides of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return out[::-1]


def _geometry(x_shape, w_shape, stride, dilation, padding):
    """``(x, w, y shapes, stride, padding, dilation)`` as cuDNN takes them: a line (one spatial dimension)
    becomes a plane of one row, since cuDNN convolves 2-D and 3-D images."""
    x_shape, w_shape = tuple(int(n) for n in x_shape), tuple(int(n) for n in w_shape)
    nd = len(x_shape) - 2
    s, p, d = _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd)
    y_sp = tuple((n + 2 * pi - di * (k - 1) - 1) // si + 1
                 for n, k, si, pi, di in zip(x_shape[2:], w_shape[2:], s, p, d))
    y_shape = (x_shape[0], w_shape[0]) + y_sp
    if nd == 1:
        x_shape, w_shape, y_shape = (x_shape[:2] + (1,) + x_shape[2:], w_shape[:2] + (1,) + w_shape[2:],
                                     y_shape[:2] + (1,) + y_shape[2:])
        s, p, d = (1,) + s, (0,) + p, (1,) + d
    return x_shape, w_shape, y_shape, s, p, d


class Plan:
    """One built cuDNN Frontend graph of one pass: its tensors by role and its workspace (also the plans of
    :mod:`.cudnn_bn`)."""

    __slots__ = ("graph", "tensors", "workspace", "handle")

    def __init__(self, graph, tensors: dict, workspace, handle):
        self.graph, self.tensors, self.workspace, self.handle = graph, tensors, workspace, handle

    def run(self, cp, arrays: dict) -> None:
        """Enqueue the plan on CuPy's current stream with ``arrays`` (C-contiguous CuPy arrays by role)."""
        cd = module()
        cd.set_stream(handle=self.handle, stream=cp.cuda.get_current_stream().ptr)
        self.graph.execute({self.tensors[role]: a.data.ptr for role, a in arrays.items()},
                           self.workspace.data.ptr, handle=self.handle)


def data_type(cd, dtype):
    """cuDNN's data type of a float32 or float64 NumPy/CuPy ``dtype``."""
    char = getattr(dtype, "char", None)
    if char == "f":
        return cd.data_type.FLOAT
    if char == "d":
        return cd.data_type.DOUBLE
    raise TypeError(f"cuDNN kernels take float32 or float64 arrays, got {dtype}")


def device_handle(cp):
    """``(device id, its cuDNN handle)`` of the current device: one handle per device, made on first use."""
    dev = int(cp.cuda.runtime.getDevice())
    h = _HANDLES.get(dev)
    if h is None:
        h = _HANDLES[dev] = module().create_handle()
    return dev, h


def _plan(cp, kind: str, x_shape, w_shape, y_shape, stride, padding, dilation, dtype) -> Plan:
    """The plan of pass ``kind`` (fprop, dgrad, wgrad) for these shapes, built on first use and kept."""
    dev, handle = device_handle(cp)
    key = (kind, dev, x_shape, w_shape, y_shape, stride, padding, dilation, dtype.char,
           TF32 and dtype.char == "f")
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _build(cp, handle, kind, x_shape, w_shape, y_shape, stride, padding, dilation,
                                    dtype)
    return plan


def _build(cp, handle, kind, x_shape, w_shape, y_shape, stride, padding, dilation, dtype) -> Plan:
    cd = module()
    dt = data_type(cd, dtype)
    g = cd.pygraph(io_data_type=dt, intermediate_data_type=dt, compute_data_type=dt, handle=handle)

    def tensor(name, shape):
        return g.tensor(name=name, dim=list(shape), stride=row_major(shape), data_type=dt)

    geo = dict(padding=list(padding), stride=list(stride), dilation=list(dilation), compute_data_type=dt)
    if kind == "fprop":
        x, w = tensor("x", x_shape), tensor("w", w_shape)
        out, shape = g.conv_fprop(image=x, weight=w, name="fprop", **geo), y_shape
        tensors = {"x": x, "w": w, "y": out}
    elif kind == "dgrad":
        dy, w = tensor("dy", y_shape), tensor("w", w_shape)
        out, shape = g.conv_dgrad(loss=dy, filter=w, name="dgrad", **geo), x_shape
        tensors = {"dy": dy, "w": w, "dx": out}
    else:
        x, dy = tensor("x", x_shape), tensor("dy", y_shape)
        out, shape = g.conv_wgrad(image=x, loss=dy, name="wgrad", **geo), w_shape
        tensors = {"x": x, "dy": dy, "dw": out}
    out.set_output(True).set_dim(list(shape)).set_stride(row_major(shape)).set_data_type(dt)
    return finish(cp, g, tensors, handle, exact_float32=dtype.char == "f" and not TF32)


def finish(cp, g, tensors: dict, handle, exact_float32: bool) -> Plan:
    """Validate and plan the graph ``g`` (set-up work, never inside a capture) and allocate its workspace:
    the :class:`Plan` of it. Engines cuDNN marks non-deterministic are left out, and with
    ``exact_float32`` (a float32 graph that stays float32) those that round operands down or run
    tensor-core approximations."""
    cd = module()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cd.heur_mode.A, cd.heur_mode.FALLBACK])
    notes = [cd.numerical_note.NONDETERMINISTIC]  # a replayed step computes what the eager one did
    if exact_float32:  # float32 stays float32: no TF32 tensor cores, no down-conversion
        notes += [cd.numerical_note.TENSOR_CORE, cd.numerical_note.DOWN_CONVERT_INPUTS]
    g.deselect_numeric_notes(notes)
    g.check_support()
    g.build_plans()
    # one byte at least: a live allocation to point at where the plan needs none
    workspace = cp.empty(max(int(g.get_workspace_size()), 1), dtype=cp.uint8)
    return Plan(g, tensors, workspace, handle)


def cupy_module():
    """CuPy, the array module of every argument here."""
    import cupy  # the array module of every argument here (a GPU run has it)

    return cupy


def contiguous(cp, a):
    """``a``, or a C-contiguous copy of it (what a plan's dense tensors take)."""
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def _result(cp, shape, dtype, out):
    """Where a pass writes: ``out`` itself when the plan can write it (C-contiguous, of the shape and
    type), else a fresh array (copied into ``out`` afterwards by :func:`_give`)."""
    if out is not None and out.flags.c_contiguous and out.dtype == dtype and tuple(out.shape) == shape:
        return out
    return cp.empty(shape, dtype=dtype)


def _give(res, out):
    if out is None or res is out:
        return res
    out[...] = res
    return out


def _check(x, w):
    if x.dtype != w.dtype:
        raise TypeError(f"cuDNN kernels take operands of one type, got {x.dtype} and {w.dtype}")
    if x.ndim not in (3, 4, 5) or w.ndim != x.ndim:
        raise ValueError(f"cuDNN kernels convolve (N, C, *spatial) arrays of 1 to 3 spatial dimensions, "
                         f"got {x.shape} with filters {w.shape}")


def conv_forward(x_window, w, b=None, stride=1, dilation=1, out=None, padding=0):
    """Valid convolution of the window: ``(N, F, *out)``; with ``padding`` (both sides of each spatial
    dimension) the window is the input block, padded with zeros inside the kernel."""
    cp = cupy_module()
    _check(x_window, w)
    xs, ws, ys, s, p, d = _geometry(x_window.shape, w.shape, stride, dilation, padding)
    shape = (ys[:2] + ys[3:]) if x_window.ndim == 3 else ys
    if min(shape[2:]) < 1:
        raise ValueError(f"a {tuple(w.shape[2:])} filter does not fit the window {tuple(x_window.shape)}")
    y = _result(cp, shape, x_window.dtype, out)
    plan = _plan(cp, "fprop", xs, ws, ys, s, p, d, x_window.dtype)
    plan.run(cp, {"x": contiguous(cp, x_window).reshape(xs), "w": contiguous(cp, w).reshape(ws),
                  "y": y.reshape(ys)})
    if b is not None:
        y += b.reshape((1, -1) + (1,) * (y.ndim - 2))
    return _give(y, out)


def conv_backward_input(dy, w, x_window, stride=1, dilation=1, out=None, padding=0):
    """Gradient w.r.t. the window, of ``x_window``'s shape (only its shape is read)."""
    cp = cupy_module()
    _check(dy, w)
    xs, ws, ys, s, p, d = _geometry(x_window.shape, w.shape, stride, dilation, padding)
    shape = tuple(int(n) for n in x_window.shape)
    dx = _result(cp, shape, dy.dtype, out)
    plan = _plan(cp, "dgrad", xs, ws, ys, s, p, d, dy.dtype)
    plan.run(cp, {"dy": contiguous(cp, dy).reshape(ys), "w": contiguous(cp, w).reshape(ws),
                  "dx": dx.reshape(xs)})
    return _give(dx, out)


def conv_backward_params(x_window, dy, w, bias=False, stride=1, dilation=1, padding=0):
    """``(filter gradient of w's shape, bias gradient or None)``."""
    cp = cupy_module()
    _check(x_window, w)
    xs, ws, ys, s, p, d = _geometry(x_window.shape, w.shape, stride, dilation, padding)
    dw = cp.empty(tuple(int(n) for n in w.shape), dtype=x_window.dtype)
    plan = _plan(cp, "wgrad", xs, ws, ys, s, p, d, x_window.dtype)
    plan.run(cp, {"x": contiguous(cp, x_window).reshape(xs), "dy": contiguous(cp, dy).reshape(ys),
                  "dw": dw.reshape(ws)})
    db = None
    if bias:
        db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    return dw, db


def planned() -> int:
    """How many plans this process holds (every pass of every shape it has convolved)."""
    return len(_PLANS)
