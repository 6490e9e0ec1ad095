"""Model zoo: ``get_spec(name, batch_size=None, input_size=None)``, ``names()`` and, per spec, the
``python -m lbannpy.data`` command that makes its data (``spec_data_command``)."""
from .zoo import ZooError, data_command, get_spec, names, path, spec_data_command

__all__ = ["ZooError", "data_command", "get_spec", "names", "path", "spec_data_command"]
