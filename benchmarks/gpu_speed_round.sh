#!/usr/bin/env bash
# The GPU measurements issues 11 and 12 still need, in one call of at most ~9 minutes on one H100
# (or H200): GPT-2 124M and the Llama-style TransformerLM against torch.compile at equal batch,
# the Mosaic GPU vs Triton kernel table, and the depthwise conv1d at the CS229S shapes. Each step
# has its own timeout so that one slow step cannot take the others' results with it.
# Usage: bash benchmarks/gpu_speed_round.sh OUTDIR   (then copy OUTDIR/*.jsonl into benchmarks/logs)
set -uo pipefail
OUT=${1:?out dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
step() {  # step NAME SECONDS CMD...: run, keep its log, print its table rows
  local name=$1 secs=$2
  shift 2
  echo "== $name"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$?"
  grep -E "^\|" "$OUT/$name.log" | grep -v "^|---" | cut -c1-220 | tail -20
}
BENCH="python3 profile.py bench --contexts 1024 --dtypes bfloat16 --modes train_step --torch --no-progress"
FAST="--kernels pallas --set model.loss_impl=pallas --set model.attention_impl=dot_product_attention"
for b in 16 64; do
  step "gpt2_b$b" 150 $BENCH --sizes small --vocab 50257 --batch $b $FAST --jsonl "$OUT/bench.jsonl"
done
step "llama_small_b16" 150 $BENCH --arch transformer_lm --sizes small --vocab 50257 --batch 16 $FAST \
  --jsonl "$OUT/bench.jsonl"
step mosaic 150 python3 benchmarks/mosaic_gpu_check.py --jsonl "$OUT/mosaic.jsonl"
step conv1d 230 python3 benchmarks/conv1d_course.py --jsonl "$OUT/conv1d.jsonl"
