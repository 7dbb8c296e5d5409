"""Fused LM head + cross-entropy: one Pallas kernel makes the loss and dlogits, a custom VJP
ties it to the head's two backward GEMMs. This module picks the kernel (cross_entropy_triton.py
or cross_entropy_mgpu.py) and owns the custom VJP; reference.linear_cross_entropy_ref is the
unfused jnp reference.

For hidden states x (N, D), a head W (V, D), targets t (N,) and row weights w (N,):

    z = x W^T (compute dtype),   ce_i = logsumexp_j z_ij - z_i,t_i,   loss = sum_i w_i ce_i

The weights are an input (the training step passes valid / count), so dloss/dz = w_i (softmax(z_i)
- onehot(t_i)) is known in the forward: the kernel makes ce and dz of each row together. The
forward then runs dx = dz W and dW = dz^T x, and the VJP's backward only scales them by the
scalar cotangent. z never outlives the forward and no float32 copy of it is made. A large batch
goes through in chunks of rows, one after the other (`max_chunk_bytes` of logits each, default
8 GiB; dW summed in float32), so only one chunk's z (and dz) exists at a time.

The vocabulary is padded inside to a multiple of 128 (50257 -> 50304) so the GEMMs see aligned
shapes; padded columns are masked out of the softmax and get zero gradient.

Memory traffic beyond the GEMMs, N rows of Vp columns, s bytes per element of z:
  forward (with gradient): read z, write dz = 2 * N * Vp * s
  primal only (no gradient): read z      = N * Vp * s   (the Triton kernel; the Mosaic one, as
                                                         above, where jax lacks Triton)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import common, cross_entropy_mgpu
from .common import (
    MASK_VALUE,
    check_backend,
    check_config,
    first_order_rules,
    resolve_interpret,
)
from .cross_entropy_triton import VOCAB_ALIGN, Config, cross_entropy_from_logits, default_config

OUT_OF_RANGE_CE = -MASK_VALUE  # the ce of a row whose target is outside [0, V): 1e30, finite
# The head's logits are made for at most this many bytes of rows at a time (linear_cross_entropy)
LOGITS_CHUNK_BYTES = 8 * 2**30
CHUNK_ROW_MULTIPLE = 32  # rows of a chunk: whole 32-row runs of the Mosaic kernel's programs


def _head_weights(x, w, compute_dtype):
    """x and W in the compute dtype, W's rows padded to a multiple of VOCAB_ALIGN (zero rows)."""
    pad = -w.shape[0] % VOCAB_ALIGN
    return x.astype(compute_dtype), jnp.pad(w.astype(compute_dtype), ((0, pad), (0, 0)))


