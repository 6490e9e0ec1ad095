"""The job templates: what each batch script does, as shell fragments filled from a JobSpec.

A template is a frozen record (name, kind, defaults); :func:`lbannpy.jobs.render.render` puts the
``#SBATCH`` header, the common preamble and the template's body together. Placeholders are ``@NAME@``
(shell uses ``$`` and ``%`` itself). A value placeholder (:data:`VALUES`: names, paths, numbers) stands only
where one shell word goes, outside any quotes (``template=@TEMPLATE@``), and is filled with
:func:`lbannpy.jobs.render.shell_word`; the script reads the variable, so no value is parsed as shell code.
The other placeholders are shell code written by the renderer (or the site's set-up lines). Rendered
scripts must be self-contained: sbatch copies the script into its spool directory, so nothing next to the
script can be sourced; helpers run as ``python -m lbannpy.jobs``.

Resources are never re-specified on srun lines: srun takes them from the allocation, so sbatch command-line
options (which win over ``#SBATCH`` lines) decide them. The only size on an srun line is ``-n P`` of the
scaling sweeps, and P never exceeds ``$SLURM_NTASKS``.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("sweep", "train", "calibrate", "strategy", "mpi-check", "predict")

# Placeholders filled with one quoted shell word each (render.shell_word); each stands alone as a word.
VALUES = ("TEMPLATE", "SITE", "MPI", "MODEL", "SIZE", "SAMPLES", "STEPS", "CONFIG_DEFAULT")


@dataclass(frozen=True)
class Template:
    name: str
    kind: str             # one of KINDS: which body the script gets
    description: str
    model: str = ""       # zoo model the default config is built from ('' = none)
    size: int = 0         # default image edge in pixels for the default config
    samples: int = 0      # default number of samples generated for the default config
    steps: int = 0        # default optimizer steps of the default config


TEMPLATES: dict[str, Template] = {
    t.name: t
    for t in (
        Template("mesh1k", "sweep",
                 "mesh tangling at 1024x1024: strong and weak scaling over ranks per sample",
                 model="mesh1k", size=1024, samples=16, steps=20),
        Template("mesh2k", "sweep",
                 "mesh tangling at 2048x2048: strong and weak scaling over ranks per sample",
                 model="mesh2k", size=2048, samples=16, steps=20),
        Template("resnet50", "train", "ResNet-50 training on the job's ranks (synthetic ImageNet-sized data "
                 "by default)", model="resnet50", size=224, samples=64, steps=50),
        Template("calibrate", "calibrate", "measure the machine (compute and alpha-beta communication) "
                 "for the strategy cost model"),
        Template("strategy", "strategy", "choose per-layer distributions for the job's rank count and write "
                 "them into the config", model="mesh1k", size=1024),
        Template("mpi-check", "mpi-check", "check that srun starts one MPI rank per task with "
                 "MPI_THREAD_MULTIPLE and node-local ranks (run this first on a new site)"),
        Template("predict", "predict", "apply a trained model (config and checkpoint) to an HDF5 file of "
                 "samples: class probabilities or probability maps"),
    )
}

# ------------------------------------------------------------------------------------------------ preamble
# After the #SBATCH lines and the usage comment. @SITE_ENV@ is the site's env setup plus --env-setup lines.
PREAMBLE = r"""set -euo pipefail

: "${SLURM_JOB_ID:?submit this script with sbatch (SLURM_JOB_ID is not set)}"
# What the job was rendered with, one shell word each; the lines below only read these variables.
template=@TEMPLATE@
job_site=@SITE@
site_mpi=@MPI@
run_parent=@RUN_PARENT@

