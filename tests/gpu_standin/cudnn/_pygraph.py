"""``cudnn.pygraph`` of the stand-in: tensors, pass-by-value scalars, convolution and batch-norm nodes
(:mod:`cudnn._bn`), the planning sequence and ``execute``.

Planning is modelled as host work that must not happen inside a stream capture (graph building and engine
choice belong to set-up; real plan finalisation allocates and loads kernels, which a capture refuses).
``execute`` is one launch on the handle's stream: it reads the input allocations and writes the outputs and
the workspace, checked for stream order by the CuPy stand-in, and under capture it is recorded with a
replay that recomputes from the buffers' contents at every graph launch.
"""
import cudnn
from cudnn import _bind, _bn, _conv
from cudnn.graph_types import Tensor

_PORTS = {"conv_fprop": ("image", "weight"), "conv_dgrad": ("loss", "filter"),
          "conv_wgrad": ("image", "loss")}
_OUT = {"conv_fprop": "Y", "conv_dgrad": "DX", "conv_wgrad": "DW"}
stream_of = _bind.stream_of


def _row_major(dim):
    out, acc = [], 1
    for d in reversed(list(dim)):
        out.append(acc)
        acc *= int(d)
    return out[::-1]


class _Node:
    def __init__(self, op, name, inputs, outputs, params, compute):
        self.op, self.name, self.inputs, self.outputs = op, name, inputs, outputs
        self.params, self.compute = params, compute
        self.geometry = None        # set by validate: (pre, post, stride, dilation)

    @property
    def output(self):
        """A convolution's one output."""
        return next(iter(self.outputs.values()))

    @property
    def norm(self):
        return self.op in _bn.OPS


