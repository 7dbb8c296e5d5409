#!/usr/bin/env bash
# The translation runs on the GPU machine: train a preset (default configs/multi30k.yaml)
# plus any overrides, then score the best checkpoint on the test split with greedy and beam
# search (5, alpha 0.6), draw the learning curve. Needs the data under .gpu_data (carried).
#   bash benchmarks/gpu_translation.sh OUTDIR RUN_NAME [--section.key=value ...]
# Env: PRESET=configs/x.yaml; LIMITS="100" also scores the first N test pairs (the course's 100).
set -euo pipefail
OUT=${1:?out dir}; NAME=${2:?run name}; shift 2
PRESET=${PRESET:-configs/multi30k.yaml}
export JAXLLM_DATA_DIR=$PWD/.gpu_data PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
RUN=runs/$NAME
start=$(date +%s)
python3 train.py --config "$PRESET" --train.progress=false --train.run_dir="$RUN" "$@" \
  2>&1 | grep -vE "Warning|warn" | tee "$OUT/$NAME.train.log" | grep -E "ops:|epochs of|BLEU|done|error|dropped"
echo "$NAME train wall s: $(( $(date +%s) - start ))" | tee -a "$OUT/$NAME.test.txt"
for beam in 1 5; do
  for limit in "" ${LIMITS:-}; do
    python3 -m jaxllm.translate --run-dir "$RUN" --split test --data.translation.beam_width=$beam \
      --data.translation.length_penalty=0.6 \
      ${limit:+--limit $limit} 2>&1 | grep -vE "Warning|warn" | tail -2 | tee -a "$OUT/$NAME.test.txt"
  done
done
python3 -m jaxllm.plot "$RUN" --out "$OUT/$NAME.curve.png"
cp "$RUN/metrics.jsonl" "$OUT/$NAME.metrics.jsonl"
