#!/usr/bin/env bash
# The one-GPU measurements issues 11 and 12 still need, in calls of at most ~10 minutes each
# on one H100: PART=torch: GPT-2 124M and the Llama-style TransformerLM (124M-class and the
# TinyStories preset's shape) against torch.compile at equal batch; PART=gpt2_50304: GPT-2 at
# batch 16 and 64 with the vocabulary padded to 50304 on both sides (nanoGPT's trick);
# PART=kernels: the Mosaic GPU vs Triton kernel table and the depthwise conv1d at the CS229S
# shapes; PART=verify: the Pallas kernel tests compiled on the GPU (incl. the Mosaic GPU
# cross-entropy at ragged row runs) and the cross-entropy bench's check at 1000 rows;
# PART=residual: execution.residual_dtype float32 vs bfloat16, GPT-2 at batch 16 and 64 (vocabulary
# 50304), both in this call, and the loss-curve pin of every fast path against all-XLA float32;
# PART=torch_residual: GPT-2 at batch 16 and 64 (vocabulary 50304) against torch.compile, both
# sides with the bf16 residual stream; PART=mfu: GPT-2 at batch 96 and 128 (vocabulary 50304),
# float32 and bfloat16 residual streams, for MFU at our best batch, and the PyTorch-reference
# tests (they skip in CI: no torch there); PART=chunks: the fused loss's rows in chunks
# (execution.loss_chunk_mib 0 = all at once, 2048, 4096, 1024; the default 8192 keeps batch 64 in one
# chunk: these runs chose it), GPT-2 at batch 64 and
# 16 (vocabulary 50304), the unchunked run repeated last; PART=determinism: the associative-
# recall preset trained in separate processes, twice with XLA_FLAGS=--xla_gpu_deterministic_ops=
# true and once without, their loss curves compared (RESULTS.md, determinism). Each step has its
# own timeout so that one slow step cannot take the others' results with it. The torch part
# times both sides back to back (--group 10: 10 steps per device sync, as a training loop
# runs; 5 such samples), the way the 2026-11-25 equal-batch rows in RESULTS.md were taken.
# Usage: bash benchmarks/gpu_speed_round.sh OUTDIR PART (one of those above)
#        (then copy OUTDIR/*.jsonl into benchmarks/logs)
set -uo pipefail
OUT=${1:?out dir}
PART=${2:?torch, gpt2_50304, kernels, verify, residual, torch_residual, mfu, chunks or determinism}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
fail=0  # the script's exit status: 1 if any step failed or timed out
step() {  # step NAME SECONDS CMD...: run, keep its log, print its table rows
  local name=$1 secs=$2 rc
  shift 2
  echo "== $name"
  timeout -s INT -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1  # INT: pytest and python summarise
  rc=$?
  echo "   rc=$rc"
  [ "$rc" -eq 0 ] || fail=1
  grep -E "^\|" "$OUT/$name.log" | grep -v "^|---" | cut -c1-220 | tail -20 || true
}
BENCH="python3 profile.py bench --dtypes bfloat16 --modes train_step --torch --no-progress \
  --samples 5 --group 10"
# compute_dtype: what --dtypes bfloat16 runs; named here too, as execution.residual_dtype=bfloat16
# (residual_grid, torch_residual) is checked against the size's config before the sweep
FAST="--execution.kernels=pallas --execution.loss_impl=pallas --execution.attention_impl=auto
  --execution.mlp_impl=pallas --execution.compute_dtype=bfloat16"
