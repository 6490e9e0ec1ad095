"""Stand-in for ``cupy.cuda.nccl`` (CuPy's ``cupy_backends/cuda/libs/nccl.pyx`` API) that moves the bytes
between ranks over MPI.

Modelled:
- pointers are ints resolved through the stand-in allocator to the exact device buffer; unknown pointers,
  counts that run past the buffer and buffers of another device than the communicator's are refused;
  counts are in elements; the stream is a pointer of a stand-in stream of the communicator's device;
- every call is one kernel on that stream for the stream-order checker (reads the send buffer, writes the
  receive buffer), so a collective on a buffer written on another stream without an event raises;
- the members of a communicator find each other from the unique id (a rendezvous directory under the
  temp dir keyed by the id), then ``MPI.COMM_WORLD.Create_group`` (collective over the members only);
- between ``groupStart()`` and ``groupEnd()`` calls are queued and posted together at ``groupEnd`` as
  non-blocking MPI operations, so matching sends/recvs inside one group never deadlock (as in NCCL). A
  blocking send outside a group is posted alone and completes only when the peer posts its receive: real
  NCCL would enqueue it and return; lbannpy always groups its point-to-point calls, so this is not modelled.
- all ranks must issue collectives in the same order (NCCL requires it; MPI matching relies on it).
The unique id is CuPy 13's tuple of 128 ints, or CuPy 14's bytes with LBANNPY_STANDIN_NCCL_UID=bytes;
the constructor accepts both.
"""
import os
import secrets
import tempfile
import time

import numpy

from cupy import _standin

NCCL_UNIQUE_ID_BYTES = 128
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUCCESS = 0
NCCL_ERROR_INVALID_ARGUMENT = 4
NCCL_ERROR_INVALID_USAGE = 5

_DTYPES = {0: numpy.int8, 1: numpy.uint8, 2: numpy.int32, 3: numpy.uint32, 4: numpy.int64, 5: numpy.uint64,
           6: numpy.float16, 7: numpy.float32, 8: numpy.float64}
_OPS = {NCCL_SUM: numpy.sum, NCCL_PROD: numpy.prod, NCCL_MAX: numpy.max, NCCL_MIN: numpy.min}
_TIMEOUT = float(os.environ.get("LBANNPY_STANDIN_NCCL_TIMEOUT", "60"))


class NcclError(RuntimeError):
    def __init__(self, status, msg=""):
        self.status = status
        super().__init__(f"NCCL_ERROR {status}: {msg}")


def get_version():
    return 21903


def get_build_version():
    return 21903


def get_unique_id():
    raw = secrets.token_bytes(NCCL_UNIQUE_ID_BYTES)
    if os.environ.get("LBANNPY_STANDIN_NCCL_UID", "tuple") == "bytes":
        return raw
    return tuple(int(b) - 256 if b > 127 else int(b) for b in raw)  # signed chars, as CuPy 13


def _uid_bytes(commId):
    if isinstance(commId, bytes):
        b = commId
    elif isinstance(commId, tuple) and all(isinstance(c, int) for c in commId):
        b = bytes(c & 0xFF for c in commId)
    else:
        raise TypeError(f"commId must be a tuple of ints or bytes, got {type(commId).__name__}")
    if len(b) != NCCL_UNIQUE_ID_BYTES:
        raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"unique id has {len(b)} bytes, not 128")
    return b


_group = {"depth": 0, "ops": []}


def groupStart():
    _group["depth"] += 1


def groupEnd():
    if _group["depth"] == 0:
        raise NcclError(NCCL_ERROR_INVALID_USAGE, "groupEnd without groupStart")
    _group["depth"] -= 1
    if _group["depth"] == 0:
        ops, _group["ops"] = _group["ops"], []
        captured = [op for op in ops if isinstance(op, _Captured)]
        if captured and len(captured) != len(ops):
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "a group mixes calls on capturing streams and others")
        if not captured:
            _execute(ops)
            return
        from cupy.cuda import _graph
        if len({id(_graph.capture_of(op.stream)) for op in captured}) != 1:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "a group's calls are on streams of different captures")
        makes = [op.make for op in captured]
        # the group is one node of the capture, after its calls' nodes: each launch of the graph posts the
        # whole group again, on every rank
        _standin.launch(captured[-1].stream, what="nccl group", count=False,
                        replay=lambda: _execute([m() for m in makes]))


class _Captured:
    """A call of a group on a capturing stream: ``make()`` builds its post when the graph is launched."""
    __slots__ = ("stream", "make")

    def __init__(self, stream, make):
        self.stream, self.make = stream, make


