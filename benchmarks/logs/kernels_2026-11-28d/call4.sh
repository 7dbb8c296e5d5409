# H100: the softmax's new default configs checked against a float32 reference (next to Triton's
# errors), then call3.sh's table and fused-loss rows.
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28d
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -P $S/item1_ab.py.txt --part smcheck > $OUT/smcheck.log 2>&1; echo "smcheck rc $?"; grep -E "WORSE|check:|Error" $OUT/smcheck.log | head
timeout 280 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
timeout 120 python3 benchmarks/cross_entropy_bench.py --rows 65536 --mosaic --no-head > $OUT/ce.log 2>&1; echo "ce rc $?"; tail -12 $OUT/ce.log
