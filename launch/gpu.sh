#!/usr/bin/env bash
# Start the same training command on every host of a GPU cluster (one process per host,
# all of its GPUs; JAX uses them through jax[cuda]).
#
#   Under SLURM (inside an allocation; jax.distributed.initialize() reads SLURM's variables):
#     launch/gpu.sh slurm -- --config=configs/x.py --workdir=/shared/run
#   On a list of hosts reachable by ssh (the first one coordinates):
#     HOSTS="gpu0 gpu1 gpu2 gpu3" launch/gpu.sh ssh -- --config=configs/x.py --workdir=/shared/run
#
# The repository must be at $PTRAIN_DIR (default: this checkout's path) on every host, with
# `pip install -e . 'jax[cuda12]'`. PORT (default 12355) is the coordinator's port.
# DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
if [ $# -lt 1 ] || { [ "$1" != slurm ] && [ "$1" != ssh ]; }; then
  sed -n '2,14p' "$0" >&2
  exit 2
fi
mode=$1
shift
[ "${1:-}" = "--" ] && shift
PTRAIN_DIR=${PTRAIN_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
PORT=${PORT:-12355}
args=$(printf ' %q' "$@")
run() { if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }

if [ "$mode" = slurm ]; then
  run srun --ntasks-per-node=1 bash -c "cd $PTRAIN_DIR && python3 -m launch.train$args"
  exit
fi
read -r -a hosts <<< "${HOSTS:?set HOSTS to the space-separated host names}"
coordinator="${hosts[0]}:$PORT"
pids=()
for i in "${!hosts[@]}"; do
  env_vars="PTRAIN_COORDINATOR=$coordinator PTRAIN_NUM_PROCESSES=${#hosts[@]} PTRAIN_PROCESS_ID=$i"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    run ssh "${hosts[$i]}" "cd $PTRAIN_DIR && $env_vars python3 -m launch.train$args"
  else
    ssh "${hosts[$i]}" "cd $PTRAIN_DIR && $env_vars python3 -m launch.train$args" &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
