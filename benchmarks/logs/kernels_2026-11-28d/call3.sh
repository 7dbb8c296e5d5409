# Both GPU models, one call each: the interleaved Mosaic / Triton table at RESULTS.md's shapes with
# the new defaults, then the fused loss's two lowerings at GPT-2's batch 64 (65536 rows).
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28d
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
timeout 150 python3 benchmarks/cross_entropy_bench.py --rows 65536 --mosaic --no-head > $OUT/ce.log 2>&1; echo "ce rc $?"; tail -15 $OUT/ce.log
