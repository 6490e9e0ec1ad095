"""The cuDNN stand-in's checks: node geometry and support, the device and stream of an ``execute``, and the
binding of caller buffers (CuPy stand-in arrays or raw pointers) to the graph's declared tensors.

Error types follow the real binding: a graph no engine supports raises ``cudnnGraphNotSupportedError``
(CUDNN_STATUS_NOT_SUPPORTED), other cuDNN statuses and frontend state errors ``RuntimeError``, a bad
buffer or variant pack ``ValueError`` (cuDNN Frontend 1.32's variant-pack normaliser), a wrong Python type
``TypeError``. Refusals of what real cuDNN would not notice itself, but which corrupt memory or race on a
GPU (a workspace smaller than the plan's, a buffer of the wrong extent, a launch on a stream other than
the current one), raise the same types with a message saying what to do.
"""
import os
import sys

import numpy as np

import cudnn
from cudnn import _conv

# The refusals by name: a test turns one off (monkeypatch.setitem) to see the bad call go through without it.
RULES = {"workspace": True,   # a workspace smaller than get_workspace_size()
         "capture": True,     # a plan built during a stream capture
         "pointer": True,     # a buffer that is not a live allocation of the CuPy stand-in
         "extent": True,      # a buffer whose type or extent is not the tensor's declared one
         "stream": True,      # execute() while the current stream is not the handle's
         "built": True,       # execute() before build_plans()
         "device": True}      # a handle, or a buffer, of another device than the current one
_HERE = os.path.dirname(os.path.abspath(__file__))
_CUPY = os.path.join(os.path.dirname(_HERE), "cupy")


def np_dtype(dt):
    table = {cudnn.data_type.FLOAT: np.float32, cudnn.data_type.DOUBLE: np.float64,
             cudnn.data_type.HALF: np.float16}
    if dt not in table:
        raise cudnn.cudnnGraphNotSupportedError(
            f"the cuDNN stand-in's convolutions take FLOAT, DOUBLE or HALF tensors, not {dt}")
    return np.dtype(table[dt])


def caller():
    """``file:line`` of the first frame outside the stand-in packages (cudnn, cupy)."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith((_HERE, _CUPY)):
        f = f.f_back
    return "<unknown>" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"


# ---------------------------------------------------------------- streams and devices
def stream_of(ptr, handle=None):
    """The CuPy stand-in stream whose ``ptr`` this is, on the handle's device (None if none is known)."""
    from cupy import _standin, cuda
    dev = _standin.local.device if handle is None else handle._ordinal
    if ptr == 0:
        with cuda.Device(dev):
            return cuda.Stream.null
    cur = cuda.get_current_stream(dev)
    if cur.ptr == ptr:
        return cur
    return next((s for s in list(cuda._all_streams) if s.ptr == ptr), None)


def refuse_during_capture(what, handle):
    """Building a plan allocates device memory and loads kernels, which a stream capture refuses
    (cudaErrorStreamCaptureUnsupported, invalidating the capture): plans are built before
    ``begin_capture``."""
    from cupy import _standin, cuda
    from cupy.cuda import _graph
    if not RULES["capture"]:
        return
    streams = [cuda.get_current_stream()]
    if handle is not None and handle.backend_handle is not None:
        streams.append(stream_of(handle.stream or 0, handle))
    for s in streams:
        if s is not None and _standin.capturing(s):
            cap = _graph.capture_of(s)
            msg = (f"{what}: CUDNN_STATUS_EXECUTION_FAILED_CUDART (cudaErrorStreamCaptureUnsupported): a "
                   f"plan is built during {cap.describe()}; build the graph's plans at set-up, before the "
                   f"capture (at {caller()})")
            if cap.invalid is None:
                cap.invalid = msg
            raise RuntimeError(msg)


