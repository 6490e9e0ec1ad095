"""lbannpy: CNN training with sample, channel and spatial parallelism over MPI (NumPy or CuPy, NCCL)."""

__version__ = "0.1.0"
