"""One guard for every command's outputs: ``export``/``predict`` refuse an output that is one of their
inputs, the config's data or a checkpoint (the file stays byte for byte); a 2-rank ``predict`` whose rank 0
cannot create ``-o`` ends every rank at once with one line (before, rank 1 waited for the 600 s watchdog);
a full disk gives one line naming the file and leaves no temporary (before: h5py tracebacks, a segfault,
the temporary left); SIGTERM to a predicting rank removes the temporary and says so in a line."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess

import h5py
import numpy as np
import pytest
import yaml

from . import util

pytestmark = pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")

# each rank: run predict's entry point in-process and record its exit status; PREDICT_SLOW (seconds) makes
# every batch read that slow, so a signal finds the job in its batch loop
RANK = """
import os, sys, time
rank = os.environ.get("PMI_RANK", "0")
from lbannpy import predict
if os.environ.get("PREDICT_SLOW"):
    read = predict._read
    def slow_read(*a, **k):
        time.sleep(float(os.environ["PREDICT_SLOW"]))
        return read(*a, **k)
    predict._read = slow_read
try:
    code = predict.main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
open(os.path.join(os.environ["FAULT_DIR"], f"rc.{rank}"), "w").write(str(code))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run at 2 ranks with checkpoints at steps 2 and 4 in ``ck/`` (the weights split over the
    ranks), its config ``cfg.yaml`` naming ``data.h5`` as the training data."""
    d = tmp_path_factory.mktemp("output-guard")
    util.make_data(d / "data.h5")
    cfg = util.spec(d, trainer={"steps": 4}, checkpoint={"every_steps": 2}, parallel={"default": {"c": 2}})
    job = util.run(d, cfg, ranks=2, timeout=120)
    assert job.rank_codes() == [0, 0], job.err[-3000:]
    return d


def _copy(tmp_path, trained):
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("pid.*", "rc.*", "rank.py"))
    # the copied config names the copied data and checkpoints
    cfg = yaml.safe_load((tmp_path / "cfg.yaml").read_text())
    cfg["data"]["train"]["path"] = str(tmp_path / "data.h5")
    cfg["checkpoint"]["dir"], cfg["output"]["dir"] = str(tmp_path / "ck"), str(tmp_path / "out")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _predict(tmp_path, ckpt, out, data=None, timeout=60, env=None) -> util.Job:
    job = _start_predict(tmp_path, ckpt, out, data, env)
    return job.wait(timeout)


def _start_predict(tmp_path, ckpt, out, data=None, env=None) -> util.Job:
    for f in tmp_path.glob("rc.*"):
        f.unlink()
    script = tmp_path / "predict_rank.py"
    script.write_text(RANK)
    cmd = [util.MPIEXEC, "-n", "2", util.PY, str(script), str(tmp_path / "cfg.yaml"), "--checkpoint",
           str(ckpt), "--data", str(data or tmp_path / "data.h5"), "-o", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(util.ENV, FAULT_DIR=str(tmp_path), **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return util.Job(tmp_path, 2, proc, util.time.monotonic())


def _export(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([util.PY, "-m", "lbannpy.export", *map(str, args)], env=util.ENV,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def _one_line(text: str, *words: str) -> str:
    assert "Traceback" not in text, text[-4000:]
    lines = util.error_lines(text)
    assert len(lines) == 1, text[-4000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _assert_refused_predict(job, *words) -> None:
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    _one_line(job.err, "-o", *words)


# ------------------------------------------------------------------------------ outputs onto inputs
def test_export_onto_its_own_checkpoints_index_is_refused(tmp_path, trained):
    _copy(tmp_path, trained)
    ckpt = tmp_path / "ck" / "ckpt-00000004"
    index = ckpt / "index.h5"
    before = _digest(index)
    r = _export(tmp_path, ckpt, "-o", index)
    assert r.returncode == 2, (r.returncode, r.stderr)
    _one_line(r.stderr, "-o", "index.h5")
    assert _digest(index) == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["index.h5", "shard-000000.h5", "shard-000001.h5"]


def test_predict_onto_a_sibling_checkpoints_index_is_refused(tmp_path, trained):
    _copy(tmp_path, trained)
    index = tmp_path / "ck" / "ckpt-00000002" / "index.h5"
    before = _digest(index)
    job = _predict(tmp_path, tmp_path / "ck" / "ckpt-00000004", out=index)
    _assert_refused_predict(job, "ckpt-00000002")
    assert _digest(index) == before
    assert not list(index.parent.glob("index.h5.tmp*"))


@pytest.mark.parametrize("onto", ["config", "output"])
def test_export_torch_module_onto_the_config_or_the_output_is_refused(tmp_path, trained, onto):
    _copy(tmp_path, trained)
    weights = tmp_path / "w.safetensors"
    r = _export(tmp_path, tmp_path / "ck", "-o", weights)  # an earlier export, to be kept
    assert r.returncode == 0, r.stderr
    target = tmp_path / "cfg.yaml" if onto == "config" else weights
    before = {p: _digest(p) for p in (tmp_path / "cfg.yaml", weights)}
    r = _export(tmp_path, tmp_path / "ck", "-o", weights, "--config", tmp_path / "cfg.yaml", "--torch-module",
                target)
    assert r.returncode == 2, (r.returncode, r.stderr)
    _one_line(r.stderr, "--torch-module", target.name)
    assert {p: _digest(p) for p in before} == before
    assert sorted(p.name for p in tmp_path.glob("*.tmp*")) == []


def test_predict_onto_the_configs_training_data_is_refused(tmp_path, trained):
    _copy(tmp_path, trained)
    other = tmp_path / "other.h5"
    shutil.copy(tmp_path / "data.h5", other)
    before = _digest(tmp_path / "data.h5")
    # --data is another file: only the config names data.h5 (as data.train.path); a '..' on the way
    job = _predict(tmp_path, tmp_path / "ck", out=tmp_path / "ck" / ".." / "data.h5", data=other)
    _assert_refused_predict(job, "data.train.path")
    assert _digest(tmp_path / "data.h5") == before


def test_train_whose_metrics_file_is_its_training_data_is_refused(tmp_path):
    """The trainer's outputs pass the same guard: a data file that output.dir's metrics.csv would replace
    (before: trained, then wrote the metrics over the data)."""
    (tmp_path / "out").mkdir()
    data = tmp_path / "out" / "metrics.csv"
    util.make_data(data)
    cfg = util.spec(tmp_path, trainer={"steps": 2})
    cfg["data"]["train"]["path"] = str(data)
    before = _digest(data)
    job = util.run(tmp_path, cfg, ranks=2, timeout=90)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    _one_line(job.err, "output.dir", "data.train.path", "metrics.csv")
    assert _digest(data) == before and not (tmp_path / "ck").exists()


# ------------------------------------------------------------------------- rank 0 cannot create -o
@pytest.fixture
def readonly_dir(tmp_path):
    """A directory no one may write into (root included: a read-only mount where the tests run as root)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.mark.parametrize("where", ["file-as-parent", "read-only-directory"])
