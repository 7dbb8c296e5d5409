"""Depthwise conv1d with in-kernel zero padding on Pallas' Mosaic GPU lowering.

The Mosaic GPU counterpart of depthwise_conv1d_triton.py's kernels, same math; picked with
`backend="mosaic_gpu"` on `depthwise_conv1d`, which keeps the custom VJP.

u (B, L, D), D % 128 == 0, w (D, K), b (D,): out[:, t, d] = b[d] + sum_k w[d, k] u[:, t + k - P, d].
A tile is `block_t` output rows x `block_d` channels of one batch entry; a program walks a run of
`steps` consecutive tiles (the next one's copy in flight while one is computed when steps > 1).
One tensor TMA copy brings the block_t + K - 1 input rows a tile needs into shared memory; rows
outside [0, L) are the copy engine's out-of-bounds zero fill, which is exactly the padding (no
padded copy of u, no masks). It then computes `rows` output rows at a time, each the K shifted
row slabs of the tile times the taps, and one TMA copy writes the tile back (rows past the output
end are clipped).
The taps, rows d of w (D, K), are one contiguous run of w: one bulk copy per program brings them
in and the warpgroup transposes them to (K, block_d) in shared memory: a transpose of w in XLA
was one more kernel per call (benchmarks/RESULTS.md, H200, 2026-11-28).
Grid (B, channel blocks, runs of row tiles), row tiles fastest: neighbours share halo rows in L2.

Backward, the same tiling over input rows s: the tile of g = dout rows s + P - k (k < K) for its
block_t rows s, and the u rows; du[s] = sum_k w[k] g[s + P - k] from the same shifted slabs,
dw[k] += u[s] g[s + P - k] and db += g (each g row counted by exactly one tile) summed over the
program's rows in float32 registers and written once per program as partials (B, runs, K + 1, D)
that one small jnp.sum reduces (deterministic, no atomics).

Memory traffic, s bytes per element (halo rows of K - 1 per tile are mostly L2 hits):
  forward : read u, write out    = (L + Lo) B D s   (+ w, b per program)
  backward: read u, g; write du  = (2 L + Lo) B D s (+ partials 4 (K + 1) D per program)
Refused (ValueError): D % 128 != 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .common import core_count
from .reference import conv1d_padding

MAX_BOX = 256  # a tensor TMA copy moves at most 256 elements along each dimension
SCRATCH_BYTES = 2048  # reductions here are over rows (in registers): the default scratch


class Config(NamedTuple):
    block_t: int  # output rows per tile (a multiple of `rows`; block_t + K - 1 <= 256)
    block_d: int  # channels per tile: 128 or 256, divides D
    rows: int = 8  # output rows computed together in registers
    steps: int = 1  # row tiles a program walks (the next one's copy in flight when > 1)


def default_config(shape: tuple[int, int, int], *, backward: bool = False) -> Config:
    """128-channel tiles. Forward: 16 rows, one tile a program. Backward: 32 rows (fewer when L
    is shorter), each program walking up to 4 tiles (2-buffer ring; dw, db summed across them)
    while that leaves at least half the SMs a program. From sweeps on an H200, 2026-11-28; over
    the CS229S course grid (B = 1, K = 3, L 1024-8192, D 768-8192, f32 and bf16;
    benchmarks/RESULTS.md) these took a median 0.98x Triton's kernel time forward (0.74-1.17x:
    above 1.0 only in calls of 2-6 us) and 0.90x backward (0.64-0.98x)."""
    rows.check_width("D", shape[2], "the channel count D")
    if not backward:
        return Config(16, 128)
    block_t = min(32, -(-shape[1] // 8) * 8)  # no taller than L needs (8-row groups)
    tiles = shape[0] * shape[2] // 128 * pl.cdiv(shape[1], block_t)
    steps = next(s for s in (4, 2, 1) if s == 1 or tiles // s >= core_count() // 2)
    return Config(block_t, 128, steps=steps)


def check_config(cfg: Config, n_channels: int, k_size: int) -> None:
    rows.check_width("D", n_channels, "the channel count D")
    ok = (
        cfg.block_d in (128, 256)
        and n_channels % cfg.block_d == 0
        and cfg.rows >= 1
        and cfg.block_t % cfg.rows == 0
        and cfg.block_t + k_size - 1 <= MAX_BOX
        and cfg.steps >= 1
    )
    if not ok:
        raise ValueError(f"invalid Mosaic GPU conv1d config {cfg} for D={n_channels}, K={k_size}")


def _taps_transpose(sm) -> None:
    """sm["w"] (K, block_d) of this channel block's rows of w, sm["wdk"] (block_d * K,) flat."""
    k_size, block_d = sm["w"].shape
    lay = plgpu.Layout.WG_STRIDED((block_d,), 1)  # one value a lane: the loads are strided
    for k in range(k_size):
        sm["w"].at[k][...] = rows.load_column(sm["wdk"], k_size, k, lay)
    plgpu.commit_smem()  # a warpgroup barrier: every lane's writes visible to the others


