"""GPT-2 (the llmsys hw2 DecoderLM): learned positions, pre-LN blocks, GELU MLP, tied head."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.layers import (
    AttentionInputs,
    DepthwiseConv1d,
    Embedding,
    FeedForward,
    KVCache,
    LayerNorm,
    MultiHeadAttention,
    pre_norm_block,
)
from jaxllm.models.decoder import Decoder
from jaxllm.ops import OpPlan


class Block(nn.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)); (x, h) in and out, as `Decoder` describes."""

    cfg: ModelConfig
    execution: ExecutionConfig
    plan: OpPlan

    @nn.compact
    def __call__(
        self, x: jax.Array, h: jax.Array | None, inputs: AttentionInputs, cache: KVCache | None
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        cfg, dtype, p = self.cfg, jnp.dtype(self.execution.compute_dtype), self.execution.dropout
        init = nn.initializers.normal(cfg.init_std)
        # GPT-2 scales the init of the projections that write into the residual stream.
        out_init = nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.n_layers))
        plan = self.plan
        ln = functools.partial(LayerNorm, cfg.norm_eps, cfg.bias, plan.norm, dtype, plan.shard)
        attn = MultiHeadAttention(
            cfg.n_heads, cfg.qkv_bias, cfg.bias, p, None, init, out_init, dtype,
            plan.attention, plan.shard, name="attn",
        )  # fmt: skip
        mlp = FeedForward(
            cfg.ffn_dim, cfg.bias, p, init, out_init, dtype, plan.mlp, plan.shard, name="mlp"
        )

        conv = None
        if cfg.short_conv:
            k = cfg.short_conv_size
            conv = DepthwiseConv1d(k, "causal", plan.conv, plan.shard, name="conv")
        return pre_norm_block(ln(name="ln1"), ln(name="ln2"), attn, mlp, conv, x, h, inputs, cache)


class GPT2(Decoder):
    def setup(self) -> None:
        cfg = self.cfg
        init = nn.initializers.normal(cfg.init_std)
        self.wte = Embedding(cfg.vocab_size, cfg.d_model, init)  # (V, D), also the tied head
        self.wpe = Embedding(cfg.context_length, cfg.d_model, init)  # (T_max, D)
        self.drop = nn.Dropout(self.execution.dropout)
        dtype = jnp.dtype(self.execution.compute_dtype)
        plan = self.plan
        norm = functools.partial(LayerNorm, cfg.norm_eps, cfg.bias, plan.norm, dtype, plan.shard)
        self.build_stack(self.wte, Block, norm, head_init=init)

    def embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
        x = self.wte(tokens) + self.wpe(positions)  # (B, T, D) float32
        return self.drop(x, deterministic)
