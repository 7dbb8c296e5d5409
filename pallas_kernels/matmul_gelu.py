"""GELU in the MLP's GEMM epilogues: the fc forward writing h and gelu(h), and GELU's backward
fused into the dX GEMM, dh = (dy @ w) * gelu'(h), each one kernel.

GPT-2's MLP is gelu(h) @ W2, h = x @ W1 + b1. Its forward needs h (for the backward) and gelu(h),
which cuBLAS's GELU-aux-bias epilogue writes from one GEMM; `matmul_gelu` does the same in less
time. Its backward needs dh = (dy @ W2^T) * gelu'(h), which XLA runs as a cuBLAS GEMM writing
dy @ W2^T and a fusion reading it back with h; `matmul_dgelu` applies gelu'(h) in the GEMM's
epilogue. Both are matmul_gelu_mgpu.py's Mosaic GPU kernels (Hopper+). jaxllm.ops owns the
custom VJP that calls them; reference.matmul_gelu_ref and matmul_dgelu_ref are the jnp
references.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common
from . import matmul_gelu_mgpu as mgpu
from .common import check_config, first_order_only

DTYPES = (jnp.bfloat16, jnp.float16)


def matmul_gelu_refusal(d_model: int, d_ff: int, compute_dtype) -> str | None:
    """Why the kernels cannot run an MLP (d_model -> d_ff -> d_model) here, as "needs ..." would
    end (None: it can): a Hopper-class GPU, 16-bit matmuls, widths its tiles divide. Rows (batch
    x context) must be a multiple of block_m too, checked per call."""
    if (refusal := common.mosaic_gpu_refusal()) is not None:
        return refusal
    if jnp.dtype(compute_dtype) not in DTYPES:
        return f"bfloat16 or float16 matmuls (got {jnp.dtype(compute_dtype)})"
    cfg = mgpu.Config()
    if d_model % cfg.block_k or d_ff % cfg.block_n:
        return (f"d_model a multiple of {cfg.block_k} and d_ff of {cfg.block_n} (got {d_model}, "
                f"{d_ff})")  # fmt: skip
    return None


@functools.partial(jax.jit, static_argnames=("config",))
def matmul_dgelu(
    dy: jax.Array, w: jax.Array, h: jax.Array, *, config: mgpu.Config | None = None
) -> jax.Array:
    """(dy @ w) * gelu'(h): dy (M, K), w (K, N), h (M, N), all bfloat16 or all float16 -> (M, N)
    in h's dtype; float32 accumulation and epilogue. M a multiple of 128, N of the config's
    block_n, K of 64. Needs a Hopper-class GPU (tests run the kernel in jax's Mosaic GPU
    interpreter through matmul_gelu_mgpu.matmul_dgelu)."""
    two_d = dy.ndim == 2 and w.ndim == 2
    if not two_d or w.shape[0] != dy.shape[1] or h.shape != (dy.shape[0], w.shape[1]):
        raise ValueError(f"matmul_dgelu needs dy (M, K), w (K, N), h (M, N), got {dy.shape}, "
                         f"{w.shape}, {h.shape}")  # fmt: skip
    if dy.dtype not in DTYPES or w.dtype != dy.dtype or h.dtype != dy.dtype:
        raise ValueError(f"dy, w, h must all be bfloat16 or float16, got {dy.dtype}, {w.dtype}, "
                         f"{h.dtype}")  # fmt: skip
    return _run("matmul_dgelu", mgpu.matmul_dgelu, config, dy, w, h)


@functools.partial(jax.jit, static_argnames=("config",))
def matmul_gelu(
    x: jax.Array, w: jax.Array, b: jax.Array, *, config: mgpu.Config | None = None
) -> tuple[jax.Array, jax.Array]:
    """(h, gelu(h)), h = x @ w + b: x (M, K), w (K, N) both bfloat16 or both float16, b (N,)
    float32 -> two (M, N) in x's dtype, both rounded from the float32 h. Shapes, configs and
    GPUs as matmul_dgelu's."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1] or b.shape != (w.shape[1],):
        raise ValueError(f"matmul_gelu needs x (M, K), w (K, N), b (N,), got {x.shape}, "
                         f"{w.shape}, {b.shape}")  # fmt: skip
    if x.dtype not in DTYPES or w.dtype != x.dtype or b.dtype != jnp.float32:
        raise ValueError(f"x and w must both be bfloat16 or float16 and b float32, got {x.dtype}, "
                         f"{w.dtype}, {b.dtype}")  # fmt: skip
    return _run("matmul_gelu", mgpu.matmul_gelu, config, x, w, b)


def _run(name: str, kernel, config: mgpu.Config | None, *arrays: jax.Array):
    """kernel(*arrays, config) once the GPU and the config pass, first derivatives only."""
    if (refusal := common.mosaic_gpu_refusal()) is not None:
        raise ValueError(f"{name} needs {refusal}")
    check_config(config, "mosaic_gpu", mgpu.Config)  # None: the kernel's default
    return first_order_only(name, lambda *a: kernel(*a, config), *arrays)
