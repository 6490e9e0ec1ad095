"""The overlap engine under mpiexec: every rank reduces its buckets in one fixed order whatever the timing
of its own backprop, the sums are right, and an exception on one rank in the middle of a step, with the
other rank's communication thread inside a bucket reduction, ends the whole job promptly."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

MPIEXEC = shutil.which("mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy as np
    from lbannpy.comm import Runtime
    from lbannpy.comm.overlap import OverlapEngine

    MODE = sys.argv[1]

    class P:
        def __init__(self, name, n):
            self.name, self.grad, self.value = name, np.zeros(n), np.zeros(n)

    with Runtime(backend="auto") as rt:
        world = rt.world
        rank, size = world.rank, world.size
        layers = [f"l{i}" for i in range(8)]
        # each layer: a large weight and a small bias. Backprop reaches both at once, but the bias is cut
        # into the bucket before the weight's (reverse order), so a bucket completes before an earlier one
        params = [P(f"{lay}.{k}", n) for i, lay in enumerate(layers)
                  for k, n in (("w", 3000 + 500 * i), ("b", 7))]
        eng = OverlapEngine(params, [world] * len(params), bucket_bytes=30_000, first_bucket_bytes=8_000)
        rng = np.random.default_rng(rank)
        try:
            for step in range(3):
                eng.start_step()
                if step == 2:  # a gradient rebound to another array is still reduced (copied in and out)
                    params[3].grad = np.zeros_like(params[3].grad)
                for i, p in enumerate(params):
                    p.grad[...] = (rank + 1) * (step + i)
                for j, l in enumerate(reversed(layers)):  # backprop, with rank-dependent compute times
                    time.sleep(float(rng.uniform(0, 0.004)))
                    if MODE == "raise" and rank == size - 1 and step == 1 and j == 4:
                        raise RuntimeError("injected failure in the middle of backprop")
                    eng.layer_done(l)
                eng.finish()
                want = sum(r + 1 for r in range(size))
                for i, p in enumerate(params):
                    assert np.all(p.grad == want * (step + i)), (p.name, p.grad[:3])
            order = [b for b, *_ in eng.records]
            every = world.allgather_obj(order)
            assert all(o == every[0] for o in every), every
            assert order == list(range(len(eng.buckets))) * 3, order
            if rank == 0:
                print(f"ORDER OK {len(eng.buckets)} buckets", flush=True)
        finally:
            eng.close()
''')


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("overlap") / "engine.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("ranks", [2, 4])
def test_buckets_reduce_in_one_fixed_order_on_every_rank(script, ranks):
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    p = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(script), "ok"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "ORDER OK" in p.stdout, p.stdout + p.stderr


def test_an_exception_mid_step_ends_every_rank(script):
    assert MPIEXEC, "mpiexec not found (pip install mpich)"
    # a rank left waiting in a collective would hang the job: the timeout turns that into a failure
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), "raise"], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "injected failure in the middle of backprop" in p.stderr, p.stderr
    assert "rank 1" in p.stderr, p.stderr  # the message names the failing rank
