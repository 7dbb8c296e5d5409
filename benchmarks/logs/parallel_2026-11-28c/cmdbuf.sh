# One GPU, GPT-2 124M at 4 and 8 rows: XLA's defaults vs command buffers for every kind incl. small graphs
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for rep in 1; do
for v in default cmdbuf; do
  if [ $v = cmdbuf ]; then export XLA_FLAGS="--xla_gpu_graph_min_graph_size=1 --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"; else unset XLA_FLAGS; fi
  timeout 90 python3 benchmarks/throughput.py --vary train.batch_size=8 --warmup 3 --samples 5 --group 5 > $OUT/$v$rep.log 2>&1; echo "$v rep $rep rc $?"; grep -E "^\|" $OUT/$v$rep.log | grep -v -- "---" | tail -3 | cut -c1-160
done; done
