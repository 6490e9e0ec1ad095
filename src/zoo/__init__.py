"""Model zoo: ``get_spec(name, batch_size=None, input_size=None)`` and ``names()``."""
from .zoo import ZooError, get_spec, names, path

__all__ = ["ZooError", "get_spec", "names", "path"]