def chunk_rows(n_rows: int, n_cols: int, itemsize: int, max_bytes: int) -> int:
    """Rows per chunk of the head so that one chunk's logits (rows x n_cols x itemsize bytes)
    stay within `max_bytes` (0: all rows at once), in whole CHUNK_ROW_MULTIPLE-row runs and as
    equal as those allow; never fewer than CHUNK_ROW_MULTIPLE rows (a smaller budget still gets
    that many). n_rows or more means one chunk."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_chunk_bytes must be an int >= 0 (0: one chunk), got {max_bytes!r}")
    if not max_bytes or n_rows * n_cols * itemsize <= max_bytes:
        return n_rows
    fit = max_bytes // (n_cols * itemsize) // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE
    cap = max(CHUNK_ROW_MULTIPLE, fit)  # most rows a chunk may take
    n_chunks = -(-n_rows // cap)
    rows = -(-n_rows // n_chunks)  # as equal as can be, then whole runs: still <= cap
    return min(n_rows, -(-rows // CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE)


def head_chunk_rows(
    n_rows: int,
    vocab: int,
    compute_dtype,
    max_chunk_bytes: int = LOGITS_CHUNK_BYTES,
) -> int:
    """Rows per chunk `linear_cross_entropy` takes for n_rows rows of a `vocab`-word head (the
    vocabulary padded to VOCAB_ALIGN); n_rows: one chunk."""
    n_cols = vocab + -vocab % VOCAB_ALIGN
    return chunk_rows(n_rows, n_cols, jnp.dtype(compute_dtype).itemsize, max_chunk_bytes)


def _over_chunks(one, rows: int, xc, targets, weights, carry=None):
    """one(x rows, targets, weights, carry) -> (carry, per-row outputs) over chunks of `rows`
    rows, one after the other (a lax.scan: one chunk's logits live at a time); the last chunk
    is padded with weight-0 rows, cut off the per-row outputs again."""
    n = xc.shape[0]
    if rows >= n:
        return one(xc, targets, weights, carry)
    n_chunks = -(-n // rows)
    pad = n_chunks * rows - n

    def split(a):  # (N, ...) -> (chunks, rows, ...), padded with zeros
        padded = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
        return padded.reshape(n_chunks, rows, *a.shape[1:])

    carry, outs = jax.lax.scan(
        lambda c, a: one(*a, c), carry, (split(xc), split(targets), split(weights))
    )
    return carry, tuple(o.reshape(n_chunks * rows, *o.shape[2:])[:n] for o in outs)


def targets_in_range(targets: jax.Array, vocab: int) -> jax.Array:
    """(N,) bool: targets in [0, vocab), checked in their own integer dtype (a cast first
    would wrap a 64-bit 2^32 + 1 to 1, a comparison with vocab in int8 would wrap vocab)."""
    info = jnp.iinfo(targets.dtype)
    ok = targets >= 0 if info.min < 0 else jnp.ones(targets.shape, bool)
    return ok & (targets < vocab) if vocab <= info.max else ok


def mark_out_of_range(ce, hit, ok):
    """ce, hit of the rows whose target was in range (ok, from targets_in_range); the others get
    ce OUT_OF_RANGE_CE, finite, so a weight-0 row adds 0 to the loss and a weighted one shows up
    at once, and are never a hit. Every loss path (this kernel, jaxllm.ops' XLA path) uses it."""
    return jnp.where(ok, ce, OUT_OF_RANGE_CE), jnp.where(ok, hit, 0).astype(hit.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _linear_ce(x, w, targets, weights, compute_dtype, interpret, cfg, backend, rows):
    # no gradient: the Triton kernel's one sweep; the Mosaic one (it also writes dz) where jax
    # has no Triton lowering
    mosaic = backend == "mosaic_gpu" and common.triton_refusal() is not None
    xc, wc = _head_weights(x, w, compute_dtype)
    cfg = cfg if backend == "triton" or mosaic else default_config()

    def one(x_rows, t, wt, carry):
        z = jnp.dot(x_rows, wc.T)  # (rows, Vp)
        if mosaic:
            ce, hit, _ = cross_entropy_mgpu.cross_entropy_from_logits(z, t, wt, w.shape[0], cfg)
            return carry, (ce, hit)
        return carry, cross_entropy_from_logits(z, t, wt, w.shape[0], False, interpret, cfg)

    _, (ce, hit) = _over_chunks(one, rows, xc, targets, weights)
    ce, hit = mark_out_of_range(ce, hit, targets >= 0)  # -1: out of range
    return jnp.sum(weights * ce), ce, hit


def _linear_ce_fwd(x, w, targets, weights, compute_dtype, interpret, cfg, backend, rows):
    vocab, f32 = w.shape[0], jnp.float32
    xc, wc = _head_weights(x, w, compute_dtype)

    def one(x_rows, t, wt, dw):  # dw (Vp, D) float32: the sum over the chunks so far
        z = jnp.dot(x_rows, wc.T)  # (rows, Vp)
        if backend == "mosaic_gpu":
            ce, hit, dz = cross_entropy_mgpu.cross_entropy_from_logits(z, t, wt, vocab, cfg)
        else:
            ce, hit, dz = cross_entropy_from_logits(z, t, wt, vocab, True, interpret, cfg)
        dx = jnp.dot(dz, wc, preferred_element_type=f32).astype(x.dtype)  # (rows, D)
        dw_rows = jnp.dot(dz.T, x_rows, preferred_element_type=f32)  # (Vp, D)
        return (dw_rows if dw is None else dw + dw_rows), (ce, hit, dx)

    dw0 = None if rows >= x.shape[0] else jnp.zeros(wc.shape, f32)
    dw, (ce, hit, dx) = _over_chunks(one, rows, xc, targets, weights, dw0)
    ce, hit = mark_out_of_range(ce, hit, targets >= 0)  # -1: out of range
    return (jnp.sum(weights * ce), ce, hit), (dx, dw[:vocab].astype(w.dtype))


def _linear_ce_bwd(compute_dtype, interpret, cfg, backend, rows, res, cts):
    dx, dw = res
    g = cts[0]  # cotangent of the loss; ce and hit leave the public function without gradient
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


_linear_ce.defvjp(*first_order_rules("linear_cross_entropy", 4, _linear_ce_fwd, _linear_ce_bwd))


def _check(x, w, targets, weights) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x (N, D) and w (V, D) with the same D, got {x.shape}, {w.shape}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"need at least one row and one feature, got x of shape {x.shape}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {a.dtype}")
    n = x.shape[0]
    if targets.shape != (n,) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets must be integers of shape ({n},), got {targets.dtype}{targets.shape}"
        )
    if weights.shape != (n,):
        raise ValueError(f"weights must have shape ({n},), got {weights.shape}")
    if not 1 <= w.shape[0] < 2**31:
        raise ValueError(f"vocabulary size must be in [1, 2^31), got {w.shape[0]}")


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    compute_dtype=jnp.bfloat16,
    interpret: bool | None = None,
    *,
    config=None,
    backend: str = "triton",
    max_chunk_bytes: int = LOGITS_CHUNK_BYTES,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Weighted cross-entropy of the head z = x W^T, without keeping z.

    x (N, D), w (V, D) float; targets (N,) int in [0, V); weights (N,) float (use 0 for rows
    without a target, 1/count for a mean). Returns (loss = sum_i w_i ce_i, differentiable in x
    and w; ce (N,) float32 per row; hit (N,) bool: the target's logit is the row's max). ce,
    hit and the weights carry no gradient. Targets outside [0, V) cannot be checked under jit:
    give them weight 0 (their ce is then OUT_OF_RANGE_CE, 1e30: finite, never a hit; with a
    weight it shows in the loss). `config`: a Config (Triton) or a cross_entropy_mgpu.Config
    (`backend="mosaic_gpu"`: bfloat16 compute only). `backend` picks the kernel of the
    forward-and-gradient pass (training); a call that takes no gradient
    (evaluation) runs the Triton forward kernel on either backend where jax has the Triton
    lowering: it reads each row of logits once and writes nothing, the least traffic there is
    (the Mosaic kernel also writes dz, which is then dropped).
    `max_chunk_bytes`: the rows go through the head in chunks whose logits take at most this
    many bytes, one chunk after the other (0: all rows at once), so the logits of a large batch
    never exist whole: GPT-2's at batch 64 are 6.7 GB, and the Mosaic kernel holds dz beside
    them. Same result (dW summed over the chunks in float32).
    """
    _check(x, w, targets, weights)
    if (dtype := jnp.dtype(compute_dtype)) not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {dtype}")
    check_backend(backend, interpret)
    if backend == "mosaic_gpu":
        check_config(config, backend, cross_entropy_mgpu.Config)
        if (dtype := jnp.dtype(compute_dtype)) != jnp.bfloat16:
            raise ValueError(f"backend='mosaic_gpu' computes in bfloat16, got {dtype}")
        cfg, interpret = config, False
    else:
        check_config(config, backend, Config, ("block_rows", "block_cols", "num_warps"))
        cfg, interpret = config or default_config(), resolve_interpret(interpret)
    weights = jax.lax.stop_gradient(weights)  # the forward bakes them into dz
    # A target outside [0, V) becomes -1, which matches no column, and its row's ce OUT_OF_RANGE_CE
    # (mark_out_of_range). In the padding columns [V, Vp) it would read a masked logit, which
    # float16 holds as -inf: ce = inf, and a weight-0 row would make the loss 0 * inf = NaN.
    targets = jnp.where(targets_in_range(targets, w.shape[0]), targets.astype(jnp.int32), -1)
    rows = head_chunk_rows(x.shape[0], w.shape[0], compute_dtype, max_chunk_bytes)
    loss, ce, hit = _linear_ce(
        x, w, targets, weights, jnp.dtype(compute_dtype), interpret, cfg, backend, rows
    )
    return loss, jax.lax.stop_gradient(ce), hit.astype(bool)


def mosaic_loss_refusal(n_vocab: int, compute_dtype) -> str | None:
    """Why the fused loss's Mosaic GPU kernel cannot run here, as "needs ..." would end (None:
    it can): a Hopper-class GPU, bfloat16 logits, padded rows that fit two per SM."""
    if (refusal := common.mosaic_gpu_refusal()) is not None:
        return refusal
    if (dtype := jnp.dtype(compute_dtype)) != jnp.bfloat16:
        return f"bfloat16 logits (got {dtype})"
    if not cross_entropy_mgpu.fits(n_vocab + -n_vocab % VOCAB_ALIGN):
        limit = cross_entropy_mgpu.MAX_COLS_TWO_PER_SM
        return f"a vocabulary of at most {limit} (two padded rows per SM; got {n_vocab})"
    return None
