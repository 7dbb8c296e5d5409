"""Generic Flax linen modules: thin wrappers that own parameters and call `jaxllm.functional`
or, where a fused kernel may run, `jaxllm.ops` with the path the model's `OpPlan` chose.

No architecture lives here (blocks are in `jaxllm/models/`). Parameters are float32;
`compute_dtype` is the dtype of matmul operands; norms, softmax and losses stay in float32.
Initializers are named, never implied by a magic value: `nn.initializers.normal(std)` (GPT-2)
or `cs336_init()` (CS336's truncated normals).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxllm import functional as F
from jaxllm import ops

Dtype = Any
Initializer = nn.initializers.Initializer
KVCache = dict[str, jax.Array]  # {"k": (B, S, H, Dh), "v": (B, S, H, Dh)}


def cs336_init(fan_in: int | None = None, fan_out: int | None = None) -> Initializer:
    """CS336's linear init: N(0, 2 / (fan_in + fan_out)) truncated at 3 sigma. Fans default to
    the weight's (D_in, D_out) shape."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> jax.Array:
        f_in = shape[0] if fan_in is None else fan_in
        f_out = shape[-1] if fan_out is None else fan_out
        std = math.sqrt(2.0 / (f_in + f_out))
        return nn.initializers.truncated_normal(std, lower=-3.0, upper=3.0)(key, shape, dtype)

    return init


class Linear(nn.Module):
    """y = x W (+ b). W (D_in, D_out) float32, applied in `compute_dtype`."""

    features: int
    use_bias: bool = True
    kernel_init: Initializer = nn.initializers.normal(0.02)
    compute_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(
        self, x: jax.Array, splits: int = 1, attend: Callable | None = None
    ) -> jax.Array | tuple[jax.Array, ...]:
        """x (..., D_in) -> (..., D_out); `splits=n` returns the n equal column blocks of the
        output as a tuple, each from its own matmul on a slice of W (for a fused q/k/v kernel:
        one (..., 3D) output split afterwards costs a copy forward and a concat backward; XLA's
        dot merger may still re-merge small ones, as at GPT-2 batch 16, not at batch 64). The
        bias gradient is a float32 sum over the rows (_add_bias). `attend`: returns
        attend(x, W, b) (x and W in compute_dtype, b the float32 bias or None), an op that owns
        the projection (ops.qkv_attention, ops.gelu_mlp)."""
        d_in = x.shape[-1]
        w = self.param("kernel", self.kernel_init, (d_in, self.features))
        b = self.param("bias", nn.initializers.zeros, (self.features,)) if self.use_bias else None
        xc, cd = x.astype(self.compute_dtype), self.compute_dtype
        if attend is not None:
            return attend(xc, w.astype(cd), b)
        ys = tuple(jnp.dot(xc, wi.astype(cd)) for wi in jnp.split(w, splits, 1))
        ys = ys if b is None else _add_bias(ys, b)
        return ys[0] if splits == 1 else ys


