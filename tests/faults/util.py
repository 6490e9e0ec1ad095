"""The fault-injection harness: a tiny model and data set, and ``mpiexec -n P`` runs of the trainer in which
every rank records its pid when it starts and its exit status when it returns (a rank that writes no status
was killed by the launcher after another rank's ``MPI_Abort``: non-zero by definition)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import yaml

MPIEXEC = shutil.which("mpiexec")
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

# each rank: record the pid, run the entry point in-process, record the status
RANK = """
import os, sys
rank = os.environ.get("PMI_RANK", "0")
d = os.environ["FAULT_DIR"]
open(os.path.join(d, f"pid.{rank}"), "w").write(str(os.getpid()))
from lbannpy.train import main
if os.environ.get("FAULT_RAISE"):  # "RANK:STEP": that rank raises in that step, the others go on
    from lbannpy.training.loop import Trainer
    at_rank, at_step = os.environ["FAULT_RAISE"].split(":")
    step = Trainer.train_step
    def train_step(self):
        if rank == at_rank and self.step + 1 == int(at_step):
            raise RuntimeError(f"injected fault at step {at_step}")
        return step(self)
    Trainer.train_step = train_step
if os.environ.get("FAULT_SETUP_SLEEP"):  # "RANK:SECONDS": that rank is slow in set-up, the others wait for it
    import time
    from lbannpy.training import loop
    at_rank, secs = os.environ["FAULT_SETUP_SLEEP"].split(":")
    build = loop.build
    def slow_build(*a, **k):
        if rank == at_rank:
            open(os.path.join(d, f"setup.{rank}"), "w").close()
            time.sleep(float(secs))
        return build(*a, **k)
    loop.build = slow_build
if os.environ.get("FAULT_GRAD_NAN"):  # "RANK:STEP:LAYER": that rank's gradient of that layer turns NaN
    from lbannpy.training.gradsync import GradSync
    at_rank, at_step, at_layer = os.environ["FAULT_GRAD_NAN"].split(":")
    calls = []
    hook = GradSync.on_layer.fget
    def on_layer(self):
        done = hook(self)
        def poisoned(name):
            if name == at_layer:
                calls.append(name)
                if rank == at_rank and len(calls) == int(at_step):
                    for p in self.engine._layer_params[name]:
                        p.grad.reshape(-1)[0] = float("nan")
            return done(name)
        return poisoned
    GradSync.on_layer = property(on_layer)
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
open(os.path.join(d, f"rc.{rank}"), "w").write(str(code))
sys.exit(code)
"""

SPEC = {
    "model": {"name": "m", "input": {"channels": 3, "spatial": [8, 8]},
              "layers": [{"name": "c1", "type": "conv", "filters": 4, "kernel": 3, "padding": 1},
                         {"name": "r1", "type": "relu"},
                         {"name": "f1", "type": "fc", "units": 2}],
              "loss": "cross_entropy"},
    "data": {"train": {"path": "data.h5"}},
    "trainer": {"batch_size": 4, "steps": 4},
    "optimizer": {"type": "sgd", "lr": 0.01},
}


def make_data(path: Path, n: int = 32, nan_at: int | None = None) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3, 8, 8)).astype(np.float32)
    if nan_at is not None:
        x[nan_at, 1, 4, 4] = np.nan
    with h5py.File(path, "w") as f:
        f["inputs"] = x
        f["labels"] = rng.integers(0, 2, n)


def spec(tmp: Path, **sections) -> dict:
    s = yaml.safe_load(yaml.safe_dump(SPEC))
    s["data"]["train"]["path"] = str(tmp / "data.h5")
    s["output"] = {"dir": str(tmp / "out")}
    s["checkpoint"] = {"dir": str(tmp / "ck")}
    for k, v in sections.items():
        s.setdefault(k, {}).update(v)
    return s


@dataclass
class Job:
    tmp: Path
    ranks: int
    proc: subprocess.Popen
    t0: float
    out: str = ""
    err: str = ""

    def pids(self, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = [self.tmp / f"pid.{r}" for r in range(self.ranks)]
            if all(f.exists() and f.read_text() for f in files):
                return [int(f.read_text()) for f in files]
            time.sleep(0.05)
        raise AssertionError("the ranks did not start")

    def wait(self, timeout: float) -> "Job":
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(self)
            self.out, self.err = self.proc.communicate()
            raise AssertionError(f"the job did not end before the harness's timeout of {timeout} s:\n"
                                 f"{self.err[-3000:]}")
        return self

    def rank_codes(self) -> list[int | None]:
        """Each rank's exit status; None for a rank the launcher killed (it never returned)."""
        out = []
        for r in range(self.ranks):
            f = self.tmp / f"rc.{r}"
            out.append(int(f.read_text()) if f.exists() else None)
        return out

    def assert_every_rank_failed(self) -> None:
        codes = self.rank_codes()
        assert self.proc.returncode != 0, f"mpiexec exited 0; ranks {codes}:\n{self.err[-3000:]}"
        assert all(c != 0 for c in codes), f"a rank exited 0: {codes}:\n{self.err[-3000:]}"

    def assert_no_traceback(self) -> None:
        assert "Traceback" not in self.err, f"a traceback on stderr:\n{self.err[-4000:]}"


def start(tmp: Path, cfg: dict, ranks: int = 2, args: tuple = (), name: str = "cfg", env: dict | None = None
          ) -> Job:
    for f in list(tmp.glob("pid.*")) + list(tmp.glob("rc.*")):
        f.unlink()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    script = tmp / "rank.py"
    script.write_text(RANK)
    env = dict(ENV, FAULT_DIR=str(tmp), **(env or {}))
    # its own session: a signal to the launcher reaches it alone (not pytest), like a scheduler's
    proc = subprocess.Popen([MPIEXEC, "-n", str(ranks), PY, str(script), str(path), "--quiet", *args],
                            cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return Job(tmp, ranks, proc, time.monotonic())


def run(tmp: Path, cfg: dict, ranks: int = 2, args: tuple = (), timeout: float = 90, env: dict | None = None
        ) -> Job:
    return start(tmp, cfg, ranks, args, env=env).wait(timeout)


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def signal_when(job: Job, ready, what: str, target, sig: str, grace: float = 30) -> None:
    """Once ``ready()`` holds, send ``sig`` to rank ``target`` (or ``"launcher"``) and wait for the job: it
    must end within ``grace`` seconds, the harness's own timeout (liveness; no duration is asserted, which
    a loaded machine would make flaky). Leaves nothing running."""
    try:
        pids = job.pids()
        wait_for(ready, 90, what)
        os.kill(job.proc.pid if target == "launcher" else pids[target], getattr(signal, sig))
        job.wait(grace)
    finally:
        kill(job)


def newest_checkpoint(ck: Path):
    from lbannpy import checkpoint

    return checkpoint.load_newest(str(ck))


def kill(job: Job) -> None:
    """Leave nothing behind: the launcher's session (it and the ranks it started)."""
    try:
        os.killpg(job.proc.pid, 9)
    except ProcessLookupError:
        pass


# start-up notes every run prints on stderr (the thread choice, the rank defaults): information, not the
# failure; the failure itself must be one line
_NOTES = ("BLAS/OpenMP thread", "left free by parallel.default", "every layer is replicated")


def error_lines(err: str) -> list[str]:
    """The non-empty stderr lines that are not start-up notes."""
    return [ln for ln in err.splitlines() if ln.strip() and not any(n in ln for n in _NOTES)]
