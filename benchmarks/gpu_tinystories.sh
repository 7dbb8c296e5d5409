#!/usr/bin/env bash
# The TinyStories run on the GPU machine: a small lr/dropout sweep of configs/tinystories.yaml,
# then the learning curve and a 256-token sample from the best run. Needs .gpu_data/ (carried):
# ts_train.bin, ts_val.bin (+ .json sidecars) and gpt2_bpe/. Usage: bash benchmarks/gpu_tinystories.sh OUTDIR
set -euo pipefail
OUT=${1:?out dir}
export JAXLLM_DATA_DIR=$PWD/.gpu_data JAXLLM_BPE_DIR=$PWD/.gpu_data/gpt2_bpe PYTHONUNBUFFERED=1
runs=/tmp/ts_runs
rm -rf "$runs"
i=0
for args in "--optim.lr=1e-3 --execution.dropout=0.1" "--optim.lr=3e-3 --execution.dropout=0.1" \
            "--optim.lr=1e-3 --execution.dropout=0.0" "--optim.lr=2e-3 --execution.dropout=0.2 --train.batch_size=64"; do
  i=$((i+1))
  echo "== run $i: $args"
  # shellcheck disable=SC2086
  python3 train.py --config configs/tinystories.yaml --train.progress=false \
    --train.run_dir=$runs/r$i $args 2>&1 | grep -E "done|step (100|300|600):" || true
done
python3 - "$runs" "$OUT" <<'PY'
import json, sys, pathlib
runs, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for r in sorted(runs.iterdir()):
    recs = [json.loads(l) for l in (r / "metrics.jsonl").read_text().splitlines()]
    ev = [x for x in recs if x.get("split") == "eval"]
    tr = [x for x in recs if "loss" in x and "split" not in x]
    best = min(ev, key=lambda x: x["loss"])
    tps = sorted(x["tokens_per_s"] for x in tr[1:])[len(tr[1:]) // 2]
    cfg = recs[0]["config"]
    rows.append((best["loss"], r.name, best["step"], tr[-1]["loss"], ev[-1]["loss"], tps,
                 cfg["optim"]["lr"], cfg["execution"]["dropout"], cfg["train"]["batch_size"], tr[-1]["wall_time"]))
rows.sort()
print("| run | lr | dropout | batch | best val loss (step) | final train loss | final val loss | tokens/s (median) | wall s |")
print("|---|---|---|---|---|---|---|---|---|")
for b, name, st, tl, vl, tps, lr, dp, bs, wall in rows:
    print(f"| {name} | {lr} | {dp} | {bs} | {b:.3f} ({st}) | {tl:.3f} | {vl:.3f} | {tps:,.0f} | {wall:.0f} |")
(out / "best_run.txt").write_text(rows[0][1])
PY
best=$(cat "$OUT/best_run.txt")
cp "$runs/$best/metrics.jsonl" "$OUT/ts_metrics.jsonl"
python3 -m jaxllm.plot "$runs/$best" --out "$OUT/ts_curve.png"
python3 generate.py --run-dir "$runs/$best" --checkpoint best --prompt "Once upon a time" \
  --max-new-tokens 256 --temperature 0.8 --top-p 0.95 --seed 0 | tee "$OUT/ts_sample.txt"
