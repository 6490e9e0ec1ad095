"""``cudnn.graph_types.Tensor`` of the stand-in: a graph tensor's declared layout (the real class is a Python
dataclass in cuDNN Frontend 1.32; the stand-in keeps the attributes and chainable setters lbannpy uses)."""


class Tensor:
    """A tensor of a ``pygraph``: name, uid, dims and strides in elements, data type, whether it is a
    virtual intermediate (op outputs start virtual; ``set_output(True)`` makes one a caller buffer), and for
    a pass-by-value scalar its value and type."""

    def __init__(self, name="", data_type=None, dim=(), stride=(), is_virtual=False, uid=0, owner=None,
                 is_pass_by_value=False, pass_by_value=None, scalar_type=None):
        self.name = name
        self.data_type = data_type
        self.dim = list(dim)
        self.stride = list(stride)
        self.is_virtual = is_virtual
        self.uid = uid
        self.owner = owner          # the graph: a setter after planning is refused there
        # a scalar whose value is part of the graph (pygraph.tensor_scalar), never a buffer
        self.is_pass_by_value = is_pass_by_value
        self.pass_by_value = pass_by_value
        self.scalar_type = scalar_type

    def _guard(self, what="mutate a tensor attribute"):
        if self.owner is not None:
            self.owner._check_mutable(what)

    def set_output(self, value):
        self._guard()
        self.is_virtual = not value
        return self

    def set_data_type(self, dtype):
        self._guard()
        self.data_type = dtype
        return self

    def set_name(self, name):
        self._guard()
        self.name = name
        return self

    def set_dim(self, dim):
        self._guard()
        self.dim = [int(d) for d in dim]
        return self

    def set_stride(self, stride):
        self._guard()
        self.stride = [int(s) for s in stride]
        return self

    def set_is_virtual(self, value):
        self._guard()
        self.is_virtual = value
        return self

    def get_uid(self):
        return self.uid

    def get_name(self):
        return self.name

    def get_dim(self):
        return list(self.dim)

    def get_stride(self):
        return list(self.stride)

    def get_data_type(self):
        return self.data_type

    def get_is_virtual(self):
        return self.is_virtual

    def validate(self):
        """The real class's checks, with its messages."""
        if not self.dim:
            raise ValueError(f"Tensor '{self.name}' dims not set.")
        if not self.stride:
            raise ValueError(f"Tensor '{self.name}' strides not set.")
        if len(self.dim) != len(self.stride):
            raise ValueError(f"Tensor '{self.name}' dim/stride length mismatch: "
                             f"{len(self.dim)} vs {len(self.stride)}")

    def __repr__(self):
        return (f"Tensor(name={self.name!r}, uid={self.uid}, dim={self.dim}, stride={self.stride}, "
                f"data_type={self.data_type}, is_virtual={self.is_virtual})")