def execution_stream(h):
    """The stream an ``execute`` on handle ``h`` is enqueued on, and the current device."""
    from cupy import _standin, cuda
    if h is None:
        raise RuntimeError("execute(): no cuDNN handle (pass handle= to execute or to pygraph)")
    if not isinstance(h, cudnn.Handle):
        raise TypeError(f"expected a cudnn.Handle (from cudnn.create_handle()) or None, got "
                        f"{type(h).__name__}")
    if h.backend_handle is None:
        raise RuntimeError("execute(): CUDNN_STATUS_BAD_PARAM: the cuDNN handle was destroyed")
    dev = _standin.local.device
    if dev != h._ordinal and RULES["device"]:
        raise RuntimeError(f"execute(): CUDNN_STATUS_EXECUTION_FAILED: the cuDNN handle was created on "
                           f"device {h._ordinal} but device {dev} is current (one handle per device; make "
                           f"its device current with cupy.cuda.Device({h._ordinal}))")
    cur = cuda.get_current_stream()
    if cur.ptr != (h.stream or 0) and not RULES["stream"]:  # the work goes to the handle's stream regardless
        return stream_of(h.stream or 0, h) or cur, dev
    if cur.ptr != (h.stream or 0):
        raise _standin.RaceError(
            f"execute(): the cuDNN handle's stream is {h.stream or 0:#x} but the current CuPy stream is "
            f"{cur!r}: cuDNN would run on the handle's stream, unordered with the work that wrote its inputs "
            f"on the current one; call cudnn.set_stream(handle=h, stream=cupy.cuda.get_current_stream().ptr) "
            f"(at {caller()})")
    return cur, dev


# ---------------------------------------------------------------- node geometry and support
def _attr(n, key, sp, msg, default=None):
    v = n.params.get(key)
    if v is None:
        v = default
    if v is None:
        raise RuntimeError(f"{n.name}: {msg}")
    v = [int(x) for x in v]
    if len(v) != sp:
        raise RuntimeError(f"{n.name}: {key} {v} has {len(v)} entries for {sp} spatial dimensions")
    return v


def _geometry(n, sp):
    pad = n.params.get("padding")
    pre = _attr(n, "pre_padding", sp, "Pre padding not set.", pad)
    post = _attr(n, "post_padding", sp, "Post padding not set.", pad)
    stride = _attr(n, "stride", sp, "Conv strides not set.")
    dil = _attr(n, "dilation", sp, "Conv dilation not set.")
    if min(pre + post) < 0 or min(stride + dil) < 1:
        raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: padding {pre}/{post} must be >= 0, stride "
                           f"{stride} and dilation {dil} >= 1")
    return pre, post, stride, dil


def infer_dims(op, a, b, params):
    """The output dims the real builder infers at once (None where it cannot: a filter gradient's), with
    its defaults for what is not given yet (no padding, unit stride and dilation)."""
    if op == "conv_wgrad" or len(a) < 3 or len(a) != len(b):
        return None
    sp = len(a) - 2
    pad = params.get("padding")
    pre = params.get("pre_padding") or pad or [0] * sp
    post = params.get("post_padding") or pad or [0] * sp
    stride = params.get("stride") or [1] * sp
    dil = params.get("dilation") or [1] * sp
    try:
        if op == "conv_fprop":
            return [a[0], b[0]] + [_conv.out_extent(a[i + 2], pre[i], post[i], b[i + 2], stride[i], dil[i])
                                   for i in range(sp)]
        return [a[0], b[1]] + [(a[i + 2] - 1) * stride[i] + (b[i + 2] - 1) * dil[i] + 1 - pre[i] - post[i]
                               for i in range(sp)]
    except (IndexError, TypeError):
        return None


def validate_node(n):
    """Shapes of a convolution node (cuDNN's CUDNN_STATUS_BAD_PARAM cases), its output's inferred dims,
    stride and data type."""
    a, b = n.inputs.values()
    for t in (a, b):
        t.validate()
    sp = len(a.dim) - 2
    if not 1 <= sp <= 3 or len(b.dim) != sp + 2:
        raise RuntimeError(f"{n.name}: {n.op} takes 3-D to 5-D tensors of one rank, got {a.dim} and {b.dim}")
    pre, post, stride, dil = _geometry(n, sp)
    out = n.output
    if n.op == "conv_dgrad" and not out.dim:  # the real frontend infers it (ambiguous for strided convs)
        out.dim = infer_dims(n.op, a.dim, b.dim, n.params)
    if n.op == "conv_wgrad" and not out.dim:
        raise ValueError(f"Tensor '{out.name}' dims not set.")
    x_dim = {"conv_fprop": a.dim, "conv_dgrad": out.dim, "conv_wgrad": a.dim}[n.op]
    w_dim = {"conv_fprop": b.dim, "conv_dgrad": b.dim, "conv_wgrad": out.dim}[n.op]
    n_, c = x_dim[:2]
    k, cg = w_dim[:2]
    if len(x_dim) != sp + 2 or len(w_dim) != sp + 2 or cg < 1 or c % cg or k % (c // cg):
        raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: image {x_dim} and filter {w_dim} do not "
                           f"form a grouped convolution (C / filter C groups, K divisible by them)")
    y_dim = [n_, k] + [_conv.out_extent(x_dim[i + 2], pre[i], post[i], w_dim[i + 2], stride[i], dil[i])
                       for i in range(sp)]
    if min(y_dim) < 1:
        raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: image {x_dim} with filter {w_dim} gives no "
                           f"output")
    dy_dim = {"conv_fprop": out.dim, "conv_dgrad": a.dim, "conv_wgrad": b.dim}[n.op]
    if n.op == "conv_fprop" and not out.dim:
        out.dim = dy_dim = list(y_dim)
    if list(dy_dim) != y_dim:
        raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: the output (gradient) dims "
                           f"{list(dy_dim)} are not the convolution's {y_dim} (image {x_dim}, filter "
                           f"{w_dim}, padding {pre}/{post}, stride {stride}, dilation {dil})")
    if not out.stride:
        out.stride = [int(s) for s in np.cumprod([1] + out.dim[:0:-1])[::-1]]
    if out.data_type is None:
        g = out.owner
        out.data_type = g.intermediate_data_type if out.is_virtual else g.io_data_type
    n.geometry = (pre, post, stride, dil)


