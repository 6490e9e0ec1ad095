"""Batch-norm nodes of the cuDNN stand-in: ``batchnorm`` (training forward: the batch's statistics over the
samples and space of each channel), ``batchnorm_backward`` and ``batchnorm_inference`` (normalise with given
statistics), with their checks and arithmetic.

Ports, output order and output names are those of cuDNN Frontend 1.32's structured builders (``Y``,
``MEAN``, ``INV_VARIANCE``; ``DX``, ``DSCALE``, ``DBIAS``). The stand-in models what lbannpy uses: the
running-statistics ports (``in_running_mean``, ``in_running_var``, ``momentum``) and ``peer_stats`` raise
TypeError instead of being ignored. Epsilon is a pass-by-value scalar (``pygraph.tensor_scalar``).

Support (``cudnnGraphNotSupportedError`` otherwise): a graph holds one norm node and nothing else, every
output is ``set_output(True)``, the image-like tensors (input, grad, Y, DX) are of one I/O type and the
per-channel tensors and epsilon of the compute type, which is DOUBLE for DOUBLE data and FLOAT for FLOAT or
HALF data. Arithmetic: float64 throughout (two passes over the data for the statistics), each output rounded
once to its type, so a FLOAT graph is at least as accurate as a cuDNN float32 engine. The training passes ask
for a workspace (per-channel partial sums), the inference pass for none.
"""
import numpy as np

import cudnn

# op -> (input ports in the real builder's order, output ports, output name suffixes)
OPS = {
    "batchnorm": (("input", "scale", "bias", "in_running_mean", "in_running_var", "epsilon", "momentum"),
                  ("Y", "mean", "inv_var"), ("Y", "MEAN", "INV_VARIANCE")),
    "batchnorm_backward": (("grad", "input", "scale", "mean", "inv_variance"), ("DX", "DScale", "DBias"),
                           ("DX", "DSCALE", "DBIAS")),
    "batchnorm_inference": (("input", "mean", "inv_variance", "scale", "bias"), ("Y",), ("Y",)),
}
_IMAGE = {"input", "grad", "Y", "DX"}          # ports of the data's dims; the rest are per channel
_UNMODELLED = ("in_running_mean", "in_running_var", "momentum")
_REQUIRED = {"batchnorm": ("input", "scale", "bias", "epsilon"),
             "batchnorm_backward": ("grad", "input", "scale", "mean", "inv_variance"),
             "batchnorm_inference": ("input", "mean", "inv_variance", "scale", "bias")}


def per_channel(dim):
    return [1, int(dim[1])] + [1] * (len(dim) - 2)


def ports(op, given):
    """The node's inputs from the builder's arguments (port -> Tensor), refusing what is not modelled."""
    bad = sorted(p for p in _UNMODELLED if given.get(p) is not None)
    if bad:
        raise TypeError(f"{op}(): the cuDNN stand-in does not model running statistics ({', '.join(bad)}); "
                        f"update them outside the graph")
    missing = [p for p in _REQUIRED[op] if given.get(p) is None]
    if missing:
        raise TypeError(f"{op}() missing tensor argument(s) {missing}")
    return {p: given[p] for p in OPS[op][0] if given.get(p) is not None}


def output_dims(op, inputs):
    """The dims the real builder infers at once: the data's for image-like outputs, [1, C, 1, ...] else."""
    image = inputs["input"].dim
    if not image:
        return {}
    return {o: (list(image) if o in _IMAGE else per_channel(image)) for o in OPS[op][1]}


