"""Causal flash attention: softmax(q k^T / sqrt(D)) v without materialising the (T, T) scores.

q, k, v (B, T, H, D) bfloat16 or float16 (the layout of jax.nn.dot_product_attention), D 64 or
128, T a multiple of the kernel's query tile (128). The forward is flash_attention_mgpu.py's
Mosaic GPU kernel (Hopper+), which also returns the logsumexp of each query's scores for the
backward. This module checks the arguments and owns the custom VJP.

The backward is a placeholder for now: the VJP of the jnp reference
(reference.flash_attention_ref) recomputed from the saved q, k, v. It is correct but materialises
the (B, H, T, T) probabilities in float32, so it is neither fast nor memory-lean; a Mosaic GPU
backward that reads o and lse will replace it.

Memory traffic: the forward kernel's (flash_attention_mgpu.py); the placeholder backward moves
O(B * H * T^2) float32 bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import flash_attention_mgpu as mgpu
from .common import check_backend, check_config, first_order_rules
from .reference import flash_attention_ref

DTYPES = (jnp.bfloat16, jnp.float16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, cfg, scale, causal):
    return mgpu.forward(q, k, v, cfg, scale, causal)[0]


def _attention_fwd(q, k, v, cfg, scale, causal):
    o, _lse = mgpu.forward(q, k, v, cfg, scale, causal)
    return o, (q, k, v)


def _attention_bwd(cfg, scale, causal, res, do):
    def ref(q, k, v):
        return flash_attention_ref(q, k, v, causal=causal, scale=scale)

    return jax.vjp(ref, *res)[1](do)


_attention.defvjp(*first_order_rules("flash_attention", 3, _attention_fwd, _attention_bwd))


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    config: mgpu.Config | None = None,
) -> jax.Array:
    """softmax(scale * q k^T) v per head, (B, T, H, D) -> (B, T, H, D); scale 1/sqrt(D) by
    default; causal: query i sees keys j <= i. Needs a Hopper-class GPU (no interpret mode:
    tests run flash_attention_mgpu.forward in jax's Mosaic GPU interpreter). `config` overrides
    the per-head-dim default (flash_attention_mgpu.CONFIGS)."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (B, T, H, D) shape, got {q.shape}, {k.shape}, "
                         f"{v.shape}")  # fmt: skip
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must all be bfloat16 or float16, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")  # fmt: skip
    if scale is not None and not isinstance(scale, int | float):
        raise ValueError(f"scale must be a Python number or None, got {type(scale).__name__}")
    check_backend("mosaic_gpu", None)
    check_config(config, "mosaic_gpu", mgpu.Config)
    t, d = q.shape[1], q.shape[3]
    cfg = config or mgpu.CONFIGS.get(d, mgpu.Config())
    mgpu.check(cfg, t, d)
    scale = d**-0.5 if scale is None else float(scale)
    return _attention(q, k, v, cfg, scale, bool(causal))