def check_node_support(n):
    """What no cuDNN engine runs: a virtual (fused) convolution output, mixed or unsupported types, a
    compute type other than the data's (DOUBLE data computes in DOUBLE, FLOAT and HALF in FLOAT)."""
    if n.output.is_virtual:
        raise cudnn.cudnnGraphNotSupportedError(
            f"{n.name}: its output {n.output.name!r} is virtual; the cuDNN stand-in runs convolution graphs "
            f"whose outputs are set_output(True)")
    types = {t.data_type for t in list(n.inputs.values()) + [n.output]}
    if len(types) != 1:
        raise cudnn.cudnnGraphNotSupportedError(
            f"{n.name}: operands of mixed data types {sorted(map(str, types))}")
    io = types.pop()
    np_dtype(io)
    want = cudnn.data_type.DOUBLE if io is cudnn.data_type.DOUBLE else cudnn.data_type.FLOAT
    if n.compute is not want:
        raise cudnn.cudnnGraphNotSupportedError(
            f"{n.name}: {io} convolutions compute in {want}, not {n.compute}")


def node_workspace(n):
    """The stand-in's workspace for a node's plan: none for a 1x1 unit-stride unpadded forward
    convolution, else a per-tap, per-channel scratch (nonzero, so a short workspace is caught)."""
    pre, post, stride, dil = n.geometry
    w = {"conv_fprop": n.inputs.get("weight"), "conv_dgrad": n.inputs.get("filter")}.get(n.op, n.output)
    taps = int(np.prod(w.dim[2:]))
    if n.op == "conv_fprop" and taps == 1 and set(stride) == {1} and not any(pre + post):
        return 0
    return -(-taps * w.dim[1] * 512 // 256) * 256


def no_overrides(override_uids, override_shapes, override_strides):
    if override_uids is not None or override_shapes is not None or override_strides is not None:
        raise ValueError("the cuDNN stand-in does not model execute-time shape or stride overrides")


# ---------------------------------------------------------------- buffers
def by_uid(g, tensor_dict, tensor_uids):
    """uid -> buffer from a variant pack keyed by Tensor, name or uid (or buffers beside ``tensor_uids``)."""
    if tensor_uids is not None:
        tensor_uids, bufs = list(tensor_uids), list(tensor_dict)
        if len(tensor_uids) != len(bufs) or len(set(tensor_uids)) != len(tensor_uids):
            raise ValueError(f"tensor_uids {tensor_uids} must be distinct, one per buffer ({len(bufs)} "
                             f"given)")
        return dict(zip(tensor_uids, bufs))
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"execute(): the variant pack must be a dict, got {type(tensor_dict).__name__}")
    out = {}
    for key, data in tensor_dict.items():
        if key is None:
            continue
        if isinstance(key, str):
            named = [t for t in g._tensors if t.name == key]
            if len(named) != 1:
                raise ValueError(f"tensor name {key!r} is {'ambiguous' if named else 'unknown'}; key the "
                                 f"variant pack by uid or Tensor")
            key = named[0]
        out[key.uid if hasattr(key, "uid") else int(key)] = data
    return out


def _span(t, itemsize):
    return (sum((d - 1) * s for d, s in zip(t.dim, t.stride)) + 1) * itemsize


