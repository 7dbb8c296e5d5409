"""Which implementation runs for each op family, decided in one place and said out loud.

`plan_ops(cfg)` turns the model config's switches (`kernels`, `attention_impl`, `loss_impl`) and
the backend into an `OpPlan`: one named path per op family. Layers receive their path from the
plan and call the functions below; nothing else in the library imports `pallas_kernels` (the
kernel benchmark in `jaxllm.profiling.kernel_bench`, whose subject is the kernels themselves,
is the one exception). A switch that cannot apply is a `ConfigError` at config time (cuDNN
attention with dropout) or a path the plan names (cuDNN needs a GPU and bf16: elsewhere
attention runs on XLA, and `OpPlan.describe()` says so); nothing falls back silently.

Paths:
  norm       xla | pallas          LayerNorm (GPT-2) or RMSNorm (transformer_lm), each with the
                                   fused residual add on the Pallas path
  attention  xla | pallas | cudnn  training/eval attention: XLA's masked softmax, the Pallas
                                   softmax between two XLA einsums, or cuDNN flash attention
  decode     xla                   attention over a KV cache (generation): always XLA
  loss       xla | pallas          LM head + cross-entropy: logits then softmax_loss, or the
                                   fused Pallas kernel that never keeps the logits
  conv       xla | pallas          depthwise conv1d
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxllm import functional as F
from jaxllm.config import ModelConfig

NormPath = Literal["xla", "pallas"]
AttentionPath = Literal["xla", "pallas", "cudnn"]


@dataclasses.dataclass(frozen=True)
class OpPlan:
    norm: NormPath = "xla"
    attention: AttentionPath = "xla"
    loss: Literal["xla", "pallas"] = "xla"
    conv: Literal["xla", "pallas"] = "xla"
    interpret: bool = False  # Pallas kernels run in interpret mode (no GPU): slow, for tests
    notes: tuple[str, ...] = ()  # why a path differs from what the config asked for

    def describe(self) -> str:
        """One line for the start of a run, e.g. 'ops: norm=pallas attention=cudnn ...'."""
        parts = [
            f"norm={self.norm}",
            f"attention={self.attention}",
            "decode=xla",
            f"loss={self.loss}",
            f"conv={self.conv}",
        ]
        pallas = "pallas" in (self.norm, self.attention, self.loss, self.conv)
        if pallas:
            parts.append("(Pallas interpreted: no GPU)" if self.interpret else "(Pallas compiled)")
        return "ops: " + " ".join(parts) + "".join(f"; {n}" for n in self.notes)


def plan_ops(cfg: ModelConfig, backend: str | None = None) -> OpPlan:
    """The op paths a model with `cfg` takes on `backend` (default: jax.default_backend())."""
    backend = backend or jax.default_backend()
    notes = []
    attention: AttentionPath = "pallas" if cfg.kernels == "pallas" else "xla"
    if cfg.attention_impl == "dot_product_attention":
        if backend == "gpu" and cfg.compute_dtype == "bfloat16":
            attention = "cudnn"
        else:
            notes.append(
                f"attention_impl=dot_product_attention needs a GPU and bfloat16 for cuDNN "
                f"(backend {backend}, {cfg.compute_dtype}): attention runs on {attention}"
            )
    return OpPlan(
        norm=cfg.kernels,  # LayerNorm and RMSNorm both have kernels
        attention=attention,
        loss=cfg.loss_impl,
        conv=cfg.kernels,
        interpret=backend != "gpu",
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------- norms


def layer_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None,
    eps: float,
    out_dtype: jnp.dtype,
    path: NormPath,
) -> jax.Array:
    """LayerNorm over the last dim of x (..., D), output in out_dtype."""
    if path == "pallas":
        bias = jnp.zeros_like(scale) if bias is None else bias
        return pallas_kernels.layer_norm(x, scale, bias, eps, out_dtype=out_dtype)
    return F.layer_norm(x, scale, bias, eps).astype(out_dtype)


def add_layer_norm(
    x: jax.Array,
    h: jax.Array,
    scale: jax.Array,
    bias: jax.Array | None,
    eps: float,
    out_dtype: jnp.dtype,
    path: NormPath,
) -> tuple[jax.Array, jax.Array]:
    """(s, LayerNorm(s)) with s = x + h in x's dtype: the pre-norm residual step, one kernel
    both ways on the Pallas path."""
    if path == "pallas":
        bias = jnp.zeros_like(scale) if bias is None else bias
        return pallas_kernels.add_layer_norm(x, h, scale, bias, eps, out_dtype=out_dtype)
    s = x + h.astype(x.dtype)
    return s, F.layer_norm(s, scale, bias, eps).astype(out_dtype)


def rms_norm(
    x: jax.Array, scale: jax.Array, eps: float, out_dtype: jnp.dtype, path: NormPath
) -> jax.Array:
    """RMSNorm over the last dim of x (..., D), output in out_dtype."""
    if path == "pallas":
        return pallas_kernels.rms_norm(x, scale, eps, out_dtype=out_dtype)
    return F.rms_norm(x, scale, eps).astype(out_dtype)


def add_rms_norm(
    x: jax.Array, h: jax.Array, scale: jax.Array, eps: float, out_dtype: jnp.dtype, path: NormPath
) -> tuple[jax.Array, jax.Array]:
    """(s, RMSNorm(s)) with s = x + h in x's dtype, as `add_layer_norm`."""
    if path == "pallas":
        return pallas_kernels.add_rms_norm(x, h, scale, eps, out_dtype=out_dtype)
    s = x + h.astype(x.dtype)
    return s, F.rms_norm(s, scale, eps).astype(out_dtype)


# ----------------------------------------------------------------------------- attention


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    path: AttentionPath,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention without a cache: q, k, v (B, T, H, Dh) -> (B, T, H, Dh)."""
    if path == "cudnn":
        if dropout_rng is not None:  # the config forbids it; a direct caller may not
            raise ValueError("cuDNN attention has no dropout; use the xla or pallas path")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if path == "pallas":

        def probs_fn(scores: jax.Array, scale: float) -> jax.Array:
            return pallas_kernels.attention_softmax(scores, None, causal=True, scale=scale)

        return F.attention(q, k, v, None, dropout_rate, dropout_rng, probs_fn=probs_fn)
    mask = F.attention_mask(q.shape[1], k.shape[1])
    return F.attention(q, k, v, mask, dropout_rate, dropout_rng)


# ----------------------------------------------------------------------------- loss, conv


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    compute_dtype: jnp.dtype,
    path: Literal["xla", "pallas"],
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LM head + cross-entropy: x (N, D), w (V, D), targets, weights (N,) ->
    (sum_i w_i loss_i, ce (N,), hit (N,)); see `F.linear_cross_entropy`."""
    if path == "pallas":
        if label_smoothing:  # ModelConfig refuses this pairing; a direct caller gets it here
            raise ValueError("label smoothing needs the xla loss path: the fused kernel has none")
        return pallas_kernels.linear_cross_entropy(x, w, targets, weights, compute_dtype)
    return F.linear_cross_entropy(x, w, targets, weights, compute_dtype, label_smoothing)


def depthwise_conv1d(
    u: jax.Array, w: jax.Array, b: jax.Array, mode: str, path: Literal["xla", "pallas"]
) -> jax.Array:
    """Per-channel conv over (B, L, D) with w (D, K), b (D,); see `F.depthwise_conv1d`."""
    if path == "pallas":
        return pallas_kernels.depthwise_conv1d(u, w, b, mode)
    return F.depthwise_conv1d(u, w, b, mode)
