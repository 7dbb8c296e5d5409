"""CS336-style Llama LM: RoPE (adjacent pairs), RMSNorm pre-norm, SwiGLU, no biases."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.layers import Embedding, KVCache, LMHead, RMSNorm, transformer_blocks
from jaxllm.models.interface import check_tokens, default_positions, lm_loss


class TransformerLM(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        key_mask: jax.Array | None = None,
        cache: list[KVCache] | None = None,
        cache_index: jax.Array | int = 0,
        deterministic: bool = True,
        targets: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, Any]:
        """tokens (B, T) int -> logits (B, T, V); with `cache`, (logits, new cache); with
        `targets` (B, T) int (IGNORE = -1: no loss), (mean loss, sums) from `lm_loss`.

        Logits are in compute_dtype (as under torch autocast); the loss and the sampler upcast
        to float32, so a bf16 model never writes a float32 copy of the (B, T, V) logits."""
        cfg = self.cfg
        check_tokens(tokens, cfg, cache is not None, targets)
        b, t = tokens.shape
        if positions is None:
            positions = default_positions(b, t, cache_index)
        embed = Embedding(cfg.vocab_size, cfg.d_model, std=1.0, name="embed")
        x = embed(tokens)  # (B, T, D)
        x, h, new_cache = transformer_blocks(
            cfg, x, positions, key_mask, cache, cache_index, deterministic
        )
        _, x = RMSNorm(cfg.norm_eps, name="ln_f")(x, residual=h)  # (B, T, D)
        dtype = jnp.dtype(cfg.compute_dtype)
        if not cfg.tie_embeddings:
            lm_head = LMHead(cfg.vocab_size, cfg.d_model, None, dtype, name="lm_head")
        if targets is not None:
            head = embed.table if cfg.tie_embeddings else lm_head.kernel.T  # (V, D)
            return lm_loss(x, head, targets, cfg)
        logits = embed.attend(x, dtype) if cfg.tie_embeddings else lm_head(x)
        return logits if cache is None else (logits, new_cache)