def _layout_matches(t, data, dt):
    """A CuPy array describes the declared memory: the same dims and strides, or both dense row-major
    with the same number of elements (the real frontend re-describes such a buffer as the declaration)."""
    strides = [s // dt.itemsize for s in data.strides]
    if list(data.shape) == t.dim and strides == t.stride:
        return True
    row_major = [int(s) for s in np.cumprod([1] + t.dim[:0:-1])[::-1]]
    return data.flags.c_contiguous and t.stride == row_major and data.size == int(np.prod(t.dim))


def device_view(t, data, dev):
    """(allocation, NumPy view with the declared dims/strides/type) of the buffer bound to tensor ``t``."""
    import cupy
    dt = np_dtype(t.data_type)
    what = f"buffer for tensor uid {t.uid} ({t.name!r})"
    if isinstance(data, cupy.ndarray) and not RULES["extent"]:
        ptr = data.data.ptr
    elif isinstance(data, cupy.ndarray):
        if data.dtype != dt:
            raise ValueError(f"{what} is {data.dtype} but the graph declares {t.data_type}")
        if not _layout_matches(t, data, dt):
            raise ValueError(f"{what} has shape {list(data.shape)} and strides {list(data.strides)} (bytes) "
                             f"but the graph declares dim {t.dim} stride {t.stride} (elements)")
        ptr = data.data.ptr
    elif isinstance(data, int) and not isinstance(data, bool):
        ptr = data
    elif isinstance(data, np.ndarray):
        raise TypeError(f"{what} is a host numpy.ndarray, not device memory")
    else:
        raise TypeError(f"{what} must be a CuPy array or a device pointer (int), got {type(data).__name__}")
    alloc = live_allocation(ptr, _span(t, dt.itemsize) if RULES["extent"] else 0, what)
    if alloc.device != dev and RULES["device"]:
        raise ValueError(f"{what} is on device {alloc.device} but the handle and the current device are "
                         f"{dev}")
    off, span = ptr - alloc.ptr, _span(t, dt.itemsize)
    # past the allocation's end only with a rule off: there the bytes a GPU would read are garbage
    buf = alloc.buf
    if not 0 <= off <= alloc.buf.size - span:
        buf, off = np.zeros(span, np.uint8), 0
    view = np.ndarray(t.dim, dt, buffer=buf, offset=off, strides=[s * dt.itemsize for s in t.stride])
    return alloc, view


def live_allocation(ptr, nbytes, what):
    """The CuPy stand-in allocation holding [ptr, ptr + nbytes): a freed or foreign pointer would make cuDNN
    read or write memory that is not the caller's (CUDNN_STATUS_EXECUTION_FAILED, or silent corruption)."""
    from cupy import _standin
    try:
        return _standin.resolve(ptr, nbytes)
    except ValueError as e:
        if RULES["pointer"] or "not a live allocation" not in str(e):
            raise ValueError(f"{what}: {e}") from None
    return _standin.new_allocation(nbytes, _standin.local.device)  # what the GPU would scribble on


def workspace_allocation(ws, need, dev):
    """The workspace's allocation (None when the plan needs none and none is given); refuses one smaller
    than ``get_workspace_size()``."""
    import cupy
    from cupy import _standin
    short = RULES["workspace"]
    if ws is None:
        if need and short:
            raise ValueError(f"execute(): the plan needs a workspace of {need} bytes "
                             f"(get_workspace_size()) and none was given")
        return None
    if isinstance(ws, cupy.ndarray):
        if not ws.flags.c_contiguous:
            raise ValueError(f"the workspace buffer must be contiguous; got shape {ws.shape} strides "
                             f"{ws.strides}")
        if ws.nbytes < need and short:
            raise ValueError(f"execute(): the workspace has {ws.nbytes} bytes but the plan needs {need} "
                             f"(get_workspace_size()); allocate at least that many")
        ptr = ws.data.ptr
    elif isinstance(ws, int) and not isinstance(ws, bool):
        ptr = ws
    else:
        raise TypeError(f"execute(): the workspace must be a CuPy array or a device pointer, got "
                        f"{type(ws).__name__}")
    if not need or ws is None:
        return None
    try:
        alloc = _standin.resolve(ptr, need if short else min(need, getattr(ws, "nbytes", 1)))
    except ValueError as e:
        raise ValueError(f"execute(): the workspace is not {need} bytes of live device memory "
                         f"(get_workspace_size()): {e}") from None
    if alloc.device != dev:
        raise ValueError(f"execute(): the workspace is on device {alloc.device}, the handle on {dev}")
    return alloc