def _params_in(w_g, b_g, sm, dblk) -> None:
    """Start the copies of this channel block's taps (block_d rows of w (D * K,) flat: one
    contiguous run) and bias, on sm["pbar"]."""
    k_size, block_d = sm["w"].shape
    n = block_d * k_size
    rows.copy_in(w_g.at[pl.ds(dblk * n, n)], sm["wdk"], sm["pbar"])
    if b_g is not None:
        rows.copy_in(b_g.at[pl.ds(dblk * block_d, block_d)], sm["b"], sm["pbar"])


def _walk(cfg: Config, sm, n_tiles: int, loads, stores, compute, init=None):
    """compute(tile, slot, carry) over this program's run of `steps` row tiles (grid axis "p"),
    the next tile's loads in flight while one is computed (a 2-buffer ring when steps > 1); the
    parameters (`_params_in`) are waited for and the taps transposed before the first tile."""
    first, count = rows.my_blocks(cfg.steps, n_tiles)

    def step(tile, slot, carry):
        @pl.when(tile == first)
        def _():
            plgpu.barrier_wait(sm["pbar"])
            _taps_transpose(sm)

        return compute(tile, slot, carry)

    return rows.pipelined_blocks(
        first=first, count=count, stages=min(cfg.steps, 2), loads=loads, stores=stores,
        barrier=sm["bar"], compute=step, init=init, copy=plgpu.copy_gmem_to_smem,
    )  # fmt: skip