class pygraph:
    """A cuDNN graph of convolution nodes (the stand-in's subset of the real ``pygraph``)."""

    def __init__(self, name="test_graph", io_data_type=None, intermediate_data_type=None,
                 compute_data_type=None, handle=None, sm_count=None, sm_version=None, kernel_cache=None,
                 device_property=None, is_dynamic_shape_enabled=False, is_override_shape_enabled=False,
                 cuda_graph_retention=None, *, is_cuda_graph_replay_expected=False, **kwargs):
        unmodelled = {"sm_count": sm_count, "sm_version": sm_version, "kernel_cache": kernel_cache,
                      "device_property": device_property, "cuda_graph_retention": cuda_graph_retention}
        given = sorted(k for k, v in unmodelled.items() if v is not None) + sorted(kwargs)
        if given or is_dynamic_shape_enabled or is_override_shape_enabled:
            raise TypeError(f"pygraph: the cuDNN stand-in does not model "
                            f"{given or 'dynamic/override shapes'}")
        if handle is not None and not isinstance(handle, cudnn.Handle):
            raise TypeError(f"pygraph: handle must be a cudnn.Handle, got {type(handle).__name__}")
        self.name = name
        self.io_data_type = io_data_type
        self.intermediate_data_type = intermediate_data_type or io_data_type
        self.compute_data_type = compute_data_type or io_data_type
        self._handle = handle
        self._tensors = []
        self._nodes = []
        self._uids = 0
        self._validated = self._planned = self._built = False
        self._heuristics = None

    # ---------------------------------------------------------------- construction
    def _check_mutable(self, what):
        if self._planned:
            raise RuntimeError(f"cannot {what} after lowering/planning — the graph is frozen (planning is "
                               f"one-shot; build a new graph)")
        self._validated = False

    def _new_tensor(self, **kw):
        self._check_mutable("add a tensor")
        self._uids += 1
        t = Tensor(uid=self._uids, owner=self, **kw)
        self._tensors.append(t)
        return t

    def tensor(self, dim, stride=None, data_type=None, is_virtual=False, is_pass_by_value=False,
               ragged_offset=None, reordering_type=None, name="", uid=None, ragged_offset_multiplier=1,
               alignment_value=1, **kwargs):
        if is_pass_by_value or ragged_offset is not None or reordering_type is not None or kwargs \
                or ragged_offset_multiplier != 1 or alignment_value != 1:
            raise TypeError("pygraph.tensor: the cuDNN stand-in models plain device tensors only")
        if data_type is not None and data_type is cudnn.data_type.NOT_SET:
            data_type = None
        t = self._new_tensor(name=name or f"tensor_{len(self._tensors)}", dim=[int(d) for d in dim],
                             stride=[int(s) for s in stride] if stride else _row_major(dim),
                             data_type=data_type or (self.intermediate_data_type if is_virtual
                                                     else self.io_data_type), is_virtual=is_virtual)
        if uid is not None and uid != -1:
            t.uid = int(uid)
        return t

    def _conv(self, op, a, b, padding, pre_padding, post_padding, stride, dilation, convolution_mode, name,
              compute_data_type, out_dims):
        ports = _PORTS[op]
        for port, t in zip(ports, (a, b)):
            if not isinstance(t, Tensor) or t.owner is not self:
                raise TypeError(f"{op}(): {port} must be a tensor of this graph, got {type(t).__name__}")
        if convolution_mode is not None:
            raise TypeError(f"{op}(): the cuDNN stand-in models the default (cross-correlation) mode only")
        name = name or f"{op}_{len(self._nodes)}"
        out = self._new_tensor(name=f"{name}::{_OUT[op]}", is_virtual=True)
        params = {"padding": padding, "pre_padding": pre_padding, "post_padding": post_padding,
                  "stride": stride, "dilation": dilation}
        dims = out_dims if out_dims is not None else _bind.infer_dims(op, a.dim, b.dim, params)
        if dims:  # as the real builder, which infers what it can at once (a filter gradient's dims it cannot)
            out.dim, out.stride = [int(d) for d in dims], _row_major(dims)
        self._nodes.append(_Node(op, name, dict(zip(ports, (a, b))), {_OUT[op]: out}, params,
                                 compute_data_type or self.compute_data_type))
        return out

    def tensor_scalar(self, value, scalar_type, name=""):
        """A pass-by-value scalar (e.g. a norm's epsilon): its value is part of the graph, never a buffer."""
        if not isinstance(scalar_type, cudnn.data_type) or scalar_type is cudnn.data_type.NOT_SET:
            raise TypeError(f"tensor_scalar: scalar_type must be a cudnn.data_type, got {scalar_type!r}")
        return self._new_tensor(name=name or f"scalar_{len(self._tensors)}", dim=[1, 1, 1, 1],
                                stride=[1, 1, 1, 1], is_pass_by_value=True, pass_by_value=value,
                                scalar_type=scalar_type)

    def _norm(self, op, given, name, compute_data_type, out_dims):
        inputs = _bn.ports(op, given)
        for port, t in inputs.items():
            if not isinstance(t, Tensor) or t.owner is not self:
                raise TypeError(f"{op}(): {port} must be a tensor of this graph, got {type(t).__name__}")
        name = name or f"{op}.{len(self._nodes)}"
        dims = dict(_bn.output_dims(op, inputs), **(out_dims or {}))
        outs = {}
        for port, suffix in zip(_bn.OPS[op][1], _bn.OPS[op][2]):
            o = outs[port] = self._new_tensor(name=f"{name}::{suffix}", is_virtual=True)
            if dims.get(port):
                o.dim, o.stride = [int(d) for d in dims[port]], _row_major(dims[port])
        self._nodes.append(_Node(op, name, inputs, outs, {}, compute_data_type or self.compute_data_type))
        if len(outs) == 1:
            return outs[_bn.OPS[op][1][0]]
        # a multi-output builder returns a list, None for the outputs not asked for (running statistics)
        return list(outs.values()) + ([None, None] if op == "batchnorm" else [])

    def batchnorm(self, input, scale, bias, in_running_mean=None, in_running_var=None, epsilon=None,
                  momentum=None, *, name="", compute_data_type=None, out_dims=None):
        """-> [Y, MEAN, INV_VARIANCE, None, None] (the running statistics' outputs are not modelled)."""
        given = dict(input=input, scale=scale, bias=bias, in_running_mean=in_running_mean,
                     in_running_var=in_running_var, epsilon=epsilon, momentum=momentum)
        return self._norm("batchnorm", given, name, compute_data_type, out_dims)

    def batchnorm_backward(self, grad, input, scale, mean, inv_variance, *, name="", compute_data_type=None,
                           out_dims=None):
        """-> [DX, DSCALE, DBIAS]."""
        return self._norm("batchnorm_backward", dict(grad=grad, input=input, scale=scale, mean=mean,
                                                     inv_variance=inv_variance),
                          name, compute_data_type, out_dims)

    def batchnorm_inference(self, input, mean, inv_variance, scale, bias, *, name="", compute_data_type=None,
                            out_dims=None):
        """-> Y."""
        return self._norm("batchnorm_inference", dict(input=input, mean=mean, inv_variance=inv_variance,
                                                      scale=scale, bias=bias),
                          name, compute_data_type, out_dims)

    def conv_fprop(self, image, weight, padding=None, pre_padding=None, post_padding=None, stride=None,
                   dilation=None, convolution_mode=None, *, name="", compute_data_type=None, out_dims=None):
        return self._conv("conv_fprop", image, weight, padding, pre_padding, post_padding, stride, dilation,
                          convolution_mode, name, compute_data_type, out_dims)

    def conv_dgrad(self, loss, filter, padding=None, pre_padding=None, post_padding=None, stride=None,
                   dilation=None, convolution_mode=None, *, name="", compute_data_type=None, out_dims=None):
        return self._conv("conv_dgrad", loss, filter, padding, pre_padding, post_padding, stride, dilation,
                          convolution_mode, name, compute_data_type, out_dims)

    def conv_wgrad(self, image, loss, padding=None, pre_padding=None, post_padding=None, stride=None,
                   dilation=None, convolution_mode=None, *, name="", compute_data_type=None, out_dims=None):
        return self._conv("conv_wgrad", image, loss, padding, pre_padding, post_padding, stride, dilation,
                          convolution_mode, name, compute_data_type, out_dims)

    # ---------------------------------------------------------------- planning
    def validate(self):
        for n in self._nodes:
            (_bn.validate if n.norm else _bind.validate_node)(n)
        for t in self._tensors:
            t.validate()
        self._validated = True

    def _planning(self, what):
        """Planning is set-up work: refused while the calling thread's stream or the handle's captures."""
        _bind.refuse_during_capture(what, self._handle)
        if not self._validated:
            self.validate()

    def build_operation_graph(self):
        self._planning("build_operation_graph")

    def create_execution_plans(self, heuristics=None):
        self._planning("create_execution_plans")
        if self._planned:
            raise RuntimeError("create_execution_plans() was already called on this graph; planning is "
                               "one-shot — build a new graph to re-plan, or use select_plan() to switch "
                               "plans")
        modes = list(heuristics or [cudnn.heur_mode.A])
        if not modes or any(not isinstance(m, cudnn.heur_mode) for m in modes):
            raise TypeError(f"create_execution_plans: heuristics must be a list of cudnn.heur_mode, got "
                            f"{modes}")
        self._heuristics = modes
        self._planned = True

    def deselect_numeric_notes(self, notes):
        """Exclude plans carrying any of ``notes`` (planning: refused during a capture, like the rest)."""
        self._planning("deselect_numeric_notes")
        notes = list(notes)
        if any(not isinstance(n, cudnn.numerical_note) for n in notes):
            raise TypeError(f"deselect_numeric_notes: notes must be a list of cudnn.numerical_note, got "
                            f"{notes}")
        return self

    def check_support(self):
        self._planning("check_support")
        if not self._planned:
            raise RuntimeError("check_support() before create_execution_plans(): no plan to check")
        self._check_nodes()

    def build_plans(self, *args, ctx=None, **kwargs):
        self._planning("build_plans")
        for a in list(args) + list(kwargs.values()):
            if not isinstance(a, cudnn.build_plan_policy):
                raise TypeError(f"build_plans: a policy must be a cudnn.build_plan_policy, got {a!r}")
        if not self._planned:
            self.create_execution_plans()
        self._check_nodes()
        self._built = True

    def _check_nodes(self):
        for n in self._nodes:
            if n.norm:
                _bn.check_support(n, self._nodes)
            elif any(m.norm for m in self._nodes):
                raise cudnn.cudnnGraphNotSupportedError(
                    f"{n.name}: the cuDNN stand-in runs a norm node alone in its graph")
            else:
                _bind.check_node_support(n)

    def build(self, heuristics=None, ctx=None):
        self.build_operation_graph()
        if not self._planned:
            self.create_execution_plans(heuristics)
        self.check_support()
        self.build_plans(ctx=ctx)

    def get_workspace_size(self, handle=None, override_uids=None, override_shapes=None,
                           override_strides=None):
        if not self._built:
            raise RuntimeError("Call build() first")
        _bind.no_overrides(override_uids, override_shapes, override_strides)
        return sum(_workspace(n) for n in self._nodes)

    # ---------------------------------------------------------------- execution
    def execute(self, tensor_dict, workspace=None, handle=None, override_uids=None, override_shapes=None,
                override_strides=None, tensor_uids=None):
        _bind.no_overrides(override_uids, override_shapes, override_strides)
        if not self._built and _bind.RULES["built"]:
            raise RuntimeError("execute() before build_plans(): the cuDNN stand-in plans at set-up only (the "
                               "real execute() would build here, inside a step or a capture); call build() "
                               "or build_plans() first")
        h = handle if handle is not None else self._handle
        stream, dev = _bind.execution_stream(h)
        if not _bind.RULES["built"]:
            self.validate()
        by_uid = _bind.by_uid(self, tensor_dict, tensor_uids)
        views, reads, writes = {}, [], []
        for t in self._tensors:
            if t.is_virtual:
                continue
            if t.is_pass_by_value:
                if t.uid in by_uid:
                    raise ValueError(f"tensor uid {t.uid} ({t.name!r}) is a pass-by-value scalar: its value "
                                     f"is part of the graph, not a buffer of the variant pack")
                continue
            if t.uid not in by_uid:
                raise ValueError(f"the variant pack is missing a buffer for tensor uid {t.uid} ({t.name!r})")
            alloc, views[t.uid] = _bind.device_view(t, by_uid[t.uid], dev)
            (writes if any(t in n.outputs.values() for n in self._nodes) else reads).append(alloc)
        need = sum(_workspace(n) for n in self._nodes)
        ws = _bind.workspace_allocation(workspace, need, dev)
        if ws is not None:
            writes.append(ws)
        nodes = list(self._nodes)

        def run():
            for n in nodes:
                _run_node(n, views)

        from cupy import _standin
        capturing = _standin.capturing(stream)
        _standin.launch(stream, reads=reads, writes=writes, what="cudnn.execute",
                        replay=run if capturing else None)
        run()


def _workspace(n):
    return _bn.workspace(n) if n.norm else _bind.node_workspace(n)


def _run_node(n, views):
    if n.norm:
        _bn.run(n, views)
        return
    pre, post, stride, dil = n.geometry
    a, b = (views[t.uid] for t in n.inputs.values())
    out = views[n.output.uid]
    if n.op == "conv_fprop":
        r = _conv.fprop(a, b, pre, post, stride, dil, out.shape[2:])
    elif n.op == "conv_dgrad":
        r = _conv.dgrad(a, b, pre, post, stride, dil, out.shape)
    else:
        r = _conv.wgrad(a, b, pre, post, stride, dil, out.shape)
    out[...] = r.astype(out.dtype) if r.dtype != out.dtype else r
