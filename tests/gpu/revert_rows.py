"""Evidence for issue #13's rows 1-12: each row's fix undone alone must make its test fail.

For every row this script copies the tracked tree (plus built extensions) to a temporary directory,
puts the row's bug back with the literal edits listed in ``ROWS`` (each one the pre-fix behaviour of that
row, found in the fix commits since 6b17689), runs the row's tests there with that copy first on the path,
and runs the same tests on the unchanged copy. It prints ``row | test | before fix | after fix``; a row
proves its point when "before fix" fails and "after fix" passes. An edit whose text is no longer in the
tree is reported as ``stale`` (the code moved: update the edit), never as a pass.

Not part of the test run (it takes minutes). Run from the repository root:

    OMP_NUM_THREADS=1 python tests/gpu/revert_rows.py [ROW ...]

Row 4 (CUDA-aware MPI) is checked where MPI is about to read the buffer (the stand-in also checks, as
mpi4py takes a device array's memory through ``__cuda_array_interface__``, that its writer finished).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

G = "tests/gpu/"
# row: (what the edits put back, [(file, text now, pre-fix text)], [tests])
ROWS: dict[str, tuple[str, list, list]] = {
    "1": ("loss metrics via numpy.asarray of device arrays",
          [("layers/loss.py", "tp.astype(f8), fp.astype(f8), fn.astype(f8)",
            "xp.asarray(np.asarray(tp, dtype=f8)), xp.asarray(np.asarray(fp, dtype=f8)), "
            "xp.asarray(np.asarray(fn, dtype=f8))")],
          [G + "test_layers_gpu.py::test_loss_metrics_on_gpus_equal_the_numpy_path_without_host_syncs"]),
    "2": ("loss statistics reduced as a host array",
          [("layers/loss.py", "return self.group.allreduce(stats)",
            "return self.group.allreduce(to_numpy(stats))")],
          [G + "test_layers_gpu.py::test_loss_metrics_on_gpus_equal_the_numpy_path_without_host_syncs"]),
    "3": ("a gradient thread on NCCL that never selects the rank's GPU",
          [("comm/overlap.py", 'bucket.mode = "stream" if getattr(bucket.comm, "backend", "") == "nccl" '
            'else "thread"', 'bucket.mode = "thread"'),
           ("comm/overlap.py", "            self._xp.cuda.Device(self._device_id).use()",
            "            pass")],
          [G + "test_overlap_gpu.py::test_the_engine_works_on_the_ranks_device[nccl]"]),
    "4": ("CUDA-aware MPI synchronises the calling thread's current device, not the buffer's",
          [("comm/mpi.py", "            with buf.device:\n                if after is not None:\n"
            "                    after.synchronize()",
            "            if True:\n                if after is not None:\n"
            "                    cupy.cuda.get_current_stream().synchronize()")],
          [G + "test_rows.py::test_cuda_aware_mpi_waits_for_the_buffers_device"]),
    # with the fix the main thread posts NCCL buckets from the compute stream itself, so dropping the event
    # alone changes nothing: the pre-fix reduction from a thread ordered by that thread's current stream
    "5": ("NCCL buckets from a thread ordered by its current stream, not the compute stream's event",
          [("comm/overlap.py", 'bucket.mode = "stream" if getattr(bucket.comm, "backend", "") == "nccl" '
            'else "thread"', 'bucket.mode = "thread"'),
           ("comm/overlap.py", "bucket.comm.allreduce(bucket.buffer, out=bucket.buffer, after=bucket.ready)",
            "bucket.comm.allreduce(bucket.buffer, out=bucket.buffer)")],
          [G + "test_overlap_gpu.py::test_gradients_are_reduced_after_backward_wrote_them"
           "[per_thread_default-nccl]"]),
    "6": ("NCCL buckets reduced from a second thread (the thread selects the device)",
          [("comm/overlap.py", 'bucket.mode = "stream" if getattr(bucket.comm, "backend", "") == "nccl" '
            'else "thread"', 'bucket.mode = "thread"')],
          [G + "test_overlap_gpu.py::test_nccl_calls_come_from_one_thread_in_one_order"]),
    "7": ("wait() blocks the host on the event before the stream waits",
          [("comm/nccl.py", "return Handle(lambda: self._consume(ev),",
            "return Handle(lambda: (ev.synchronize(), self._consume(ev)),")],
          [G + "test_comm_gpu.py::test_waiting_never_blocks_the_host",
           G + "test_overlap_gpu.py::test_no_host_synchronization_in_a_nccl_step"]),
    "8a": ("loss kernel: label range read back from the device",
           [("layers/kernels/loss.py", "        if array_module(labels) is numpy:  # device labels were "
             "checked on the host before upload\n            check_label_range(labels, k)",
             "        if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= k):\n"
             "            raise KernelShapeError('labels out of range')")],
           [G + "test_layers_gpu.py::test_loss_metrics_on_gpus_equal_the_numpy_path_without_host_syncs"]),
    "8b": ("batch norm: the statistics count reduced and read back",
           [("layers/batchnorm.py", "        tot = self.ctx.xp.concatenate((s, sq))\n",
             "        tot = self.ctx.xp.concatenate((s, sq, self.ctx.xp.asarray([float(_)])))\n"),
            ("layers/batchnorm.py", "        count = self.stat_count\n",
             "        count = float(tot[-1])\n")],
           [G + "test_layers_gpu.py::test_batchnorm_and_pooling_make_no_host_sync"]),
    "8c": ("max pooling asks the device whether a NaN exists",
           [("layers/kernels/pool.py", "has_nan = bool(xp.isnan(y).any()) if xp is numpy else True",
             "has_nan = bool(xp.isnan(y).any())")],
           [G + "test_layers_gpu.py::test_batchnorm_and_pooling_make_no_host_sync"]),
    "9": ("step, layer and halo times on the host clock on a GPU",
          [("src/training/clock.py", "return EventClock(xp) if device == \"gpu\" else Clock()",
            "return Clock()")],
          [G + "test_train_gpu.py::test_gpu_training_equals_the_numpy_run[classification]"]),
    "9b": ("gradient bucket times and hidden_comm_fraction on the host clock on a GPU",
           [("comm/overlap.py", "self._events = self._device_id is not None and bool(device_timing)",
             "self._events = False")],
           [G + "test_rows.py::test_bucket_times_are_cuda_events_on_a_gpu"]),
    "10": ("GPU-site jobs train and calibrate on the CPU",
           [("src/jobs/render.py", '" --set runtime.device=gpu --set runtime.backend=nccl" if gpu else ""',
             '""'),
            ("src/jobs/render.py", '" --device gpu --backend nccl" if gpu else ""', '""')],
           ["tests/test_jobs_render.py::test_gpu_sites_train_and_calibrate_on_their_gpus"]),
    "11": ("batches uploaded on the main thread, blocking, from pageable memory",
           [("src/training/loop.py", '        if self.rt.device == "gpu":  # batches go up one ahead',
             '        if False:  # batches go up one ahead')],
           [G + "test_train_gpu.py::test_host_syncs_per_training_step_stay_within_the_budget"]),
    "12": ("make_communicator / Runtime leave every local rank on GPU 0",
           [("comm/runtime.py", "    device_id = local_rank % count\n", "    device_id = 0\n")],
           [G + "test_comm_gpu.py::test_each_rank_gets_its_own_gpu"]),
}


def copy_tree(dst: Path) -> None:
    """The tracked files and the built extensions (untracked) of this checkout, and a ``lbannpy``
    package made of links into the copy, first on the path so that the copy is what gets imported."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    names = [n for n in files.decode().split("\0") if n]
    names += [str(p.relative_to(ROOT)) for p in ROOT.glob("layers/**/*.so")]
    for name in names:
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    pkg = dst / ".rows_path" / "lbannpy"
    pkg.mkdir(parents=True)
    for entry in (dst / "src").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for sub in ("comm", "layers"):
        (pkg / sub).symlink_to(dst / sub)


