"""NCCL calls captured into a graph and replayed at 2-4 ranks (each launch performs the collectives again,
in the same order on every rank); run under mpiexec by tests/test_gpu_standin_graph.py with PYTHONPATH
starting with tests/gpu_standin."""
import sys

import numpy as np
from mpi4py import MPI

import cupy
from cupy import _standin
from cupy.cuda import nccl

w = MPI.COMM_WORLD
r, n = w.rank, w.size
uid = w.bcast(nccl.get_unique_id() if r == 0 else None)
c = nccl.NcclCommunicator(n, uid, r)
x = cupy.zeros(6)
ring = cupy.zeros(3)
pool = cupy.cuda.MemoryPool()
s, comm_s, recv_s = (cupy.cuda.Stream(non_blocking=True) for _ in range(3))
s.wait_event(cupy.cuda.get_current_stream().record())
with cupy.cuda.using_allocator(pool.malloc), s:
    s.begin_capture()
    y = x * 2.0
    z = cupy.empty(6)
    forked = s.record()
    comm_s.wait_event(forked)                 # the collectives on their own streams, joined by events
    recv_s.wait_event(forked)
    c.allReduce(y.data.ptr, z.data.ptr, 6, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, comm_s.ptr)
    nccl.groupStart()                         # one group over two streams of the capture
    c.send(x.data.ptr, 3, nccl.NCCL_FLOAT64, (r + 1) % n, comm_s.ptr)
    c.recv(ring.data.ptr, 3, nccl.NCCL_FLOAT64, (r - 1) % n, recv_s.ptr)
    nccl.groupEnd()
    s.wait_event(comm_s.record())
    s.wait_event(recv_s.record())
    out = z + 1.0
    g = s.end_capture()
assert np.isnan(out.get()).all()  # nothing moved at capture
for k in range(3):
    hosts = [np.random.default_rng(100 * k + q).standard_normal(6) for q in range(n)]
    x.set(hosts[r], stream=s)
    _standin.reset_host_syncs()
    _standin.reset_launches()
    g.launch(s)
    assert _standin.host_syncs() == {}, _standin.host_syncs()
    assert _standin.graph_launches() == 1
    assert _standin.launches()["nccl allReduce"] == 1, _standin.launches()
    s.synchronize()
    np.testing.assert_allclose(out.get(), 2 * np.sum(hosts, axis=0) + 1, rtol=1e-14)
    np.testing.assert_array_equal(ring.get(), hosts[(r - 1) % n][:3])
c.destroy()
print(f"rank {r} of {n}: standin graph nccl ok", flush=True)
sys.exit(0)
