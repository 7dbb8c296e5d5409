"""Fused attention softmax (scale, additive mask, causal mask) on Pallas' Mosaic GPU lowering.

The Mosaic GPU counterpart of attention_softmax_triton.py's kernels, same math; picked with
`backend="mosaic_gpu"` on `attention_softmax`, which keeps the custom VJP.

Scores (B, H, Tq, Tk) are B*H*Tq rows of Tk, Tk % 128 == 0. As layer_norm_mgpu: each program
walks a contiguous run of `block_rows`-row blocks (one bulk TMA copy per block into shared
memory, double buffered, rows_mgpu.pipelined_blocks) and computes `rows` rows at a time in column
chunks: the row max, the sum of exponentials, then the normalised output (the backward: the row
sum of y * dy, then dx), each a sweep over the row (a tile of whole rows read from shared memory
once and held in registers: rows_mgpu.Tiles.once). block_rows divides Tq, so a
block is one (b, h) slice of consecutive queries: its additive mask rows are one row (mask without
a query axis) or block_rows consecutive rows, copied alongside the scores; the causal mask comes
from the row and column indices.

Minimal memory traffic, R = B*H*Tq rows of Tk, s bytes per element (as the Triton kernels):
  forward : read scores, write probs           = 2 * R * Tk * s  (+ the mask rows of each block:
            one row, or block_rows rows of a per-query mask, i.e. H times the mask in all)
  backward: read probs, dprobs; write dscores  = 3 * R * Tk * s
Refused (ValueError): Tk % 128 != 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .attention_softmax_common import Layout
from .common import safe_max


class Config(NamedTuple):
    block_rows: int  # rows per TMA block: divides Tq, a multiple of `rows`
    rows: int  # rows computed together in registers (a power of two; 1 when chunk < Tk)
    chunk: int  # keys per register chunk: divides Tk, a multiple of 128
    programs_per_sm: int  # persistent programs per streaming multiprocessor
    stages: int = 2  # shared memory buffers per operand
    warp_rows: bool = False  # rows_mgpu.row_layout: a warp per row (rows % 4 == 0)


def default_config(
    n_queries: int, n_keys: int, itemsize: int, n_operands: int, *, backward: bool
) -> Config:
    """Block sizes for rows of Tk keys and `n_operands` block buffers per stage: whole rows in
    registers up to 4096 keys (several rows at once for short rows), blocks of whole query runs
    (block_rows a power of two dividing Tq) of about 8 KB per operand (forward) or 16 KB
    (backward), as many programs per SM as are resident together (rows_mgpu.programs_per_sm).
    8 KB forward blocks (2026-11-28, benchmarks/RESULTS.md): 1.55x -> 1.19x Triton's time at 128
    bf16 keys on an H200, 1.30x -> 1.08x on an H100; at 1024 bf16 keys a tie on the H200 and
    1.12x -> 1.14x on the H100."""
    rows.check_width("Tk", n_keys, "the key length Tk")
    budget = 4096
    if n_keys <= budget:
        group, chunk = min(8, pl.next_power_of_2(budget // n_keys + 1) // 2), n_keys
    else:
        group, chunk = 1, rows.pick_chunk(n_keys, rows.pick_vec(n_keys, itemsize), budget)
    divisor = n_queries & -n_queries  # largest power of two dividing Tq
    block_bytes = 16384 if backward else 8192
    block = pl.next_power_of_2(block_bytes // (n_keys * itemsize) + 1) // 2
    if n_keys <= 1024:  # at least 4 rows: a warp per row (below)
        block = max(block, 4)
    block = max(1, min(divisor, block))
    group = min(group, block)
    # rows of <= 1024 keys: a warp per row, several rows a warp (H100, 2026-11-27, 8 rows:
    # forward 2.75x -> 1.31x Triton's time at 128 bf16 keys, 1.19x -> 1.11x at 1024;
    # benchmarks/RESULTS.md)
    warp_rows = chunk == n_keys <= 1024 and block >= 4
    if warp_rows:
        group = min(8 if backward else 16, block)

    def smem(stages: int) -> int:
        blocks = [stages * block * n_keys * itemsize] * n_operands
        return rows.smem_bytes(blocks, _scratch_bytes(group))

    stages = 2 if smem(2) <= rows.SMEM_BYTES else 1
    if smem(stages) > rows.SMEM_BYTES:
        raise ValueError(f"backend='mosaic_gpu': rows of Tk = {n_keys} do not fit in shared memory")
    return Config(block, group, chunk, rows.programs_per_sm(smem(stages)), stages, warp_rows)


def _scratch_bytes(group: int) -> int:
    """Cross-warp reduction scratch for row groups of `group` rows."""
    return 8 * rows.LANES * group


def check_config(cfg: Config, n_rows: int, n_queries: int, n_keys: int) -> None:
    rows.check_width("Tk", n_keys, "the key length Tk")
    if not (rows.tiling_ok(cfg, n_rows, n_keys) and n_queries % cfg.block_rows == 0):
        raise ValueError(f"invalid Mosaic GPU softmax config {cfg} for Tq={n_queries}, Tk={n_keys}")


def _fwd_kernel(*refs, p: rows.BlockPlan, scale: float, causal: bool, lay: Layout):
    x_g, m_g, y_g, sm = refs if len(refs) == 4 else (refs[0], None, refs[1], refs[2])
    t = p.tiles
    n_keys = p.width
    first, count = rows.my_blocks(p.steps, pl.cdiv(p.n_rows, p.block_rows))

    def compute(blk, slot, carry):
        x_s, y_s = sm["x"].at[slot], sm["y"].at[slot]
        q0 = blk * p.block_rows % lay.n_queries  # a block is a run of queries of one (b, h)

        def group(row0):
            if causal:
                q = q0 + (row0 if t.rows == 1 else t.row_ids(row0))
                last_key = q + (n_keys - lay.n_queries)  # key j allowed iff j <= last_key

            @t.once  # the three sweeps' input
            def logits(ci):
                x = t.load(x_s, row0, ci) * scale
                if m_g is not None:
                    m_s = sm["m"].at[slot]  # per-query rows, or one row for the block
                    x = x + (t.load(m_s, row0, ci) if lay.mask_query else t.col(m_s.at[ci]))
                if causal:
                    x = jnp.where(t.col_ids(ci * t.chunk) <= last_key, x, -jnp.inf)
                return x

            m = t.chunks(lambda ci, m: jnp.maximum(m, t.row_max(logits(ci))), t.row_init(-jnp.inf))
            m_t = t.bcast(safe_max(m))
            total = t.chunks(
                lambda ci, acc: acc + t.row_sum(jnp.exp(logits(ci) - m_t)), t.row_init(0.0)
            )
            inv_t = t.bcast(1.0 / jnp.where(total > 0, total, 1.0))

            def write(ci, carry):
                t.store(y_s, row0, ci, jnp.exp(logits(ci) - m_t) * inv_t)
                return carry

            t.chunks(write, None)

        p.groups(blk, group)
        return carry

    loads = [(p.block_view(x_g), sm["x"])]
    if m_g is not None:
        mask_block = p.block_rows if lay.mask_query else 1

        def mask_view(blk):
            r0 = blk * p.block_rows
            m_row = (r0 % lay.n_queries) if lay.mask_query else 0
            if lay.mask_batch:
                m_row = m_row + r0 // (lay.heads * lay.n_queries) * lay.mask_rows
            n = mask_block * t.n_chunks
            return m_g.at[pl.ds(m_row * t.n_chunks, n)]

        loads.append((mask_view, sm["m"]))
    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=loads,
        stores=[(p.block_view(y_g), sm["y"])],
        barrier=sm["bar"],
        compute=compute,
    )


def forward(x, mask, cfg: Config, scale: float, causal: bool, lay: Layout, interpret: Any = None):
    """probs (R, Tk) of scores x (R, Tk) and mask (Bm * Tqm, Tk) or None.

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    n_rows, n_keys = x.shape
    check_config(cfg, n_rows, lay.n_queries, n_keys)
    p, programs, _ = rows.plan(cfg, n_rows, n_keys, x.dtype.itemsize)
    nc = p.tiles.n_chunks
    sub = (n_rows * nc, cfg.chunk)  # rows as sub-rows of one chunk: a tile is contiguous
    blk = (cfg.stages, cfg.block_rows * nc, cfg.chunk)
    scratch = dict(
        x=plgpu.SMEM(blk, x.dtype),
        y=plgpu.SMEM(blk, x.dtype),
        bar=plgpu.Barrier(num_arrivals=1 if mask is None else 2, num_barriers=cfg.stages),
    )
    args = (x.reshape(sub),)
    if mask is not None:
        mask_rows = cfg.block_rows if lay.mask_query else 1
        scratch["m"] = plgpu.SMEM((cfg.stages, mask_rows * nc, cfg.chunk), mask.dtype)
        args += (mask.reshape(-1, cfg.chunk),)

    def kernel(*refs, **scratch_refs):
        _fwd_kernel(*refs, scratch_refs, p=p, scale=scale, causal=causal, lay=lay)

    out_type = jax.ShapeDtypeStruct(sub, x.dtype)
    y = rows.launch(kernel, "attention_softmax_fwd_mgpu", out_type, scratch, {"p": programs},
                    _scratch_bytes(cfg.rows), interpret, args)  # fmt: skip
    return y.reshape(x.shape)


