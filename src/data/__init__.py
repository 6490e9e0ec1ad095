"""lbannpy.data: synthetic data sets and the distributed HDF5 reader.

* :mod:`lbannpy.data.mesh` — mesh-tangling segmentation data (``python -m lbannpy.data mesh``)
* :mod:`lbannpy.data.mesh3d` — its 3-D counterpart, volumes with per-voxel labels (``python -m lbannpy.data
  mesh3d``)
* :mod:`lbannpy.data.blobs` — small classification images for trainer tests (``python -m lbannpy.data blobs``)
* :mod:`lbannpy.data.reader` — :class:`HDF5Reader` (each rank reads its own hyperslab of each shuffled
  mini-batch, with prefetch (:mod:`lbannpy.data.prefetch`) and exact resume)
* :mod:`lbannpy.data.dataset` — :func:`validate_dataset`, :func:`split_indices`, the order of an epoch
* :mod:`lbannpy.data.upload` — batches converted (on a GPU also staged in pinned memory) in the reader's
  thread; :class:`DeviceUploader`: batches on the GPU one step ahead
"""
from .blobs import write_blobs
from .mesh import CHANNEL_NAMES, MeshParams, write_mesh
from .dataset import DataError, DatasetInfo, epoch_order, split_indices, validate_dataset
from .reader import Batch, HDF5Reader

__all__ = ["CHANNEL_NAMES", "MeshParams", "write_blobs", "write_mesh", "Batch", "DataError", "DatasetInfo",
           "HDF5Reader", "epoch_order", "split_indices", "validate_dataset"]
