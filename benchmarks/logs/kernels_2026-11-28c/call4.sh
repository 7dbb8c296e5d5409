# H200: the interleaved table (straight-line chains), then the GPT-2 step, batch 64, norms on
# Triton vs Mosaic GPU (loss Mosaic GPU in both, attention cuDNN), A B A B. `auto` here is run
# with ops.MOSAIC_AUTO = {"loss"} (norms on Triton): the rule before this measurement.
export PYTHONPATH=$PWD
S=benchmarks/logs/kernels_2026-11-28c
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python3 -P $S/item1_ab.py.txt --part ab > $OUT/ab.log 2>&1; echo "ab rc $?"; cat $OUT/ab.log
timeout 250 python3 -c "
import runpy, sys
from jaxllm.xla_flags import apply_default_xla_flags
apply_default_xla_flags()  # before jax is imported, as throughput.py does
import jaxllm.ops as ops
ops.MOSAIC_AUTO = frozenset({'loss'})
sys.argv = ['throughput.py', '--vary', 'execution.kernel_backend=auto,mosaic_gpu,auto,mosaic_gpu', '--vary', 'train.batch_size=64']
runpy.run_path('benchmarks/throughput.py', run_name='__main__')
" > $OUT/step.log 2>&1; echo "step rc $?"; grep -v "^ *$" $OUT/step.log | tail -7
