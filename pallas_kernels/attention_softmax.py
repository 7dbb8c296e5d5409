"""Fused attention softmax (scale, additive mask, causal mask): Pallas kernels with a custom VJP.

softmax(scale * scores + mask) over the keys of scores (B, H, Tq, Tk), float32 math. This module
checks the arguments, picks the lowering (attention_softmax_triton.py by default,
attention_softmax_mgpu.py with backend="mosaic_gpu") and owns the custom VJP; the backward reads
only the probabilities: dscores = scale * y * (dy - sum(dy * y)). reference.attention_softmax_ref
is the jnp reference.

Memory traffic, R = B*H*Tq rows of Tk, s bytes per element (both lowerings):
  forward : read scores, write probs           = 2 * R * Tk * s  (+ the mask)
  backward: read probs, dprobs; write dscores  = 3 * R * Tk * s
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import attention_softmax_mgpu as mgpu
from . import attention_softmax_triton as triton
from .attention_softmax_common import Layout
from .attention_softmax_triton import Config
from .common import check_backend, check_config, first_order_rules, resolve_interpret

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# Jitted (here and _backward) so that call sites of one shape and config lower the kernels once.
@functools.partial(
    jax.jit, static_argnames=("cfg", "scale", "causal", "lay", "interpret", "backend")
)
def _forward(x, mask, cfg, scale, causal, lay, interpret, backend: str):
    if backend == "mosaic_gpu":
        return mgpu.forward(x, mask, cfg[0], scale, causal, lay)
    return triton.forward(x, mask, cfg, scale, causal, lay, interpret)


@functools.partial(jax.jit, static_argnames=("cfg", "scale", "n_queries", "interpret", "backend"))
def _backward(y, dy, cfg, scale, n_queries: int, interpret, backend: str):
    if backend == "mosaic_gpu":
        return mgpu.backward(y, dy, cfg[1], scale, n_queries)
    return triton.backward(y, dy, cfg, scale, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _softmax(x, mask, cfg, scale, causal, lay, interpret, backend):
    return _forward(x, mask, cfg, scale, causal, lay, interpret, backend)


def _softmax_fwd(x, mask, cfg, scale, causal, lay, interpret, backend):
    y = _forward(x, mask, cfg, scale, causal, lay, interpret, backend)
    return y, (y, mask)


def _softmax_bwd(cfg, scale, causal, lay, interpret, backend, res, dy):
    y, mask = res
    dmask = None if mask is None else jnp.zeros_like(mask)
    return _backward(y, dy, cfg, scale, lay.n_queries, interpret, backend), dmask


_softmax.defvjp(*first_order_rules("attention_softmax", 2, _softmax_fwd, _softmax_bwd))


def _check(scores, mask, scale) -> jax.Array | None:
    """Validate; return the mask as a 4-D (B or 1, 1, Tq or 1, Tk) array or None."""
    if scores.ndim != 4:
        raise ValueError(f"scores must be 4-D (B, H, Tq, Tk), got shape {scores.shape}")
    if scores.dtype not in DTYPES:
        raise ValueError(f"scores dtype must be float32, bfloat16 or float16, got {scores.dtype}")
    if scores.size == 0:
        raise ValueError(f"scores must have B, H, Tq, Tk >= 1, got shape {scores.shape}")
    if scale is not None and not isinstance(scale, int | float):
        raise ValueError(f"scale must be a Python number or None, got {type(scale).__name__}")
    if mask is None:
        return None
    if mask.ndim > 4 or not jnp.issubdtype(mask.dtype, jnp.floating):
        raise ValueError(
            f"mask must be an additive float array of at most 4 dims, got {mask.dtype} {mask.shape}"
        )
    mask4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    b, _, tq, tk = scores.shape
    allowed = ((1, b), (1,), (1, tq), (tk,))
    if any(n not in ok for n, ok in zip(mask4.shape, allowed, strict=True)):
        raise ValueError(
            f"mask shape {mask.shape} must broadcast as (B or 1, 1, Tq or 1, Tk) = "
            f"({b} or 1, 1, {tq} or 1, {tk}) against scores {scores.shape}; it may not vary over H"
        )
    return mask4


def attention_softmax(
    scores: jax.Array,
    mask: jax.Array | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    interpret: bool | None = None,
    config=None,
    backend: str = "triton",
) -> jax.Array:
    """softmax(scale * scores + mask) over keys; scores (B, H, Tq, Tk) -> probs, same dtype.

    mask: additive float, (B or 1, 1, Tq or 1, Tk) or fewer leading dims; it gets no gradient.
    causal: key j allowed for query i iff j <= i + (Tk - Tq). Fully masked rows give zeros.
    Math is float32. `config` overrides the tuned block sizes (benchmarks use it): a Config for
    backend "triton", an attention_softmax_mgpu.Config (both directions) for "mosaic_gpu".
    """
    mask4 = _check(scores, mask, scale)
    check_backend(backend, interpret)
    b, h, tq, tk = scores.shape
    if backend == "mosaic_gpu":
        check_config(config, backend, mgpu.Config)
        cfgs = mgpu.configs(tq, tk, scores.dtype, mask4 is not None)
        cfg, interpret = ((config, config) if config else cfgs), False
    else:
        check_config(config, backend, Config, ("block_rows", "num_warps", "max_block"))
        cfg, interpret = config or triton.default_config(tk), resolve_interpret(interpret)
    lay = Layout(
        heads=h,
        n_queries=tq,
        mask_batch=mask4 is not None and mask4.shape[0] > 1,
        mask_query=mask4 is not None and mask4.shape[2] > 1,
        mask_rows=1 if mask4 is None else mask4.shape[2],
    )
    mask2 = None if mask4 is None else mask4.reshape(-1, tk)  # (Bm * Tqm, Tk)
    scale = 1.0 if scale is None else float(scale)
    y = _softmax(scores.reshape(-1, tk), mask2, cfg, scale, bool(causal), lay, interpret, backend)
    return y.reshape(scores.shape)
