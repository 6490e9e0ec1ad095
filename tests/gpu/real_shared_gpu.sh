#!/usr/bin/env bash
# On a real one-GPU node (lbannpy installed, mpiexec on PATH): the checks of issue 35. Every 2- and 4-rank
# GPU tier runs with its ranks sharing the GPU over the host-staged MPI backend (none skipped for "needs N
# GPUs"), the mesh zoo models train 20 steps at 256² on 2 ranks sharing the GPU against the 2-rank CPU
# run, and the halo benchmark puts the host-staged exchange and allreduce beside the run's backend.
# Usage: bash tests/gpu/real_shared_gpu.sh [pytest -n workers, default 8]; ZOO_S, TIERS_S, BENCH_S: time limits (s)
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
rc=0
echo "== zoo: mesh_tiny and mesh1k 256², 20 steps, 2 ranks sharing the GPU (h=2) against the CPU run"
LBANNPY_GPU=real timeout "${ZOO_S:-420}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_zoo_shared_gpu.py \
  2>&1 | grep -E "mesh|passed|failed|Error|assert" | tail -20 || rc=1
echo "== every GPU tier (LBANNPY_GPU=real), skip reasons listed"
LBANNPY_GPU=real timeout "${TIERS_S:-480}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider -n "${1:-8}" tests/gpu \
  --ignore=tests/gpu/test_zoo_shared_gpu.py \
  2>&1 | tail -40 || rc=1
echo "== bench halo --device gpu on 2 ranks sharing the GPU"
timeout "${BENCH_S:-120}" mpiexec -n 2 python3 -m lbannpy.bench halo --device gpu --share-gpu --shape 1,18,512,512 \
  --reps 10 --allreduce-mib 1,32 2>&1 | tail -12 || rc=1
exit $rc