# lbannpy_int VAR NAME DEFAULT MIN: VAR = the environment variable NAME (DEFAULT when unset or empty) as a
# whole number >= MIN; anything else ends the job at its start with one line naming NAME (exit 2), instead
# of in shell arithmetic hours later. An empty DEFAULT leaves VAR empty when NAME is unset.
lbannpy_int() {
    local value="${!2:-$3}"
    if [[ -z "$value" && -z "$3" ]]; then
        printf -v "$1" '%s' ""
        return 0
    fi
    if [[ ! "$value" =~ ^[0-9]{1,9}$ ]] || (( 10#$value < $4 )); then
        printf 'error: %s=%q is not a whole number >= %s; unset it or give one, e.g. %s=%s\n' \
            "$2" "$value" "$4" "$2" "${3:-$4}" >&2
        exit 2
    fi
    printf -v "$1" '%d' "$(( 10#$value ))"
}
# lbannpy_str VAR NAME DEFAULT: VAR = the environment variable NAME, or DEFAULT when unset or empty
lbannpy_str() {
    local value="${!2:-}"
    printf -v "$1" '%s' "${value:-$3}"
}

# srun's MPI plugin for this site; an environment value from the submitter wins.
export SLURM_MPI_TYPE="${SLURM_MPI_TYPE:-$site_mpi}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
# a rank that dies (in MPI_Init, say) ends its srun step, instead of leaving the other ranks waiting for it
export SLURM_KILL_BAD_EXIT="${SLURM_KILL_BAD_EXIT:-1}"
@SITE_ENV@
# numbers the job reads from its environment, checked before anything runs
lbannpy_int max_requeues LBANNPY_MAX_REQUEUES 10 0
lbannpy_int restarts SLURM_RESTART_COUNT 0 0
# Every output of the job (inputs it builds, runs, checkpoints) goes under one run directory, keyed by the
# job id: a requeued job keeps its id, so its next start finds its checkpoints there.
run_dir="${LBANNPY_RUN_DIR:-$run_parent/$template-$SLURM_JOB_ID}"
mkdir -p -- "$run_dir"
run_dir="$(CDPATH='' cd -- "$run_dir" && pwd)"

lbannpy_job_info() {
    echo "lbannpy job $SLURM_JOB_ID: template=$template site=$job_site host=$(hostname) cwd=$PWD"
    echo "  nodes=${SLURM_JOB_NUM_NODES:-?} ntasks=${SLURM_NTASKS:-?}" \
         "tasks_per_node=${SLURM_NTASKS_PER_NODE:-?}" \
         "cpus_per_task=${SLURM_CPUS_PER_TASK:-1} gpus_per_node=${SLURM_GPUS_PER_NODE:-0}" \
         "partition=${SLURM_JOB_PARTITION:-?} mpi=$SLURM_MPI_TYPE omp_threads=$OMP_NUM_THREADS"
    echo "  run_dir=$run_dir"
}
lbannpy_job_info

# Pre-emption and the time limit: SLURM signals this shell (--signal=B:USR1@120 before the limit, SIGTERM
# on pre-emption); the trap passes the signal on to the running step, whose ranks write a checkpoint and exit
# 4; lbannpy_train then requeues the job (--requeue) and its next start resumes from that checkpoint.
lbannpy_step_pid=""
lbannpy_forward() {
    echo "lbannpy job $SLURM_JOB_ID: got SIG$1; the ranks write a checkpoint and stop"
    if [[ -n "$lbannpy_step_pid" ]]; then kill -"$1" "$lbannpy_step_pid" 2>/dev/null || true; fi
}
trap 'lbannpy_forward USR1' USR1
trap 'lbannpy_forward TERM' TERM

# lbannpy_train OUT_DIR [srun options] -- CONFIG.h5 [train options]: one training run writing into OUT_DIR
# (checkpoints in OUT_DIR/ckpt). A run that finished in an earlier start of this job is skipped; one that
# left a checkpoint resumes from the newest. Exit 4 (stopped after a checkpoint) requeues the job, at most
# LBANNPY_MAX_REQUEUES (default 10) times.
lbannpy_train() {
    local out="$1" srun_opts=() resume=() rc=0
    shift
    while [[ "$1" != "--" ]]; do srun_opts+=("$1"); shift; done
    shift
    if [[ -f "$out/finished" ]]; then
        echo "  $out: finished in an earlier start of this job; skipped"
        return 0
    fi
    if compgen -G "$out/ckpt/ckpt-*/index.h5" >/dev/null; then
        resume=(--resume)
        echo "  $out: resuming from the newest checkpoint in $out/ckpt (start $restarts)"
    fi
    srun "${srun_opts[@]}" python -m lbannpy.train "$@" --set "output.dir=$out" \
        --set "checkpoint.dir=$out/ckpt" "${resume[@]}" &
    lbannpy_step_pid=$!
    while :; do  # a trapped signal ends `wait` early: wait again until the step has ended
        rc=0
        wait "$lbannpy_step_pid" || rc=$?
        kill -0 "$lbannpy_step_pid" 2>/dev/null || break
    done
    lbannpy_step_pid=""
    if (( rc == 0 )); then
        touch "$out/finished"
        return 0
    fi
    if (( rc == 4 )); then
        if (( restarts < max_requeues )) && scontrol requeue "$SLURM_JOB_ID"; then
            echo "lbannpy job $SLURM_JOB_ID: stopped after a checkpoint (exit 4); requeued, the next start" \
                 "resumes from $out/ckpt"
            exit 0
        fi
        echo "error: stopped after a checkpoint (exit 4) and not requeued" \
             "(restarts $restarts, LBANNPY_MAX_REQUEUES=$max_requeues);" \
             "resubmit with LBANNPY_RUN_DIR=$run_dir to resume" >&2
        exit 4
    fi
    echo "error: training into $out failed with exit status $rc (see the lines above)" >&2
    exit "$rc"
}
"""

# Config resolution: $1, else the rendered --config, else the template's built-in default (@BUILD@).
CONFIG_ARG = r"""
config_default=@CONFIG_DEFAULT@
config="${1:-$config_default}"
if [[ -n "$config" ]]; then
    if [[ ! -f "$config" ]]; then
        echo "error: config '$config' not found (cwd $PWD); pass an existing CONFIG.h5 as the first" \
             "argument or none to build the default" >&2
        exit 2
    fi
    echo "  config=$config (given)"
elif [[ -f "$run_dir/input/config.h5" ]]; then
    config="$run_dir/input/config.h5"
    echo "  config=$config (built by an earlier start of this job)"
else
@BUILD@    echo "  config=$config (built-in default)"
fi
"""

# Default config from the zoo: the spec is resized to the env-given sizes before it is built.
BUILD_MESH = r"""    lbannpy_str model LBANNPY_MODEL @MODEL@
    lbannpy_int mesh_size LBANNPY_MESH_SIZE @SIZE@ 1
    lbannpy_int mesh_samples LBANNPY_MESH_SAMPLES @SAMPLES@ 1
    lbannpy_int steps LBANNPY_STEPS @STEPS@ 1
    lbannpy_int batch_size LBANNPY_BATCH_SIZE '' 1
    input_dir="$run_dir/input"
    mkdir -p "$input_dir"
    python -m lbannpy.config zoo "$model" -o "$input_dir/zoo.yaml"
    if [[ -z "${LBANNPY_MESH_SAMPLES:-}" && " ${LBANNPY_SWEEPS:-strong weak} " == *" weak "* ]]; then
        # the weak sweep's largest point reads a mini-batch of B*P samples: the data holds that many
        weak_b="${batch_size:-$(python -m lbannpy.jobs config-value \
            "$input_dir/zoo.yaml" trainer.batch_size)}"
        for p in @RANKS@; do
            if (( p <= SLURM_NTASKS && weak_b * p > mesh_samples )); then mesh_samples=$(( weak_b * p )); fi
        done
    fi
    echo "  building default config: model=$model size=$mesh_size samples=$mesh_samples steps=$steps" \
         "batch_size=${batch_size:-zoo}"
    python -m lbannpy.data mesh --size "$mesh_size" --samples "$mesh_samples" -o "$input_dir/mesh.h5"
    python -m lbannpy.jobs adapt-spec "$input_dir/zoo.yaml" -o "$input_dir/spec.yaml" \
        --data "$input_dir/mesh.h5" --size "$mesh_size" --samples "$mesh_samples" --steps "$steps" \
        ${batch_size:+--batch-size "$batch_size"}
    python -m lbannpy.config build "$input_dir/spec.yaml" -o "$input_dir/config.h5"
    config="$input_dir/config.h5"
"""

BUILD_IMAGES = r"""    model=@MODEL@
    lbannpy_int image_size LBANNPY_IMAGE_SIZE @SIZE@ 1
    lbannpy_int samples LBANNPY_SAMPLES @SAMPLES@ 1
    lbannpy_int steps LBANNPY_STEPS @STEPS@ 1
    lbannpy_int batch_size LBANNPY_BATCH_SIZE '' 1
    echo "  building default config: model=$model size=$image_size samples=$samples steps=$steps" \
         "batch_size=${batch_size:-zoo}"
    input_dir="$run_dir/input"
    mkdir -p "$input_dir"
    python -m lbannpy.config zoo "$model" -o "$input_dir/zoo.yaml"
    python -m lbannpy.jobs adapt-spec "$input_dir/zoo.yaml" -o "$input_dir/spec.yaml" \
        --data "$input_dir/images.h5" --size "$image_size" --samples "$samples" --steps "$steps" \
        ${batch_size:+--batch-size "$batch_size"}
    python -m lbannpy.jobs synth-images --like "$input_dir/spec.yaml" --samples "$samples" \
        -o "$input_dir/images.h5"
    python -m lbannpy.config build "$input_dir/spec.yaml" -o "$input_dir/config.h5"
    config="$input_dir/config.h5"
"""

BUILD_MODEL_ONLY = r"""    lbannpy_str model LBANNPY_MODEL @MODEL@
    lbannpy_int model_size LBANNPY_MESH_SIZE @SIZE@ 1
    echo "  building default config: model=$model size=$model_size (no data needed to choose a strategy)"
    input_dir="$run_dir/input"
    mkdir -p "$input_dir"
    python -m lbannpy.config zoo "$model" -o "$input_dir/zoo.yaml"
    python -m lbannpy.jobs adapt-spec "$input_dir/zoo.yaml" -o "$input_dir/spec.yaml" --size "$model_size"
    python -m lbannpy.config build "$input_dir/spec.yaml" -o "$input_dir/config.h5"
    config="$input_dir/config.h5"
"""

# ------------------------------------------------------------------------------------------------ bodies
BODY_SWEEP = r"""
# Ranks per sample P = 1, 2, 4, ... up to the job's task count. Every run splits each sample's height over
# its P ranks (parallel.default.h=P, n=1).
#   strong-P: the config's mini-batch and image; ideal step time T1/P.
#   weak-P:   mini-batch B*P, so every rank keeps B samples' worth of pixels; ideal step time T1.
# `jobs render` checked these rank counts against the config it was given (or the template's model);
# each point is checked again here against the config the job runs, and one that cannot run is left out
# with a note (in RUN_DIR/skipped.txt) instead of stopping the sweep.
@RANK_NOTE@sweeps="${LBANNPY_SWEEPS:-strong weak}"
ranks=()
for p in @RANKS@; do if (( p <= SLURM_NTASKS )); then ranks+=("$p"); fi; done
echo "  sweeps=$sweeps ranks_per_sample=${ranks[*]}"
if [[ " $sweeps " == *" weak "* ]]; then
    base_batch="$(python -m lbannpy.jobs config-value "$config" trainer.batch_size)"
    if [[ ! "$base_batch" =~ ^[0-9]{1,9}$ ]]; then
        printf 'error: trainer.batch_size of %q is %q, not a whole number\n' "$config" "$base_batch" >&2
        exit 2
    fi
    echo "  weak scaling base batch_size=$base_batch (from the config)"
fi
for sweep in $sweeps; do
    for p in "${ranks[@]}"; do
        case "$sweep" in
            strong) extra=() ;;
            weak) extra=(--set "trainer.batch_size=$(( base_batch * p ))") ;;
            *) echo "error: LBANNPY_SWEEPS holds '$sweep'; use 'strong', 'weak' or both" >&2; exit 2 ;;
        esac
        point=(--set parallel.default.n=1 --set "parallel.default.h=$p" "${extra[@]}")
        if ! why="$(python -m lbannpy.config validate "$config" --ranks "$p" \
                    "${point[@]}"@TRAIN_DEVICE@ 2>&1)"
        then
            echo "note: $sweep-$p left out, it cannot run: ${why##*$'\n'}" | tee -a "$run_dir/skipped.txt"
            continue
        fi
        echo "== $sweep scaling: $p rank(s) per sample -> $run_dir/$sweep-$p"
        lbannpy_train "$run_dir/$sweep-$p" -n "$p" -- "$config" "${point[@]}"@TRAIN_DEVICE@
    done
