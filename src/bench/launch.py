"""Run a benchmark at a given number of ranks: relaunch under ``mpiexec`` when started alone."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from lbannpy.comm import launched_size


def relaunch_if_needed(subcommand: str, argv: list[str], ranks: int) -> int | None:
    """``None`` when this process already runs under a launcher (continue in place); otherwise start
    ``mpiexec -n ranks python -m lbannpy.bench subcommand argv...`` and return its exit status."""
    if launched_size() is not None:
        return None
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        print(f"lbannpy.bench {subcommand}: needs {ranks} MPI ranks and no mpiexec was found; run it as\n"
              f"  mpiexec -n {ranks} python -m lbannpy.bench {subcommand} ...   (or srun -n {ranks} ...)",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")  # one thread per rank unless the user says otherwise
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "lbannpy.bench", subcommand, *argv]
    print(f"lbannpy.bench {subcommand}: starting {' '.join(cmd[:3])} ... ({ranks} ranks)", file=sys.stderr,
          flush=True)
    return subprocess.call(cmd, env=env)
