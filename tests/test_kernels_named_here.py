"""A conv kernel set named outright that cannot run on this machine is refused by ``config validate`` in
train's words (exit 2, one line naming ``runtime.kernels``), and the benchmarks that offer cuDNN Frontend's
set refuse it without ``--device gpu`` the same way, before any run starts."""
import subprocess
import sys

import pytest

from train_util import ENV


def _run(args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    r = _run(["lbannpy.config", "zoo", "mesh_tiny", "-o", "spec.yaml"], d)
    assert r.returncode == 0, r.stderr
    return d


def test_validate_refuses_cudnn_off_a_gpu(spec):
    r = _run(["lbannpy.config", "validate", "spec.yaml", "--no-data", "--set", "runtime.kernels=cudnn"], spec)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "runtime.kernels: cudnn needs runtime.device: gpu" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_validate_keeps_the_sets_that_run_here(spec):
    r = _run(["lbannpy.config", "validate", "spec.yaml", "--no-data", "--set", "runtime.kernels=own"], spec)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("bench", ["peer", "overhead"])
def test_bench_refuses_cudnn_on_the_cpu(bench, tmp_path):
    r = _run(["lbannpy.bench", bench, "--kernels", "cudnn"], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--kernels cudnn runs on a GPU only; add --device gpu" in r.stderr
    assert "Traceback" not in r.stderr
