# H200, the final defaults: the norm family's correctness (the forward of 8192-wide bf16 rows now
# runs 4 stages), then the interleaved table.
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28d
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -P $S/item1_ab.py.txt --part normcheck > $OUT/normcheck.log 2>&1; echo "normcheck rc $?"; grep -E "FAILED|check:" $OUT/normcheck.log | grep -v "fit in shared" | head
timeout 300 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