def _fwd_kernel(u_g, w_g, b_g, o_g, sm, *, cfg: Config, pad: int, tiles: rows.Tiles, n_tiles):
    batch, dblk = jax.lax.axis_index("b"), jax.lax.axis_index("d")
    d = pl.ds(dblk * cfg.block_d, cfg.block_d)
    k_size = sm["w"].shape[0]
    halo = cfg.block_t + k_size - 1
    _params_in(w_g, b_g, sm, dblk)

    def compute(tile, slot, carry):
        u_s, o_s = sm["u"].at[slot], sm["o"].at[slot]
        bias = tiles.col(sm["b"])
        taps = [tiles.col(sm["w"].at[k]) for k in range(k_size)]

        def group(j, carry):
            r0 = j * cfg.rows
            acc = bias
            for k in range(k_size):  # out row r0 + i reads tile row r0 + i + k
                acc = acc + taps[k] * tiles.load(u_s, r0 + k, 0)
            tiles.store(o_s, r0, 0, acc)
            return carry

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(cfg.block_t // cfg.rows), group, carry)

    # tile t: rows t * block_t - pad ... + halo - 1 of u; those outside [0, L) arrive as zeros
    _walk(
        cfg, sm, n_tiles,
        loads=[(lambda t: u_g.at[batch, pl.ds(t * cfg.block_t - pad, halo), d], sm["u"])],
        stores=[(lambda t: o_g.at[batch, pl.ds(t * cfg.block_t, cfg.block_t), d], sm["o"])],
        compute=compute,
    )  # fmt: skip


def forward(u, w, b, mode: str, cfg: Config, interpret: Any = None) -> jax.Array:
    """out (B, Lo, D) in u's dtype; Lo = L for 'same' / 'causal', L + K - 1 for 'full'.

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    n_batch, n_len, n_channels = u.shape
    k_size = w.shape[1]
    check_config(cfg, n_channels, k_size)
    left, right = conv1d_padding(k_size, mode)
    out_len = n_len + left + right - k_size + 1
    itemsize = max(u.dtype.itemsize, w.dtype.itemsize, b.dtype.itemsize)
    tiles = rows.Tiles(cfg.rows, cfg.block_d, 1, rows.pick_vec(cfg.block_d, itemsize))
    stages = min(cfg.steps, 2)
    scratch = dict(
        u=plgpu.SMEM((stages, cfg.block_t + k_size - 1, cfg.block_d), u.dtype),
        o=plgpu.SMEM((stages, cfg.block_t, cfg.block_d), u.dtype),
        wdk=plgpu.SMEM((cfg.block_d * k_size,), w.dtype),
        w=plgpu.SMEM((k_size, cfg.block_d), w.dtype),
        b=plgpu.SMEM((cfg.block_d,), b.dtype),
        bar=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        pbar=plgpu.Barrier(num_arrivals=2),
    )
    n_tiles = pl.cdiv(out_len, cfg.block_t)

    def kernel(u_g, w_g, b_g, o_g, **sm):
        _fwd_kernel(u_g, w_g, b_g, o_g, sm, cfg=cfg, pad=left, tiles=tiles, n_tiles=n_tiles)

    out_type = jax.ShapeDtypeStruct((n_batch, out_len, n_channels), u.dtype)
    grid = {"b": n_batch, "d": n_channels // cfg.block_d, "p": pl.cdiv(n_tiles, cfg.steps)}
    return rows.launch(kernel, "depthwise_conv1d_fwd_mgpu", out_type, scratch, grid,
                       SCRATCH_BYTES, interpret, (u, w.reshape(-1), b))  # fmt: skip


def _bwd_kernel(u_g, g_g, w_g, du_g, part_g, sm, *, cfg: Config, pad: int, tiles: rows.Tiles,
                n_tiles: int):  # fmt: skip
    batch, dblk = jax.lax.axis_index("b"), jax.lax.axis_index("d")
    d = pl.ds(dblk * cfg.block_d, cfg.block_d)
    k_size = sm["w"].shape[0]
    halo = cfg.block_t + k_size - 1
    _params_in(w_g, None, sm, dblk)

    def compute(tile, slot, sums):
        u_s, g_s, du_s = sm["u"].at[slot], sm["g"].at[slot], sm["du"].at[slot]
        taps = [tiles.col(sm["w"].at[k]) for k in range(k_size)]

        def group(j, sums):
            r0 = j * cfg.rows
            u = tiles.load(u_s, r0, 0)
            du, dw = None, list(sums[:-1])
            for k in range(k_size):
                g = tiles.load(g_s, r0 + k_size - 1 - k, 0)  # g rows s + pad - k
                du = g * taps[k] if du is None else du + g * taps[k]
                dw[k] = dw[k] + tiles.col_sum(u * g)
            tiles.store(du_s, r0, 0, du)
            db = sums[-1] + tiles.col_sum(tiles.load(g_s, r0, 0))  # g rows this tile counts
            return (*dw, db)

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(cfg.block_t // cfg.rows), group, sums)

    # tile t's g row m is g row t * block_t + pad - (K - 1) + m: rows s + pad - k of its rows s
    shift = pad - (k_size - 1)
    sums = _walk(
        cfg, sm, n_tiles,
        loads=[
            (lambda t: g_g.at[batch, pl.ds(t * cfg.block_t + shift, halo), d], sm["g"]),
            (lambda t: u_g.at[batch, pl.ds(t * cfg.block_t, cfg.block_t), d], sm["u"]),
        ],
        stores=[(lambda t: du_g.at[batch, pl.ds(t * cfg.block_t, cfg.block_t), d], sm["du"])],
        compute=compute,
        init=tuple(tiles.col_zeros() for _ in range(k_size + 1)),
    )  # fmt: skip
    for k, total in enumerate(sums):
        sm["part"][k] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sm["part"], part_g.at[batch, jax.lax.axis_index("p"), :, d])
    plgpu.wait_smem_to_gmem(0)


def backward(u, w, g, mode: str, cfg: Config, interpret: Any = None):
    """(du, dw, db) of out's gradient g (B, Lo, D): du (B, L, D) in u's dtype, dw (D, K) and
    db (D,) float32."""
    n_batch, n_len, n_channels = u.shape
    k_size = w.shape[1]
    check_config(cfg, n_channels, k_size)
    left, _ = conv1d_padding(k_size, mode)
    # tiles over input rows; enough of them that every g row is counted into db by one tile
    n_tiles = pl.cdiv(max(n_len, g.shape[1] + k_size - 1 - left), cfg.block_t)
    itemsize = max(u.dtype.itemsize, w.dtype.itemsize, g.dtype.itemsize)
    tiles = rows.Tiles(cfg.rows, cfg.block_d, 1, rows.pick_vec(cfg.block_d, itemsize))
    stages = min(cfg.steps, 2)
    scratch = dict(
        u=plgpu.SMEM((stages, cfg.block_t, cfg.block_d), u.dtype),
        g=plgpu.SMEM((stages, cfg.block_t + k_size - 1, cfg.block_d), g.dtype),
        du=plgpu.SMEM((stages, cfg.block_t, cfg.block_d), u.dtype),
        wdk=plgpu.SMEM((cfg.block_d * k_size,), w.dtype),
        w=plgpu.SMEM((k_size, cfg.block_d), w.dtype),
        part=plgpu.SMEM((k_size + 1, cfg.block_d), jnp.float32),
        bar=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        pbar=plgpu.Barrier(num_arrivals=1),
    )

    def kernel(u_g, g_g, w_g, du_g, part_g, **sm):
        _bwd_kernel(u_g, g_g, w_g, du_g, part_g, sm, cfg=cfg, pad=left, tiles=tiles,
                    n_tiles=n_tiles)  # fmt: skip

    programs = pl.cdiv(n_tiles, cfg.steps)  # along the rows: each sums its tiles' dw, db
    out_type = (
        jax.ShapeDtypeStruct(u.shape, u.dtype),
        jax.ShapeDtypeStruct((n_batch, programs, k_size + 1, n_channels), jnp.float32),
    )
    grid = {"b": n_batch, "d": n_channels // cfg.block_d, "p": programs}
    du, part = rows.launch(kernel, "depthwise_conv1d_bwd_mgpu", out_type, scratch, grid,
                           SCRATCH_BYTES, interpret, (u, g, w.reshape(-1)))  # fmt: skip
    sums = jnp.sum(part, axis=(0, 1))  # (K + 1, D)
    return du, sums[:k_size].T, sums[k_size]
