# H200/H100 call: correctness checks, then the interleaved Mosaic/Triton table (item1_ab.py.txt)
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28c
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 150 python3 -P $S/item1_ab.py.txt --part check > $OUT/check.log 2>&1; echo "check rc $?"; grep -E "check:|FAILED|BAD" $OUT/check.log | head -20
timeout 400 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
