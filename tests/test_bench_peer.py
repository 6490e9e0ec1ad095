"""`python -m lbannpy.bench peer`: the PyTorch network is lbannpy's (parameter counts, refused when they
differ), the data it writes fits the model, and the quick run prints its four tables."""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lbannpy.bench import peer  # noqa: E402


SMALL = [peer.Case("lenet5", "lenet5", 32, 4), peer.Case("mesh_tiny", "mesh_tiny", 32, 2)]


@pytest.mark.parametrize("case", SMALL + [peer.Case("alexnet", "alexnet", 128, 2),
                                          peer.Case("mesh_unet", "mesh_unet", 32, 2)])
def test_the_pytorch_network_has_lbannpys_parameter_count(case):
    from lbannpy.export import torch_module_source

    spec, params, out_shape = peer.network(case)
    space = {}
    exec(compile(torch_module_source(spec["model"]), "<net>", "exec"), space)
    net = space["Net"]()
    assert sum(p.numel() for p in net.parameters()) == params
    x = torch.zeros(case.batch, spec["model"]["input"]["channels"], case.size, case.size)
    assert tuple(net(x).shape) == out_shape


def test_the_worker_refuses_a_different_network(tmp_path):
    case = peer.Case("lenet5", "lenet5", 32, 4)
    _, params, _ = peer.network(case)
    args = {"zoo": "lenet5", "size": 32, "batch": 4, "layout": "nchw", "steps": 2, "params": params + 1,
            "rendezvous": str(tmp_path / "r"), "result": str(tmp_path / "res")}
    with pytest.raises(peer.PeerError, match="not the same network"):
        peer.torch_worker(args)
    args["params"] = params  # the control: the right count runs and leaves its result
    assert peer.torch_worker(args) == 0
    with open(tmp_path / "res.0.json") as f:
        assert json.load(f)["median_step_s"] > 0