def _add_bias_impl(ys: tuple[jax.Array, ...], b: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(y + bi.astype(y.dtype) for y, bi in zip(ys, jnp.split(b, len(ys)), strict=True))


@jax.custom_vjp
def _add_bias(ys: tuple[jax.Array, ...], b: jax.Array) -> tuple[jax.Array, ...]:
    """ys[i] + the i-th of len(ys) equal blocks of b (D_out,), in ys[i]'s dtype. Under
    jax.shard_map's check_vma, b must vary over the mesh axes like ys (jaxllm.pipeline marks
    the stage's parameters so)."""
    return _add_bias_impl(ys, b)


def _add_bias_fwd(ys, b):
    return _add_bias_impl(ys, b), b


def _add_bias_bwd(b, dys):
    # db: one sum over the rows of the blocks stacked on a new leading axis, in at least
    # float32. Autodiff's would sum bfloat16 rows in bfloat16, and fuse each block's sum into
    # the concatenate that reassembles db, whose kernel then sums every column serially (GPT-2
    # 124M, 2-stage pipeline, 4-row microbatches: 10.8 ms a step). Stacked, not concatenated
    # on the minor axis: 1.2 ms less a step at S = 2, M = 16 (benchmarks/RESULTS.md).
    rows = tuple(range(1, dys[0].ndim))
    acc = jnp.promote_types(dys[0].dtype, jnp.float32)
    db = jnp.sum(jnp.stack(dys), axis=rows, dtype=acc).reshape(-1)  # (blocks, D / blocks)
    return dys, db.astype(b.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim; output in `out_dtype` (None: x's dtype). Pre-norm blocks ask
    for the compute dtype: the Pallas kernel then writes the matmul input in one pass."""

    eps: float = 1e-5
    use_bias: bool = True
    path: ops.NormPath = "xla"
    out_dtype: Dtype | None = None
    shard: ops.KernelShard | None = None  # the plan's: Pallas calls per batch shard

    @nn.compact
    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x (..., D) -> norm(x); with `residual` (a branch output to add first), returns
        (s = x + residual, norm(s)): on the Pallas path one kernel does both, both ways."""
        d = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (d,))
        bias = self.param("bias", nn.initializers.zeros, (d,)) if self.use_bias else None
        out_dtype = self.out_dtype or x.dtype
        return ops.norm(x, residual, scale, bias, self.eps, out_dtype, self.path, self.shard)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (scale only); `path` and `out_dtype` as in LayerNorm."""

    eps: float = 1e-5
    path: ops.NormPath = "xla"
    out_dtype: Dtype | None = None
    shard: ops.KernelShard | None = None  # the plan's: Pallas calls per batch shard

    @nn.compact
    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """As LayerNorm: with `residual`, returns (s = x + residual, norm(s)); on the Pallas
        path one kernel does both, both ways."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        out_dtype = self.out_dtype or x.dtype
        return ops.norm(
            x, residual, scale, None, self.eps, out_dtype, self.path, self.shard, rms=True
        )


def add_and_norm(norm: nn.Module, x: jax.Array, h: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(x + h, norm(x + h)) for a residual stream x with a pending branch output h (None: none
    pending, as before the first block). The add happens inside the norm (fused on Pallas)."""
    return (x, norm(x)) if h is None else norm(x, residual=h)


def pre_norm_block(
    ln1: nn.Module,
    ln2: nn.Module,
    attn: nn.Module,
    mlp: nn.Module,
    conv: nn.Module | None,
    x: jax.Array,
    h: jax.Array | None,
    inputs: AttentionInputs,
    cache: KVCache | None,
) -> tuple[jax.Array, jax.Array, KVCache | None]:
    """The pre-norm block every architecture shares, in its named scopes: x, pending h (B, T, D)
    -> (x + h + attn, the MLP output pending, cache). `conv`: the optional short conv."""
    with jax.named_scope("ln_1"):
        x, y = add_and_norm(ln1, x, h)
    if conv is not None:  # each position mixes in its predecessors before attending
        with jax.named_scope("conv"):
            y = conv(y)
    with jax.named_scope("attn"):
        h, cache = attn(y, inputs, cache)
    with jax.named_scope("ln_2"):
        x, y = ln2(x, residual=h)
    with jax.named_scope("mlp"):
        h = mlp(y, inputs.deterministic)
    return x, h, cache


class Embedding(nn.Module):
    """Token (or position) table (N, D); `attend` is the tied LM head x @ table^T."""

    num_embeddings: int
    features: int
    embedding_init: Initializer = nn.initializers.normal(0.02)

    def setup(self) -> None:
        shape = (self.num_embeddings, self.features)
        self.table = self.param("embedding", self.embedding_init, shape)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids (...) int -> (..., D). An id outside [0, N) gives a NaN row, also under jit where
        nothing can raise: negative ids are sent past the end first (jnp.take would wrap -1
        to the last row)."""
        ids = jnp.where(ids < 0, self.num_embeddings, ids)
        return jnp.take(self.table, ids, axis=0, mode="fill", fill_value=jnp.nan)  # (..., D)

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
    kernel_init: Initializer = nn.initializers.normal(0.02)
    compute_dtype: Dtype = jnp.float32

    def setup(self) -> None:
        self.kernel = self.param("kernel", self.kernel_init, (self.features, self.vocab_size))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Output in compute_dtype, as Embedding.attend says why.
        return jnp.dot(x.astype(self.compute_dtype), self.kernel.astype(self.compute_dtype))


@struct.dataclass
class AttentionInputs:
    """What every attention layer of one forward pass shares. A pytree whose `deterministic`
    flag is static (it picks code paths), so a block under jax.checkpoint (execution.remat) still
    sees a Python bool; the arrays are its leaves."""

    positions: jax.Array  # (B, T) int absolute positions (RoPE; GPT-2 embeds them outside)
    deterministic: bool = struct.field(pytree_node=False, default=True)  # no dropout
    key_mask: jax.Array | None = None  # (B, S) bool, True = real key (decoding: S = cache len)
    cache_index: jax.Array | int = 0  # decoding: cache slot of the first of the T new tokens


class MultiHeadAttention(nn.Module):
    """Causal self-attention: q/k/v from one fused (D, 3D) kernel [W_q | W_k | W_v], optional
    RoPE, optional KV cache. Without a cache the `path` (jaxllm.ops.AttentionPath) runs;
    with one, XLA attends over the cache slots written so far (see jaxllm.ops)."""

    n_heads: int
    qkv_bias: bool = True
    out_bias: bool = True
    dropout: float = 0.0
    rope_theta: float | None = None  # None: no rotary embedding (GPT-2 uses learned positions)
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    compute_dtype: Dtype = jnp.float32
    path: ops.AttentionPath = "xla"
    shard: ops.KernelShard | None = None

    @nn.compact
    def __call__(
        self, x: jax.Array, inputs: AttentionInputs, cache: KVCache | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        """x (B, T, D) -> (y (B, T, D), updated cache or None); with `cache`, the T new keys
        and values are written at slot `inputs.cache_index`."""
        b, t, d = x.shape
        h, dh = self.n_heads, d // self.n_heads
        lin = dict(kernel_init=self.kernel_init, compute_dtype=self.compute_dtype)
        qkv = Linear(3 * d, use_bias=self.qkv_bias, name="qkv", **lin)
        dropout = not inputs.deterministic and self.dropout > 0.0  # flash refuses it (ops)
        if cache is None and self.path == "flash" and self.rope_theta is None and not dropout:
            # one op, whose kernels read q, k, v in place from the projection's output
            y = qkv(x, attend=functools.partial(ops.qkv_attention, n_heads=h, shard=self.shard))
        else:
            with jax.named_scope("qkv"):
                q, k, v = (a.reshape(b, t, h, dh) for a in qkv(x, splits=3))  # (B, T, H, Dh)
            rng = self.make_rng("dropout") if dropout else None
            y, cache = self._attend(q, k, v, inputs, cache, rng)
        with jax.named_scope("out"):
            out = Linear(d, self.out_bias, self.out_init, self.compute_dtype, name="out")
            y = nn.Dropout(self.dropout)(out(y.reshape(b, t, d)), inputs.deterministic)
        return y, cache

    def _attend(self, q, k, v, inputs: AttentionInputs, cache: KVCache | None, rng):
        """(attention of q, k, v (B, T, H, Dh): RoPE, then the path, or XLA over the cache,
        dropout with `rng` unless None; the updated cache or None)."""
        if self.rope_theta is not None:
            with jax.named_scope("qkv"):
                cos, sin = F.rope_angles(inputs.positions, q.shape[-1], self.rope_theta)
                q, k = F.apply_rope(q, cos, sin), F.apply_rope(k, cos, sin)
        with jax.named_scope("sdpa"):  # softmax(q k^T / sqrt(Dh) + mask) v, + the cache write
            if cache is None:
                return ops.causal_attention(q, k, v, self.path, self.dropout, rng, self.shard), None
            slot, old_k, old_v = inputs.cache_index, cache["k"], cache["v"]
            k = jax.lax.dynamic_update_slice_in_dim(old_k, k.astype(old_k.dtype), slot, 1)
            v = jax.lax.dynamic_update_slice_in_dim(old_v, v.astype(old_v.dtype), slot, 1)
            mask = F.attention_mask(q.shape[1], k.shape[1], slot, inputs.key_mask)
            return F.attention(q, k, v, mask, self.dropout, rng), {"k": k, "v": v}  # (B, S, H, Dh)


class FeedForward(nn.Module):
    """GPT-2 MLP: W2 gelu(W1 x), hidden width d_ff."""

    d_ff: int
    use_bias: bool = True
    dropout: float = 0.0
    kernel_init: Initializer = nn.initializers.normal(0.02)
    out_init: Initializer = nn.initializers.normal(0.02)
    compute_dtype: Dtype = jnp.float32
    path: ops.MLPPath = "xla"  # pallas_mgpu: both GEMMs in one op, ops.gelu_mlp
    shard: ops.KernelShard | None = None

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        cd = self.compute_dtype
        fc = Linear(self.d_ff, self.use_bias, self.kernel_init, cd, name="fc")
        proj = Linear(x.shape[-1], self.use_bias, self.out_init, cd, name="proj")
        if self.path == "xla":
            y = proj(F.gelu(fc(x)))
        else:  # proj's weights first (a (d_ff,) input only shapes them), then one op for both
            w2, b2 = proj(jnp.zeros((self.d_ff,), cd), attend=lambda _, w, b: (w, b))
            y = fc(x, attend=lambda xc, w1, b1: ops.gelu_mlp(xc, w1, b1, w2, self.shard))
            y = y if b2 is None else _add_bias((y,), b2)[0]
        return nn.Dropout(self.dropout)(y, deterministic)


class SwiGLU(nn.Module):
    """W2 (SiLU(W1 x) * W3 x), no biases (CS336 / Llama)."""

    d_ff: int
    kernel_init: Initializer = cs336_init()
    compute_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        lin = dict(use_bias=False, kernel_init=self.kernel_init, compute_dtype=self.compute_dtype)
        gate = Linear(self.d_ff, name="w1", **lin)(x)
        up = Linear(self.d_ff, name="w3", **lin)(x)
        return Linear(x.shape[-1], name="w2", **lin)(jax.nn.silu(gate) * up)


class DepthwiseConv1d(nn.Module):
    """Per-channel 1-D convolution over (B, L, D) with a (D, K) filter and bias (D,).

    mode 'causal' (output t sees inputs <= t), 'same' or 'full' (length L + K - 1).
    """

    kernel_size: int = 3
    mode: str = "causal"
    path: ops.ConvPath = "xla"
    shard: ops.KernelShard | None = None

    @nn.compact
    def __call__(self, u: jax.Array) -> jax.Array:
        d = u.shape[-1]
        init = cs336_init(fan_in=self.kernel_size, fan_out=1)
        w = self.param("kernel", init, (d, self.kernel_size))
        b = self.param("bias", nn.initializers.zeros, (d,))
        return ops.depthwise_conv1d(u, w, b, self.mode, self.path, self.shard)
