"""``runtime.tf32``: cuDNN's float32 arithmetic is set where a run's convolutions may take ATen on a GPU (off
by default, so float32 convolutions stay float32), and left alone everywhere else."""
import pytest

torch = pytest.importorskip("torch")

from lbannpy.config.schema import SCHEMA  # noqa: E402
from lbannpy.layers.kernels import aten, select  # noqa: E402


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32 = before


def _default(section, key):
    sec = next(k for k in SCHEMA.keys if k.name == section)
    return next(k for k in sec.keys if k.name == key).default


def test_off_by_default():
    assert _default("runtime", "tf32") is False


@pytest.mark.parametrize("tf32", [False, True])
def test_set_for_aten_on_a_gpu(monkeypatch, cudnn_flag, tf32):
    monkeypatch.setattr(aten, "available", lambda device="cpu": True)  # as on a node with CUDA
    torch.backends.cudnn.allow_tf32 = not tf32
    for choice in ("auto", "aten"):
        assert select.gpu_math(choice, "gpu", tf32) is True
        assert torch.backends.cudnn.allow_tf32 is tf32


@pytest.mark.parametrize("choice,device,cuda", [("own", "gpu", True), ("auto", "cpu", True),
                                                ("aten", "cpu", True), ("auto", "gpu", False)])
def test_left_alone_elsewhere(monkeypatch, cudnn_flag, choice, device, cuda):
    monkeypatch.setattr(aten, "available", lambda device="cpu": cuda)
    torch.backends.cudnn.allow_tf32 = True
    assert select.gpu_math(choice, device, False) is False
    assert torch.backends.cudnn.allow_tf32 is True