def validate(n):
    """cuDNN's CUDNN_STATUS_BAD_PARAM cases of a norm node: 4-D or 5-D data, every image-like tensor of the
    data's dims, every per-channel tensor [1, C, 1, ...], epsilon a pass-by-value scalar."""
    for t in list(n.inputs.values()) + list(n.outputs.values()):
        t.validate()
    image = n.inputs["input"].dim
    if len(image) not in (4, 5):
        raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: {n.op} takes 4-D or 5-D tensors, got "
                           f"{image}")
    tensors = dict(n.inputs, **n.outputs)
    for port, t in tensors.items():
        if port == "epsilon":
            if not t.is_pass_by_value:
                raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: epsilon must be a pass-by-value "
                                   f"scalar (pygraph.tensor_scalar)")
            continue
        if t.is_pass_by_value:
            raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: {port} is a pass-by-value scalar")
        want = list(image) if port in _IMAGE else per_channel(image)
        if list(t.dim) != want:
            raise RuntimeError(f"{n.name}: CUDNN_STATUS_BAD_PARAM: {port} has dims {t.dim}, the node "
                               f"needs {want} for data {image}")
    for t in n.outputs.values():
        if t.data_type is None:
            g = t.owner
            t.data_type = g.intermediate_data_type if t.is_virtual else g.io_data_type


def check_support(n, graph_nodes):
    """What no engine runs (see the module docstring)."""
    if len(graph_nodes) != 1:
        raise cudnn.cudnnGraphNotSupportedError(
            f"{n.name}: the cuDNN stand-in's norm engines run a graph of one norm node, this one has "
            f"{len(graph_nodes)} nodes")
    virtual = [t.name for t in n.outputs.values() if t.is_virtual]
    if virtual:
        raise cudnn.cudnnGraphNotSupportedError(
            f"{n.name}: outputs {virtual} are virtual; every output of a norm node must be set_output(True)")
    tensors = dict(n.inputs, **n.outputs)
    io = {tensors[p].data_type for p in tensors if p in _IMAGE}
    if len(io) != 1:
        raise cudnn.cudnnGraphNotSupportedError(f"{n.name}: data of mixed types {sorted(map(str, io))}")
    io = io.pop()
    want = cudnn.data_type.DOUBLE if io is cudnn.data_type.DOUBLE else cudnn.data_type.FLOAT
    if n.compute is not want:
        raise cudnn.cudnnGraphNotSupportedError(f"{n.name}: {io} batch-norm computes in {want}, not "
                                                f"{n.compute}")
    for port, t in tensors.items():
        dt = t.scalar_type if t.is_pass_by_value else t.data_type
        if port not in _IMAGE and dt is not want:
            raise cudnn.cudnnGraphNotSupportedError(
                f"{n.name}: {port} is {dt}; the per-channel tensors of {io} batch-norm are {want}")


def workspace(n):
    """Per-channel partial sums for the training passes (nonzero, so a short workspace is caught)."""
    if n.op == "batchnorm_inference":
        return 0
    c = n.inputs["input"].dim[1]
    return -(-(c * 4 * 8 + 1024) // 256) * 256


def _scalar(t):
    from cudnn import _bind
    return float(np.asarray(t.pass_by_value, dtype=_bind.np_dtype(t.scalar_type)))


def run(n, views):
    """Compute the node from the buffers' current contents into its outputs."""
    f = {p: np.asarray(views[t.uid], np.float64) for p, t in n.inputs.items() if not t.is_pass_by_value}
    x = f["input"]
    axes = (0,) + tuple(range(2, x.ndim))
    count = x.size // x.shape[1]
    if n.op == "batchnorm":
        mean = x.mean(axis=axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
        inv = 1.0 / np.sqrt(var + _scalar(n.inputs["epsilon"]))
        out = {"Y": (x - mean) * inv * f["scale"] + f["bias"], "mean": mean, "inv_var": inv}
    elif n.op == "batchnorm_inference":
        out = {"Y": (x - f["mean"]) * f["inv_variance"] * f["scale"] + f["bias"]}
    else:
        g, inv = f["grad"], f["inv_variance"]
        xhat = (x - f["mean"]) * inv
        dbias = g.sum(axis=axes, keepdims=True)
        dscale = (g * xhat).sum(axis=axes, keepdims=True)
        out = {"DX": f["scale"] * inv * (g - dbias / count - xhat * dscale / count), "DScale": dscale,
               "DBias": dbias}
    for port, t in n.outputs.items():
        dst = views[t.uid]
        dst[...] = out[port].astype(dst.dtype)
