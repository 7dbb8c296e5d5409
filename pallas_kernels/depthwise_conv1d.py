"""Depthwise conv1d over time with in-kernel zero padding: Pallas kernels with a custom VJP.

u (B, L, D), w (D, K), b (D,): out[:, t, d] = b[d] + sum_k w[d, k] * u[:, t + k - P, d], reads
outside [0, L) being zeros, with left padding P = K - 1 ('full', 'causal') or (K - 1) // 2
('same'). 'full' is the CS229S layout (K = 3, two zeros on each side): Lo = L + K - 1 output rows;
the other modes give Lo = L. No padded copy is made: out-of-range rows are masked loads.

Work layout (both kernels). A program owns `block_d` channels, i.e. one contiguous segment of
every row, and a strip of consecutive rows that it walks `block_t` rows per loop step. A step
loads the next `block_t` rows once, each a coalesced (block_d,) vector, and keeps the newest
K - 1 of them in registers for the next step, so within a strip every input row is read exactly
once; a strip re-reads only K - 1 halo rows at its start, (K - 1) / strip of the input (an L2 hit
when the neighbouring strip ran at the same time). The strip length follows from the target grid
size (`Config.fwd_programs` / `bwd_programs`): long strips for large inputs, short ones (more
programs) for small.

Forward: out[t] = b + sum_k w[k] u[t + k - P] over the sliding window of K input rows.
Backward, one kernel walking the input rows s: du[s] = sum_k w[k] g[s + P - k] (the same sliding
window over g = dout, taps reversed), dw[k] += u[s] g[s + P - k] and db += g rows, the last two in
float32 registers, written once per program as partial sums that one small jnp.sum reduces
(deterministic, no atomics). Math is float32 for every input dtype.

Memory traffic, s bytes per element (the minimum: each input read once, each output written once):
  forward : read u, write out    = (L + Lo) B D s   (+ w, b; halo K - 1 rows per strip)
  backward: read u, g; write du  = (2 L + Lo) B D s (+ w; partials (K + 1) D 4 bytes per strip)
Backend: Triton lowering by default; `backend="mosaic_gpu"` runs depthwise_conv1d_mgpu.py's
kernels in the same custom VJP (pallas_kernels/triton_backend.py picks and validates the lowering).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import CONV_MODES, conv1d_padding
from .triton_backend import (
    check_backend,
    check_triton_config,
    compiler_params,
    core_count,
    first_order_rules,
    resolve_interpret,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_KERNEL = 7  # the K taps are unrolled


class Config(NamedTuple):
    """Tiling of both kernels (module docstring)."""

    block_t: int  # rows per loop step, unrolled: that many row loads in flight per step
    block_d: int  # channels per program, a power of two
    num_warps: int
    bwd_programs: int  # target number of backward programs: sets the strip length
    num_stages: int = 1  # Triton software pipelining of the strip loop
    fwd_programs: int | None = None  # target number of forward programs; None: bwd_programs


# Tilings measured fastest on the CS229S course grid (B = 1, K = 3, 'full'; L in 1024..8192,
# D in {768, 1024, 2048, 8192}) on an NVIDIA H100 80GB HBM3 (132 SMs), jax 0.11.2, 2026-11-23,
# over the runs of benchmarks/logs/conv1d_2026-11-23/ (fifth session: the full grid, then a
# forward-only sweep of up to 7 tilings per row):
#   PYTHONPATH=$PWD python3 benchmarks/conv1d_course.py --jsonl $OUT/conv.jsonl
#   PYTHONPATH=$PWD python3 benchmarks/conv1d_course.py --dirs fwd --sweep 7 --jsonl ...
# (direction, dtype, L, D) -> (block_t, block_d, num_warps, programs per SM, num_stages): the
# tiling with the lowest mean time over the runs, where it beat the default of that run by more
# than 2 % (noise). Course rows not listed: the heuristic was fastest or within 2 %. Sixth
# session (2026-11-24, benchmarks/logs/conv1d_2026-11-24/fwd_*.jsonl: `--dirs fwd --sweep 10`
# over the rows under 1.0x XLA): five bfloat16 forward entries replaced where the sweep's best
# beat the entry by >= 10 %. Thirteenth session (2026-11-25, benchmarks/logs/conv1d_2026-11-25_s13/:
# `--dirs bwd --dtypes bfloat16,float16 --sweep 9`, the sweep now also trying 2x and 4x the warps
# on the same channel block): the eight 16-bit backward entries of u >= 32 MiB set to that run's
# best where it beat the default by > 2 % (4.6-12.5 %), then re-timed alone in a second call.
_TUNED: dict[tuple[str, str, int, int], tuple[int, int, int, int, int]] = {
    ("fwd", "float32", 8192, 768): (8, 256, 2, 4, 1),
    ("fwd", "float32", 1024, 1024): (8, 512, 4, 8, 3),
    ("fwd", "float32", 2048, 1024): (2, 512, 4, 16, 3),
    ("fwd", "float32", 4096, 1024): (4, 1024, 8, 8, 3),
    ("fwd", "float32", 1024, 2048): (4, 512, 4, 8, 1),
    ("fwd", "float32", 2048, 2048): (4, 512, 4, 16, 3),
    ("fwd", "float32", 4096, 2048): (4, 256, 2, 8, 1),
    ("fwd", "float32", 2048, 8192): (8, 512, 4, 8, 1),
    ("fwd", "float32", 4096, 8192): (8, 512, 4, 8, 1),
    ("fwd", "bfloat16", 1024, 768): (8, 256, 1, 8, 3),
    ("fwd", "bfloat16", 2048, 768): (8, 256, 2, 8, 1),
    ("fwd", "bfloat16", 4096, 768): (2, 256, 1, 16, 1),
    ("fwd", "bfloat16", 8192, 768): (8, 256, 1, 8, 1),
    ("fwd", "bfloat16", 1024, 1024): (4, 1024, 4, 16, 3),
    ("fwd", "bfloat16", 2048, 1024): (2, 1024, 4, 8, 3),
    ("fwd", "bfloat16", 4096, 1024): (4, 512, 2, 8, 3),
    ("fwd", "bfloat16", 8192, 1024): (2, 1024, 4, 32, 1),
    ("fwd", "bfloat16", 1024, 2048): (8, 512, 2, 8, 1),
    ("fwd", "bfloat16", 2048, 2048): (8, 1024, 4, 4, 1),
    ("fwd", "bfloat16", 4096, 2048): (8, 1024, 4, 16, 1),
    ("fwd", "bfloat16", 8192, 2048): (4, 1024, 4, 16, 1),
    ("fwd", "bfloat16", 1024, 8192): (8, 1024, 4, 8, 1),
    ("fwd", "bfloat16", 2048, 8192): (4, 2048, 8, 16, 1),
    ("fwd", "bfloat16", 4096, 8192): (8, 2048, 8, 8, 1),
    ("fwd", "bfloat16", 8192, 8192): (4, 2048, 8, 8, 1),
    ("fwd", "float16", 1024, 768): (8, 256, 1, 8, 1),
    ("fwd", "float16", 2048, 768): (4, 128, 1, 16, 1),
    ("fwd", "float16", 4096, 768): (8, 256, 1, 4, 1),
    ("fwd", "float16", 8192, 768): (8, 256, 1, 8, 1),
    ("fwd", "float16", 4096, 1024): (8, 1024, 4, 4, 1),
    ("fwd", "float16", 8192, 1024): (2, 1024, 4, 32, 1),
    ("fwd", "float16", 1024, 2048): (4, 512, 2, 8, 3),
    ("fwd", "float16", 2048, 2048): (8, 1024, 4, 8, 1),
    ("fwd", "float16", 4096, 2048): (4, 512, 2, 8, 1),
    ("fwd", "float16", 8192, 2048): (4, 1024, 4, 32, 1),
    ("fwd", "float16", 1024, 8192): (8, 1024, 4, 8, 1),
    ("fwd", "float16", 2048, 8192): (4, 1024, 4, 16, 1),
    ("fwd", "float16", 4096, 8192): (4, 2048, 8, 8, 1),
    ("fwd", "float16", 8192, 8192): (4, 1024, 4, 16, 1),
    ("bwd", "float32", 1024, 768): (4, 128, 1, 4, 1),
    ("bwd", "float32", 2048, 768): (4, 128, 1, 4, 1),
    ("bwd", "float32", 4096, 768): (4, 128, 1, 4, 1),
    ("bwd", "float32", 1024, 1024): (4, 512, 4, 4, 3),
    ("bwd", "float32", 2048, 1024): (4, 512, 4, 8, 1),
    ("bwd", "float32", 4096, 1024): (4, 256, 2, 4, 1),
    ("bwd", "float32", 1024, 2048): (8, 512, 4, 2, 1),
    ("bwd", "float32", 2048, 2048): (4, 256, 2, 8, 1),
    ("bwd", "float32", 8192, 2048): (4, 512, 4, 4, 3),
    ("bwd", "bfloat16", 1024, 768): (8, 128, 1, 4, 1),
    ("bwd", "bfloat16", 4096, 768): (4, 256, 1, 4, 3),
    ("bwd", "bfloat16", 8192, 768): (4, 128, 1, 8, 1),
    ("bwd", "bfloat16", 1024, 1024): (4, 1024, 4, 4, 3),
    ("bwd", "bfloat16", 4096, 1024): (4, 512, 2, 4, 1),
    ("bwd", "bfloat16", 8192, 1024): (4, 512, 2, 4, 1),
    ("bwd", "bfloat16", 1024, 2048): (8, 1024, 4, 4, 1),
    ("bwd", "bfloat16", 2048, 2048): (8, 1024, 4, 4, 1),
    ("bwd", "bfloat16", 4096, 2048): (8, 1024, 4, 2, 1),
    ("bwd", "bfloat16", 8192, 2048): (8, 512, 4, 4, 1),
    ("bwd", "bfloat16", 1024, 8192): (4, 512, 2, 4, 1),
    ("bwd", "bfloat16", 2048, 8192): (8, 512, 4, 4, 1),
    ("bwd", "bfloat16", 4096, 8192): (8, 1024, 8, 2, 1),
    ("bwd", "bfloat16", 8192, 8192): (8, 1024, 4, 2, 1),
    ("bwd", "float16", 1024, 768): (4, 256, 1, 4, 3),
    ("bwd", "float16", 2048, 768): (8, 256, 1, 4, 1),
    ("bwd", "float16", 4096, 768): (4, 256, 1, 8, 1),
    ("bwd", "float16", 8192, 768): (4, 256, 1, 8, 1),
    ("bwd", "float16", 1024, 1024): (8, 1024, 4, 4, 1),
    ("bwd", "float16", 4096, 1024): (8, 1024, 4, 4, 1),
    ("bwd", "float16", 8192, 1024): (4, 512, 2, 4, 3),
    ("bwd", "float16", 1024, 2048): (4, 512, 2, 4, 1),
    ("bwd", "float16", 2048, 2048): (4, 256, 1, 4, 1),
    ("bwd", "float16", 4096, 2048): (4, 512, 2, 4, 1),
    ("bwd", "float16", 8192, 2048): (8, 512, 4, 4, 1),
    ("bwd", "float16", 2048, 8192): (8, 512, 4, 4, 1),
    ("bwd", "float16", 4096, 8192): (8, 512, 2, 4, 1),
    ("bwd", "float16", 8192, 8192): (8, 1024, 4, 2, 1),
}


def default_config(shape: tuple[int, ...], dtype, *, backward: bool = False) -> Config:
    """Tiling for u of `shape` (B, L, D) and `dtype`: the measured `_TUNED` entry for D and B * L
    (the strip length follows from B * L; rounded to the nearest power of two), else a heuristic:
    16-byte loads per thread, block_d a divisor of D where one exists (768 -> 256), four rows per
    step, eight (forward) or four (backward) programs per SM. benchmarks/conv1d_course.py sweeps
    tilings around it."""
    n_channels, n_rows = shape[-1], max(1, math.prod(shape[:-1]))
    direction = "bwd" if backward else "fwd"
    rows = 1 << round(math.log2(n_rows))
    tuned = _TUNED.get((direction, jnp.dtype(dtype).name, rows, n_channels))
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


def _i32(x) -> jax.Array:
    """x as an int32 index. Under jax_enable_x64 Python ints and loop counters are int64 while
    program ids are int32, and interpret mode rejects slice starts of mixed integer types; int32
    is also what the GPU's index arithmetic wants."""
    return jax.lax.convert_element_type(x, jnp.int32)


