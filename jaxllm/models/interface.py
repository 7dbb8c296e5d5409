"""What every language model here shares: input checks, the KV-cache layout, the training loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxllm.config import ModelConfig
from jaxllm.functional import IGNORE
from jaxllm.layers import KVCache


def check_tokens(
    tokens: jax.Array, cfg: ModelConfig, cached: bool, targets: jax.Array | None = None
) -> None:
    """Raise ValueError for inputs the model cannot take (tokens, and training targets).

    Shapes are static, so length is checked at trace time; ids are checked only when the
    array is concrete (outside jit), since a traced value has no contents yet.
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have shape (batch, time), got {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if targets is not None:
        if cached:
            raise ValueError("targets (the training loss) cannot be combined with a KV cache")
        if targets.shape != tokens.shape:
            raise ValueError(
                f"targets shape {targets.shape} must equal tokens shape {tokens.shape}"
            )
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


def lm_loss(
    x: jax.Array, head: jax.Array, targets: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy over the targets that are not IGNORE.

    x (B, T, D) final hidden states; head (V, D) the LM-head matrix (logits = x head^T, in
    cfg.compute_dtype); targets (B, T) int. Returns (loss, {loss_sum, correct, count}): sums
    over the batch, so metrics of several batches add up exactly; "correct" counts targets whose
    logit is the row's maximum. cfg.loss_impl picks the fused Pallas kernel or the XLA path.
    """
    d = x.shape[-1]
    valid = (targets != IGNORE).reshape(-1)  # (N,)
    count = jnp.sum(valid)
    weights = valid / jnp.maximum(count, 1).astype(jnp.float32)
    safe = jnp.where(valid, targets.reshape(-1), 0)
    fn = (
        pallas_kernels.linear_cross_entropy
        if cfg.loss_impl == "pallas"
        else pallas_kernels.linear_cross_entropy_ref
    )
    loss, ce, hit = fn(x.reshape(-1, d), head, safe, weights, jnp.dtype(cfg.compute_dtype))
    return loss, {
        "loss_sum": jnp.sum(jnp.where(valid, ce, 0.0)),
        "correct": jnp.sum(valid & hit),
        "count": count,
    }
