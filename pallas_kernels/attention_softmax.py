"""Fused attention softmax (scale, additive mask, causal mask): Pallas kernels with a custom VJP.

Scores (B, H, Tq, Tk) are viewed as B*H*Tq rows of Tk. A program owns `block_rows` rows. Rows up to
`max_block` keys are held in registers whole (one read, one write); longer rows are swept in
`max_block`-wide chunks twice: an online max/sum pass, then a normalising pass (one extra read).
The causal mask is computed from the row/column indices (no mask tensor is read); the additive
mask (B or 1, 1, Tq or 1, Tk) is gathered per row, so heads share it.

Minimal memory traffic, R = B*H*Tq rows of Tk, s bytes per element:
  forward : read scores, write probs           = 2 * R * Tk * s  (+ the mask once)
  backward: read probs, dprobs; write dscores  = 3 * R * Tk * s
  (rows over `max_block` read the input a second time in each direction.)
Backward: dx = scale * y * (dy - sum(dy * y)) in one pass over the row.
Backend: Triton lowering by default; `backend="mosaic_gpu"` runs attention_softmax_mgpu.py's
kernels in the same custom VJP (pallas_kernels/triton_backend.py picks and validates the lowering).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .triton_backend import (
    check_backend,
    check_triton_config,
    compiler_params,
    first_order_rules,
    resolve_interpret,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class Config(NamedTuple):
    block_rows: int
    num_warps: int
    max_block: int  # widest row held in registers at once; longer rows loop over chunks


def default_config(n_keys: int) -> Config:
    """Block sizes by padded row length; tuned on the H100 (benchmarks/RESULTS.md)."""
    width = min(pl.next_power_of_2(n_keys), 4096)
    block_rows = max(1, min(16, 2048 // width))
    num_warps = 4 if width * block_rows <= 2048 else 8
    return Config(block_rows, num_warps, max_block=4096)


class Layout(NamedTuple):
    """Static facts the kernels (both backends) need to find a row's query index and mask row."""

    heads: int
    n_queries: int
    mask_batch: bool  # mask varies over B
    mask_query: bool  # mask varies over Tq
    mask_rows: int  # Tq or 1: rows of mask per batch entry


def _i32(x) -> jax.Array:
    """x as an int32 index. Under jax_enable_x64 Python ints and loop counters are int64 while
    program ids are int32, and interpret mode rejects slice starts of mixed integer types; int32
    is also what the GPU's index arithmetic wants."""
    return jax.lax.convert_element_type(x, jnp.int32)


def _logits(x_ref, m_ref, rows0, cols0, *, cfg, width, scale, causal, lay):
    """Scaled, masked float32 logits of one (block_rows, width) tile; -inf where not allowed."""
    n_rows, n_keys = x_ref.shape
    rows0, cols0 = _i32(rows0), _i32(cols0)
    r = rows0 + jnp.arange(cfg.block_rows, dtype=jnp.int32)  # (R,) global row index
    c = cols0 + jnp.arange(width, dtype=jnp.int32)  # (C,)
    valid = (r < n_rows)[:, None] & (c < n_keys)[None, :]
    x = pltriton.load(
        x_ref.at[pl.ds(rows0, cfg.block_rows), pl.ds(cols0, width)], mask=valid, other=0.0
    )
    x = x.astype(jnp.float32) * scale
    q = r % lay.n_queries
    if m_ref is not None:
        m_row = jnp.zeros_like(r)  # (R,) row of the (Bm * Tqm, Tk) mask
        if lay.mask_batch:
            m_row += r // (lay.heads * lay.n_queries) * lay.mask_rows
        if lay.mask_query:
            m_row += q
        x = x + pltriton.load(m_ref.at[m_row[:, None], c[None, :]], mask=valid, other=0.0).astype(
            jnp.float32
        )
    keep = valid
    if causal:
        keep = keep & (c[None, :] <= (q + (n_keys - lay.n_queries))[:, None])
    return jnp.where(keep, x, -jnp.inf), valid


def _safe_max(m):
    return jnp.where(m == -jnp.inf, 0.0, m)  # fully masked row: keep exp(-inf - m) = 0, no NaN