def _row(ref, batch, row, d, d_ok) -> jax.Array:
    """float32 (block_d,) row ref[batch, row, d]; zeros for rows outside [0, len): the padding."""
    ok = d_ok & (row >= 0) & (row < ref.shape[1])
    return pltriton.load(ref.at[batch, row, d], mask=ok, other=0.0).astype(jnp.float32)


def _store_row(ref, batch, row, d, d_ok, value) -> None:
    pltriton.store(ref.at[batch, row, d], value.astype(ref.dtype), mask=d_ok & (row < ref.shape[1]))


def _taps(w_ref, d, d_ok) -> list[jax.Array]:
    """The K columns of w (D, K) over the program's channels, as float32 (block_d,) vectors."""
    return [
        pltriton.load(w_ref.at[d, _i32(k)], mask=d_ok, other=0.0).astype(jnp.float32)
        for k in range(w_ref.shape[1])
    ]


def _program(cfg: Config, n_channels: int, steps: int):
    """(batch, strip, first row of the strip, channel indices, channel mask) of this program."""
    d_blk, strip, batch = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = _i32(d_blk * cfg.block_d) + jnp.arange(cfg.block_d, dtype=jnp.int32)
    return batch, strip, _i32(strip * (steps * cfg.block_t)), d, d < n_channels


