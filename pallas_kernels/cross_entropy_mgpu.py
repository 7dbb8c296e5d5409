"""The fused cross-entropy kernel (loss, hit and dz of each row of logits) on Pallas' Mosaic GPU
lowering, reading each row once.

The Triton kernel (cross_entropy_triton.py) sweeps each row of z twice from global memory,
statistics then dz, and the second sweep misses L2 at GPT-2's sizes. Here a row lives in shared
memory between its sweeps: each program (one warpgroup, persistent over a contiguous run
of rows) copies a row in with one bulk TMA copy, computes the max, then the sum of exponentials
(per-lane running vectors, reduced across the warpgroup once per row), reads the target's logit
as one scalar, then writes dz = w softmax over the row in shared memory, stores the one-hot term
at the target as one scalar, and copies the row back with one bulk copy. Only the chunks that
hold a column past the vocabulary mask (the last one at GPT-2's sizes): no per-element compare for
the target, and none for the padding elsewhere, took the kernel from 4.62 to 3.93 ms at
65536 x 51200 (H200, 2026-11-29, benchmarks/RESULTS.md).
By default two programs share an SM with one row buffer each, so one computes while the other's
copies run (`stages=2` double-buffers within one program instead: slower, see default_config).
Exponentials and the log use the GPU's approximate instructions.

z (N, Vp) with Vp % 8 == 0 (16-byte rows; cross_entropy pads the head to a multiple of 128
for the GEMMs). A row's buffer in shared memory holds whole chunks of a
multiple of 1024 columns (LANE_CHUNK: 8 bf16, 16 bytes, on each of the warpgroup's 128 lanes);
the bulk copies move the Vp columns, and the chunks that hold a column >= the vocabulary mask
both the vocabulary's padding and the buffer's tail. Two rows of shared memory per SM bound the
row: Vp up to MAX_COLS_TWO_PER_SM bf16 columns (one row per SM: MAX_COLS). dz is a new array
(`plgpu.kernel` takes no input/output aliasing): the forward holds z and dz of a chunk of rows
together (cross_entropy.linear_cross_entropy's chunks bound both), where the Triton kernel writes
dz over z. The per-row targets and weights are
padded to whole runs of rows (ce and hit come back that long, then sliced), so no copy runs past
an array: a bulk copy moves multiples of 16 bytes, which a clamped run of 4-byte values is not.
Padding columns are masked with MASK_VALUE (finite, as in the Triton kernel): a row whose target
lies in the padding has a huge but finite ce, so its weight 0 gives 0, not 0 * inf = NaN.

Minimal memory traffic, N rows of Vp columns, s bytes per element of z:
  read z, write dz = 2 * N * Vp * s   (+ 4 N targets, weights, 8 N ce and hit)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .common import MASK_VALUE, core_count

LANE_CHUNK = 1024  # columns of one register chunk unit: 128 lanes x 8 bf16 (16-byte accesses)
ROW_ALIGN = 32  # rows per program's run: its targets/weights/ce copies move multiples of 128 B
MAX_RUN = 256  # rows per program at most: its 4 vectors of per-row values take <= 4 KB
SCRATCH_BYTES = 2048  # the compiler's scratch for cross-lane reductions, per program


class Config(NamedTuple):
    chunk: int  # columns per register chunk: a multiple of LANE_CHUNK
    programs_per_sm: int = 2  # CUDA blocks resident per SM (default_config: why 2)
    stages: int = 1  # row buffers per program: 2 copies row k + 1 in while row k is computed


def _buffer_cols(cfg: Config, n_cols: int) -> int:
    """Columns of a row's buffer in shared memory: whole chunks."""
    return -(-n_cols // cfg.chunk) * cfg.chunk


def _smem_bytes(cfg: Config, n_cols: int) -> int:
    """Shared memory one program takes: its row buffers, its 4 KB of per-row vectors, the
    reduction scratch and the 1 KB the driver reserves per block."""
    row = _buffer_cols(cfg, n_cols) * 2
    return cfg.stages * row + 4 * 1024 + SCRATCH_BYTES + rows.BLOCK_RESERVED_BYTES


def _fit(cfg: Config, n_cols: int) -> bool:
    """One program within a block's limit, and programs_per_sm of them within the SM's."""
    each = _smem_bytes(cfg, n_cols)
    return each <= rows.SMEM_BYTES and cfg.programs_per_sm * each <= rows.SM_SMEM_BYTES


def _max_cols(cfg: Config) -> int:
    """The widest row `cfg`'s programs fit."""
    n = 0
    while _fit(cfg, n + LANE_CHUNK):
        n += LANE_CHUNK
    return n


MAX_COLS_TWO_PER_SM = _max_cols(Config(LANE_CHUNK, 2, 1))  # 54272 on an H100
MAX_COLS = _max_cols(Config(LANE_CHUNK, 1, 1))  # 112640


def default_config(n_cols: int) -> Config:
    """Two programs per SM with one row buffer each where two rows fit (GPT-2's head padded to
    51200: 5.02 ms at 65536 rows on the H100, against 6.06 ms for one double-buffered program
    per SM: a single warpgroup cannot hide its own latencies), else one program per SM. Chunks of
    2048 columns where they pad the row's buffer no further than chunks of 1024."""
    chunk = 2 * LANE_CHUNK
    if _buffer_cols(Config(chunk), n_cols) > _buffer_cols(Config(LANE_CHUNK), n_cols):
        chunk = LANE_CHUNK
    two = Config(chunk, programs_per_sm=2, stages=1)
    return two if _fit(two, n_cols) else Config(chunk, programs_per_sm=1, stages=1)


def fits(n_cols: int) -> bool:
    """Whether rows of `n_cols` (padded) logits fit two programs per SM, the measured
    configuration (one program alone per SM leaves its copies unhidden): up to
    MAX_COLS_TWO_PER_SM."""
    return default_config(n_cols).programs_per_sm == 2


def _check(z: jax.Array, cfg: Config) -> None:
    n_cols = z.shape[1]
    if z.dtype != jnp.bfloat16:
        raise ValueError(f"backend='mosaic_gpu' cross-entropy takes bfloat16 logits, got {z.dtype}")
    if n_cols % 8 or cfg.chunk < LANE_CHUNK or cfg.chunk % LANE_CHUNK:
        raise ValueError(
            f"backend='mosaic_gpu' needs the padded vocabulary ({n_cols}) to be a multiple of 8 "
            f"(16-byte rows) and the chunk ({cfg.chunk}) a multiple of {LANE_CHUNK}"
        )
    if cfg.stages not in (1, 2) or cfg.programs_per_sm < 1:
        raise ValueError(
            f"Mosaic GPU cross-entropy config {cfg}: stages must be 1 or 2 and programs_per_sm >= 1"
        )
    if not _fit(cfg, n_cols):
        raise ValueError(
            f"backend='mosaic_gpu': rows of {n_cols} bfloat16 logits, "
            f"{cfg.programs_per_sm * cfg.stages} per SM, do not fit in shared memory (padded "
            f"rows up to {MAX_COLS_TWO_PER_SM} columns fit 2 per SM, up to {MAX_COLS} 1 per SM); "
            "use backend='triton' or fewer rows per SM"
        )


def _kernel(z_g, t_g, w_g, ce_g, hit_g, dz_g, sm, *, vocab: int, n_rows: int, tiles: rows.Tiles,
            steps: int, stages: int):  # fmt: skip
    n_cols = z_g.shape[1]
    chunk = tiles.chunk
    clean = vocab // chunk  # chunks 0 .. clean - 1 hold no padding column
    first, count = rows.my_blocks(steps, n_rows)  # this program's run of rows
    # this program's targets and weights (padded to whole runs: the copy stays in bounds)
    rows.copy_in(t_g.at[pl.ds(first, steps)], sm["t"], sm["params_bar"])
    rows.copy_in(w_g.at[pl.ds(first, steps)], sm["w"], sm["params_bar"])

    def row_buf(slot):  # the part of a row buffer the copies move (its tail stays stale)
        return sm["z"].at[slot, pl.ds(0, n_cols)]

    def fetch(k, slot):
        rows.copy_in(z_g.at[first + k], row_buf(slot), sm["bar"].at[slot])

    fetch(jnp.int32(0), jnp.int32(0))
    plgpu.barrier_wait(sm["params_bar"])

    def step(k, carry):
        slot = jax.lax.rem(k, stages)
        if stages == 2:

            @pl.when(k + 1 < count)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # row k - 1 has left that buffer
                fetch(k + 1, 1 - slot)

        plgpu.barrier_wait(sm["bar"].at[slot])
        z_s = sm["z"].at[slot]
        target, weight = sm["t"][k], sm["w"][k]

        def chunk_ref(ci):
            return z_s.at[pl.ds(ci * chunk, chunk)]

        def sweep(body, init):
            """body(ci, acc, z) over the row's chunks, z a chunk of logits as float32; only the
            chunks that hold a column >= vocab (padding, the buffer's stale tail) mask them."""

            def at(masked):
                def step(ci, acc):
                    z = rows.load(chunk_ref(ci), tiles.layout).astype(jnp.float32)
                    if masked:
                        z = jnp.where(tiles.col_ids(ci * chunk) < vocab, z, MASK_VALUE)
                    return body(ci, acc, z)

                return step

            return tiles.chunks(at(True), tiles.chunks(at(False), init, 0, clean), clean)

        neg_inf = tiles.col_zeros() - jnp.inf
        m = jnp.max(sweep(lambda ci, acc, z: jnp.maximum(acc, z), neg_inf))
        v_sum = sweep(lambda ci, acc, z: acc + jnp.exp(z - m), tiles.col_zeros())
        lse = m + jnp.log(jnp.sum(v_sum))
        # The target's logit, one scalar read by every thread (a padding column counts as
        # masked, a target off the row as 0, as a one-hot sum over the row would give). The
        # barrier Pallas puts before the store of ce orders every read before the dz sweep
        # overwrites the row.
        on_row = (target >= 0) & (target < n_cols)
        t_clip = jnp.clip(target, 0, n_cols - 1)
        z_t = jnp.where(target < vocab, z_s[t_clip].astype(jnp.float32), MASK_VALUE)
        z_t = jnp.where(on_row, z_t, 0.0)
        sm["ce"][k] = lse - z_t
        sm["hit"][k] = (z_t >= m).astype(jnp.int32)

        def write(ci, c, z):
            chunk_ref(ci)[...] = (jnp.exp(z - lse) * weight).astype(z_s.dtype)
            return c

        sweep(write, None)

        @pl.when(on_row)
        def _():  # dz's one-hot term: every thread stores the same value, after a barrier
            # (Pallas puts one around each store to shared memory) that follows the row's stores
            z_s[t_clip] = ((jnp.exp(z_t - lse) - 1.0) * weight).astype(z_s.dtype)

        plgpu.commit_smem()  # the register writes visible to the copy engine
        plgpu.copy_smem_to_gmem(row_buf(slot), dz_g.at[first + k], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        if stages == 1:  # one buffer: the next row comes in once this one has gone out

            @pl.when(k + 1 < count)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                fetch(k + 1, jnp.int32(0))

        return carry

    jax.lax.fori_loop(jnp.int32(0), count, step, None)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sm["ce"], ce_g.at[pl.ds(first, steps)], commit_group=False)
    plgpu.copy_smem_to_gmem(sm["hit"], hit_g.at[pl.ds(first, steps)], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def cross_entropy_from_logits(
    z: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    vocab: int,
    cfg: Config | None = None,
    interpret: Any = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ce (N,) f32, hit (N,) int32, dz like z) of padded bf16 logits z (N, Vp), as the Triton
    kernel with its gradient. `interpret`: jax's Mosaic GPU interpreter parameters (CPU tests)."""
    cfg = cfg or default_config(z.shape[1])
    _check(z, cfg)
    n_rows, n_cols = z.shape
    n_chunks = -(-n_cols // cfg.chunk)
    tiles = rows.Tiles(1, cfg.chunk, n_chunks, rows.pick_vec(cfg.chunk, 2))
    programs = max(1, cfg.programs_per_sm * core_count())
    # runs of whole 32-row multiples, at most MAX_RUN (more rows: more programs than SMs hold)
    steps = min(MAX_RUN, -(-pl.cdiv(n_rows, programs) // ROW_ALIGN) * ROW_ALIGN)
    programs = pl.cdiv(n_rows, steps)
    padded = programs * steps  # per-row arrays in whole runs
    scratch = dict(
        z=plgpu.SMEM((cfg.stages, n_chunks * cfg.chunk), z.dtype),
        t=plgpu.SMEM((steps,), jnp.int32),
        w=plgpu.SMEM((steps,), jnp.float32),
        ce=plgpu.SMEM((steps,), jnp.float32),
        hit=plgpu.SMEM((steps,), jnp.int32),
        bar=plgpu.Barrier(num_arrivals=1, num_barriers=cfg.stages),
        params_bar=plgpu.Barrier(num_arrivals=2),
    )
    out_type = (
        jax.ShapeDtypeStruct((padded,), jnp.float32),
        jax.ShapeDtypeStruct((padded,), jnp.int32),
        jax.ShapeDtypeStruct(z.shape, z.dtype),
    )

    def kernel(z_g, t_g, w_g, ce_g, hit_g, dz_g, **sm):
        _kernel(z_g, t_g, w_g, ce_g, hit_g, dz_g, sm, vocab=vocab, n_rows=n_rows, tiles=tiles,
                steps=steps, stages=cfg.stages)  # fmt: skip

    pad = (0, padded - n_rows)
    args = (z, jnp.pad(targets.astype(jnp.int32), pad), jnp.pad(weights.astype(jnp.float32), pad))
    ce, hit, dz = rows.launch(kernel, "cross_entropy_fwd_bwd_mgpu", out_type, scratch,
                              {"p": programs}, SCRATCH_BYTES, interpret, args,
                              approx_math=True)  # fmt: skip
    return ce[:n_rows], hit[:n_rows], dz
