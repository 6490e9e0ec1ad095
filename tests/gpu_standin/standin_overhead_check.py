"""``python -m lbannpy.bench overhead --device gpu`` on the CuPy stand-in (run by
tests/test_bench_overhead_gpu.py in a subprocess whose PYTHONPATH starts with tests/gpu_standin): every
chain runs on device arrays (the stand-in refuses host arrays in device kernels) and the table has a
forward and a backward figure per layer type."""
import re

import cupy
from cupy import _standin
from lbannpy.bench import overhead


def test_is_the_standin():
    assert cupy.__file__.replace("\\", "/").endswith("tests/gpu_standin/cupy/__init__.py")


def test_gpu_table_runs_on_the_device():
    _standin.reset_launches()
    lines = overhead.report_gpu(["conv", "batchnorm", "relu", "pool", "batchnorm+relu"], 3, 3, 1, True,
                                "mesh_tiny", 8)
    assert sum(_standin.launches().values()) > 0   # the layers launched device work
    assert "host time per layer and pass on the GPU" in lines[0] and "target 20 us" in lines[0]
    assert lines[1].split() == ["layer", "forward", "backward", "target"]
    rows = lines[2:-1]
    assert [r.split()[0] for r in rows] == ["conv", "batchnorm", "relu", "pool", "batchnorm+relu"]
    for r in rows:
        assert re.match(r"^\S+\s+-?\d+\.\d\s+-?\d+\.\d\s+(ok|over)", r), r
    assert re.match(r"^step: mesh_tiny 8x8 batch 1: host \d+\.\d{3} ms forward, \d+\.\d{3} ms backward, "
                    r"\d+ layers", lines[-1]), lines[-1]