def _fwd_kernel(*refs, cfg: Config, scale: float, causal: bool, lay: Layout):
    x_ref, m_ref, y_ref = refs if len(refs) == 3 else (refs[0], None, refs[1])
    n_keys = x_ref.shape[1]
    width = min(pl.next_power_of_2(n_keys), cfg.max_block)
    n_chunks = pl.cdiv(n_keys, width)
    rows0 = pl.program_id(0) * cfg.block_rows
    logits = functools.partial(
        _logits, x_ref, m_ref, rows0, cfg=cfg, width=width, scale=scale, causal=causal, lay=lay
    )

    def store(cols0, y, valid):
        out = y_ref.at[pl.ds(rows0, cfg.block_rows), pl.ds(_i32(cols0), width)]
        pltriton.store(out, y.astype(y_ref.dtype), mask=valid)

    if n_chunks == 1:
        x, valid = logits(0)
        e = jnp.exp(x - _safe_max(jnp.max(x, axis=1))[:, None])
        s = jnp.sum(e, axis=1)
        store(0, e * (1.0 / jnp.where(s > 0, s, 1.0))[:, None], valid)
        return

    def stats(i, carry):  # online max and rescaled sum over chunks
        m, s = carry
        x, _ = logits(_i32(i) * width)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        e = jnp.exp(x - _safe_max(m_new)[:, None])
        # m = -inf (nothing seen yet) rescales s = 0 by exp(-inf) = 0: a stand-in 0 for m would
        # give exp(-m_new) = inf for rows far below 0, 0 * inf = NaN, and no normalisation
        return m_new, s * jnp.exp(m - _safe_max(m_new)) + jnp.sum(e, axis=1)

    rows = (cfg.block_rows,)  # float32 carries: x64 would make a plain jnp.zeros float64
    init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32))
    m, s = jax.lax.fori_loop(0, n_chunks, stats, init)
    m, inv_s = _safe_max(m), 1.0 / jnp.where(s > 0, s, 1.0)

    def write(i, carry):
        x, valid = logits(_i32(i) * width)
        store(_i32(i) * width, jnp.exp(x - m[:, None]) * inv_s[:, None], valid)
        return carry

    jax.lax.fori_loop(0, n_chunks, write, 0)


def _bwd_kernel(y_ref, dy_ref, dx_ref, *, cfg: Config, scale: float):
    n_rows, n_keys = y_ref.shape
    width = min(pl.next_power_of_2(n_keys), cfg.max_block)
    n_chunks = pl.cdiv(n_keys, width)
    rows0 = pl.program_id(0) * cfg.block_rows
    row_ok = rows0 + jnp.arange(cfg.block_rows, dtype=jnp.int32) < n_rows

    def load(cols0):
        cols0 = _i32(cols0)
        valid = row_ok[:, None] & (cols0 + jnp.arange(width, dtype=jnp.int32) < n_keys)[None, :]
        idx = (pl.ds(rows0, cfg.block_rows), pl.ds(cols0, width))
        y = pltriton.load(y_ref.at[idx], mask=valid, other=0.0).astype(jnp.float32)
        dy = pltriton.load(dy_ref.at[idx], mask=valid, other=0.0).astype(jnp.float32)
        return y, dy, idx, valid

    def write(cols0, dot):
        y, dy, idx, valid = load(cols0)
        dx = scale * y * (dy - dot[:, None])
        pltriton.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=valid)

    if n_chunks == 1:
        y, dy, idx, valid = load(0)
        dx = scale * y * (dy - jnp.sum(y * dy, axis=1)[:, None])
        pltriton.store(dx_ref.at[idx], dx.astype(dx_ref.dtype), mask=valid)
        return

    def dot_step(i, acc):
        y, dy, _, _ = load(_i32(i) * width)
        return acc + jnp.sum(y * dy, axis=1)

    dot = jax.lax.fori_loop(0, n_chunks, dot_step, jnp.zeros((cfg.block_rows,), jnp.float32))

    def write_step(i, carry):
        write(_i32(i) * width, dot)
        return carry

    jax.lax.fori_loop(0, n_chunks, write_step, 0)


def _forward(x, mask, cfg, scale, causal, lay, interpret, backend: str):
    if backend == "mosaic_gpu":
        from . import attention_softmax_mgpu as mgpu

        return mgpu.forward(x, mask, cfg[0], scale, causal, lay)
    args = (x,) if mask is None else (x, mask)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, scale=scale, causal=causal, lay=lay),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], cfg.block_rows),),
        compiler_params=compiler_params(cfg.num_warps),
        interpret=interpret,
        name="attention_softmax_fwd",
    )(*args)


def _backward(y, dy, cfg, scale, n_queries: int, interpret, backend: str):
    if backend == "mosaic_gpu":
        from . import attention_softmax_mgpu

        return attention_softmax_mgpu.backward(y, dy, cfg[1], scale, n_queries)
    return pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg, scale=scale),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(pl.cdiv(y.shape[0], cfg.block_rows),),
        compiler_params=compiler_params(cfg.num_warps),
        interpret=interpret,
        name="attention_softmax_bwd",
    )(y, dy)


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
        from . import attention_softmax_mgpu

        if config is not None and not isinstance(config, attention_softmax_mgpu.Config):
            raise ValueError(
                f"backend='mosaic_gpu' takes an attention_softmax_mgpu.Config: {config}"
            )
        cfgs = attention_softmax_mgpu.configs(tq, tk, scores.dtype, mask4 is not None)
        cfg, interpret = ((config, config) if config else cfgs), False
    else:
        if config is not None and not isinstance(config, Config):
            raise ValueError(f"backend='triton' takes an attention_softmax.Config, got {config}")
        if config is not None:
            check_triton_config(config, ("block_rows", "num_warps", "max_block"))
        cfg, interpret = config or default_config(tk), resolve_interpret(interpret)
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
