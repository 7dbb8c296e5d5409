# one call: the interleaved table (straight-line chains), the conv backward check at small L,
# the GPT-2 step with norms on Triton (kernel_backend auto) vs Mosaic GPU, batch 64, A B A B
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28c
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
timeout 60 python3 -P $S/item1_ab.py.txt --part conv > $OUT/conv.log 2>&1; echo "conv rc $?"; tail -4 $OUT/conv.log
timeout 220 python3 benchmarks/throughput.py --vary execution.kernel_backend=auto,mosaic_gpu,auto,mosaic_gpu --vary train.batch_size=64 > $OUT/step.log 2>&1; echo "step rc $?"; grep -v "^ *$" $OUT/step.log | tail -12
