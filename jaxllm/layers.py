"""Flax linen modules: thin wrappers that own parameters and call `jaxllm.functional`.

Parameters are float32. `compute_dtype` is the dtype of matmul operands; norms, softmax and
losses stay in float32. `kernels="pallas"` routes LayerNorm and the attention softmax through
the fused kernels in `pallas_kernels` (same math, fewer passes over memory).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels
from jaxllm import functional as F
from jaxllm.config import ModelConfig

Dtype = Any
KVCache = dict[str, jax.Array]  # {"k": (B, S, H, Dh), "v": (B, S, H, Dh)}


def scaled_normal(std: float | None, fan_in: int, fan_out: int) -> nn.initializers.Initializer:
    """N(0, std^2); std=None gives CS336's N(0, 2/(fan_in+fan_out)) truncated at 3 sigma."""
    if std is None:
        std = math.sqrt(2.0 / (fan_in + fan_out))
        return nn.initializers.truncated_normal(stddev=std, lower=-3.0, upper=3.0)
    return nn.initializers.normal(stddev=std)


class Linear(nn.Module):
    """y = x W (+ b). W (D_in, D_out) float32, applied in `compute_dtype`."""

    features: int
    use_bias: bool = True
    std: float | None = 0.02
    compute_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, splits: int = 1) -> jax.Array | tuple[jax.Array, ...]:
        """x (..., D_in) -> (..., D_out); `splits=n` returns the n equal column blocks of the
        output as a tuple, each from its own matmul on a slice of W (for a fused q/k/v kernel:
        one (..., 3D) output split afterwards costs a copy forward and a concat backward; XLA's
        dot merger may still re-merge small ones, as at GPT-2 batch 16, not at batch 64)."""
        d_in = x.shape[-1]
        w = self.param(
            "kernel", scaled_normal(self.std, d_in, self.features), (d_in, self.features)
        )
        b = self.param("bias", nn.initializers.zeros, (self.features,)) if self.use_bias else None
        xc = x.astype(self.compute_dtype)
        ys = []
        for wi, bi in zip(
            jnp.split(w, splits, axis=1),
            jnp.split(b, splits) if b is not None else [None] * splits,
            strict=True,
        ):
            y = jnp.dot(xc, wi.astype(self.compute_dtype))
            ys.append(y if bi is None else y + bi.astype(y.dtype))
        return ys[0] if splits == 1 else tuple(ys)


