# GPT-2 124M step: norms on Triton (kernel_backend auto) vs Mosaic GPU (mosaic_gpu); the loss is
# Mosaic GPU in both (auto picks it on Hopper), attention cuDNN
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 540 python3 benchmarks/throughput.py --vary execution.kernel_backend=auto,mosaic_gpu,auto,mosaic_gpu --vary train.batch_size=16,64 2>&1 | tee $OUT/step.log | grep -v "^ *$" | tail -20
