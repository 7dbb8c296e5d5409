"""Depthwise conv1d over time with in-kernel zero padding on Pallas' Triton lowering:
depthwise_conv1d's default forward and backward kernels.

u (B, L, D), w (D, K), b (D,): out[:, t, d] = b[d] + sum_k w[d, k] * u[:, t + k - P, d], reads
outside [0, L) being zeros (masked loads: no padded copy is made).

Work layout (both kernels). A program owns `block_d` channels, i.e. one contiguous segment of
every row, and a strip of consecutive rows that it walks `block_t` rows per loop step. A step
loads the next `block_t` rows once, each a coalesced (block_d,) vector, and keeps the newest
K - 1 of them in registers for the next step, so within a strip every input row is read exactly
once; a strip re-reads only K - 1 halo rows at its start, (K - 1) / strip of the input (an L2 hit
when the neighbouring strip ran at the same time). The strip length follows from the target grid
size (`Config.fwd_programs` / `bwd_programs`): long strips for large inputs, short ones (more
programs) for small. Tilings: the measured table tuning/depthwise_conv1d_<gpu>.json, else a
heuristic (`default_config`).

Forward: out[t] = b + sum_k w[k] u[t + k - P] over the sliding window of K input rows.
Backward, one kernel walking the input rows s: du[s] = sum_k w[k] g[s + P - k] (the same sliding
window over g = dout, taps reversed), dw[k] += u[s] g[s + P - k] and db += g rows, the last two in
float32 registers, written once per program as partial sums that one small jnp.sum reduces
(deterministic, no atomics).

Memory traffic, s bytes per element (the minimum: each input read once, each output written once):
  forward : read u, write out    = (L + Lo) B D s   (+ w, b; halo K - 1 rows per strip)
  backward: read u, g; write du  = (2 L + Lo) B D s (+ w; partials (K + 1) D 4 bytes per strip)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import compiler_params, core_count, i32, pltriton, tuning_table
from .reference import conv1d_padding


class Config(NamedTuple):
    """Tiling of both kernels (module docstring)."""

    block_t: int  # rows per loop step, unrolled: that many row loads in flight per step
    block_d: int  # channels per program, a power of two
    num_warps: int
    bwd_programs: int  # target number of backward programs: sets the strip length
    num_stages: int = 1  # Triton software pipelining of the strip loop
    fwd_programs: int | None = None  # target number of forward programs; None: bwd_programs


def default_config(shape: tuple[int, ...], dtype, *, backward: bool = False) -> Config:
    """Tiling for u of `shape` (B, L, D) and `dtype`: the measured entry of
    tuning/depthwise_conv1d_<gpu>.json for D and B * L (the strip length follows from B * L;
    rounded to the nearest power of two), else a heuristic:
    16-byte loads per thread, block_d a divisor of D where one exists (768 -> 256), four rows per
    step, eight (forward) or four (backward) programs per SM. benchmarks/conv1d_course.py sweeps
    tilings around it."""
    n_channels, n_rows = shape[-1], max(1, math.prod(shape[:-1]))
    direction = "bwd" if backward else "fwd"
    rows = 1 << round(math.log2(n_rows))
    key = (direction, jnp.dtype(dtype).name, rows, n_channels)
    tuned = tuning_table("depthwise_conv1d").get(key)
    if tuned is not None:
        block_t, block_d, num_warps, per_sm, stages = tuned
        programs = per_sm * core_count()
        return Config(block_t, block_d, num_warps, programs, stages, programs)
    vec = 16 // jnp.dtype(dtype).itemsize  # elements per 16-byte load
    cap = 4 * 32 * vec  # four warps of 16-byte loads
    divisor = n_channels & -n_channels  # largest power of two dividing D
    block_d = min(cap, divisor if divisor >= 64 else pl.next_power_of_2(n_channels))
    num_warps = max(1, min(8, block_d // (32 * vec)))
    programs = (4 if backward else 8) * core_count()
    return Config(4, block_d, num_warps, programs, 1, programs)


def _row(ref, batch, row, d, d_ok) -> jax.Array:
    """float32 (block_d,) row ref[batch, row, d]; zeros for rows outside [0, len): the padding."""
    ok = d_ok & (row >= 0) & (row < ref.shape[1])
    return pltriton.load(ref.at[batch, row, d], mask=ok, other=0.0).astype(jnp.float32)


def _store_row(ref, batch, row, d, d_ok, value) -> None:
    pltriton.store(ref.at[batch, row, d], value.astype(ref.dtype), mask=d_ok & (row < ref.shape[1]))


def _taps(w_ref, d, d_ok) -> list[jax.Array]:
    """The K columns of w (D, K) over the program's channels, as float32 (block_d,) vectors."""
    return [
        pltriton.load(w_ref.at[d, i32(k)], mask=d_ok, other=0.0).astype(jnp.float32)
        for k in range(w_ref.shape[1])
    ]


def _program(cfg: Config, n_channels: int, steps: int):
    """(batch, strip, first row of the strip, channel indices, channel mask) of this program."""
    d_blk, strip, batch = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = i32(d_blk * cfg.block_d) + jnp.arange(cfg.block_d, dtype=jnp.int32)
    return batch, strip, i32(strip * (steps * cfg.block_t)), d, d < n_channels