def _fwd_kernel(u_ref, w_ref, b_ref, o_ref, *, cfg: Config, pad: int, steps: int):
    k_size, rows = w_ref.shape[1], cfg.block_t
    batch, _, first, d, d_ok = _program(cfg, o_ref.shape[2], steps)
    taps = _taps(w_ref, d, d_ok)
    bias = pltriton.load(b_ref.at[d], mask=d_ok, other=0.0).astype(jnp.float32)

    def step(i, window):  # window: u rows t - pad + m, m < K - 1, for this step's first row t
        t = first + _i32(i) * rows
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
        s = first + _i32(i) * rows
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
        pltriton.store(dw_ref.at[part, d, _i32(k)], dw[k], mask=d_ok)
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


def _forward(u, w, b, mode: str, interpret: bool, cfg, backend: str = "triton") -> jax.Array:
    if backend == "mosaic_gpu":
        from . import depthwise_conv1d_mgpu

        return depthwise_conv1d_mgpu.forward(u, w, b, mode, cfg)
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


def _backward(u, w, g, mode: str, interpret: bool, cfg, backend: str = "triton"):
    if backend == "mosaic_gpu":
        from . import depthwise_conv1d_mgpu

        return depthwise_conv1d_mgpu.backward(u, w, g, mode, cfg)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _conv(u, w, b, mode, interpret, cfgs, backend):
    return _forward(u, w, b, mode, interpret, cfgs[0], backend)


