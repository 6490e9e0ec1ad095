# Shared settings for jobs/local-cluster/start and stop (sourced, not executed).
#
# Everything the one-node cluster owns lives under one private directory so that it never touches
# /etc/slurm, /etc/munge or a system munged, and so that `stop` can find exactly the daemons `start`
# launched (by their pid files).

# What the caller set (for the hints printed later), before the defaults fill them in.
_SET_DIR="${LBANNPY_SLURM_DIR:-}"
_SET_PORT="${LBANNPY_SLURM_PORT:-}"
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

# Who started the cluster in SLURM_DIR: the invoking user and the checkout whose start script ran. A cluster
# of another user or another checkout is never reused silently (its jobs would run that checkout's code).
OWNER_FILE="$SLURM_DIR/owner"
owner_line() { printf 'user=%s checkout=%s\n' "${SUDO_USER:-${USER:-$(id -un)}}" "$1"; }

# check_owner CHECKOUT: fail unless the running cluster was started by this user from CHECKOUT
# (LBANNPY_SLURM_REUSE=1 accepts it anyway).
check_owner() {
    local want have
    want="$(owner_line "$1")"
    have="$(cat "$OWNER_FILE" 2>/dev/null || echo 'unknown (no owner file)')"
    [[ "$have" == "$want" || "${LBANNPY_SLURM_REUSE:-0}" == 1 ]] && return 0
    die "a cluster already runs in $SLURM_DIR, started by $have; this is $want. Start your own with
  LBANNPY_SLURM_DIR=/tmp/lbannpy-slurm-\$USER LBANNPY_SLURM_PORT=<free port> $1/start
or use that one deliberately with LBANNPY_SLURM_REUSE=1"
}

# The variables a later command needs to reach this cluster (only those the caller set).
env_prefix() {
    local out=""
    [[ -n "$_SET_DIR" ]] && out+="LBANNPY_SLURM_DIR=$LBANNPY_SLURM_DIR "
    [[ -n "$_SET_PORT" ]] && out+="LBANNPY_SLURM_PORT=$LBANNPY_SLURM_PORT "
    printf '%s' "$out"
}
