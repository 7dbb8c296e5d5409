"""What every language model here shares: input checks and the KV-cache layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.layers import KVCache


def check_tokens(tokens: jax.Array, cfg: ModelConfig, cached: bool) -> None:
    """Raise ValueError for inputs the model cannot take.

    Shapes are static, so length is checked at trace time; ids are checked only when the
    array is concrete (outside jit), since a traced value has no contents yet.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, time), got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    t = tokens.shape[1]
    if t > cfg.context_length:
        raise ValueError(
            f"sequence length {t} exceeds the model's context_length {cfg.context_length}"
        )
    if t == 0 and not cached:
        raise ValueError("sequence length must be >= 1")
    if isinstance(tokens, jax.core.Tracer) or not tokens.size:
        return
    try:
        lo, hi = int(np.min(tokens)), int(np.max(tokens))
    except jax.errors.ConcretizationTypeError:  # e.g. under jax.eval_shape: nothing to check
        return
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(
            f"token ids must be in [0, {cfg.vocab_size - 1}] (vocab_size {cfg.vocab_size}), "
            f"got min {lo}, max {hi}"
        )


def init_kv_cache(cfg: ModelConfig, batch: int, length: int) -> list[KVCache]:
    """Zeroed per-layer caches of `length` slots: k, v (B, S, H, Dh) in the compute dtype."""
    if not 1 <= length <= cfg.context_length:
        raise ValueError(f"cache length must be in [1, {cfg.context_length}], got {length}")
    shape = (batch, length, cfg.n_heads, cfg.d_model // cfg.n_heads)
    dtype = jnp.dtype(cfg.compute_dtype)
    return [
        {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.n_layers)
    ]


def default_positions(batch: int, t: int, cache_index: jax.Array | int) -> jax.Array:
    """(B, T) absolute positions cache_index, ..., cache_index + T - 1."""
    return jnp.broadcast_to(jnp.arange(t) + cache_index, (batch, t))