def _fwd_kernel(u_ref, w_ref, b_ref, o_ref, *, cfg: Config, pad: int, steps: int):
    k_size, rows = w_ref.shape[1], cfg.block_t
    batch, _, first, d, d_ok = _program(cfg, o_ref.shape[2], steps)
    taps = _taps(w_ref, d, d_ok)
    bias = pltriton.load(b_ref.at[d], mask=d_ok, other=0.0).astype(jnp.float32)

    def step(i, window):  # window: u rows t - pad + m, m < K - 1, for this step's first row t
        t = first + i32(i) * rows
        new = [_row(u_ref, batch, t - pad + k_size - 1 + j, d, d_ok) for j in range(rows)]
        window = [*window, *new]  # window[j + k] = u[t + j + k - pad]
        for j in range(rows):
            acc = window[j] * taps[0]
            for k in range(1, k_size):
                acc = acc + window[j + k] * taps[k]
            _store_row(o_ref, batch, t + j, d, d_ok, acc + bias)
        return tuple(window[rows:])

    window = tuple(_row(u_ref, batch, first - pad + m, d, d_ok) for m in range(k_size - 1))
    jax.lax.fori_loop(0, steps, step, window)


def _bwd_kernel(u_ref, g_ref, w_ref, du_ref, dw_ref, db_ref, *, cfg: Config, pad: int, steps: int):
    k_size, rows = w_ref.shape[1], cfg.block_t
    batch, strip, first, d, d_ok = _program(cfg, du_ref.shape[2], steps)
    taps = _taps(w_ref, d, d_ok)
    zeros = jnp.zeros((cfg.block_d,), jnp.float32)

    def step(i, carry):  # window: g rows s + pad - (K - 1) + m, m < K - 1, for first row s
        window, dw, db = carry
        s = first + i32(i) * rows
        new = [_row(g_ref, batch, s + pad + j, d, d_ok) for j in range(rows)]
        us = [_row(u_ref, batch, s + j, d, d_ok) for j in range(rows)]  # all loads before stores
        window, dw = [*window, *new], list(dw)  # window[j + K - 1 - k] = g[s + j + pad - k]
        for j in range(rows):
            du = None
            for k in range(k_size):
                g = window[j + k_size - 1 - k]
                du = g * taps[k] if du is None else du + g * taps[k]
                dw[k] = dw[k] + us[j] * g
            _store_row(du_ref, batch, s + j, d, d_ok, du)
            db = db + new[j]
        return tuple(window[rows:]), tuple(dw), db

    window = tuple(
        _row(g_ref, batch, first + pad - k_size + 1 + m, d, d_ok) for m in range(k_size - 1)
    )
    # g rows before the first step's `new` ones count towards db once: in strip 0 only.
    db = jnp.where(strip == 0, functools.reduce(jnp.add, window, zeros), zeros)
    _, dw, db = jax.lax.fori_loop(0, steps, step, (window, (zeros,) * k_size, db))
    part = batch * pl.num_programs(1) + strip
    for k in range(k_size):
        pltriton.store(dw_ref.at[part, d, i32(k)], dw[k], mask=d_ok)
    pltriton.store(db_ref.at[part, d], db, mask=d_ok)


def _grid(n_batch: int, n_rows: int, n_channels: int, cfg: Config, programs: int):
    """(grid, steps per strip) for programs walking n_rows rows, cfg.block_t rows per step.

    Grid (channel blocks, strips, batch): neighbouring programs share rows, so the programs in
    flight read whole rows of DRAM, and a strip's halo rows were just read by its neighbour."""
    n_dblocks = pl.cdiv(n_channels, cfg.block_d)
    n_steps = pl.cdiv(n_rows, cfg.block_t)
    strips = max(1, min(n_steps, programs // (n_batch * n_dblocks)))
    steps = pl.cdiv(n_steps, strips)
    return (n_dblocks, pl.cdiv(n_steps, steps), n_batch), steps


def forward(u, w, b, mode: str, cfg: Config, interpret: bool) -> jax.Array:
    """out (B, Lo, D) in u's dtype; Lo = L for 'same' / 'causal', L + K - 1 for 'full'."""
    n_batch, n_len, n_channels = u.shape
    left, right = conv1d_padding(w.shape[1], mode)
    out_len = n_len + left + right - w.shape[1] + 1
    programs = cfg.bwd_programs if cfg.fwd_programs is None else cfg.fwd_programs
    grid, steps = _grid(n_batch, out_len, n_channels, cfg, programs)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, pad=left, steps=steps),
        out_shape=jax.ShapeDtypeStruct((n_batch, out_len, n_channels), u.dtype),
        grid=grid,
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="depthwise_conv1d_fwd",
    )(u, w, b)


def backward(u, w, g, mode: str, cfg: Config, interpret: bool):
    """(du, dw, db) of out's gradient g (B, Lo, D): du (B, L, D) in u's dtype, dw (D, K) and
    db (D,) float32."""
    n_batch, n_len, n_channels = u.shape
    k_size = w.shape[1]
    left, _ = conv1d_padding(k_size, mode)
    grid, steps = _grid(n_batch, n_len, n_channels, cfg, cfg.bwd_programs)
    n_parts = n_batch * grid[1]
    du, dw_part, db_part = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg, pad=left, steps=steps),
        out_shape=(
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct((n_parts, n_channels, k_size), jnp.float32),
            jax.ShapeDtypeStruct((n_parts, n_channels), jnp.float32),
        ),
        grid=grid,
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="depthwise_conv1d_bwd",
    )(u, g, w)
    return du, jnp.sum(dw_part, axis=0), jnp.sum(db_part, axis=0)  # dw (D, K), db (D,)
