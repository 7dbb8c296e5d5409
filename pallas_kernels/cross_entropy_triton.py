"""The fused cross-entropy kernel (loss, hit and dz of each row of logits) on Pallas' Triton
lowering: cross_entropy.linear_cross_entropy's default kernel, and its forward without gradient.

For padded logits z (N, Vp) of which the first `vocab` columns count, targets t and row weights w,
a program walks `block_rows` rows per step and sweeps each row twice in `block_cols` chunks: an
online max/sum pass (and the target's logit), then a pass that overwrites z in place with
dz = w (softmax(z) - onehot(t)). Padding columns read MASK_VALUE and get dz = 0.

Memory traffic, N rows of Vp columns, s bytes per element of z:
  with gradient: read z, write dz = 2 * N * Vp * s  (+ the second read of each row, from L2
                 when it is still there)
  no gradient:   read z           = N * Vp * s
against about five passes in XLA (max, argmax, sum-exp, then softmax - onehot and its pad).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import MASK_VALUE, compiler_params, i32, pltriton

VOCAB_ALIGN = 128  # cross_entropy pads the head's rows to a multiple of this for the GEMMs


class Config(NamedTuple):
    block_rows: int  # rows per program step
    block_cols: int  # columns per chunk of the row sweep
    num_warps: int
    programs: int  # most programs in the grid; each walks ceil(row blocks / programs) steps
    num_stages: int = 1


def default_config() -> Config:
    """Tuned on the H100 (benchmarks/RESULTS.md, GPT-2's 16384 x 50304 bf16 logits): one
    program per row streaming 2048-column chunks ran 2.0 ms vs 2.5 ms for XLA. Holding a whole
    row in registers (65536 columns over 16-32 warps) spilled and ran 5.5-7.2 ms."""
    return Config(block_rows=1, block_cols=2048, num_warps=4, programs=2**31 - 1)


def _kernel(z_ref, t_ref, w_ref, *out_refs, vocab: int, cfg: Config, steps: int):
    if len(out_refs) == 3:
        ce_ref, hit_ref, dz_ref = out_refs
    else:
        (ce_ref, hit_ref), dz_ref = out_refs, None
    n_rows, width = z_ref.shape
    r, c = cfg.block_rows, cfg.block_cols
    part = pl.program_id(0)  # read outside the loops: interpret mode cannot lower it inside

    @pl.loop(0, steps)
    def row_block(i):
        row0 = (part * steps + i32(i)) * r
        rows = pl.ds(row0, r)
        row_ok = row0 + jnp.arange(r, dtype=jnp.int32) < n_rows  # (R,)
        t = pltriton.load(t_ref.at[rows], mask=row_ok, other=0)  # (R,)

        def chunk(j):
            j = i32(j)
            cols = j * c + jnp.arange(c, dtype=jnp.int32)  # (C,)
            ok = row_ok[:, None] & (cols < vocab)[None, :]
            z = pltriton.load(z_ref.at[rows, pl.ds(j * c, c)], mask=ok, other=MASK_VALUE)
            return cols, z.astype(jnp.float32)  # (C,), (R, C)

        def stats(j, carry):  # online max, rescaled sum and the target's logit
            m, s, z_t = carry
            cols, z = chunk(j)
            m_new = jnp.maximum(m, jnp.max(z, axis=1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
            z_t = z_t + jnp.sum(jnp.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
            return m_new, s, z_t

        zeros = jnp.zeros((r,), jnp.float32)
        init = (jnp.full((r,), MASK_VALUE, jnp.float32), zeros, zeros)
        m, s, z_t = jax.lax.fori_loop(0, pl.cdiv(vocab, c), stats, init)
        lse = m + jnp.log(s)
        pltriton.store(ce_ref.at[rows], lse - z_t, mask=row_ok)
        pltriton.store(hit_ref.at[rows], (z_t >= m).astype(jnp.int32), mask=row_ok)
        if dz_ref is None:
            return
        w = pltriton.load(w_ref.at[rows], mask=row_ok, other=0.0).astype(jnp.float32)

        @pl.loop(0, pl.cdiv(width, c))  # padded columns too: they get dz = 0
        def grad(j):
            cols, z = chunk(j)
            onehot = (cols[None, :] == t[:, None]).astype(jnp.float32)
            dz = (jnp.exp(z - lse[:, None]) - onehot) * w[:, None]
            ok = row_ok[:, None] & (cols < width)[None, :]
            out = dz_ref.at[rows, pl.ds(i32(j) * c, c)]
            pltriton.store(out, dz.astype(dz_ref.dtype), mask=ok)


def cross_entropy_from_logits(
    z: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    vocab: int,
    with_grad: bool,
    interpret: bool,
    cfg: Config,
) -> tuple[jax.Array, ...]:
    """The kernel alone, on padded logits z (N, Vp) of which the first `vocab` columns count:
    (ce (N,) f32, hit (N,) int32[, dz = w (softmax - onehot) like z, written over z]).
    No custom VJP: cross_entropy.linear_cross_entropy is the differentiable op."""
    n_rows = z.shape[0]
    n_blocks = pl.cdiv(n_rows, cfg.block_rows)
    steps = pl.cdiv(n_blocks, cfg.programs)
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    out_shape = [row, jax.ShapeDtypeStruct((n_rows,), jnp.int32)]
    if with_grad:
        out_shape.append(jax.ShapeDtypeStruct(z.shape, z.dtype))
    return pl.pallas_call(
        functools.partial(_kernel, vocab=vocab, cfg=cfg, steps=steps),
        out_shape=tuple(out_shape),
        grid=(pl.cdiv(n_blocks, steps),),
        input_output_aliases={0: 2} if with_grad else {},
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="cross_entropy_fwd_bwd" if with_grad else "cross_entropy_fwd",
    )(z, targets.astype(jnp.int32), weights.astype(jnp.float32))
