"""lbannpy.comm: the only code that talks MPI or NCCL."""
