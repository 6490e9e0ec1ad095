"""Strict NumPy-backed stand-in for the cuDNN Frontend Python API (PyPI ``nvidia-cudnn-frontend``, module
``cudnn``), visible only where ``tests/gpu_standin`` is first on ``sys.path``, beside the CuPy stand-in whose
arrays, streams and captures it works on.

The subset lbannpy uses: handles bound to a device with a stream set on them, ``pygraph`` with tensors and
convolution nodes (forward, data and filter gradient), the planning sequence, the workspace size, and
``execute`` as one modelled launch on the handle's stream (``cupy._standin.launch``), recorded with a replay
under stream capture. Names and parameter names are those of cuDNN Frontend 1.32
(``tests/test_gpu_standin_cudnn.py`` checks them against the real wheel). What it refuses, and how, is in
``tests/gpu_standin/README.md``.
"""
import enum as _enum

from cudnn import _handle
from cudnn._handle import Handle as Handle

__version__ = "1.32.0+standin"
_BACKEND = (9, 14, 0)
#: None: the cuDNN library loaded; else the reason it did not (a test sets it: a frontend installed without
#: the library, whose first call into cuDNN raises as the real module's does)
_NO_LIBRARY = None


def _library():
    if _NO_LIBRARY is not None:
        raise RuntimeError(_NO_LIBRARY)


class cudnnGraphNotSupportedError(Exception):
    """What the real binding raises for CUDNN_STATUS_NOT_SUPPORTED (a graph no engine can run)."""


class data_type(_enum.Enum):
    NOT_SET = 0
    FLOAT = 1
    DOUBLE = 2
    HALF = 3


class heur_mode(_enum.Enum):
    A = 0
    B = 1
    FALLBACK = 2


class build_plan_policy(_enum.Enum):
    HEURISTICS_CHOICE = 0
    ALL = 1


class numerical_note(_enum.Enum):
    """Engine notes a plan filter names (``pygraph.deselect_numeric_notes``); the stand-in's one engine is
    exact and deterministic, so a filter leaves it."""
    TENSOR_CORE = 1
    DOWN_CONVERT_INPUTS = 2
    REDUCED_PRECISION_REDUCTION = 3
    FFT = 4
    NONDETERMINISTIC = 5
    WINOGRAD = 6
    WINOGRAD_TILE_4x4 = 7
    WINOGRAD_TILE_6x6 = 8
    WINOGRAD_TILE_13x13 = 9
    STRICT_NAN_PROP = 10


def backend_version():
    """The cuDNN library version as an int (major * 10000 + minor * 100 + patch, cuDNN 9's encoding)."""
    _library()
    return _BACKEND[0] * 10000 + _BACKEND[1] * 100 + _BACKEND[2]


def backend_version_string():
    _library()
    return ".".join(str(v) for v in _BACKEND)


def _current_device():
    from cupy import _standin
    return _standin.local.device


def create_handle():
    """A handle bound to the device current on the calling thread, on stream 0 until ``set_stream``."""
    _library()
    return Handle(_handle.new_backend_handle(), _current_device(), 0)


def _check_handle(handle, what):
    if not isinstance(handle, Handle):
        raise TypeError(f"cudnn.{what} expects a cudnn.Handle (from cudnn.create_handle()), got "
                        f"{type(handle).__name__}")


def set_stream(handle, stream):
    """Set the stream (a ``cupy.cuda.Stream.ptr``) the handle's work is enqueued on. cudnnSetStream refuses
    a stream of another device than the handle's (CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH)."""
    _check_handle(handle, "set_stream")
    if handle.backend_handle is None:
        raise RuntimeError("cudnnSetStream failed: CUDNN_STATUS_BAD_PARAM: the handle was destroyed")
    if not isinstance(stream, int):
        raise TypeError(f"cudnn.set_stream: stream must be an int (cupy.cuda.Stream.ptr), got "
                        f"{type(stream).__name__}")
    s = _pygraph.stream_of(stream, handle)
    if s is None and stream not in (1, 2):  # cudaStreamLegacy and cudaStreamPerThread are special handles
        raise RuntimeError(f"cudnnSetStream failed: CUDNN_STATUS_BAD_PARAM: {stream:#x} is not a live stream")
    if s is not None and s.device_id != handle._ordinal:
        raise RuntimeError(f"cudnnSetStream failed: CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH: {s!r} belongs to "
                           f"device {s.device_id} but the handle was created on device {handle._ordinal}")
    handle.stream = stream


def get_stream(handle):
    _check_handle(handle, "get_stream")
    return handle.stream


def destroy_handle(handle):
    _check_handle(handle, "destroy_handle")
    handle.backend_handle = None
    handle.stream = None


from cudnn import _pygraph  # noqa: E402
from cudnn._pygraph import pygraph as pygraph  # noqa: E402
from cudnn import graph_types as graph_types  # noqa: E402, F401
