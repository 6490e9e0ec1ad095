"""lbannpy.data: synthetic data sets and the distributed HDF5 reader.

* :mod:`lbannpy.data.mesh` — mesh-tangling segmentation data (``python -m lbannpy.data mesh``)
* :mod:`lbannpy.data.blobs` — small classification images for trainer tests (``python -m lbannpy.data blobs``)
"""
from .blobs import write_blobs
from .mesh import CHANNEL_NAMES, MeshParams, write_mesh

__all__ = ["CHANNEL_NAMES", "MeshParams", "write_blobs", "write_mesh"]