done
python -m lbannpy.jobs scaling "$run_dir" -o "$run_dir/scaling.csv"
echo "done: $run_dir/scaling.csv"
"""

BODY_TRAIN = r"""
echo "== training on $SLURM_NTASKS rank(s) -> $run_dir"
lbannpy_train "$run_dir" -- "$config"@TRAIN_DEVICE@
echo "done: $run_dir/metrics.csv $run_dir/summary.json"
"""

BODY_CALIBRATE = r"""
# The first argument is the machine file to write (not a config).
machine="${1:-$run_dir/machine.yaml}"
echo "  machine=$machine"
mkdir -p "$(dirname "$machine")"
srun python -m lbannpy.bench calibrate@BENCH_DEVICE@ -o "$machine"
[[ -s "$machine" ]] || { echo "error: calibration wrote no $machine" >&2; exit 1; }
echo "done: $machine (use it with: python -m lbannpy.strategy CONFIG --ranks P --machine $machine)"
"""

BODY_STRATEGY = r"""
# The selection itself is serial; the job's task count is the rank count it plans for.
machine_args=()
if [[ -n "${LBANNPY_MACHINE:-}" ]]; then
    [[ -f "$LBANNPY_MACHINE" ]] || { echo "error: LBANNPY_MACHINE=$LBANNPY_MACHINE not found" >&2; exit 2; }
    machine_args=(--machine "$LBANNPY_MACHINE")
