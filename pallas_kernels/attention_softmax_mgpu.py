"""Fused attention softmax (scale, additive mask, causal mask) on Pallas' Mosaic GPU lowering.

The Mosaic GPU counterpart of attention_softmax_triton.py's kernels, same math; picked with
`backend="mosaic_gpu"` on `attention_softmax`, which keeps the custom VJP.

Scores (B, H, Tq, Tk) are B*H*Tq rows of Tk, Tk % 128 == 0, in blocks of `block_rows` rows
(block_rows divides Tq, so a block is one (b, h) slice of consecutive queries: its additive mask
rows are one row (mask without a query axis) or block_rows consecutive rows; the causal mask
comes from the row and column indices). A block is computed `rows` rows at a time in column
chunks: the row max, the sum of exponentials, then the normalised output (the backward: the row
sum of y * dy, then dx), each a sweep over the row (a tile of whole rows read once and held in
registers: rows_mgpu.Tiles.once). Two ways to move a block (Config.direct):
- direct (rows of up to DIRECT_KEYS keys): one block a program, a warp per row, read from global
  memory into registers and written back from them (rows_mgpu.direct_blocks);
- otherwise as layer_norm_mgpu: each program walks a contiguous run of blocks, one bulk TMA copy
  per block and operand into shared memory, double buffered (rows_mgpu.pipelined_blocks).

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
    direct: bool = False  # rows_mgpu.direct_blocks: no shared memory (stages unused)


# Rows of up to this many keys go `direct` (a warp per row, global memory <-> registers), the
# whole Triton-timed range: on an H200 (2026-11-28, benchmarks/RESULTS.md) the TMA blocks took
# 1.01-1.27x Triton's time forward and 0.99-1.13x backward at 128-2048 keys.
DIRECT_KEYS = 2048


def default_config(
    n_queries: int, n_keys: int, itemsize: int, n_operands: int, *, backward: bool
) -> Config:
    """Block sizes for rows of Tk keys. Up to DIRECT_KEYS keys (and Tq a multiple of 4): each
    program reads one group of 4-16 whole rows (32 values a thread from 256 keys up to 1024), a
    warp per row, straight from global memory into registers and back (`direct`), as many
    programs as groups. Otherwise TMA blocks of `n_operands` buffers per stage: whole rows in
    registers up to 4096 keys, blocks of whole query runs (block_rows a power of two dividing Tq)
    of about 8 KB per operand (forward) or 16 KB (backward), as many programs per SM as are
    resident together (rows_mgpu.programs_per_sm)."""
    rows.check_width("Tk", n_keys, "the key length Tk")
    divisor = n_queries & -n_queries  # largest power of two dividing Tq
    if n_keys <= DIRECT_KEYS and divisor >= 4:
        group = min(divisor, 16, max(4, 4096 // n_keys))
        return Config(group, group, n_keys, rows.ONE_BLOCK_EACH, 1, warp_rows=True, direct=True)
    budget = 4096
    if n_keys <= budget:
        group, chunk = min(8, pl.next_power_of_2(budget // n_keys + 1) // 2), n_keys
    else:
        group, chunk = 1, rows.pick_chunk(n_keys, rows.pick_vec(n_keys, itemsize), budget)
    block_bytes = 16384 if backward else 8192
    block = pl.next_power_of_2(block_bytes // (n_keys * itemsize) + 1) // 2
    block = max(1, min(divisor, block))
    group = min(group, block)

    def smem(stages: int) -> int:
        blocks = [stages * block * n_keys * itemsize] * n_operands
        return rows.smem_bytes(blocks, _scratch_bytes(group, False))

    stages = 2 if smem(2) <= rows.SMEM_BYTES else 1
    if smem(stages) > rows.SMEM_BYTES:
        raise ValueError(f"backend='mosaic_gpu': rows of Tk = {n_keys} do not fit in shared memory")
    return Config(block, group, chunk, rows.programs_per_sm(smem(stages)), stages)


def _scratch_bytes(group: int, warp_rows: bool) -> int:
    """Cross-warp reduction scratch for row groups of `group` rows (none with a warp per row)."""
    return 0 if warp_rows else 8 * rows.LANES * group


def check_config(cfg: Config, n_rows: int, n_queries: int, n_keys: int) -> None:
    rows.check_width("Tk", n_keys, "the key length Tk")
    if not (rows.tiling_ok(cfg, n_rows, n_keys) and n_queries % cfg.block_rows == 0):
        raise ValueError(f"invalid Mosaic GPU softmax config {cfg} for Tq={n_queries}, Tk={n_keys}")


def _fwd_kernel(*refs, p: rows.BlockPlan, scale: float, causal: bool, lay: Layout, direct: bool):
    x_g, m_g, y_g, sm = refs if len(refs) == 4 else (refs[0], None, refs[1], refs[2])
    t = p.tiles
    n_keys = p.width
    first, count = rows.my_blocks(p.steps, pl.cdiv(p.n_rows, p.block_rows))

    def compute(blk, x_s, m_s, y_s):  # one block's (rows * n_chunks, chunk) refs
        q0 = blk * p.block_rows % lay.n_queries  # a block is a run of queries of one (b, h)

        def group(row0):
            if causal:
                q = q0 + (row0 if t.rows == 1 else t.row_ids(row0))
                last_key = q + (n_keys - lay.n_queries)  # key j allowed iff j <= last_key

            @t.once  # the three sweeps' input
            def logits(ci):
                x = t.load(x_s, row0, ci) * scale
                if m_s is not None:  # per-query rows, or one row for the block
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

    x_view, y_view, m_view = p.block_view(x_g), p.block_view(y_g), None
    if m_g is not None:
        mask_block = p.block_rows if lay.mask_query else 1

        def m_view(blk):
            r0 = blk * p.block_rows
            m_row = (r0 % lay.n_queries) if lay.mask_query else 0
            if lay.mask_batch:
                m_row = m_row + r0 // (lay.heads * lay.n_queries) * lay.mask_rows
            n = mask_block * t.n_chunks
            return m_g.at[pl.ds(m_row * t.n_chunks, n)]

    if direct:
        rows.direct_blocks(
            first, count, lambda b: compute(b, x_view(b), m_view(b) if m_view else None, y_view(b))
        )
        return

    def staged(blk, slot, carry):
        compute(blk, sm["x"].at[slot], sm["m"].at[slot] if m_view else None, sm["y"].at[slot])

    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=[(x_view, sm["x"])] + ([(m_view, sm["m"])] if m_view else []),
        stores=[(y_view, sm["y"])],
        barrier=sm["bar"],
        compute=staged,
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
        _fwd_kernel(*refs, scratch_refs, p=p, scale=scale, causal=causal, lay=lay,
                    direct=cfg.direct)  # fmt: skip

    out_type = jax.ShapeDtypeStruct(sub, x.dtype)
    scratch = {} if cfg.direct else scratch
    y = rows.launch(kernel, "attention_softmax_fwd_mgpu", out_type, scratch, {"p": programs},
                    _scratch_bytes(cfg.rows, cfg.warp_rows), interpret, args)  # fmt: skip
    return y.reshape(x.shape)


def _bwd_kernel(y_g, dy_g, dx_g, sm, *, p: rows.BlockPlan, scale: float, direct: bool):
    t = p.tiles
    first, count = rows.my_blocks(p.steps, pl.cdiv(p.n_rows, p.block_rows))

    def compute(y_s, dy_s, dx_s):  # one block's (rows * n_chunks, chunk) refs

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

        return group

    views = [p.block_view(g) for g in (y_g, dy_g, dx_g)]
    if direct:
        rows.direct_blocks(first, count, lambda b: p.groups(b, compute(*(v(b) for v in views))))
        return

    def staged(blk, slot, carry):
        p.groups(blk, compute(*(sm[k].at[slot] for k in ("y", "dy", "dx"))))

    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=[(views[0], sm["y"]), (views[1], sm["dy"])],
        stores=[(views[2], sm["dx"])],
        barrier=sm["bar"],
        compute=staged,
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
        _bwd_kernel(y_g, dy_g, dx_g, scratch_refs, p=p, scale=scale, direct=cfg.direct)

    dx = rows.launch(kernel, "attention_softmax_bwd_mgpu", jax.ShapeDtypeStruct(sub, y.dtype),
                     {} if cfg.direct else scratch, {"p": programs},
                     _scratch_bytes(cfg.rows, cfg.warp_rows), interpret,
                     (y.reshape(sub), dy.reshape(sub)))  # fmt: skip
    return dx.reshape(y.shape)


def configs(n_queries: int, n_keys: int, dtype, has_mask: bool) -> tuple[Config, Config]:
    """(forward, backward) default configs (the backward has three block operands)."""
    s = jnp.dtype(dtype).itemsize
    fwd = default_config(n_queries, n_keys, s, 2 + (4 // s if has_mask else 0), backward=False)
    return fwd, default_config(n_queries, n_keys, s, 3, backward=True)