@pytest.mark.parametrize("case", SMALL)
def test_the_data_fits_the_model(tmp_path, case):
    spec, _, out_shape = peer.network(case)
    path = tmp_path / "d.h5"
    peer.write_data(str(path), spec, out_shape, 6)
    with h5py.File(path, "r") as f:
        x, y = f["inputs"], f["labels"][...]
        assert x.shape == (6, spec["model"]["input"]["channels"], case.size, case.size)
        assert x.dtype == np.float32 and np.isfinite(x[...]).all()
        assert y.shape == ((6, case.size, case.size) if len(out_shape) > 2 else (6,))
        assert y.min() >= 0 and y.max() < out_shape[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_run_prints_the_four_tables(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "lbannpy.bench", "peer", "--quick", "--rounds", "1", "--steps", "3",
           "--dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for title in ("1 process: lbannpy / PyTorch", "2 ranks data parallel: lbannpy / PyTorch DDP",
                  "2 ranks data parallel against 1 rank", "2 ranks splitting"):
        assert title in out, out
    ratios = re.findall(r"ratio\s+([0-9.]+)x", out)
    assert len(ratios) == 8, out  # two networks in each of the four tables
    assert all(float(r) > 0 for r in ratios)


def test_bad_arguments_get_one_line():
    p = subprocess.run([sys.executable, "-m", "lbannpy.bench", "peer", "--models", "resnet9"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown model" in p.stderr and "Traceback" not in p.stderr


def test_small_networks_run_more_steps_on_both_sides(monkeypatch, tmp_path):
    """A network whose step is milliseconds runs ``steps_scale`` times the steps, lbannpy and PyTorch alike
    (and its data set holds that many batches), so both medians cover the same stretch."""
    calls = []
    monkeypatch.setattr(peer, "network", lambda case: ({}, 10, (case.batch, 10)))
    monkeypatch.setattr(peer, "write_data", lambda path, spec, out, samples: calls.append(("data", samples)))
    monkeypatch.setattr(peer, "lbannpy_step", lambda work, case, spec, data, ranks, split, steps, tag, t:
                        calls.append(("ours", case.name, steps)) or 0.01)
    monkeypatch.setattr(peer, "torch_step", lambda work, case, ranks, layout, steps, params, t:
                        calls.append(("torch", case.name, steps)) or 0.01)
    small = peer.Case("small", "lenet5", 32, 4, steps_scale=5)
    big = peer.Case("big", "lenet5", 32, 4)
    tables = peer.compare((small, big), rounds=1, steps=3, two_ranks=False, work=str(tmp_path), timeout=1)
    assert calls[:2] == [("data", 4 * 15), ("data", 4 * 3)]
    assert {c[2] for c in calls[2:] if c[1] == "small"} == {15}
    assert {c[2] for c in calls[2:] if c[1] == "big"} == {3}
    assert [r.ratios() for r in tables[0][1]] == [[1.0], [1.0]]
    scales = {c.name: c.steps_scale for c in peer.CASES}
    assert scales == {"lenet5": 5, "mesh_tiny": 5, "alexnet": 1, "mesh1k": 1, "mesh_unet": 1}


def test_mesh_unet_is_compared_on_one_process_and_splitting_the_height(monkeypatch, tmp_path):
    """The full-resolution U-Net is a default case, in the 1-process table and in the 2-rank height split
    against 1-process PyTorch (and its labels are per pixel at the input's resolution)."""
    (case,) = [c for c in peer.CASES if c.zoo == "mesh_unet"]
    spec, _, out_shape = peer.network(peer.Case("u", "mesh_unet", 16, 2))
    assert out_shape == (2, 2, 16, 16)
    runs = []
    monkeypatch.setattr(peer, "network", lambda c: ({}, 10, (c.batch, 2, c.size, c.size)))
    monkeypatch.setattr(peer, "write_data", lambda *a: None)
    monkeypatch.setattr(peer, "lbannpy_step", lambda work, c, spec, data, ranks, split, steps, tag, t:
                        runs.append((ranks, split)) or 0.02)
    monkeypatch.setattr(peer, "torch_step", lambda work, c, ranks, layout, steps, params, t: 0.01)
    monkeypatch.setattr(peer, "launcher", lambda ranks: [])
    tables = dict(peer.compare((case,), rounds=1, steps=2, two_ranks=True, work=str(tmp_path), timeout=1))
    assert runs == [(1, "n"), (2, "n"), (2, "h")]
    split = tables["2 ranks splitting each sample's height: lbannpy / 1-process PyTorch"]
    assert [r.what for r in split] == [case.label] and split[0].ratios() == [2.0]
    assert tables["1 process: lbannpy / PyTorch (best of NCHW and channels-last)"][0].ratios() == [2.0]


def test_gpu_comparison_without_a_gpu_says_why_in_one_line():
    p = subprocess.run([sys.executable, "-m", "lbannpy.bench", "peer", "--device", "gpu", "--quick"],
                       capture_output=True, text=True, timeout=120)
    if "skipped" not in p.stdout:
        pytest.skip(f"this node has a GPU: the comparison ran ({p.stdout[-200:]!r})")
    assert p.returncode == 0 and p.stdout.startswith("lbannpy.bench peer --device gpu: skipped, "), p.stdout
    assert len(p.stdout.strip().splitlines()) == 1 and "Traceback" not in p.stderr


class _FakeCuda:
    """torch.cuda's events and synchronize, on the host clock: records what the loop does and when."""

    def __init__(self, log):
        self.log = log
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self):
                self.t = len(fake.log)
                fake.log.append("record")

            def elapsed_time(self, end):  # milliseconds, as CUDA events give them
                assert "synchronize" in fake.log, "an event read before the device was waited for"
                return float(end.t - self.t)

        self.Event = Event

    def synchronize(self):
        self.log.append("synchronize")


def test_gpu_step_times_come_from_events_read_after_the_last_step():
    log: list = []
    fake_torch = type("T", (), {"cuda": _FakeCuda(log)})()
    times = peer._step_times(fake_torch, lambda: log.append("step"), 3, gpu=True)
    assert log == ["record", "step", "record", "step", "record", "step", "record", "synchronize"]
    assert times == [2e-3, 2e-3, 2e-3]  # each step's span between its two events, in seconds
    host = peer._step_times(fake_torch, lambda: None, 4, gpu=False)
    assert len(host) == 4 and all(t >= 0 for t in host) and log.count("synchronize") == 1