def _bwd_kernel(y_g, dy_g, dx_g, sm, *, p: rows.BlockPlan, scale: float):
    t = p.tiles
    first, count = rows.my_blocks(p.steps, pl.cdiv(p.n_rows, p.block_rows))

    def compute(blk, slot, carry):
        y_s, dy_s, dx_s = sm["y"].at[slot], sm["dy"].at[slot], sm["dx"].at[slot]

        def group(row0):
            @t.once  # the two sweeps' input
            def y_dy(ci):
                return t.load(y_s, row0, ci), t.load(dy_s, row0, ci)

            def dot(ci, acc):
                y, dy = y_dy(ci)
                return acc + t.row_sum(y * dy)

            dot_t = t.bcast(t.chunks(dot, t.row_init(0.0)))

            def write(ci, carry):
                y, dy = y_dy(ci)
                t.store(dx_s, row0, ci, scale * y * (dy - dot_t))
                return carry

            t.chunks(write, None)

        p.groups(blk, group)
        return carry

    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=[(p.block_view(y_g), sm["y"]), (p.block_view(dy_g), sm["dy"])],
        stores=[(p.block_view(dx_g), sm["dx"])],
        barrier=sm["bar"],
        compute=compute,
    )


def backward(y, dy, cfg: Config, scale: float, n_queries: int, interpret: Any = None):
    """dscores (R, Tk) = scale * y * (dy - sum(y * dy)) of probs y and their gradient dy."""
    n_rows, n_keys = y.shape
    check_config(cfg, n_rows, n_queries, n_keys)
    itemsize = max(y.dtype.itemsize, dy.dtype.itemsize)
    p, programs, _ = rows.plan(cfg, n_rows, n_keys, itemsize)
    nc = p.tiles.n_chunks
    sub = (n_rows * nc, cfg.chunk)
    blk = (cfg.stages, cfg.block_rows * nc, cfg.chunk)
    scratch = dict(
        y=plgpu.SMEM(blk, y.dtype),
        dy=plgpu.SMEM(blk, dy.dtype),
        dx=plgpu.SMEM(blk, y.dtype),
        bar=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
    )

    def kernel(y_g, dy_g, dx_g, **scratch_refs):
        _bwd_kernel(y_g, dy_g, dx_g, scratch_refs, p=p, scale=scale)

    dx = rows.launch(kernel, "attention_softmax_bwd_mgpu", jax.ShapeDtypeStruct(sub, y.dtype),
                     scratch, {"p": programs}, _scratch_bytes(cfg.rows), interpret,
                     (y.reshape(sub), dy.reshape(sub)))  # fmt: skip
    return dx.reshape(y.shape)


def configs(n_queries: int, n_keys: int, dtype, has_mask: bool) -> tuple[Config, Config]:
    """(forward, backward) default configs (the backward has three block operands)."""
    s = jnp.dtype(dtype).itemsize
    fwd = default_config(n_queries, n_keys, s, 2 + (4 // s if has_mask else 0), backward=False)
    return fwd, default_config(n_queries, n_keys, s, 3, backward=True)