TS="--model.d_model=512 --model.d_ff=1344 --model.n_layers=4 --model.n_heads=16"
residual_grid() {  # residual_grid SECONDS BATCH...: GPT-2 (vocabulary 50304), no torch, one
  local secs=$1 b r  # process per batch x residual stream dtype
  shift
  for b in "$@"; do
    for r in float32 bfloat16; do
      step "gpt2_b${b}_residual_$r" "$secs" ${BENCH/ --torch/} --contexts 1024 --sizes small \
        --model.vocab_size=50304 --train.batch_size="$b" $FAST --execution.residual_dtype=$r --jsonl "$OUT/bench.jsonl"
    done
  done
}
case $PART in
  torch)
    for b in 16 64; do
      step "gpt2_b$b" $((b == 16 ? 140 : 200)) $BENCH --contexts 1024 --sizes small \
        --model.vocab_size=50257 --train.batch_size=$b $FAST --jsonl "$OUT/bench.jsonl"
    done
    step llama_b16 130 $BENCH --model.arch=transformer_lm --contexts 1024 --sizes small --model.vocab_size=50257 \
      --train.batch_size=16 $FAST --jsonl "$OUT/bench.jsonl"
    step llama_tinystories 100 $BENCH --model.arch=transformer_lm --contexts 256 --sizes small \
      --model.vocab_size=50257 --train.batch_size=32 $FAST $TS --jsonl "$OUT/bench.jsonl"
    ;;
  gpt2_50304)
    for b in 16 64; do
      step "gpt2_v50304_b$b" $((b == 16 ? 140 : 200)) $BENCH --contexts 1024 --sizes small \
        --model.vocab_size=50304 --train.batch_size=$b $FAST --jsonl "$OUT/bench.jsonl"
    done
    ;;
  verify)
    step pallas_tests 330 env JAX_PLATFORMS=cuda,cpu python3 -m pytest -q -rfE -n 0 -p no:benchmark \
      -p no:randomly tests/test_pallas_*.py tests/test_ops.py tests/test_kernel_switch.py
    # (the suite pins the CPU unless JAX_PLATFORMS says otherwise: tests/conftest.py)
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pallas_tests.log" | tail -15
    step ce_ragged 90 python3 benchmarks/cross_entropy_bench.py --rows 1000 --mosaic --no-head \
      --jsonl "$OUT/ce_ragged.jsonl"
    ;;
  residual)
    step pin 200 python3 benchmarks/loss_curve_pin.py --jsonl "$OUT/pin.jsonl"  # 200 + 4 x 90
    residual_grid 90 16 64
    ;;
  torch_residual)
    for b in 16 64; do
      step "gpt2_b${b}_residual_bf16_torch" $((b == 16 ? 140 : 200)) $BENCH --contexts 1024 \
        --sizes small --model.vocab_size=50304 --train.batch_size=$b $FAST --execution.residual_dtype=bfloat16 \
        --jsonl "$OUT/bench.jsonl"
    done
    ;;
  mfu)
    residual_grid 120 96 128
    step torch_reference_tests 150 python3 -m pytest -q -rfEs -n 0 -p no:benchmark \
      -p no:randomly tests/test_bench.py -k torch_reference
    grep -E "passed|failed|skipped|^FAILED|^ERROR|^SKIPPED" "$OUT/torch_reference_tests.log" | tail
    ;;
  chunks)
    for run in 0 2048 4096 1024 0_again; do
      mib=${run%_again}
      step "gpt2_b64_chunk_${run}" 100 ${BENCH/ --torch/} --contexts 1024 --sizes small \
        --model.vocab_size=50304 --train.batch_size=64 $FAST --execution.loss_chunk_mib=$mib --jsonl "$OUT/bench.jsonl"
    done
    for mib in 0 1024; do
      step "gpt2_b16_chunk_${mib}" 70 ${BENCH/ --torch/} --contexts 1024 --sizes small \
        --model.vocab_size=50304 --train.batch_size=16 $FAST --execution.loss_chunk_mib=$mib --jsonl "$OUT/bench.jsonl"
    done
    ;;
  determinism)
    echo "XLA_FLAGS in this environment: '${XLA_FLAGS:-}'"
    AR="--model.n_layers=1 --train.batch_size=16 --data.associative_recall.num_train=640
      --data.associative_recall.num_test=64 --execution.dropout=0.1 --train.steps=60
      --train.log_every=5 --train.eval_every=30 --train.checkpoint_every=20
      --optim.warmup_steps=5 --train.progress=false"
    for run in det1 det2 plain; do
      flags="${XLA_FLAGS:-} --xla_gpu_deterministic_ops=true"  # the environment's flags kept
      [ "$run" = plain ] && flags="${XLA_FLAGS:-}"
      # shellcheck disable=SC2086  # AR is a list of flags
      step "ar_$run" 120 env XLA_FLAGS="$flags" python3 train.py --config configs/ar.yaml $AR \
        "--train.run_dir=$OUT/$run"
    done
    python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
def curve(d):
    rows = [json.loads(x) for x in (Path(sys.argv[1]) / d / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r and "split" not in r]
c = {d: curve(d) for d in ("det1", "det2", "plain")}
print("det1 == det2 (deterministic ops, two processes):", c["det1"] == c["det2"])
print("det1 == plain:", c["det1"] == c["plain"])
for d, v in c.items():
    print(d, v[:3], v[-1])
PY
    for run in det1 det2 plain; do  # keep the curves, not the checkpoints (few files come back)
      mv "$OUT/$run/metrics.jsonl" "$OUT/ar_$run.metrics.jsonl" && rm -rf "${OUT:?}/$run"
    done
    ;;
  kernels)
    # --quick: the full table (72 rows, 3 compiles each) takes more than one call
    step mosaic 200 python3 benchmarks/mosaic_gpu_check.py --quick --jsonl "$OUT/mosaic.jsonl"
    step conv1d 230 python3 benchmarks/conv1d_course.py --budget 165 --jsonl "$OUT/conv1d.jsonl"
    ;;
  *) echo "unknown PART $PART (see the comment at the top)" >&2; exit 2 ;;
esac
exit $fail
