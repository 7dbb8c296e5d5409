"""XLA flags the CLIs set before JAX starts its backend (read once, at backend start).

`--xla_gpu_enable_triton_gemm=false`: XLA otherwise fuses the float32 -> bfloat16 weight casts
into Triton GEMMs that run far below cuBLAS on the H100 (GPT-2 124M train step, batch 16:
47.3 ms with them, 40.6 ms without; benchmarks/RESULTS.md).
`--xla_gpu_dot_merger_threshold_mb=0`: keep the q/k/v projections three GEMMs with their bias
adds in the epilogue (jaxllm.layers.Linear(splits=3): every attention path but our flash
attention without RoPE, whose kernels read one GEMM's output in place); XLA's dot merger
otherwise re-merges them at small batches and slices q, k, v out with separate bias-add
kernels. GPT-2 124M train step,
batch 16, H100: 35.72 -> 34.99 ms, Llama-style 124M-class 40.5 -> 40.2 ms (RESULTS.md).
`--xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}=true`: let XLA start a
loop's collectives an iteration early, overlapping them with compute. With
execution.scan_layers FSDP's per-layer gathers live in a scanned loop
(jaxllm.parallel.gathered_layers): GPT-2 124M, fsdp=2 on 2 H200s, 83.9 -> 82.0 ms a step
(1.77x -> 1.82x one GPU); no effect on one device or on unrolled blocks.
Flags the user already put in XLA_FLAGS win.
"""

from __future__ import annotations

import os

DEFAULT_FLAGS = {
    "--xla_gpu_enable_triton_gemm": "false",
    "--xla_gpu_dot_merger_threshold_mb": "0",
    "--xla_gpu_enable_pipelined_all_gather": "true",
    "--xla_gpu_enable_pipelined_reduce_scatter": "true",
    "--xla_gpu_enable_pipelined_all_reduce": "true",
}


def add_xla_flags(flags: dict[str, str]) -> None:
    """Append `flags` ({"--name": "value"}) to $XLA_FLAGS, each unless $XLA_FLAGS already names it
    (the user's setting wins). Call before the first JAX computation."""
    current = os.environ.get("XLA_FLAGS", "")
    names = {f.split("=", 1)[0] for f in current.split()}
    extra = [f"{k}={v}" for k, v in flags.items() if k not in names]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def apply_default_xla_flags() -> None:
    """Append our defaults to $XLA_FLAGS (add_xla_flags); a no-op on CPU (XLA ignores GPU flags
    there)."""
    add_xla_flags(DEFAULT_FLAGS)
