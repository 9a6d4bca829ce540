#!/usr/bin/env bash
# scripts/launch.sh ROLE [FLAGS...]: start one role of a fanout run on this host, its
# settings from the environment (what a Slurm batch script or a Kubernetes Job sets).
#
#   FANOUT_RUN_DIR=/shared/runs/r1 FANOUT_DB_URL='postgresql://fanout@db:5432/fanout?schema=r1' \
#       FANOUT_CONFIG=/shared/cfg/producer.json scripts/launch.sh producer
#   FANOUT_DRY_RUN=1 scripts/launch.sh trainer      # print the command, start nothing
#   scripts/launch.sh --roles                       # the roles, one a line
#
# Roles (docs/deploy.md: the Slurm and Kubernetes recipes that call them):
#   producer         fanout produce: one producer replica of the run
#   follow-producer  fanout produce --follow FANOUT_FOLLOW: the run's one producer of a
#                    growing log
#   trainer          fanout train: one draft, one process
#   dp-trainer       torchrun ... -m fanout.cli train: this node's ranks of a
#                    data-parallel draft (c10d rendezvous across FANOUT_NNODES nodes);
#                    torchrun as python -m fanout.train.dplaunch: its flags, a failed
#                    rank in one line instead of torch's ChildFailedError traceback
#   status           fanout status --serve: Prometheus /metrics, /status.json, a page
#
# Environment (unset = the flag is not passed, so FANOUT_CONFIG or fanout's default holds):
#   FANOUT_RUN_DIR        the run directory on the shared filesystem (every role; required)
#   FANOUT_DB_URL         postgresql://user@host:port/db?schema=RUN (the producers: required;
#                         the others read it from the run dir); the password comes from
#                         PGPASSWORD or ~/.pgpass, never from here
#   FANOUT_CONFIG         a JSON file of the role's fields (`--config`); FLAGS after ROLE win
#   FANOUT_PYTHON         the interpreter that has fanout installed (default: python3)
#   FANOUT_REPLICAS       producer: --replicas
#   FANOUT_REPLICA_RANK   producer: --replica-rank; default: SLURM_PROCID under srun, else
#                         JOB_COMPLETION_INDEX in an Indexed Job, else the first free rank
#   FANOUT_FOLLOW         follow-producer: the JSONL file or directory a gateway appends to
#   FANOUT_CONSUMER_ID    trainer, dp-trainer: --consumer-id
#   FANOUT_SAVE_PATH      trainer, dp-trainer: --save-path (checkpoints, on a shared disk)
#   FANOUT_NNODES         dp-trainer: nodes of the torchrun (default 1: --standalone)
#   FANOUT_NPROC_PER_NODE dp-trainer: ranks on this node (default 1)
#   FANOUT_RDZV_ENDPOINT  dp-trainer with FANOUT_NNODES > 1: HOST:PORT of one trainer node,
#                         the same on every node (that node hosts the c10d store)
#   FANOUT_RDZV_ID        dp-trainer: the rendezvous id (default: SLURM_JOB_ID, else
#                         FANOUT_CONSUMER_ID)
#   FANOUT_STATUS_PORT    status: the port to serve (default 9464)
#   FANOUT_STATUS_HOST    status: the address to bind (default 0.0.0.0: scraped from others)
#   FANOUT_DRY_RUN=1      print the command on stdout and exit 0
#
# A bad setting is one line on stderr and exit 1. Otherwise the command is logged on
# stderr (a password in the URL masked) and exec'd: fanout (or torchrun) replaces this
# shell, so the scheduler's SIGTERM reaches it and its exit status is the job's.
set -euo pipefail

ROLES=(producer follow-producer trainer dp-trainer status)
me=launch.sh

die() {
  echo "$me: $*" >&2
  exit 1
}

