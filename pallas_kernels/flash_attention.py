"""Causal flash attention: softmax(q k^T / sqrt(D)) v without materialising the (T, T) scores.

q, k, v (B, T, H, D) bfloat16 or float16 (the layout of jax.nn.dot_product_attention), D 64 or
128; causal: any T (padded to the kernels' tile, `causal_tile`, 128 by default: a padded key
comes after every real query, so no real query sees it); otherwise T a multiple of what each
kernel's check asks (128 by default). Forward and backward are flash_attention_mgpu.py's Mosaic
GPU kernels (Hopper+): the forward also returns the logsumexp of each query's scores, which the
backward (a dq kernel, which also computes delta = rowsum(o * do), then a dk/dv kernel) reads to
recompute the probabilities block by block. This module checks the arguments and owns the custom
VJP of flash_attention; flash_attention_qkv and its backward run the same kernels on q, k, v
packed (B, T, 3, H, D) without a VJP (jaxllm.ops.qkv_attention owns theirs, with the q/k/v
projection). Memory traffic: see flash_attention_mgpu.forward and .backward.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import common
from . import flash_attention_mgpu as mgpu
from .common import check_config, first_order_only, first_order_rules

DTYPES = (jnp.bfloat16, jnp.float16)

# Jitted so that call sites of one shape and config lower the kernels once (an unrolled model or
# a pipeline's ticks call them hundreds of times in one step).
_forward = jax.jit(mgpu.forward, static_argnames=("cfg", "scale", "causal"))
_backward = jax.jit(mgpu.backward, static_argnames=("cfg", "scale", "causal"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention(q, k, v, cfg, bwd_cfg, scale, causal):
    return _forward(q, k, v, cfg, scale, causal)[0]


def _attention_fwd(q, k, v, cfg, bwd_cfg, scale, causal):
    o, lse = _forward(q, k, v, cfg, scale, causal)
    return o, (q, k, v, o, lse)


def _attention_bwd(cfg, bwd_cfg, scale, causal, res, do):
    return _backward(*res, do, bwd_cfg, scale, causal)


_attention.defvjp(*first_order_rules("flash_attention", 3, _attention_fwd, _attention_bwd))


def causal_tile(cfg: mgpu.Config, bwd_cfg: mgpu.BwdConfig) -> int:
    """The multiple of T both kernels take (causal T is padded up to it)."""
    fwd = math.lcm(mgpu.COMPUTE_WGS * cfg.block_q, cfg.block_kv)
    return math.lcm(fwd, mgpu.COMPUTE_WGS * max(bwd_cfg.block_q, bwd_cfg.block_kv))


# head dim -> the longest T at which ours (forward + backward, default configs) measured faster
# than cuDNN's, each pair in one call (benchmarks/RESULTS.md, "Flash attention"): the persistent
# kernels on an H200 (2026-11-28, logs/flash_2026-11-28d): head dim 64 at T 128-2048 1.02-1.35x
# (GPT-2's shape 1.02x; 1.055x with the backward's overlap and a 3-stage forward, 2026-11-29),
# head dim 128 at T 128, 512, 2048 1.12-1.51x (T 512-2048 1.14-1.31x with the overlap). The H100
# timed only the earlier, non-persistent kernels (head dim 64: T 128-512 faster, T 1024
# 0.88-1.02x). Longer T: not measured.
FASTER_THAN_CUDNN_UP_TO = {64: 2048, 128: 2048}


def faster_than_cudnn(seq_len: int, head_dim: int) -> bool:
    """Whether our flash attention measured faster than cuDNN's at this T and head dim."""
    return seq_len <= FASTER_THAN_CUDNN_UP_TO.get(head_dim, 0)


def flash_attention_refusal(head_dim: int, compute_dtype) -> str | None:
    """Why flash_attention cannot run a model here, as "needs ..." would end (None: it can): a
    Hopper-class GPU, 16-bit inputs, a head dim the kernels take."""
    if (refusal := common.mosaic_gpu_refusal()) is not None:
        return refusal
    if jnp.dtype(compute_dtype) not in DTYPES:
        return f"bfloat16 or float16 inputs (got {jnp.dtype(compute_dtype)})"
    if head_dim not in mgpu.HEAD_DIMS:
        return f"a head dim in {mgpu.HEAD_DIMS} (got {head_dim})"
    return None


