"""CS336-style Llama LM: RoPE (adjacent pairs), RMSNorm pre-norm, SwiGLU, no biases."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.layers import Embedding, KVCache, Linear, RMSNorm, transformer_blocks
from jaxllm.models.interface import check_tokens, default_positions


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
    ) -> jax.Array | tuple[jax.Array, list[KVCache]]:
        """tokens (B, T) int -> logits (B, T, V); with `cache`, (logits, new cache).

        Logits are in compute_dtype (as under torch autocast); the loss and the sampler upcast
        to float32, so a bf16 model never writes a float32 copy of the (B, T, V) logits."""
        cfg = self.cfg
        check_tokens(tokens, cfg, cache is not None)
        b, t = tokens.shape
        if positions is None:
            positions = default_positions(b, t, cache_index)
        embed = Embedding(cfg.vocab_size, cfg.d_model, std=1.0, name="embed")
        x = embed(tokens)  # (B, T, D)
        x, new_cache = transformer_blocks(
            cfg, x, positions, key_mask, cache, cache_index, deterministic
        )
        x = RMSNorm(cfg.norm_eps, name="ln_f")(x)
        dtype = jnp.dtype(cfg.compute_dtype)
        if cfg.tie_embeddings:
            logits = embed.attend(x, dtype)
        else:
            logits = Linear(
                cfg.vocab_size, use_bias=False, std=None, compute_dtype=dtype, name="lm_head"
            )(x)
        return logits if cache is None else (logits, new_cache)