fi
echo "== strategy for $SLURM_NTASKS ranks (machine: ${LBANNPY_MACHINE:-built-in})"
python -m lbannpy.strategy "$config" --ranks "$SLURM_NTASKS" "${machine_args[@]}" --write --explain \
    | tee "$run_dir/strategy.txt"
echo "done: strategy written into $config; explanation in $run_dir/strategy.txt"
"""

BODY_MPI_CHECK = r"""
# No config: this job only checks the launcher. Each rank reports; rank 0 checks the whole job.
check_py='
import os, socket, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
ntasks = int(os.environ["SLURM_NTASKS"])
level = MPI.Query_thread()
row = (comm.rank, comm.size, level, os.environ.get("SLURM_LOCALID"), socket.gethostname())
rows = comm.gather(row, root=0)
if comm.rank == 0:
    problems = []
    if comm.size != ntasks:
        problems.append(f"MPI world size {comm.size} != SLURM_NTASKS {ntasks} (wrong --mpi plugin?)")
    for rank, size, lvl, localid, host in rows:
        print(f"rank {rank}/{size} host={host} SLURM_LOCALID={localid} "
              f"thread_multiple={lvl == MPI.THREAD_MULTIPLE}", flush=True)
        if lvl != MPI.THREAD_MULTIPLE:
            problems.append(f"rank {rank}: thread level {lvl}, not MPI_THREAD_MULTIPLE")
        if localid is None:
            problems.append(f"rank {rank}: SLURM_LOCALID is not set")
    print(MPI.Get_library_version().splitlines()[0].strip(), flush=True)
    for p in problems:
        print("error:", p, file=sys.stderr, flush=True)
    print("mpi-check:", "FAILED" if problems else f"OK ({comm.size} ranks, MPI_THREAD_MULTIPLE)", flush=True)
    code = 1 if problems else 0
