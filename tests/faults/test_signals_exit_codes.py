"""Exit codes and messages: a configuration the machine cannot run exits 2 with one line naming the key to
change (the GPU, backend, shared-GPU and thread settings), a closed stdout or a reader that left ends
quietly with the work kept, a standard output on a full device is named, every file error names the file,
and a huge key is not echoed whole. Also: SIGINT in an NCCL run (on the CUDA stand-in) says why the job
ended and nothing after it."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import h5py
import pytest
import yaml

from . import util

STANDIN = Path(__file__).resolve().parents[1] / "gpu_standin"


def _setup(tmp: Path, **sections) -> Path:
    util.make_data(tmp / "data.h5")
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(util.spec(tmp, **sections)))
    return cfg


def _no_cupy(tmp: Path) -> dict:
    """An environment in which ``import cupy`` fails as on a machine without it, whatever is installed."""
    fake = tmp / "nocupy" / "cupy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError(\"No module named 'cupy'\")\n")
    return dict(util.ENV, PYTHONPATH=str(tmp / "nocupy"))


def _train(tmp: Path, cfg: Path, *args, env=None, ranks: int = 1, timeout: float = 120, **kw):
    cmd = [util.PY, "-m", "lbannpy.train", str(cfg), "--quiet", *args]
    if ranks > 1:
        cmd = [util.MPIEXEC, "-n", str(ranks)] + cmd
    return subprocess.run(cmd, cwd=tmp, env=env or util.ENV, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _one_error_line(p, *names: str) -> str:
    lines = util.error_lines(p.stderr)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert len(lines) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# -- the device, backend, shared GPUs and threads against the machine ------------------------------------

def test_device_gpu_without_cupy_names_runtime_device(tmp_path):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg, "--set", "runtime.device=gpu", env=_no_cupy(tmp_path))
    line = _one_error_line(p, "cfg.yaml", "runtime.device: gpu", "runtime.device: cpu")
    assert "backend 'numpy'" not in line


def test_backend_nccl_without_cupy_names_runtime_backend(tmp_path):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg, "--set", "runtime.device=gpu", "--set", "runtime.backend=nccl",
               env=_no_cupy(tmp_path))
    line = _one_error_line(p, "runtime.backend: nccl", "runtime.backend: mpi")
    assert "backend 'numpy'" not in line


def _standin_env(devices: int) -> dict:
    return dict(util.ENV, PYTHONPATH=str(STANDIN), LBANNPY_STANDIN_DEVICES=str(devices))


@pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")
def test_ranks_sharing_a_gpu_without_share_gpu(tmp_path):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg, "--set", "runtime.device=gpu", env=_standin_env(1), ranks=2)
    _one_error_line(p, "2 ranks on this node but 1 GPU(s)", "runtime.share_gpu: true")


@pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")
def test_share_gpu_with_nccl(tmp_path):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg, "--set", "runtime.device=gpu", "--set", "runtime.share_gpu=true", "--set",
               "runtime.backend=nccl", env=_standin_env(1), ranks=2)
    _one_error_line(p, "runtime.backend: nccl", "runtime.backend: mpi")


def test_threads_beyond_the_node_are_refused(tmp_path):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg, "--set", "runtime.threads=100000")
    _one_error_line(p, "runtime.threads: 100000", "at most")
    assert not (tmp_path / "out" / "metrics.csv").exists()


@pytest.mark.parametrize("setting, names", [
    ("runtime.threads=100000", ("runtime.threads: 100000", "at most")),
    ("runtime.device=gpu", ("runtime.device: gpu", "runtime.device: cpu")),
])
def test_predict_refuses_what_this_machine_cannot_run_as_train_does(tmp_path, setting, names):
    """predict starts from the same checks: one line, exit 2, before MPI (it segfaulted on the threads and
    failed with a traceback file on the device)."""
    cfg = _setup(tmp_path)
    cmd = [util.PY, "-m", "lbannpy.predict", str(cfg), "--checkpoint", str(tmp_path / "ck"),
           "--data", str(tmp_path / "data.h5"), "-o", str(tmp_path / "pred.h5"), "--set", setting]
    p = subprocess.run(cmd, cwd=tmp_path, env=_no_cupy(tmp_path), capture_output=True, text=True, timeout=120)
    _one_error_line(p, "cfg.yaml", *names)
    assert not (tmp_path / "pred.h5").exists()


# -- standard output -------------------------------------------------------------------------------------

def test_strategy_whose_reader_left_ends_quietly(tmp_path):
    """``strategy ... | head -1``: 141, as a shell reports a program SIGPIPE ended, and nothing on stderr."""
    cfg = _setup(tmp_path)
    proc = subprocess.Popen([util.PY, "-m", "lbannpy.strategy", str(cfg), "--ranks", "2", "--explain"],
                            cwd=tmp_path, env=util.ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()  # the reader left before anything was written: every write meets a broken pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_train_with_stdout_closed_keeps_its_work(tmp_path):
    cfg = _setup(tmp_path)
    p = subprocess.run(["bash", "-c", 'exec "$0" -m lbannpy.train "$1" --quiet >&-', util.PY, str(cfg)],
                       cwd=tmp_path, env=util.ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "NoneType" not in p.stderr and "failed" not in p.stderr, p.stderr
    assert (tmp_path / "out" / "metrics.csv").exists() and (tmp_path / "out" / "summary.json").exists()
    assert util.newest_checkpoint(tmp_path / "ck")[1]["step"] == 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["train", "strategy"])
def test_stdout_on_a_full_device_is_named(tmp_path, command):
    cfg = _setup(tmp_path)
    args = ["lbannpy.train", str(cfg), "--quiet"] if command == "train" else \
        ["lbannpy.strategy", str(cfg), "--ranks", "2"]
    with open("/dev/full", "w") as full:
        p = subprocess.run([util.PY, "-m", *args], cwd=tmp_path, env=util.ENV, stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    lines = util.error_lines(p.stderr)
    named = [ln for ln in lines if "standard output" in ln and "No space left on device" in ln]
    assert len(named) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    if command == "train":  # the run's work is kept: the output lines were only lost
        assert p.returncode == 0, p.stderr[-3000:]
        assert (tmp_path / "out" / "metrics.csv").exists()
    else:  # the table is the command's product: an error
        assert p.returncode == 2, p.stderr[-3000:]


# -- files -----------------------------------------------------------------------------------------------

def test_data_check_on_a_file_being_written(tmp_path):
    path = tmp_path / "live.h5"
    with h5py.File(path, "w") as f:  # open for writing in this process: HDF5 locks it
        f["inputs"] = [[1.0]]
        f.flush()
        p = subprocess.run([util.PY, "-m", "lbannpy.data", "check", str(path)], env=util.ENV,
                           capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    out = p.stdout.splitlines()
    assert p.returncode == 1 and len(out) == 1, (p.returncode, p.stdout, p.stderr[-2000:])
    assert str(path) in out[0] and "locked" in out[0], out


def _unreadable(path: Path) -> list[str]:
    """Make ``path`` unreadable to the command: mode 000, and as root (which reads it anyway) run the
    command without the capabilities that bypass file permissions. The prefix to run it with."""
    path.chmod(0)
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("kind", ["empty", "directory", "unreadable"])
def test_predict_data_that_cannot_be_read_is_named(tmp_path, kind):
    cfg = _setup(tmp_path)
    p = _train(tmp_path, cfg)
    assert p.returncode == 0, p.stderr[-3000:]
    ckpt, _ = util.newest_checkpoint(tmp_path / "ck")
    bad = tmp_path / "in.h5"
    prefix: list[str] = []
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "directory":
        bad.mkdir()
    else:
        shutil.copy(tmp_path / "data.h5", bad)
        prefix = _unreadable(bad)
    p = subprocess.run(prefix + [util.PY, "-m", "lbannpy.predict", str(cfg), "--checkpoint", str(ckpt),
                                 "--data", str(bad), "-o", str(tmp_path / "pred.h5")],
                       cwd=tmp_path, env=util.ENV, capture_output=True, text=True, timeout=120)
    want = {"empty": "empty (0 bytes)", "directory": "a directory", "unreadable": "permission denied"}[kind]
    line = _one_error_line(p, f"--data {bad}", want)
    assert line.startswith("lbannpy.predict: error: "), line


@pytest.mark.parametrize("where", ["--set", "spec"])
def test_a_huge_key_is_not_echoed_whole(tmp_path, where):
    key = "k" * 60000
    if where == "--set":
        cfg = _setup(tmp_path)
        args: tuple = ("--set", f"trainer.{key}=1")
    else:
        cfg = _setup(tmp_path, trainer={key: 1})
        args = ()
    p = _train(tmp_path, cfg, *args)
    line = _one_error_line(p, "unknown key", "characters]")
    assert len(p.stderr) < 2000 and len(line) < 1000, len(p.stderr)


# -- SIGINT in an NCCL run (the CUDA stand-in) -----------------------------------------------------------

@pytest.mark.skipif(util.MPIEXEC is None, reason="needs mpiexec")
def test_sigint_in_an_nccl_run_says_only_why_it_ended(tmp_path):
    """SIGINT through the launcher (Ctrl-C: every rank gets it): each rank's one line and nothing after it,
    though aborting NCCL fails the step each main thread is in ("communicator destroyed")."""
    util.make_data(tmp_path / "data.h5")
    cfg = util.spec(tmp_path, trainer={"steps": 100000, "watchdog_s": 120}, checkpoint={"every_steps": 1000},
                    runtime={"device": "gpu", "backend": "nccl"})
    job = util.start(tmp_path, cfg, ranks=2, env={"PYTHONPATH": str(STANDIN), "LBANNPY_STANDIN_DEVICES": "4"})
    metrics = tmp_path / "out" / "metrics.csv"
    util.signal_when(job, lambda: metrics.exists() and len(metrics.read_text().splitlines()) > 3,
                     "some steps", "launcher", "SIGINT")
    assert job.proc.returncode == 5, (job.proc.returncode, job.err[-3000:])
    lines = util.error_lines(job.err)
    why = "SIGINT received; ending the job without a checkpoint"
    first = next((i for i, ln in enumerate(lines) if why in ln), None)
    assert first is not None, job.err[-3000:]
    after = [ln for ln in lines[first:] if ln.startswith("lbannpy")]  # MPICH's own Abort lines aside
    assert all(why in ln for ln in after), job.err[-3000:]
    assert "NcclError" not in job.err and "communicator destroyed" not in job.err, job.err[-3000:]