def _conv_fwd(u, w, b, mode, interpret, cfgs, backend):
    return _forward(u, w, b, mode, interpret, cfgs[0], backend), (u, w, b)


def _conv_bwd(mode, interpret, cfgs, backend, res, g):
    u, w, b = res
    du, dw, db = _backward(u, w, g, mode, interpret, cfgs[1], backend)
    return du, dw.astype(w.dtype), db.astype(b.dtype)


_conv.defvjp(*first_order_rules("depthwise_conv1d", 3, _conv_fwd, _conv_bwd))


def _check(u, w, b, mode: str, config: Config | None) -> None:
    if getattr(u, "ndim", None) != 3:
        raise ValueError(f"u must be 3-D (B, L, D), got shape {jnp.shape(u)}")
    if any(n < 1 for n in u.shape):
        raise ValueError(f"u must have B, L, D >= 1, got shape {u.shape}")
    if getattr(w, "ndim", None) != 2 or w.shape[0] != u.shape[2]:
        raise ValueError(f"w must be 2-D (D, K) with D = {u.shape[2]}, got shape {jnp.shape(w)}")
    if jnp.shape(b) != (u.shape[2],):
        raise ValueError(f"b must have shape ({u.shape[2]},), got {jnp.shape(b)}")
    if not 1 <= w.shape[1] <= MAX_KERNEL:
        raise ValueError(f"kernel size K must be in [1, {MAX_KERNEL}], got {w.shape[1]}")
    for name, a in (("u", u), ("w", w), ("b", b)):
        if a.dtype not in DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {a.dtype}")
    if mode not in CONV_MODES:
        raise ValueError(f"mode must be one of {CONV_MODES}, got {mode!r}")
    if config is not None:  # fields >= 1 (fwd_programs None: bwd_programs), block_d a power of 2
        check_triton_config(config, ("block_d",))


def depthwise_conv1d(
    u: jax.Array,
    w: jax.Array,
    b: jax.Array,
    mode: str = "same",
    interpret: bool | None = None,
    *,
    config=None,
    backend: str = "triton",
) -> jax.Array:
    """Depthwise conv1d: u (B, L, D), w (D, K), b (D,) -> (B, Lo, D) in u's dtype.

    A cross-correlation (as torch's conv1d). Lo = L for 'same' and 'causal', L + K - 1 for 'full'
    (the course's padding of K - 1 zeros on both ends). K may exceed L: the padding defines it.
    Math is float32; dw and db come back in w's and b's dtypes. `config` overrides the tiling of
    both kernels (benchmarks use it); by default each direction takes `default_config`.
    `backend`: "triton" or "mosaic_gpu" (triton_backend.py); the latter takes a
    depthwise_conv1d_mgpu.Config.
    """
    check_backend(backend, interpret)
    if backend == "mosaic_gpu":
        from . import depthwise_conv1d_mgpu as mgpu

        _check(u, w, b, mode, None)
        if config is not None and not isinstance(config, mgpu.Config):
            raise ValueError(f"backend='mosaic_gpu' takes a depthwise_conv1d_mgpu.Config: {config}")
        cfg = config or mgpu.default_config(u.shape, u.dtype, w.shape[1])
        return _conv(u, w, b, mode, False, (cfg, cfg), backend)
    if config is not None and not isinstance(config, Config):
        raise ValueError(f"backend='triton' takes a depthwise_conv1d.Config, got {config}")
    _check(u, w, b, mode, config)
    fwd_cfg = config or default_config(u.shape, u.dtype)
    bwd_cfg = config or default_config(u.shape, u.dtype, backward=True)
    return _conv(u, w, b, mode, resolve_interpret(interpret), (fwd_cfg, bwd_cfg), backend)
