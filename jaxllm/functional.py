"""Pure jnp building blocks: activations, softmax, losses, masks, rotary embeddings.

No Flax, no state: every function maps arrays to arrays. Reductions that need range (softmax,
logsumexp, losses) run in float32 whatever the input dtype, because bfloat16 sums lose digits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _atleast_f32(x: jax.Array) -> jax.Array:
    """Upcast half types to float32; float64 stays float64 (for x64 reference checks)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# Large negative logit for masked positions. Finite (unlike -inf) so a fully masked row gives a
# uniform distribution instead of NaN, and far below any real logit so exp() underflows to 0.
MASK_VALUE = -1e30

IGNORE = -1  # target id of positions that carry no loss (padding, prompts, AR context)


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """GELU. `approximate=True` is GPT-2's tanh form; False is the exact erf form."""
    if approximate:
        return _gelu_tanh(x)
    return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))


_GELU_C = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def _gelu_tanh(x: jax.Array) -> jax.Array:
    # Spelled exactly as XLA's cuBLASLt GELU-epilogue pattern, x * (0.5 * (1 + tanh(...))) with
    # x * (x * x): on the GPU the MLP's matmul, bias add and GELU then run as one GEMM
    # (epilogue BIAS_GELU_AUX, which also writes x for the backward). GPT-2 124M train step,
    # H100: 35.72 -> 34.99 ms at batch 16, 127.5 -> 125.7 ms at 64 (benchmarks/RESULTS.md).
    return x * (0.5 * (1.0 + jnp.tanh(_GELU_C * (x + 0.044715 * (x * (x * x))))))


def _gelu_tanh_fwd(x: jax.Array):
    # Save only x (the MLP's matmul output, kept anyway) and recompute tanh in the backward:
    # autodiff would save tanh as well, one more (B, T, 4D) tensor written and read per layer.
    # Saved as a no-op reduce_precision of x: under jax.checkpoint (FSDP's per-layer gather) a
    # saved value the forward also reads gets such a rounding inserted after its producer, which
    # would sit between the bias add and GELU and hide the pair from the GEMM epilogue; a saved
    # value the forward does not read gets none.
    f = jnp.finfo(x.dtype)
    return _gelu_tanh(x), jax.lax.reduce_precision(x, f.nexp, f.nmant)


def _gelu_tanh_bwd(x: jax.Array, g: jax.Array):
    # The barrier keeps XLA's CSE from sharing x * x or tanh with the forward: a shared
    # subexpression gives the forward's pattern a second user and the GEMM epilogue no longer
    # matches.
    x = jax.lax.optimization_barrier(x)
    u = _GELU_C * (x + 0.044715 * x**3)
    t = 2.0 * jax.nn.sigmoid(2.0 * u) - 1.0  # tanh(u)
    du = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return (g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du),)


_gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) along `axis`, in float32 (an all -inf row gives -inf, not NaN)."""
    return jax.nn.logsumexp(_atleast_f32(x), axis=axis, keepdims=keepdims)


def one_hot(ids: jax.Array, n: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """(...,) int ids -> (..., n) one-hot; ids outside [0, n) give an all-zero row."""
    return jax.nn.one_hot(ids, n, dtype=dtype)


def softmax(x: jax.Array, axis: int = -1, temperature: float = 1.0) -> jax.Array:
    """softmax(x / temperature) along `axis`, in float32; returns float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = _atleast_f32(x) / temperature
    # exp(z - m) / sum, not exp(z - logsumexp(z)): a float32 logsumexp of large logits (~100)
    # is rounded by up to half an ulp (4e-6), an error every probability then carries. The max
    # shift is exact and the division rounds once per element. The shift does not change the
    # result, so it takes no gradient; a non-finite max (an all -inf row) is replaced by 0 as in
    # `logsumexp`. A row of MASK_VALUE gives exp(0) everywhere: uniform. (jax.nn.softmax gives
    # the same values on float32 input; the roofline's FLOP count is checked on this form.)
    m = jax.lax.stop_gradient(jnp.max(z, axis=axis, keepdims=True))
    e = jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0))
    return e / jnp.sum(e, axis=axis, keepdims=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def softmax_loss(logits: jax.Array, target: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Per-example cross-entropy: logits (..., V), target (...) int -> (...) float32 =
    logsumexp(z) - z_y, computed in float32.

    label_smoothing e in [0, 1): the target distribution is (1 - e) onehot(y) + e / V
    (Szegedy et al. 2016), so the loss is logsumexp(z) - (1 - e) z_y - e mean(z).

    The custom VJP keeps the logits in their own dtype as the saved residual and recomputes
    softmax in the backward: for a (B*T, 50257) bf16 LM head this avoids writing and re-reading
    a float32 copy of the logits.
    """
    return _softmax_loss_fwd(logits, target, label_smoothing)[0]


def _softmax_loss_fwd(logits: jax.Array, target: jax.Array, label_smoothing: float = 0.0):
    lse = logsumexp(logits, axis=-1)  # (...,) float32
    idx = target[..., None].astype(jnp.int32)
    z_y = _atleast_f32(jnp.take_along_axis(logits, idx, axis=-1)[..., 0])
    loss = lse - z_y
    if label_smoothing:
        z_mean = jnp.mean(_atleast_f32(logits), axis=-1)
        loss = lse - (1.0 - label_smoothing) * z_y - label_smoothing * z_mean
    return loss, (logits, idx, lse)


def _softmax_loss_bwd(label_smoothing: float, res, g: jax.Array):
    logits, idx, lse = res
    p = jnp.exp(_atleast_f32(logits) - lse[..., None])  # softmax, (..., V)
    hit = jnp.arange(logits.shape[-1]) == idx  # one-hot of the target
    # the gradient of the loss is softmax minus the target distribution
    q = (1.0 - label_smoothing) * hit + label_smoothing / logits.shape[-1]
    dlogits = (p - q) * g[..., None].astype(p.dtype)
    return dlogits.astype(logits.dtype), None


softmax_loss.defvjp(_softmax_loss_fwd, _softmax_loss_bwd)


def cross_entropy(
    logits: jax.Array, targets: jax.Array, ignore_index: int | None = IGNORE
) -> jax.Array:
    """Mean token cross-entropy. logits (..., V), targets (...) int -> scalar float32.

    Positions whose target equals `ignore_index` (default IGNORE = -1, as everywhere in
    jaxllm: padding, prompt tokens) count neither in the sum nor in the mean; if every position
    is ignored the result is 0, not NaN. None: every position counts.
    """
    if ignore_index is None:
        return jnp.mean(softmax_loss(logits, targets))
    valid = targets != ignore_index
    losses = softmax_loss(logits, jnp.where(valid, targets, 0))
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def causal_mask(t: int, additive: bool = False) -> jax.Array:
    """(T, T) causal mask: query i may see key j iff j <= i.

    Boolean (True = attend) by default; `additive=True` gives float32 0 / MASK_VALUE to add to
    the attention scores.
    """
    allowed = jnp.tril(jnp.ones((t, t), dtype=bool))
    if additive:
        return jnp.where(allowed, 0.0, MASK_VALUE).astype(jnp.float32)
    return allowed


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout: zero each element with prob `rate`, scale the rest by 1/(1-rate).

    `rng=None` or `rate=0` is the identity (evaluation).
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotary angles: positions (..., T) -> two (..., T, head_dim // 2) arrays.

    Pair i rotates by positions * theta^(-2i / head_dim), as in RoFormer and CS336.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {head_dim}")
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # (Dh/2,)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of the last dim (CS336 layout, not halves).

    x (B, T, H, Dh); cos, sin (B or 1, T, Dh/2). Math in float32, returns x's dtype.
    """
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)  # (B, T, H, Dh/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def layer_norm(
    x: jax.Array, scale: jax.Array, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
    """LayerNorm over the last dim, statistics in float32; returns x's dtype. x (..., D)."""
    xf = _atleast_f32(x)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * scale, in float32. x (..., D)."""
    xf = _atleast_f32(x)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps) * scale
    return y.astype(x.dtype)


def attention_mask(
    tq: int, tk: int, offset: jax.Array | int = 0, key_mask: jax.Array | None = None
) -> jax.Array:
    """Boolean (B or 1, 1, Tq, Tk) mask, True = attend.

    Query i sits at absolute slot offset + i and may see key slots j <= offset + i (causal);
    `key_mask` (B, Tk) bool additionally hides padding keys.
    """
    allowed = jnp.arange(tk)[None, :] <= (jnp.arange(tq)[:, None] + offset)  # (Tq, Tk)
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    probs_fn: Callable[[jax.Array, float], jax.Array] | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(Dh) + mask) v with scores and softmax in float32.

    q (B, Tq, H, Dh); k, v (B, Tk, H, Dh); mask bool broadcastable to (B, H, Tq, Tk), True =
    attend. `probs_fn(scores, scale) -> probs` replaces the masked softmax (a fused kernel that
    applies its own mask). Returns (B, Tq, H, Dh) in v's dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if probs_fn is None:
        scores = scores * scale
        if mask is not None:  # None: every query attends to every key
            scores = jnp.where(mask, scores, MASK_VALUE)
        probs = softmax(scores, axis=-1)  # (B, H, Tq, Tk)
    else:
        probs = probs_fn(scores, scale)
    probs = dropout(probs, dropout_rate, dropout_rng)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    compute_dtype: jnp.dtype = jnp.bfloat16,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The LM-head loss on XLA: logits = x W^T in compute_dtype, then `softmax_loss`.

    x (N, D), w (V, D), targets (N,) int, weights (N,) -> (sum_i w_i loss_i, ce (N,), hit (N,)),
    loss_i = the (label-smoothed) objective, ce_i = the plain cross-entropy (the metric),
    hit = the target's logit is the row maximum (ties included). ce, hit and the weights carry
    no gradient, as in the fused kernel `pallas_kernels.linear_cross_entropy`.
    """
    weights = jax.lax.stop_gradient(weights)
    logits = jnp.dot(x.astype(compute_dtype), w.astype(compute_dtype).T)  # (N, V)
    loss = softmax_loss(logits, targets, label_smoothing)  # (N,) float32
    ce = softmax_loss(logits, targets) if label_smoothing else loss
    z = _atleast_f32(logits)
    z_t = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    hit = z_t >= jnp.max(z, axis=-1)
    return jnp.sum(weights * loss), jax.lax.stop_gradient(ce), hit


def depthwise_conv1d(u: jax.Array, w: jax.Array, b: jax.Array, mode: str = "causal") -> jax.Array:
    """out[:, t, d] = b[d] + sum_k w[d, k] * u_padded[:, t + k, d] (a cross-correlation, as
    torch's conv1d). u (B, L, D), w (D, K), b (D,); mode 'causal' (output t sees inputs <= t),
    'same' or 'full' (length L + K - 1). Math in float32, returns u's dtype."""
    k = w.shape[1]
    pads = {"causal": (k - 1, 0), "same": ((k - 1) // 2, k // 2), "full": (k - 1, k - 1)}
    if mode not in pads:
        raise ValueError(f"mode must be one of {sorted(pads)}, got {mode!r}")
    up = jnp.pad(_atleast_f32(u), ((0, 0), pads[mode], (0, 0)))  # (B, L + pads, D)
    n = up.shape[1] - k + 1
    wf = _atleast_f32(w)
    out = b.astype(wf.dtype) + sum(up[:, i : i + n] * wf[:, i] for i in range(k))
    return out.astype(u.dtype)