def _execute(ops):
    from mpi4py import MPI
    reqs, posts = [], []
    for post in ops:
        req, after = post()
        reqs.append(req)
        posts.append(after)
    # bounded: ranks that issued different calls (order, count, datatype, root or peer) would wait forever,
    # as real NCCL does; the stand-in fails instead, naming what it waited for
    deadline = time.monotonic() + _TIMEOUT
    while not MPI.Request.Testall(reqs):
        if time.monotonic() > deadline:  # the communicator is unusable from here, as after an NCCL error
            raise NcclError(NCCL_ERROR_INVALID_USAGE,
                            f"{len(reqs)} operation(s) did not complete in {_TIMEOUT:g} s "
                            f"(LBANNPY_STANDIN_NCCL_TIMEOUT): the ranks issued different calls (order, "
                            f"count, datatype, root or peer)")
        time.sleep(0.001)
    for after in posts:
        if after is not None:
            after()


def _submit(post):
    if _group["depth"] > 0:
        _group["ops"].append(post)
    else:
        _execute([post])


class NcclCommunicator:
    """``NcclCommunicator(ndev, commId, rank)``: collective over the ``ndev`` members (each passes its
    rank)."""

    def __init__(self, ndev, commId, rank, config=None):
        from mpi4py import MPI
        uid = _uid_bytes(commId)
        if not 0 <= rank < ndev:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"rank {rank} not in [0, {ndev})")
        self._ndev, self._rank = ndev, rank
        self._device = _standin.local.device
        world = MPI.COMM_WORLD
        d = os.path.join(tempfile.gettempdir(), "lbannpy-standin-nccl", uid[:16].hex())
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{rank}.tmp")
        with open(tmp, "w") as f:
            f.write(str(world.Get_rank()))
        os.replace(tmp, os.path.join(d, f"rank-{rank}"))
        deadline = time.monotonic() + _TIMEOUT
        members = [None] * ndev
        while any(m is None for m in members):
            for r in range(ndev):
                if members[r] is None:
                    try:
                        with open(os.path.join(d, f"rank-{r}")) as f:
                            members[r] = int(f.read())
                    except (FileNotFoundError, ValueError):
                        pass
            if any(m is None for m in members):
                if time.monotonic() > deadline:
                    raise NcclError(NCCL_ERROR_INVALID_USAGE, f"rank {rank}: only "
                                    f"{sum(m is not None for m in members)} of {ndev} members joined in "
                                    f"{_TIMEOUT}s")
                time.sleep(0.01)
        group = world.Get_group().Incl(members)
        self._comm = world.Create_group(group, tag=int.from_bytes(uid[:2], "little") % 32000)
        group.Free()
        if self._comm.Get_rank() != rank:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "rendezvous produced a wrong rank order")
        self._comm.Barrier()  # everyone has read the directory before rank 0 removes it
        if rank == 0:
            for r in range(ndev):
                os.unlink(os.path.join(d, f"rank-{r}"))
            os.rmdir(d)

    # --- introspection
    def rank_id(self):
        return self._rank

    def size(self):
        return self._ndev

    def device_id(self):
        return self._device

    def destroy(self):
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def abort(self):
        self._comm = None

    # --- helpers
    def _live(self):
        if self._comm is None:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, "communicator destroyed or aborted")
        return self._comm

    def _buf(self, ptr, count, datatype, what):
        if datatype not in _DTYPES:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"{what}: datatype {datatype} not supported")
        if not isinstance(count, int) or count < 0:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"{what}: count {count!r} is not an int >= 0")
        dt = numpy.dtype(_DTYPES[datatype])
        alloc = _standin.resolve(ptr, count * dt.itemsize)
        if alloc.device != self._device:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT,
                            f"{what}: buffer {ptr:#x} is on device {alloc.device}, the communicator on "
                            f"device {self._device}")
        off = ptr - alloc.ptr
        return alloc, alloc.buf[off:off + count * dt.itemsize].view(dt)

    def _stream(self, stream, what):
        from cupy import cuda
        if not isinstance(stream, int):
            raise TypeError(f"{what}: stream must be a pointer (int), got {type(stream).__name__}")
        if stream == 0:
            return cuda._null_streams.get(self._device)
        for s in list(cuda._all_streams):
            if s.ptr == stream and s.device_id == self._device:
                return s
        raise NcclError(NCCL_ERROR_INVALID_ARGUMENT,
                        f"{what}: stream {stream:#x} is not a stream of device {self._device}")

    def _issue(self, what, stream, reads, writes, make):
        """One NCCL call on ``stream``: ``make()`` reads the send buffer and returns the MPI post. On a
        capturing stream nothing moves now: each launch of the graph calls ``make()`` again."""
        if _standin.local.device != self._device:
            raise NcclError(NCCL_ERROR_INVALID_USAGE, f"{what}: device {_standin.local.device} is current, "
                            f"the communicator is on device {self._device}")
        s = self._stream(stream, what)
        if not _standin.capturing(s):
            _standin.launch(s, reads=reads, writes=writes, what=f"nccl {what}")
            _submit(make())
            return
        make()  # the checks of the arguments, now; the post it builds is dropped
        if _group["depth"] > 0:
            _standin.launch(s, reads=reads, writes=writes, what=f"nccl {what}", covered=True)
            _group["ops"].append(_Captured(s, make))
        else:
            _standin.launch(s, reads=reads, writes=writes, what=f"nccl {what}",
                            replay=lambda: _execute([make()]))

    def _reduce_post(self, send, op, what, finish):
        if op not in _OPS and op != NCCL_AVG:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"{what}: op {op} not supported")
        comm = self._live()
        gathered = numpy.empty((self._ndev,) + send.shape, send.dtype)
        src = send.copy()

        def post():
            return comm.Iallgather(src, gathered), lambda: finish(_reduce(gathered, op))
        return post

    # --- collectives (argument lists as CuPy's nccl.pyx)
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        sa, s = self._buf(sendbuf, count, datatype, "allReduce")
        ra, r = self._buf(recvbuf, count, datatype, "allReduce")
        self._issue("allReduce", stream, [sa], [ra],
                    lambda: self._reduce_post(s, op, "allReduce", lambda v: r.__setitem__(Ellipsis, v)))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        sa, s = self._buf(sendbuf, count, datatype, "reduce")
        writes = []
        if self._rank == root:
            ra, r = self._buf(recvbuf, count, datatype, "reduce")
            writes = [ra]
        self._issue("reduce", stream, [sa], writes,
                    lambda: self._reduce_post(s, op, "reduce",
                                              lambda v: r.__setitem__(Ellipsis, v) if self._rank == root
                                              else None))

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        sa, s = self._buf(sendbuf, recvcount * self._ndev, datatype, "reduceScatter")
        ra, r = self._buf(recvbuf, recvcount, datatype, "reduceScatter")
        lo = self._rank * recvcount
        self._issue("reduceScatter", stream, [sa], [ra],
                    lambda: self._reduce_post(s, op, "reduceScatter",
                                              lambda v: r.__setitem__(Ellipsis, v[lo:lo + recvcount])))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        sa, s = self._buf(sendbuf, count, datatype, "allGather")
        ra, r = self._buf(recvbuf, count * self._ndev, datatype, "allGather")
        comm = self._live()

        def make():
            src = s.copy()
            return lambda: (comm.Iallgather(src, r), None)
        self._issue("allGather", stream, [sa], [ra], make)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        sendbuf, recvbuf = sendbuff, recvbuff
        ra, r = self._buf(recvbuf, count, datatype, "broadcast")
        reads = []
        if self._rank == root:
            sa, s = self._buf(sendbuf, count, datatype, "broadcast")
            reads = [sa]
        comm = self._live()

        def make():
            if self._rank == root:
                src = s.copy()

                def post():
                    r[...] = src
                    return comm.Ibcast(r, root=root), None
            else:
                def post():
                    return comm.Ibcast(r, root=root), None
            return post
        self._issue("broadcast", stream, reads, [ra], make)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def send(self, sendbuf, count, datatype, peer, stream):
        sa, s = self._buf(sendbuf, count, datatype, "send")
        self._check_peer(peer, "send")
        comm = self._live()

        def make():
            src = s.copy()
            return lambda: (comm.Isend(src, dest=peer, tag=7), None)
        self._issue("send", stream, [sa], [], make)

    def recv(self, recvbuf, count, datatype, peer, stream):
        ra, r = self._buf(recvbuf, count, datatype, "recv")
        self._check_peer(peer, "recv")
        comm = self._live()
        self._issue("recv", stream, [], [ra], lambda: lambda: (comm.Irecv(r, source=peer, tag=7), None))

    def _check_peer(self, peer, what):
        if not isinstance(peer, int) or not 0 <= peer < self._ndev:
            raise NcclError(NCCL_ERROR_INVALID_ARGUMENT, f"{what}: peer {peer!r} not in [0, {self._ndev})")


def _reduce(gathered, op):
    if op == NCCL_AVG:
        return (numpy.sum(gathered, axis=0) / gathered.shape[0]).astype(gathered.dtype)
    return _OPS[op](gathered, axis=0).astype(gathered.dtype)