class Dropout(nn.Module):
    """Inverted dropout, active only when `deterministic=False` (uses the 'dropout' rng)."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        return F.dropout(x, self.rate, self.make_rng("dropout"))


class LayerNorm(nn.Module):
    """LayerNorm over the last dim; output in `out_dtype` (None: x's dtype). Pre-norm blocks ask
    for the compute dtype: the Pallas kernel then writes the matmul input in one pass."""

    eps: float = 1e-5
    use_bias: bool = True
    kernels: str = "xla"
    out_dtype: Dtype | None = None

    @nn.compact
    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x (..., D) -> norm(x); with `residual` (a branch output to add first), returns
        (s = x + residual, norm(s)): with kernels="pallas" one kernel does both, both ways."""
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,))
        bias = self.param("bias", nn.initializers.zeros, (d,)) if self.use_bias else None
        out_dtype = self.out_dtype or x.dtype
        if self.kernels == "pallas":
            bias = jnp.zeros((d,), jnp.float32) if bias is None else bias
            if residual is not None:
                return pallas_kernels.add_layer_norm(
                    x, residual, scale, bias, self.eps, out_dtype=out_dtype
                )
            return pallas_kernels.layer_norm(x, scale, bias, self.eps, out_dtype=out_dtype)
        if residual is not None:
            x = x + residual.astype(x.dtype)
            return x, F.layer_norm(x, scale, bias, self.eps).astype(out_dtype)
        return F.layer_norm(x, scale, bias, self.eps).astype(out_dtype)


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """As LayerNorm: with `residual`, returns (s = x + residual, norm(s))."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        if residual is not None:
            x = x + residual.astype(x.dtype)
            return x, F.rms_norm(x, scale, self.eps)
        return F.rms_norm(x, scale, self.eps)


class Embedding(nn.Module):
    """Token (or position) table (N, D); `attend` is the tied LM head x @ table^T."""

    num_embeddings: int
    features: int
    std: float = 0.02

    def setup(self) -> None:
        init = (
            nn.initializers.normal(self.std)
            if self.std != 1.0
            else (nn.initializers.truncated_normal(1.0, lower=-3.0, upper=3.0))
        )
        self.table = self.param("embedding", init, (self.num_embeddings, self.features))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.table, ids, axis=0)  # (..., D)

    def attend(self, x: jax.Array, compute_dtype: Dtype = jnp.float32) -> jax.Array:
        # Output in compute_dtype, as under torch autocast: asking for float32 output makes the
        # backward matmuls take the float32 cotangent and run as fp32 GEMMs (an sm80 fp32
        # CUTLASS kernel led an H100 trace of the GPT-2 step). Callers upcast for the loss.
        return jnp.dot(x.astype(compute_dtype), self.table.T.astype(compute_dtype))  # (..., N)


class LMHead(nn.Module):
    """Untied output projection: kernel (D, V) float32, logits = x @ kernel in compute_dtype.

    Parameters come from `setup`, so `.kernel` is readable without calling the module (the
    fused training loss takes the matrix itself)."""

    vocab_size: int
    features: int  # D
    std: float | None = 0.02
    compute_dtype: Dtype = jnp.float32

    def setup(self) -> None:
        init = scaled_normal(self.std, self.features, self.vocab_size)
        self.kernel = self.param("kernel", init, (self.features, self.vocab_size))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Output in compute_dtype, as Embedding.attend says why.
        return jnp.dot(x.astype(self.compute_dtype), self.kernel.astype(self.compute_dtype))


class RotaryEmbedding(nn.Module):
    """RoPE with base `theta`: rotates adjacent pairs (x[2i], x[2i+1]) by position * theta^(-2i/Dh).

    No parameters; x (B, T, H, Dh), positions (B, T) int -> same shape and dtype as x.
    """

    theta: float = 10000.0

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cos, sin = F.rope_angles(positions, x.shape[-1], self.theta)
        return F.apply_rope(x, cos, sin)


class MultiHeadAttention(nn.Module):
    """Causal self-attention: one fused q/k/v projection, optional RoPE, optional KV cache.

    The fused `qkv` kernel (D, 3D) is [W_q | W_k | W_v] concatenated along the output axis.
    """

    n_heads: int
    qkv_bias: bool = True
    out_bias: bool = True
    dropout: float = 0.0
    rope_theta: float | None = None  # None: no rotary embedding (GPT-2 uses learned positions)
    init_std: float | None = 0.02
    out_std: float | None = 0.02
    compute_dtype: Dtype = jnp.float32
    kernels: str = "xla"
    attention_impl: str = "xla"

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        key_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        deterministic: bool = True,
    ) -> tuple[jax.Array, KVCache | None]:
        """x (B, T, D); positions (B, T) int; key_mask (B, S) bool, True = real token (S = T,
        or the cache length); cache: write the T new keys/values at slot `cache_index`.
        Returns (y (B, T, D), updated cache or None)."""
        b, t, d = x.shape
        if d % self.n_heads:
            raise ValueError(f"d_model ({d}) must be divisible by n_heads ({self.n_heads})")
        h, dh = self.n_heads, d // self.n_heads
        lin = dict(std=self.init_std, compute_dtype=self.compute_dtype)
        qkv = Linear(3 * d, use_bias=self.qkv_bias, name="qkv", **lin)(x, splits=3)  # 3x (B,T,D)
        q, k, v = (a.reshape(b, t, h, dh) for a in qkv)  # (B, T, H, Dh)
        if self.rope_theta is not None:
            rope = RotaryEmbedding(self.rope_theta)
            q, k = rope(q, positions), rope(k, positions)

        offset: jax.Array | int = 0
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(
                cache["k"], k.astype(cache["k"].dtype), cache_index, axis=1
            )  # (B, S, H, Dh)
            v = jax.lax.dynamic_update_slice_in_dim(
                cache["v"], v.astype(cache["v"].dtype), cache_index, axis=1
            )
            cache, offset = {"k": k, "v": v}, cache_index

        rng = None if deterministic or self.dropout == 0.0 else self.make_rng("dropout")
        if cache is None and self.attention_impl == "dot_product_attention" and rng is None:
            # cuDNN's fused flash attention needs a GPU, half precision and no padding mask;
            # jax's default (implementation=None) is the unfused XLA path, so ask for cuDNN.
            fused = (
                jax.default_backend() == "gpu"
                and key_mask is None
                and q.dtype in (jnp.bfloat16, jnp.float16)
            )
            pad = None if key_mask is None else key_mask[:, None, None, :]
            y = jax.nn.dot_product_attention(
                q, k, v, mask=pad, is_causal=True, implementation="cudnn" if fused else None
            )
        elif cache is None and self.kernels == "pallas":
            additive = None
            if key_mask is not None:
                additive = jnp.where(key_mask, 0.0, F.MASK_VALUE)[:, None, None, :]  # (B,1,1,T)

            def probs_fn(scores: jax.Array, scale: float) -> jax.Array:
                return pallas_kernels.attention_softmax(scores, additive, causal=True, scale=scale)

            y = F.attention(q, k, v, None, self.dropout, rng, probs_fn=probs_fn)
        else:
            mask = F.attention_mask(t, k.shape[1], offset, key_mask)
            y = F.attention(q, k, v, mask, self.dropout, rng)
        y = y.reshape(b, t, d)
        y = Linear(
            d,
            use_bias=self.out_bias,
            name="out",
            std=self.out_std,
            compute_dtype=self.compute_dtype,
        )(y)
        return Dropout(self.dropout)(y, deterministic), cache


class FeedForward(nn.Module):
    """GPT-2 MLP: W2 gelu(W1 x), hidden width d_ff (4 * d_model by default)."""

    d_ff: int
    use_bias: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    out_std: float = 0.02
    compute_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        hid = Linear(self.d_ff, self.use_bias, self.init_std, self.compute_dtype, name="fc")(x)
        y = Linear(
            x.shape[-1],
            self.use_bias,
            name="proj",
            std=self.out_std,
            compute_dtype=self.compute_dtype,
        )(F.gelu(hid))
        return Dropout(self.dropout)(y, deterministic)


class SwiGLU(nn.Module):
    """W2 (SiLU(W1 x) * W3 x), no biases (CS336 / Llama)."""

    d_ff: int
    compute_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        lin = dict(use_bias=False, std=None, compute_dtype=self.compute_dtype)
        gate = Linear(self.d_ff, name="w1", **lin)(x)
        up = Linear(self.d_ff, name="w3", **lin)(x)
        return Linear(x.shape[-1], name="w2", **lin)(jax.nn.silu(gate) * up)


class DepthwiseConv1d(nn.Module):
    """Per-channel 1-D convolution over (B, L, D) with a (D, K) filter and bias (D,).

    mode 'causal' (output t sees inputs <= t), 'same' or 'full' (length L + K - 1).
    """

    kernel_size: int = 3
    mode: str = "causal"
    kernels: str = "xla"

    @nn.compact
    def __call__(self, u: jax.Array) -> jax.Array:
        d = u.shape[-1]
        w = self.param("kernel", scaled_normal(None, self.kernel_size, 1), (d, self.kernel_size))
        b = self.param("bias", nn.initializers.zeros, (d,))
        if self.kernels == "pallas":
            return pallas_kernels.depthwise_conv1d(u, w, b, self.mode)
        return pallas_kernels.reference.depthwise_conv1d_ref(u, w, b, self.mode)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)).

    The residual stream arrives as x + h, h being the previous block's MLP output (None for the
    first block), and leaves the same way: every residual add happens inside the next norm
    (`norm(x, residual=h)`), where kernels="pallas" fuses add and norm into one kernel.

    gpt2: LayerNorm, learned positions (outside), GELU MLP, biases per config.
    transformer_lm: RMSNorm, RoPE, SwiGLU, no biases.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        h: jax.Array | None,
        positions: jax.Array,
        key_mask: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """x (B, T, D) residual stream, h (B, T, D) or None its pending branch output ->
        (x, h) the same way after this block, and the updated cache."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.compute_dtype)
        gpt2 = cfg.arch == "gpt2"
        # GPT-2 scales the init of the projections that write into the residual stream.
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if gpt2 else None
        if gpt2:
            norm1 = LayerNorm(cfg.norm_eps, cfg.bias, cfg.kernels, dtype, name="ln1")
            norm2 = LayerNorm(cfg.norm_eps, cfg.bias, cfg.kernels, dtype, name="ln2")
        else:
            norm1, norm2 = RMSNorm(cfg.norm_eps, name="ln1"), RMSNorm(cfg.norm_eps, name="ln2")
        attn = MultiHeadAttention(
            n_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            out_bias=cfg.bias,
            dropout=cfg.dropout,
            rope_theta=None if gpt2 else cfg.rope_theta,
            init_std=cfg.init_std if gpt2 else None,
            out_std=out_std,
            compute_dtype=dtype,
            kernels=cfg.kernels,
            attention_impl=cfg.attention_impl,
            name="attn",
        )
        x, y = (x, norm1(x)) if h is None else norm1(x, residual=h)
        h, cache = attn(y, positions, key_mask, cache, cache_index, deterministic)
        x, y = norm2(x, residual=h)
        if gpt2:
            ffn = FeedForward(
                cfg.ffn_dim, cfg.bias, cfg.dropout, cfg.init_std, out_std, dtype, name="mlp"
            )
        else:
            ffn = SwiGLU(cfg.ffn_dim, dtype, name="mlp")
        return x, ffn(y, deterministic), cache


def transformer_blocks(
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    key_mask: jax.Array | None,
    cache: list[KVCache] | None,
    cache_index: jax.Array | int,
    deterministic: bool,
) -> tuple[jax.Array, jax.Array, list[KVCache | None]]:
    """The n_layers blocks h0, h1, ... of a model; call from inside its compact __call__
    (the blocks become its children). Returns (x, h, per-layer caches): the residual stream is
    x + h, h the last MLP output, for the final norm to add (`ln_f(x, residual=h)`)."""
    new_cache, h = [], None
    for i in range(cfg.n_layers):
        layer_cache = None if cache is None else cache[i]
        x, h, layer_cache = TransformerBlock(cfg, name=f"h{i}")(
            x, h, positions, key_mask, layer_cache, cache_index, deterministic
        )
        new_cache.append(layer_cache)
    return x, h, new_cache