else:
    code = 0
sys.exit(comm.bcast(code, root=0))
'
srun python -m mpi4py -c "$check_py"
"""

BODY_PREDICT = r"""
# Arguments: CONFIG.h5 CHECKPOINT DATA.h5 [OUT.h5]; run with the task count the model was trained on (or
# one its parallel.* settings divide).
usage="usage: sbatch jobs/$template.sbatch CONFIG.h5 CHECKPOINT DATA.h5 [OUT.h5]"
lbannpy_int png LBANNPY_PNG 4 0
config="${1:?$usage}"
checkpoint="${2:?$usage}"
data="${3:?$usage}"
out="${4:-$run_dir/predictions.h5}"
for f in "$config" "$checkpoint" "$data"; do
    [[ -e "$f" ]] || { echo "error: '$f' not found (cwd $PWD); $usage" >&2; exit 2; }
done
echo "== predicting $data with $checkpoint on $SLURM_NTASKS rank(s) -> $out"
srun python -m lbannpy.predict "$config" --checkpoint "$checkpoint" --data "$data" -o "$out" \
    --png "$png"
echo "done: $out"
"""

BODIES = {
    "sweep": BODY_SWEEP,
    "train": BODY_TRAIN,
    "calibrate": BODY_CALIBRATE,
    "strategy": BODY_STRATEGY,
    "mpi-check": BODY_MPI_CHECK,
    "predict": BODY_PREDICT,
}

BUILDERS = {
    "sweep": BUILD_MESH,
    "train": BUILD_IMAGES,
    "strategy": BUILD_MODEL_ONLY,
}

# Lines for the usage comment at the top of each script (after the #SBATCH lines).
USAGE = {
    "sweep": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch [CONFIG.h5]",
        "Without CONFIG.h5 the job generates mesh data and builds the zoo model LBANNPY_MODEL",
        "  (default @MODEL@), sized by",
        "  LBANNPY_MESH_SIZE (default @SIZE@), LBANNPY_MESH_SAMPLES (@SAMPLES@), LBANNPY_STEPS (@STEPS@),",
        "  LBANNPY_BATCH_SIZE (default: the zoo's).",
        "LBANNPY_SWEEPS='strong weak' picks the sweeps; LBANNPY_RUN_DIR the output (@RUN_DIR_SHOWN@).",
        "Output: RUN_DIR/strong-P/ and weak-P/ (metrics.csv, summary.json per run) and RUN_DIR/scaling.csv",
        "  (sweep, ranks, step_s, speedup, efficiency, key) from each run's summary.json.",
    ),
    "train": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch [CONFIG.h5]",
        "Without CONFIG.h5 the job builds the zoo model @MODEL@ on synthetic images, sized by",
        "  LBANNPY_IMAGE_SIZE (default @SIZE@), LBANNPY_SAMPLES (@SAMPLES@), LBANNPY_STEPS (@STEPS@),",
        "  LBANNPY_BATCH_SIZE (default: the zoo's).",
        "Output: LBANNPY_RUN_DIR (default @RUN_DIR_SHOWN@): metrics.csv, summary.json.",
    ),
    "calibrate": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch [MACHINE.yaml]",
        "The first argument is the machine file to write (default RUN_DIR/machine.yaml), not a config;",
        "  LBANNPY_RUN_DIR sets RUN_DIR (default @RUN_DIR_SHOWN@).",
    ),
    "strategy": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch [CONFIG.h5]",
        "Writes the chosen strategy into CONFIG.h5 (python -m lbannpy.strategy --write) for $SLURM_NTASKS",
        "  ranks; LBANNPY_MACHINE=machine.yaml uses a calibrated machine. Without CONFIG.h5 it builds the",
        "  zoo model LBANNPY_MODEL (default @MODEL@) at LBANNPY_MESH_SIZE (default @SIZE@).",
        "Output: LBANNPY_RUN_DIR (default @RUN_DIR_SHOWN@)/strategy.txt.",
    ),
    "predict": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch CONFIG.h5 CHECKPOINT DATA.h5 [OUT.h5]",
        "CHECKPOINT is a ckpt-*.h5 file or a checkpoint directory (its newest); OUT.h5 defaults to",
        "  RUN_DIR/predictions.h5 (LBANNPY_RUN_DIR, default @RUN_DIR_SHOWN@); LBANNPY_PNG=N samples",
        "  (default 4) are drawn into OUT.png. Metrics are printed when DATA.h5 holds labels.",
    ),
    "mpi-check": (
        "Usage: sbatch [sbatch options] jobs/@TEMPLATE@.sbatch",
        "Prints one line per rank and fails unless the MPI world matches SLURM_NTASKS, every rank has",
        "  MPI_THREAD_MULTIPLE (needed by the gradient-overlap thread) and SLURM_LOCALID is set.",
    ),
}
