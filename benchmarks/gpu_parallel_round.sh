#!/usr/bin/env bash
# The 2-GPU measurements issue 14 still needs, in one call of at most ~8 minutes on
# nvidia-h200-x2: DP against one GPU, and the pipeline (rows split over the stages, x + h sent
# as one array: not yet measured) at batch 64 and 32 per device. Each step has its own timeout.
# Usage: bash benchmarks/gpu_parallel_round.sh OUTDIR   (then copy OUTDIR/par.jsonl into
# benchmarks/logs and the table rows into RESULTS.md)
set -uo pipefail
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
BENCH="python3 benchmarks/parallel_throughput.py --config configs/gpt2_124m.yaml --group 10 \
  --samples 5 --execution.kernels=pallas --execution.loss_impl=pallas --no-baseline \
  --jsonl $OUT/par.jsonl"
fail=0  # the script's exit status: 1 if any step failed or timed out
step() {  # step NAME SECONDS ARGS...: run, keep its log, print its table rows
  local name=$1 secs=$2 rc
  shift 2
  echo "== $name"
  timeout -s INT -k 10 "$secs" $BENCH "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "   rc=$rc"
  [ "$rc" -eq 0 ] || fail=1
  grep -E "^\|" "$OUT/$name.log" | grep -v "^|---" | cut -c1-220 | tail -6 || true
}
step dp 120 --per-device-batch 32 --variants single,dp
step pp64 200 --per-device-batch 64 --variants single,pp --microbatches 4,8
step pp32 120 --per-device-batch 32 --variants single,pp --microbatches 4,8
exit $fail
