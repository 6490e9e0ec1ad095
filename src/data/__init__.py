"""lbannpy.data: synthetic data sets and the distributed HDF5 reader.

* :mod:`lbannpy.data.mesh` — mesh-tangling segmentation data (``python -m lbannpy.data mesh``)
* :mod:`lbannpy.data.blobs` — small classification images for trainer tests (``python -m lbannpy.data blobs``)
* :mod:`lbannpy.data.reader` — :class:`HDF5Reader` (each rank reads its own hyperslab of each shuffled
  mini-batch, with prefetch and exact resume), :func:`validate_dataset`, :func:`split_indices`
"""
from .blobs import write_blobs
from .mesh import CHANNEL_NAMES, MeshParams, write_mesh
from .reader import Batch, DataError, DatasetInfo, HDF5Reader, epoch_order, split_indices, validate_dataset

__all__ = ["CHANNEL_NAMES", "MeshParams", "write_blobs", "write_mesh", "Batch", "DataError", "DatasetInfo",
           "HDF5Reader", "epoch_order", "split_indices", "validate_dataset"]
