# Shared settings for jobs/local-cluster/start and stop (sourced, not executed).
#
# Everything the one-node cluster owns lives under one private directory so that it never touches
# /etc/slurm, /etc/munge or a system munged, and so that `stop` can find exactly the daemons `start`
# launched (by their pid files).

LBANNPY_SLURM_DIR="${LBANNPY_SLURM_DIR:-/tmp/lbannpy-slurm}"
# slurmctld listens on PORT, slurmd on PORT+1; override when another cluster already uses 6817/6818.
LBANNPY_SLURM_PORT="${LBANNPY_SLURM_PORT:-6817}"

SLURM_DIR="$LBANNPY_SLURM_DIR"
CONF="$SLURM_DIR/etc/slurm.conf"
MUNGE_SOCKET="$SLURM_DIR/munge/munge.socket"
MUNGE_KEY="$SLURM_DIR/munge/munge.key"
PID_MUNGED="$SLURM_DIR/run/munged.pid"
PID_SLURMCTLD="$SLURM_DIR/run/slurmctld.pid"
PID_SLURMD="$SLURM_DIR/run/slurmd.pid"

log() { printf 'local-cluster: %s\n' "$*" >&2; }
die() { printf 'local-cluster: error: %s\n' "$*" >&2; exit 1; }

# pid_alive PIDFILE NAME: true when PIDFILE names a live process whose command is NAME.
# Checking the command name keeps a recycled pid from being mistaken for (or killed as) our daemon. A zombie
# counts as dead: in a container whose init does not reap, a killed daemon lingers in /proc as state Z.
pid_alive() {
    local file="$1" name="$2" pid comm
    [[ -r "$file" ]] || return 1
    pid="$(tr -dc '0-9' < "$file")"
    [[ -n "$pid" ]] || return 1
    [[ -r "/proc/$pid/comm" ]] || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
    [[ "$comm" == "$name" ]] || return 1
    running "$pid"
}

# running PID: the process exists and is not a zombie (or already being reaped).
running() {
    local state
    state="$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null || true)"
    [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

pid_of() { tr -dc '0-9' < "$1"; }
