#!/usr/bin/env bash
# The prepared accelerator check (WORKSPACE.md): four measurements, each under its own
# timeout, 6 minutes in all; every script rewrites its JSON after each row, so a step cut
# short still leaves what it measured.
#   indexer     the lightning indexer at 32K / 8K / 128K: selection kernel (pallas) vs the
#               score kernel + XLA's top_k (pallas_topk) vs the jnp path (xla)
#   tune        at 32K: the sparse forward (default vs two queries per program) and the
#               selection kernel's variants vs XLA's top_k on the same scores
#   train_mfu   forward + backward of the `mid` preset, dense and DSA, bfloat16, MFU
#   decode      the engine's decode step at batch 1 / 16 / 64 vs the HBM floor
# Usage:
#   OUT=/some/dir bash launch/device_check.sh          # on the accelerator (H200 peaks below)
#   OUT=/tmp/dc bash launch/device_check.sh smoke      # CPU, tiny shapes: every step runs
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
PY=${PYTHON:-python3}
TF=--peak_tflops=${PEAK_TFLOPS:-630.92}       # the H200's measured peaks (docs/benchmarks.md)
GB=--peak_gbs=${PEAK_GBS:-2453.5}

run() {  # name, timeout (s), module and flags
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout ${limit} s)"
  timeout "$limit" "$PY" -m "$@" 2>&1 | grep -v '^[WIE][0-9]' | tee "$OUT/$name.txt"
}

if [ "${1:-}" = smoke ]; then
  T=(--shape=tiny)
  run indexer 300 experiments.bench_kernels "${T[@]}" --ops=indexer --lengths=64,128 \
      --impls=pallas,pallas_topk,xla --check_f32=false --repeats=1 $TF $GB \
      --out="$OUT/indexer.json"
  run tune 300 experiments.tune_gpu_kernels "${T[@]}" --seq_len=128 --sparse_fwd_queries=2 \
      --max_configs=3 \
      --kernels=sparse_fwd,indexer_topk,indexer_select --repeats=1 $TF $GB --out="$OUT/tune.json"
  run train_mfu 300 experiments.bench_train_mfu --smoke $TF --out="$OUT/train_mfu.json"
  run decode 300 experiments.bench_decode_step --smoke --batches=1,2 $GB \
      --out="$OUT/decode_step.json"
  exit 0
fi

run indexer 120 experiments.bench_kernels --shape=glm5 --ops=indexer --lengths=32768,8192,131072 \
    --impls=pallas,pallas_topk,xla --check_f32=false --repeats=2 $TF $GB \
    --out="$OUT/indexer.json"
run tune 90 experiments.tune_gpu_kernels --seq_len=32768 --sparse_fwd_queries=2 --max_configs=3 \
    --kernels=indexer_topk,indexer_select,sparse_fwd --repeats=3 $TF $GB --out="$OUT/tune.json"
run train_mfu 95 experiments.bench_train_mfu $TF --out="$OUT/train_mfu.json"
run decode 55 experiments.bench_decode_step $GB --out="$OUT/decode_step.json"
