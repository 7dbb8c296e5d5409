"""CS336-style Llama LM: RoPE (adjacent pairs), RMSNorm pre-norm, SwiGLU, no biases, CS336 init."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.layers import (
    AttentionInputs,
    DepthwiseConv1d,
    Embedding,
    KVCache,
    MultiHeadAttention,
    RMSNorm,
    SwiGLU,
    cs336_init,
    pre_norm_block,
)
from jaxllm.models.decoder import Decoder
from jaxllm.ops import OpPlan


def rms_norm(cfg: ModelConfig, ex: ExecutionConfig, plan: OpPlan) -> functools.partial:
    """RMSNorm on the plan's norm path. The Pallas kernel writes the compute dtype (the next
    matmul's input) in its one pass, as GPT-2's LayerNorm does; XLA keeps its float32 output (it
    fuses the convert into the consumer anyway)."""
    out_dtype = jnp.dtype(ex.compute_dtype) if plan.norm != "xla" else None
    return functools.partial(RMSNorm, cfg.norm_eps, plan.norm, out_dtype, plan.shard)


class Block(nn.Module):
    """x + attn(norm1(x)) with RoPE on q, k; then x + swiglu(norm2(x)); (x, h) in and out."""

    cfg: ModelConfig
    execution: ExecutionConfig
    plan: OpPlan

    @nn.compact
    def __call__(
        self, x: jax.Array, h: jax.Array | None, inputs: AttentionInputs, cache: KVCache | None
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        cfg, ex, plan = self.cfg, self.execution, self.plan
        dtype = jnp.dtype(ex.compute_dtype)
        attn = MultiHeadAttention(
            cfg.n_heads, False, False, ex.dropout, cfg.rope_theta, cs336_init(), cs336_init(),
            dtype, plan.attention, plan.shard, name="attn",
        )  # fmt: skip
        mlp = SwiGLU(cfg.ffn_dim, cs336_init(), dtype, name="mlp")

        conv = None
        if cfg.short_conv:
            k = cfg.short_conv_size
            conv = DepthwiseConv1d(k, "causal", plan.conv, plan.shard, name="conv")
        norm = rms_norm(cfg, ex, plan)
        ln1, ln2 = norm(name="ln1"), norm(name="ln2")
        return pre_norm_block(ln1, ln2, attn, mlp, conv, x, h, inputs, cache)


class TransformerLM(Decoder):
    def setup(self) -> None:
        cfg = self.cfg
        # CS336: token embeddings N(0, 1) truncated at 3 sigma.
        table_init = nn.initializers.truncated_normal(1.0, lower=-3.0, upper=3.0)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.d_model, table_init, name="embed")
        norm = rms_norm(cfg, self.execution, self.plan)
        self.build_stack(self.embed_tokens, Block, norm, head_init=cs336_init())

    def embed(self, tokens: jax.Array, positions: jax.Array, deterministic: bool) -> jax.Array:
        return self.embed_tokens(tokens)  # (B, T, D); positions enter through RoPE