def _setup(shape, dtype, config, bwd_config, scale, causal: bool = True):
    """The checked (config, backward config, padded T, scale) of q's (B, T, H, D) and dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"flash attention needs bfloat16 or float16 inputs, got {dtype}")
    if scale is not None and not isinstance(scale, int | float):
        raise ValueError(f"scale must be a Python number or None, got {type(scale).__name__}")
    t, d = shape[1], shape[3]
    if (refusal := flash_attention_refusal(d, dtype)) is not None:
        raise ValueError(f"flash_attention needs {refusal}")
    check_config(config, "mosaic_gpu", mgpu.Config)
    cfg = config or mgpu.CONFIGS.get(d, mgpu.Config())
    check_config(bwd_config, "mosaic_gpu", mgpu.BwdConfig)
    bwd_cfg = bwd_config or mgpu.BwdConfig()
    padded = -(-t // (tile := causal_tile(cfg, bwd_cfg))) * tile if causal else t
    mgpu.check(cfg, padded, d)
    mgpu.check_bwd(bwd_cfg, padded, d)
    return cfg, bwd_cfg, padded, d**-0.5 if scale is None else float(scale)


def _pad_t(x: jax.Array, padded: int) -> jax.Array:
    """x padded with zeros along T (axis 1) to `padded`: keys past T come after every real
    query, so causally invisible to them."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, padded - x.shape[1])
    return jnp.pad(x, pad) if padded != x.shape[1] else x


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    config: mgpu.Config | None = None,
    bwd_config: mgpu.BwdConfig | None = None,
) -> jax.Array:
    """softmax(scale * q k^T) v per head, (B, T, H, D) -> (B, T, H, D); scale 1/sqrt(D) by
    default; causal: query i sees keys j <= i (T padded to the tile: see the module docstring).
    Needs a Hopper-class GPU (no interpret mode: tests run the kernels in jax's Mosaic GPU
    interpreter). `config` overrides the per-head-dim default (flash_attention_mgpu.CONFIGS),
    `bwd_config` the backward's (default flash_attention_mgpu.BwdConfig(), every head dim)."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (B, T, H, D) shape, got {q.shape}, {k.shape}, "
                         f"{v.shape}")  # fmt: skip
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cfg, bwd_cfg, padded, scale = _setup(q.shape, q.dtype, config, bwd_config, scale, causal)
    t = q.shape[1]
    q, k, v = (_pad_t(x, padded) for x in (q, k, v))
    return _attention(q, k, v, cfg, bwd_cfg, scale, bool(causal))[:, :t]


def _packed_setup(qkv: jax.Array) -> tuple[mgpu.Config, mgpu.BwdConfig, int, float]:
    """flash_attention_qkv's and its backward's shared (configs, padded T, scale): the defaults."""
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be (B, T, 3, H, D) (q, k, v along axis 2), got {qkv.shape}")
    b, t, _, h, d = qkv.shape
    return _setup((b, t, h, d), qkv.dtype, None, None, None)


def flash_attention_qkv(qkv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Causal attention of q, k, v packed (B, T, 3, H, D), as a fused q/k/v projection writes
    them (read in place where T is a multiple of the tile, else padded), without a VJP, default
    configs and scale 1/sqrt(D): (o (B, T, H, D), lse (B, H, Tp) float32, the natural-log
    logsumexp of each query's scaled scores, T padded as in flash_attention).
    flash_attention_qkv_grad is its backward; jaxllm.ops.qkv_attention owns the custom VJP (of
    the projection and the attention together)."""
    cfg, _, padded, scale = _packed_setup(qkv)

    def forward(qkv):
        return _forward(qkv, None, None, cfg, scale, True)

    o, lse = first_order_only("flash_attention", forward, _pad_t(qkv, padded))
    return o[:, : qkv.shape[1]], lse


def flash_attention_qkv_grad(
    qkv: jax.Array, o: jax.Array, lse: jax.Array, do: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The backward of flash_attention_qkv: (dq (B, T, H, D), dkv (B, T, 2, H, D)) of the
    output's cotangent do (B, T, H, D), given its o and lse; dk and dv come from one kernel in
    one array, which a fused projection's backward reads in place."""
    _, bwd_cfg, padded, scale = _packed_setup(qkv)
    b, t, _, h, d = qkv.shape
    if o.shape != (b, t, h, d) or do.shape != o.shape or lse.shape != (b, h, padded):
        raise ValueError(f"flash_attention_qkv_grad needs o, do (B, T, H, D) and lse (B, H, "
                         f"{padded}) of qkv {qkv.shape}, got {o.shape}, {do.shape}, "
                         f"{lse.shape}")  # fmt: skip
    if o.dtype != qkv.dtype or lse.dtype != jnp.float32:
        raise ValueError(f"flash_attention_qkv_grad needs o in qkv's {qkv.dtype} and lse in "
                         f"float32, got {o.dtype}, {lse.dtype}")  # fmt: skip
    args = (_pad_t(qkv, padded), _pad_t(o, padded), lse, _pad_t(do.astype(o.dtype), padded))

    def grad(qkv, o, lse, do):
        return _backward(qkv, None, None, o, lse, do, bwd_cfg, scale, True)

    dq, dkv = first_order_only("flash_attention", grad, *args)
    return dq[:, :t], dkv[:, :t]