def edit(tree: Path, edits: list) -> str | None:
    """Apply the edits; the first one whose text is gone, or None."""
    for name, now, before in edits:
        path = tree / name
        text = path.read_text()
        if text.count(now) != 1:
            return f"{name}: {now[:50]!r} found {text.count(now)} times"
        path.write_text(text.replace(now, before))
    return None


def run_tests(tree: Path, tests: list) -> tuple[str, str]:
    """``(outcome, summary)``: outcome ``passed`` (every test ran and passed), ``failed`` (a test ran and
    failed an assertion or raised in its body: the bug is seen) or ``broken`` (errors in set-up or
    collection, nothing ran: no evidence either way). The summary ends with the first error line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tree / ".rows_path"), str(tree)]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    last = lines[-1] if lines else p.stderr.strip()[-200:]
    if p.returncode == 0:
        return "passed", last
    why = next((ln[1:].strip() for ln in lines if ln.startswith("E ")), "")
    outcome = "failed" if p.returncode == 1 and " failed" in last and " error" not in last else "broken"
    return outcome, f"{last.strip('= ')}; {why[:110]}" if why else last.strip("= ")


def main(argv: list[str]) -> int:
    rows = argv or list(ROWS)
    table, ok = [], True
    with tempfile.TemporaryDirectory(prefix="lbannpy-rows-") as tmp:
        after_tree = Path(tmp) / "after"
        copy_tree(after_tree)
        for row in rows:
            what, edits, tests = ROWS[row]
            before_tree = Path(tmp) / f"row{row}"
            copy_tree(before_tree)
            stale = edit(before_tree, edits)
            if stale:
                before = f"stale ({stale})"
            else:
                outcome, last = run_tests(before_tree, tests)
                before = {"failed": "fails", "passed": "PASSES (no proof)",
                          "broken": "BROKEN (no proof)"}[outcome] + f": {last}"
            outcome_after, last_after = run_tests(after_tree, tests)
            after = f"{'passes' if outcome_after == 'passed' else 'FAILS'}: {last_after}"
            good = before.startswith("fails") and outcome_after == "passed"
            ok &= good
            table.append((row, what, " ".join(t.split("::")[-1] for t in tests), before, after))
            shutil.rmtree(before_tree)
            print(f"row {row} done: {'ok' if good else 'NOT PROVEN'}", file=sys.stderr, flush=True)
    print("row | reverted | test | before fix | after fix")
    for r in table:
        print(" | ".join(r))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
