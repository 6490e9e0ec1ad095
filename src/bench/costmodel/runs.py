"""Measured training steps (``mpiexec -n P python -m lbannpy.train``, one BLAS thread per rank) and the
other work on the machine while they run."""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from .builders import OPTIMIZER, BenchModel

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = "1"
    return env


def run_checked(cmd: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` with the benchmark's thread settings; a ``RuntimeError`` naming ``what`` on failure."""
    p = subprocess.run(list(cmd), env=thread_env(), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{what}: `{' '.join(cmd)}` exited {p.returncode}\n{p.stdout[-2000:]}\n"
                           f"{p.stderr[-2000:]}")
    return p


def prepare(model: BenchModel, work: str, timeout: float = 300) -> tuple[str, str]:
    """Write the model's data set and config (``config.h5``) under ``work``; returns their paths."""
    import yaml

    data = os.path.join(work, f"{model.name}-data.h5")
    run_checked([sys.executable, "-m", "lbannpy.data", *model.data, "-o", data], timeout,
                f"data for {model.name}")
    spec = {"model": dict(model.model), "data": {"train": {"path": data}},
            "trainer": {"batch_size": model.batch_size, "steps": 1, "seed": 1},
            "optimizer": dict(OPTIMIZER),
            "checkpoint": {"dir": os.path.join(work, "ckpt"), "every_steps": 0},
            "output": {"dir": os.path.join(work, "run"), "log_every": 1}}
    spec_path = os.path.join(work, f"{model.name}.yaml")
    with open(spec_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    cfg = os.path.join(work, f"{model.name}.h5")
    run_checked([sys.executable, "-m", "lbannpy.config", "build", spec_path, "-o", cfg], timeout,
         f"config for {model.name}")
    return cfg, data


def measure_step(config: str, ranks: int, layers: Mapping[str, Mapping[str, int]], steps: int, out_dir: str,
                 overlap: bool = False, timeout: float = 600) -> float:
    """Median step time (seconds) of ``steps`` optimizer steps of ``mpiexec -n ranks python -m lbannpy.train
    config`` with ``parallel.layers`` set to ``layers`` and ``comm.overlap`` to ``overlap``, from the run's
    ``summary.json``."""
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        raise RuntimeError("mpiexec not found: install an MPI (pip install mpich) or run under srun")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.train", config, "--quiet",
           "--set", f"trainer.steps={steps}", "--set", "parallel.layers=" + json.dumps(dict(layers)),
           "--set", f"comm.overlap={'true' if overlap else 'false'}",
           "--set", f"output.dir={out_dir}", "--set", f"checkpoint.dir={out_dir}/ckpt"]
    run_checked(cmd, timeout, f"training on {ranks} rank(s)")
    with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    t = summary.get("median_step_s")
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise RuntimeError(f"{out_dir}/summary.json has no usable median_step_s: {t!r}")
    return float(t)


# --------------------------------------------------------------------------------------------------------
# other work on the machine


def busy_cpu_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot, all cores (``/proc/stat``; Linux), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (a training run: mpiexec and its ranks)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherLoad:
    """Cores that other processes kept busy during a ``with`` block: the machine's busy CPU time less this
    process's and its children's, over the wall time (nan where ``/proc/stat`` cannot be read)."""

    cores = math.nan

    def __enter__(self) -> "OtherLoad":
        self._busy, self._own, self._t = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = busy_cpu_seconds(), time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            self.cores = max(0.0, (busy - self._busy) - (own_cpu_seconds() - self._own)) / wall


@dataclass
class Quiet:
    """Measure while the machine is otherwise idle, as far as it goes: before a measurement, wait (from a
    budget for the whole benchmark) until other processes keep fewer than ``threshold`` cores busy; repeat
    a training run during which they kept more, up to ``retries`` times. Whatever was measured last is
    kept, with its other load printed next to it."""

    budget_s: float = 300.0
    threshold: float = 0.25  # cores
    retries: int = 2
    waited_s: float = 0.0

    def wait(self) -> float:
        """Other load (cores) over the last one-second sample before returning (nan: no budget, no wait)."""
        if self.budget_s <= 0:
            return math.nan
        while True:
            with OtherLoad() as load:
                time.sleep(1.0)
            self.waited_s += 1.0
            if not load.cores > self.threshold or self.waited_s >= self.budget_s:
                return load.cores
