"""2-4 rank exchange through the NCCL stand-in (pointer + count); run under mpiexec by
tests/test_gpu_standin.py with PYTHONPATH starting with tests/gpu_standin."""
import sys

import numpy as np
from mpi4py import MPI

import cupy
from cupy.cuda import nccl

w = MPI.COMM_WORLD
r, n = w.rank, w.size
uid = w.bcast(nccl.get_unique_id() if r == 0 else None)
c = nccl.NcclCommunicator(n, uid, r)
assert (c.rank_id(), c.size(), c.device_id()) == (r, n, 0)
cur = cupy.cuda.get_current_stream()
s = cupy.cuda.Stream(non_blocking=True)
x = cupy.full(6, r + 1, dtype=np.float64)
y = cupy.empty(6, np.float64)
g = cupy.empty(6 * n, np.float64)
rs = cupy.empty(2, np.float64)
s.wait_event(cur.record())
c.allReduce(x.data.ptr, y.data.ptr, 6, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
c.allGather(x.data.ptr, g.data.ptr, 6, nccl.NCCL_FLOAT64, s.ptr)
src = cupy.arange(2 * n, dtype=np.float64)
s.wait_event(cur.record())
c.reduceScatter(src.data.ptr, rs.data.ptr, 2, nccl.NCCL_FLOAT64, nccl.NCCL_MAX, s.ptr)
nccl.groupStart()
c.send(x.data.ptr, 3, nccl.NCCL_FLOAT64, (r + 1) % n, s.ptr)
c.recv(x[3:].data.ptr, 3, nccl.NCCL_FLOAT64, (r - 1) % n, s.ptr)
nccl.groupEnd()
b = cupy.full(2, r, dtype=np.int32)
s.wait_event(cur.record())
c.bcast(b.data.ptr, 2, nccl.NCCL_INT32, n - 1, s.ptr)
cur.wait_event(s.record())
tot = n * (n + 1) / 2
np.testing.assert_array_equal(y.get(), np.full(6, tot))
np.testing.assert_array_equal(g.get(), np.repeat(np.arange(1, n + 1.0), 6))
np.testing.assert_array_equal(rs.get(), np.arange(2 * n, dtype=np.float64)[2 * r:2 * r + 2])
np.testing.assert_array_equal(x.get(), [r + 1] * 3 + [(r - 1) % n + 1] * 3)
np.testing.assert_array_equal(b.get(), [n - 1, n - 1])
c.destroy()
print(f"rank {r} of {n}: standin nccl ok", flush=True)
sys.exit(0)
