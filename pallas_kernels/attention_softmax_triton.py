"""Fused attention softmax (scale, additive mask, causal mask) on Pallas' Triton lowering:
attention_softmax.attention_softmax's default kernels.

Scores (B, H, Tq, Tk) are viewed as R = B*H*Tq rows of Tk. A program owns `block_rows` rows. Rows
up to `max_block` keys are held in registers whole (one read, one write); longer rows are swept in
`max_block`-wide chunks twice: an online max/sum pass, then a normalising pass (one extra read).
The causal mask is computed from the row/column indices (no mask tensor is read); the additive
mask (Bm * Tqm, Tk) is gathered per row, so heads share it.

Forward: y = softmax(scale * x + mask). Backward: dx = scale * y * (dy - sum(dy * y)), one pass
over the row.

Memory traffic, R rows of Tk, s bytes per element:
  forward : read scores, write probs           = 2 * R * Tk * s  (+ the mask once)
  backward: read probs, dprobs; write dscores  = 3 * R * Tk * s
  (rows over `max_block` read the input a second time in each direction.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .attention_softmax_common import Layout
from .common import compiler_params, i32, pltriton, safe_max


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


def _logits(x_ref, m_ref, rows0, cols0, *, cfg, width, scale, causal, lay):
    """Scaled, masked float32 logits of one (block_rows, width) tile; -inf where not allowed."""
    n_rows, n_keys = x_ref.shape
    rows0, cols0 = i32(rows0), i32(cols0)
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
        out = y_ref.at[pl.ds(rows0, cfg.block_rows), pl.ds(i32(cols0), width)]
        pltriton.store(out, y.astype(y_ref.dtype), mask=valid)

    if n_chunks == 1:
        x, valid = logits(0)
        e = jnp.exp(x - safe_max(jnp.max(x, axis=1))[:, None])
        s = jnp.sum(e, axis=1)
        store(0, e * (1.0 / jnp.where(s > 0, s, 1.0))[:, None], valid)
        return

    def stats(i, carry):  # online max and rescaled sum over chunks
        m, s = carry
        x, _ = logits(i32(i) * width)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        e = jnp.exp(x - safe_max(m_new)[:, None])
        # m = -inf (nothing seen yet) rescales s = 0 by exp(-inf) = 0: a stand-in 0 for m would
        # give exp(-m_new) = inf for rows far below 0, 0 * inf = NaN, and no normalisation
        return m_new, s * jnp.exp(m - safe_max(m_new)) + jnp.sum(e, axis=1)

    rows = (cfg.block_rows,)  # float32 carries: x64 would make a plain jnp.zeros float64
    init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32))
    m, s = jax.lax.fori_loop(0, n_chunks, stats, init)
    m, inv_s = safe_max(m), 1.0 / jnp.where(s > 0, s, 1.0)

    def write(i, carry):
        x, valid = logits(i32(i) * width)
        store(i32(i) * width, jnp.exp(x - m[:, None]) * inv_s[:, None], valid)
        return carry

    jax.lax.fori_loop(0, n_chunks, write, 0)


def _bwd_kernel(y_ref, dy_ref, dx_ref, *, cfg: Config, scale: float):
    n_rows, n_keys = y_ref.shape
    width = min(pl.next_power_of_2(n_keys), cfg.max_block)
    n_chunks = pl.cdiv(n_keys, width)
    rows0 = pl.program_id(0) * cfg.block_rows
    row_ok = rows0 + jnp.arange(cfg.block_rows, dtype=jnp.int32) < n_rows

    def load(cols0):
        cols0 = i32(cols0)
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
        y, dy, _, _ = load(i32(i) * width)
        return acc + jnp.sum(y * dy, axis=1)

    dot = jax.lax.fori_loop(0, n_chunks, dot_step, jnp.zeros((cfg.block_rows,), jnp.float32))

    def write_step(i, carry):
        write(i32(i) * width, dot)
        return carry

    jax.lax.fori_loop(0, n_chunks, write_step, 0)


def forward(x, mask, cfg: Config, scale: float, causal: bool, lay: Layout, interpret: bool):
    """probs (R, Tk) of scores x (R, Tk) and mask (Bm * Tqm, Tk) or None."""
    args = (x,) if mask is None else (x, mask)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, scale=scale, causal=causal, lay=lay),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], cfg.block_rows),),
        compiler_params=compiler_params(cfg.num_warps),
        interpret=interpret,
        name="attention_softmax_fwd",
    )(*args)


def backward(y, dy, cfg: Config, scale: float, interpret: bool):
    """dscores (R, Tk) = scale * y * (dy - sum(y * dy)) of probs y and their gradient dy."""
    return pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg, scale=scale),
        out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
        grid=(pl.cdiv(y.shape[0], cfg.block_rows),),
        compiler_params=compiler_params(cfg.num_warps),
        interpret=interpret,
        name="attention_softmax_bwd",
    )(y, dy)
