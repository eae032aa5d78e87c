#!/usr/bin/env bash
# Start the same training command on every host of a Cloud TPU pod slice.
#
#   launch/tpu_pod.sh TPU_NAME ZONE -- --config=configs/x.py --workdir=gs://bucket/run
#
# Every host runs `python -m launch.train ARGS...`; jax.distributed.initialize() finds the
# other hosts through the TPU metadata. The repository must be at $PTRAIN_DIR (default
# ~/ptrain) on every host, installed with `pip install -e .` (run `launch/tpu_pod.sh NAME ZONE
# --setup` once to clone/update and install it everywhere). DRY_RUN=1 prints the command.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,10p' "$0" >&2
  exit 2
fi
TPU_NAME=$1 ZONE=$2
shift 2
PTRAIN_DIR=${PTRAIN_DIR:-'~/ptrain'}
PTRAIN_REPO=${PTRAIN_REPO:-$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null || echo REPO_URL)}
if [ "$1" = "--setup" ]; then
  remote="[ -d $PTRAIN_DIR ] || git clone $PTRAIN_REPO $PTRAIN_DIR; cd $PTRAIN_DIR && git pull --ff-only && pip install -q -e . 'jax[tpu]'"
else
  [ "$1" = "--" ] && shift
  args=$(printf ' %q' "$@")
  remote="cd $PTRAIN_DIR && python3 -m launch.train$args"
fi
cmd=(gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$remote")
if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "${cmd[@]}"; echo; else "${cmd[@]}"; fi
