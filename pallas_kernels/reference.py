"""Pure-jnp references for the Pallas kernels: the oracle the tests and benchmarks compare with.

Math runs in float32 (float64 when given float64, which the tests use for the exact oracle);
results come back in the input's dtype. All are differentiable with jax.grad (plain autodiff:
no custom VJPs, no memory tricks). This package never imports jaxllm, and the model's XLA path
(jaxllm.functional) never calls these: an oracle shared with the code under test proves nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CONV_MODES = ("same", "causal", "full")


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def attention_softmax_ref(
    scores: jax.Array, mask: jax.Array | None = None, *, causal: bool = False, scale=None
) -> jax.Array:
    """softmax(scale * scores + mask) over the last axis; scores (B, H, Tq, Tk).

    causal: key j is allowed for query i iff j <= i + (Tk - Tq). Rows with no allowed key (all
    masked by -inf or by causality) give zeros.
    """
    ct = _compute_dtype(scores.dtype)
    x = scores.astype(ct)
    if scale is not None:
        x = x * scale
    if mask is not None:
        x = x + mask.astype(ct)
    if causal:
        tq, tk = x.shape[-2:]
        q = jnp.arange(tq)[:, None]
        k = jnp.arange(tk)[None, :]
        x = jnp.where(k <= q + (tk - tq), x, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    m = jnp.where(jnp.isneginf(m), 0.0, m)  # fully masked row: exp(-inf) = 0 below, no NaN
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    return (e / jnp.where(s > 0, s, 1.0)).astype(scores.dtype)


def flash_attention_ref(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, scale=None
) -> jax.Array:
    """softmax(scale * q k^T, causal) v per head; q, k, v (B, T, H, D), scale 1/sqrt(D) by default.
    Math in float32 (float64 for float64 input); returns q's dtype."""
    ct = _compute_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(ct), k.astype(ct)) * scale
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(ct)).astype(q.dtype)


def layer_norm_ref(x: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float = 1e-5) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis; x (..., D), gamma, beta
    (D,). Statistics in float32 (float64 for float64 input); returns x's dtype."""
    xf = x.astype(_compute_dtype(x.dtype))
    centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = centered / jnp.sqrt(jnp.var(xf, axis=-1, keepdims=True) + eps)
    return (y * gamma + beta).astype(x.dtype)


def rms_norm_ref(x: jax.Array, gamma: jax.Array, eps: float = 1e-5) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * gamma over the last axis; x (..., D), gamma (D,). Statistics in
    float32 (float64 for float64 input); returns x's dtype."""
    xf = x.astype(_compute_dtype(x.dtype))
    y = xf / jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * gamma).astype(x.dtype)


def conv1d_padding(kernel_size: int, mode: str) -> tuple[int, int]:
    """(left, right) zero padding of a depthwise conv1d; output length L + left + right - K + 1."""
    if mode == "same":
        left = (kernel_size - 1) // 2
        return left, kernel_size - 1 - left
    if mode == "causal":
        return kernel_size - 1, 0
    if mode == "full":
        return kernel_size - 1, kernel_size - 1
    raise ValueError(f"mode must be one of {CONV_MODES}, got {mode!r}")


def depthwise_conv1d_ref(u: jax.Array, w: jax.Array, b: jax.Array, mode: str = "same") -> jax.Array:
    """out[:, t, d] = b[d] + sum_k w[d, k] * u_padded[:, t + k, d]; u (B, L, D), w (D, K), b (D,).

    A cross-correlation (as torch.nn.functional.conv1d). 'full' pads K-1 zeros on both ends, so
    out[:, 0] = u[:, 0] * w[:, K-1] + b.
    """
    ct = _compute_dtype(u.dtype)
    k_size = w.shape[1]
    left, right = conv1d_padding(k_size, mode)
    up = jnp.pad(u.astype(ct), ((0, 0), (left, right), (0, 0)))  # (B, L + left + right, D)
    out_len = up.shape[1] - k_size + 1
    wf = w.astype(ct)
    out = b.astype(ct) + sum(up[:, k : k + out_len] * wf[:, k] for k in range(k_size))
    return out.astype(u.dtype)


def linear_cross_entropy_ref(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    compute_dtype=jnp.bfloat16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The unfused LM-head loss: logits = x W^T in compute_dtype, then -log_softmax at the target.

    x (N, D), w (V, D), targets (N,) int, weights (N,) -> (sum_i w_i ce_i, ce (N,), hit (N,)),
    as `pallas_kernels.linear_cross_entropy` (ce, hit and the weights without gradient)."""
    weights = jax.lax.stop_gradient(weights)
    logits = jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype).T)  # (N, V)
    z = logits.astype(_compute_dtype(logits.dtype))
    z_t = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]  # (N,)
    ce = -(z_t - jax.nn.logsumexp(z, axis=-1))
    hit = z_t >= jnp.max(z, axis=-1)
    return jnp.sum(weights * ce), jax.lax.stop_gradient(ce), jax.lax.stop_gradient(hit)


def add_layer_norm_ref(
    x: jax.Array, h: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float = 1e-5
) -> tuple[jax.Array, jax.Array]:
    """(s, LayerNorm(s)) with s = x + h in x's dtype: the pre-norm residual step."""
    s = x + h.astype(x.dtype)
    return s, layer_norm_ref(s, gamma, beta, eps)


def add_rms_norm_ref(
    x: jax.Array, h: jax.Array, gamma: jax.Array, eps: float = 1e-5
) -> tuple[jax.Array, jax.Array]:
    """(s, RMSNorm(s)) with s = x + h in x's dtype: the Llama pre-norm residual step."""
    s = x + h.astype(x.dtype)
    return s, rms_norm_ref(s, gamma, eps)


def matmul_gelu_ref(x: jax.Array, w: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(h, gelu(h)), h = x @ w + b, gelu GPT-2's tanh form: x (M, K), w (K, N), b (N,) -> x's
    dtype, both from the unrounded h."""
    ct = _compute_dtype(x.dtype)
    h = jnp.dot(x.astype(ct), w.astype(ct)) + b.astype(ct)
    return h.astype(x.dtype), jax.nn.gelu(h, approximate=True).astype(x.dtype)


def matmul_dgelu_ref(dy: jax.Array, w: jax.Array, h: jax.Array) -> jax.Array:
    """(dy @ w) * gelu'(h), gelu GPT-2's tanh form: dy (M, K), w (K, N), h (M, N) -> h's dtype
    (the gradient of gelu(h) @ w.T with respect to h, given dy)."""
    ct = _compute_dtype(h.dtype)
    x = h.astype(ct)
    gelu = jax.grad(lambda v: jnp.sum(jax.nn.gelu(v, approximate=True)))(x)
    return (jnp.dot(dy.astype(ct), w.astype(ct)) * gelu).astype(h.dtype)
