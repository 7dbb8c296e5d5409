"""GPT-2 (the llmsys hw2 DecoderLM): learned positions, pre-LN blocks, tied or untied head."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ModelConfig
from jaxllm.layers import Dropout, Embedding, KVCache, LayerNorm, Linear, transformer_blocks
from jaxllm.models.interface import check_tokens, default_positions


class GPT2(nn.Module):
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
        to float32, so a bf16 model never writes a float32 copy of the (B, T, V) logits.

        positions (B, T) default to cache_index + arange(T); key_mask (B, T or S) marks real
        (non-padding) keys.
        """
        cfg = self.cfg
        check_tokens(tokens, cfg, cache is not None)
        b, t = tokens.shape
        if positions is None:
            positions = default_positions(b, t, cache_index)
        wte = Embedding(cfg.vocab_size, cfg.d_model, cfg.init_std, name="wte")
        wpe = Embedding(cfg.context_length, cfg.d_model, cfg.init_std, name="wpe")
        x = wte(tokens) + wpe(positions)  # (B, T, D) float32 residual stream
        x = Dropout(cfg.dropout)(x, deterministic)
        x, new_cache = transformer_blocks(
            cfg, x, positions, key_mask, cache, cache_index, deterministic
        )
        x = LayerNorm(cfg.norm_eps, cfg.bias, cfg.kernels, name="ln_f")(x)
        dtype = jnp.dtype(cfg.compute_dtype)
        if cfg.tie_embeddings:
            logits = wte.attend(x, dtype)
        else:
            logits = Linear(cfg.vocab_size, False, cfg.init_std, dtype, name="lm_head")(x)
        return logits if cache is None else (logits, new_cache)
