#!/usr/bin/env bash
# Runs one command on every worker of a TPU VM (pod slice) at once.
#
#   launch/tpu_vm.sh TPU_NAME ZONE [PROJECT] -- python -m experiments.pretrain \
#       --config=configs/pretrain.py:model=glm5 --workdir=gs://BUCKET/run1
#
# Each worker must already have the repo at ~/glm5-jax with its venv (see WORKSPACE.md;
# `launch/tpu_vm.sh NAME ZONE -- bash launch/local.sh true` creates it). On TPU,
# jax.distributed.initialize() finds the coordinator and process ids by itself, so the
# config's `distributed` section stays at its defaults; every process feeds its own
# slice of the global batch.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 TPU_NAME ZONE [PROJECT] -- COMMAND..." >&2
  exit 2
fi
name=$1 zone=$2
shift 2
project=()
if [ "$1" != "--" ]; then project=(--project "$1"); shift; fi
[ "$1" = "--" ] && shift
cmd="cd ~/glm5-jax && source .venv/bin/activate && $*"
exec gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" "${project[@]}" --worker=all \
  --command "$cmd"