def test_an_output_rank_0_cannot_create_ends_every_rank_promptly(tmp_path, trained, request, where):
    _copy(tmp_path, trained)
    if where == "file-as-parent":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "p.h5"
    else:
        out = request.getfixturevalue("readonly_dir") / "p.h5"
    # the watchdog would end a hang after 600 s; the harness's own timeout is far shorter
    job = _predict(tmp_path, tmp_path / "ck", out=out, timeout=120)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    line = _one_line(job.err, str(out))
    assert "rank 1" not in line, line
    assert not out.exists()


# ---------------------------------------------------------------------------------------- full disk
@pytest.fixture
def full_disk(tmp_path):
    """A small tmpfs filled to the last byte (needs root, as CI runs)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        for size in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
        os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_predict_on_a_full_disk_says_one_line_and_leaves_no_temporary(tmp_path, trained, full_disk):
    _copy(tmp_path, trained)
    out = full_disk / "p.h5"
    job = _predict(tmp_path, tmp_path / "ck", out=out, timeout=120)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.proc.returncode, job.err[-3000:])
    _one_line(job.err, str(out), "No space left on device")
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_export_on_a_full_disk_says_one_line_and_leaves_no_temporary(tmp_path, trained, full_disk):
    _copy(tmp_path, trained)
    out = full_disk / "w.safetensors"
    r = _export(tmp_path, tmp_path / "ck", "-o", out)
    assert r.returncode == 2, (r.returncode, r.stderr)
    _one_line(r.stderr, str(out), "No space left on device")
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


# ------------------------------------------------------------------------------------------ SIGTERM
@pytest.mark.parametrize("target", [0, 1])
def test_sigterm_to_a_predicting_rank_removes_the_temporary_and_says_so(tmp_path, trained, target):
    _copy(tmp_path, trained)
    big = tmp_path / "big.h5"  # 400 samples: 100 batches, each read made slow
    rng = np.random.default_rng(1)
    with h5py.File(big, "w") as f:
        f["inputs"] = rng.standard_normal((400, 3, 8, 8)).astype(np.float32)
    out = tmp_path / "p.h5"
    job = _start_predict(tmp_path, tmp_path / "ck", out, data=big, env={"PREDICT_SLOW": "0.1"})
    try:
        util.wait_for(lambda: list(tmp_path.glob("p.h5.tmp*")), 90, "the output's temporary")
        util.time.sleep(3.0)  # in the batch loop by now (the model is built within a second of the claim)
        assert job.proc.poll() is None, job.proc.communicate()
        pids = _rank_pids(job)
        os.kill(pids[target], signal.SIGTERM)
        job.wait(60)
    finally:
        util.kill(job)
    assert job.proc.returncode != 0 and all(c != 0 for c in job.rank_codes()), (job.rank_codes(), job.err)
    assert "Traceback" not in job.err, job.err[-3000:]
    said = [ln for ln in job.err.splitlines() if ln.startswith("lbannpy") and "SIGTERM" in ln]
    assert said and f"rank {target}" in said[0] and "p.h5.tmp" in said[0], job.err[-3000:]
    assert not list(tmp_path.glob("p.h5*")), list(tmp_path.glob("p.h5*"))


def _rank_pids(job) -> list[int]:
    """The ranks' pids: the launcher's descendants running the rank script, in rank order."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        fault = f"FAULT_DIR={job.tmp}".encode()
        if b"predict_rank.py" in cmd and fault in env:
            rank = next((e.split(b"=", 1)[1] for e in env if e.startswith(b"PMI_RANK=")), None)
            if rank is not None:
                found[int(rank)] = int(pid)
    assert sorted(found) == [0, 1], found
    return [found[0], found[1]]


