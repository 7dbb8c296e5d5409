#!/usr/bin/env bash
# Issue 9's Multi30k De->En run on the GPU machine: train configs/multi30k.yaml (plus any
# overrides), then score the best checkpoint on test 2016 with greedy and beam search, draw the
# learning curve. Needs .gpu_data/multi30k_de_en (carried). Usage:
#   bash benchmarks/gpu_translation.sh OUTDIR RUN_NAME [--section.key=value ...]
set -euo pipefail
OUT=${1:?out dir}; NAME=${2:?run name}; shift 2
export JAXLLM_DATA_DIR=$PWD/.gpu_data PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
RUN=runs/$NAME
start=$(date +%s)
python3 train.py --config configs/multi30k.yaml --train.progress=false --train.run_dir="$RUN" "$@" \
  2>&1 | grep -vE "Warning|warn" | tee "$OUT/$NAME.train.log" | grep -E "ops:|epochs of|BLEU|done|error|dropped"
echo "train wall s: $(( $(date +%s) - start ))"
for beam in 1 5; do
  python3 -m jaxllm.translate --run-dir "$RUN" --split test --beam-width $beam --length-penalty 0.6 \
    2>&1 | grep -vE "Warning|warn" | tail -2 | tee -a "$OUT/$NAME.test.txt"
done
python3 -m jaxllm.plot "$RUN" --out "$OUT/$NAME.curve.png"
cp "$RUN/metrics.jsonl" "$OUT/$NAME.metrics.jsonl"
