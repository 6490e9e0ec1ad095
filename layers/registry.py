"""Layer type name -> class. The config schema's layer registry lists the same names and parameters."""
from __future__ import annotations

from .base import Layer


def layer_classes() -> dict[str, type[Layer]]:
    from .batchnorm import BatchNorm
    from .conv import Conv
    from .fc import FullyConnected
    from .pool import Pool
    from .simple import Concat, Dropout, Flatten, LeakyReLU, ReLU, Sum

    classes = (Conv, Pool, BatchNorm, ReLU, LeakyReLU, Dropout, Sum, Concat, Flatten, FullyConnected)
    return {c.type: c for c in classes}