# ------------------------------------------------------------------------------------ two small cases
@pytest.mark.parametrize("dtype", ["uint8", "bool", "complex64"])
def test_predict_without_labels_refuses_inputs_that_are_not_floating_point(tmp_path, trained, dtype):
    """Without labels the inputs were only shape-checked: uint8 and bool ran, and complex inputs lost their
    imaginary part silently."""
    _copy(tmp_path, trained)
    x = np.random.default_rng(2).standard_normal((8, 3, 8, 8))
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f["inputs"] = (x + 1j * x).astype(dtype) if dtype == "complex64" else (x > 0).astype(dtype)
    out = tmp_path / "p.h5"
    job = _predict(tmp_path, tmp_path / "ck", out=out, data=bad)
    assert job.rank_codes() == [2, 2], (job.rank_codes(), job.err[-3000:])
    _one_line(job.err, "bad.h5", dtype, "floating point")
    assert not list(tmp_path.glob("p.h5*"))


def test_export_torch_module_of_a_leaky_relu_model_loads_and_matches(tmp_path):
    """The generated module read the slope from the layer's forward-pass attribute: AttributeError."""
    torch = pytest.importorskip("torch")
    import importlib.util

    from lbannpy import checkpoint
    from lbannpy.comm import SingleCommunicator
    from lbannpy.export import main, read_safetensors
    from lbannpy.layers.context import LayerContext
    from lbannpy.model import Model
    from lbannpy.optim import make_optimizer
    from lbannpy.tensor import DistTensor

    spec = yaml.safe_load(yaml.safe_dump(util.SPEC))
    spec["model"]["layers"][1] = {"name": "a1", "type": "leaky_relu", "slope": 0.2}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    model = Model(spec["model"], 2, LayerContext(SingleCommunicator(), np, "float64", seed=3), {})
    opt = make_optimizer({"type": "sgd", "lr": 0.01}, model.params, 10)
    checkpoint.save(SingleCommunicator(), str(tmp_path / "ck"), 1, model.params, opt, {}, model.layers)
    out, src = tmp_path / "m.safetensors", tmp_path / "net.py"
    assert main([str(tmp_path / "ck"), "-o", str(out), "--dtype", "float64", "--config",
                 str(tmp_path / "spec.yaml"), "--torch-module", str(src)]) == 0
    sp = importlib.util.spec_from_file_location("leaky_net", src)
    mod = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(mod)
    net = mod.Net().double()
    tensors, _ = read_safetensors(str(out))
    net.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    net.eval()
    x = np.random.default_rng(4).standard_normal(model.input_shape)
    model.set_train(False)
    want = model.forward(DistTensor(x, model.input_shape, model.input_dist, 0)).local
    with torch.no_grad():
        got = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    assert "0.2" in src.read_text()