# pos_int NAME VALUE: VALUE, checked to be a whole number >= 1 (NAME names the variable)
pos_int() {
  [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a whole number >= 1, got '$2'"
  echo "$2"
}

# nonneg_int NAME VALUE
nonneg_int() {
  [[ $2 =~ ^(0|[1-9][0-9]*)$ ]] || die "$1 must be a whole number >= 0, got '$2'"
  echo "$2"
}

[ $# -gt 0 ] || die "no role given (roles: ${ROLES[*]}; --help: every variable it reads)"
if [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi
if [ "$1" = --roles ]; then
  printf '%s\n' "${ROLES[@]}"
  exit 0
fi
role=$1
shift
known=0
for r in "${ROLES[@]}"; do [ "$r" = "$role" ] && known=1; done
[ $known = 1 ] || die "unknown role '$role' (roles: ${ROLES[*]})"

py=${FANOUT_PYTHON:-python3}
command -v "$py" >/dev/null || die "FANOUT_PYTHON: '$py' is not an executable on PATH"
run_dir=${FANOUT_RUN_DIR:-}
[ -n "$run_dir" ] || die "FANOUT_RUN_DIR is not set (the run directory on the shared filesystem)"
db=${FANOUT_DB_URL:-}
case "$role" in
  producer | follow-producer)
    [ -n "$db" ] || die "$role: FANOUT_DB_URL is not set (postgresql://user@host:port/db?schema=RUN: roles on several hosts share one PostgreSQL)"
    ;;
esac
if [ -n "$db" ]; then
  case "$db" in
    postgresql://* | postgres://*) ;;
    *) die "FANOUT_DB_URL must be a postgresql:// URL (roles on several hosts need PostgreSQL, not SQLite), got '$db'" ;;
  esac
fi

common=(--run-dir "$run_dir")
[ -z "$db" ] || common+=(--db-path "$db")
[ -z "${FANOUT_CONFIG:-}" ] || common+=(--config "$FANOUT_CONFIG")

train_flags() {
  [ -z "${FANOUT_CONSUMER_ID:-}" ] || common+=(--consumer-id "$FANOUT_CONSUMER_ID")
  [ -z "${FANOUT_SAVE_PATH:-}" ] || common+=(--save-path "$FANOUT_SAVE_PATH")
}

case "$role" in
  producer)
    [ -z "${FANOUT_FOLLOW:-}" ] || die "producer: FANOUT_FOLLOW is set: use the follow-producer role for a growing log"
    [ -z "${FANOUT_REPLICAS:-}" ] || common+=(--replicas "$(pos_int FANOUT_REPLICAS "$FANOUT_REPLICAS")")
    for from in FANOUT_REPLICA_RANK SLURM_PROCID JOB_COMPLETION_INDEX; do
      rank=${!from:-}
      [ -z "$rank" ] || break
    done
    [ -z "$rank" ] || common+=(--replica-rank "$(nonneg_int "$from" "$rank")")
    cmd=("$py" -m fanout.cli produce "${common[@]}")
    ;;
  follow-producer)
    [ -n "${FANOUT_FOLLOW:-}" ] || die "follow-producer: FANOUT_FOLLOW is not set (the JSONL file or directory the gateway appends to)"
    cmd=("$py" -m fanout.cli produce "${common[@]}" --follow "$FANOUT_FOLLOW")
    ;;
  trainer)
    train_flags
    cmd=("$py" -m fanout.cli train "${common[@]}")
    ;;
  dp-trainer)
    train_flags
    nnodes=$(pos_int FANOUT_NNODES "${FANOUT_NNODES:-1}")
    nproc=$(pos_int FANOUT_NPROC_PER_NODE "${FANOUT_NPROC_PER_NODE:-1}")
    # torchrun's agent and flags, a failed rank reported in one line (fanout.train.dplaunch)
    run=("$py" -m fanout.train.dplaunch --nnodes "$nnodes" --nproc-per-node "$nproc")
    if [ "$nnodes" = 1 ] && [ -z "${FANOUT_RDZV_ENDPOINT:-}" ]; then
      run+=(--standalone)
    else
      endpoint=${FANOUT_RDZV_ENDPOINT:-}
      [ -n "$endpoint" ] || die "dp-trainer: FANOUT_RDZV_ENDPOINT is not set (HOST:PORT of one trainer node, the same on all $nnodes nodes)"
      [[ $endpoint =~ ^[^:]+:[0-9]+$ ]] || die "FANOUT_RDZV_ENDPOINT must be HOST:PORT, got '$endpoint'"
      id=${FANOUT_RDZV_ID:-${SLURM_JOB_ID:-${FANOUT_CONSUMER_ID:-}}}
      [ -n "$id" ] || die "dp-trainer: FANOUT_RDZV_ID is not set (one id shared by the trainer's nodes)"
      run+=(--rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$id")
    fi
    cmd=("${run[@]}" -m fanout.cli train "${common[@]}")
    ;;
  status)
    port=$(nonneg_int FANOUT_STATUS_PORT "${FANOUT_STATUS_PORT:-9464}")
    cmd=("$py" -m fanout.cli status "${common[@]}" --serve "$port"
      --host "${FANOUT_STATUS_HOST:-0.0.0.0}")
    ;;
esac
cmd+=("$@")

printed=$(printf '%q ' "${cmd[@]}")
printed=${printed% }
if [ "${FANOUT_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "$printed" # one write: steps started together do not mix their lines
  exit 0
fi
# a password in the URL (user:pw@) never reaches a log
shown=$(sed 's#\(://[^:/@]*:\)[^@]*@#\1***@#g' <<<"$printed")
echo "$me: $role on $(hostname): $shown" >&2
exec "${cmd[@]}"
