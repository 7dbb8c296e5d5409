"""Depthwise conv1d over time with in-kernel zero padding: Pallas kernels with a custom VJP.

u (B, L, D), w (D, K), b (D,); out[:, t, d] = b[d] + sum_k w[d, k] * u[:, t + k - P, d] where P is
the left padding of the mode ('same': (K-1)//2, 'causal' and 'full': K-1) and reads outside
[0, L) are zero (masked loads: no padded copy is made). A program owns a (block_t, block_d) tile
of the output; its K shifted input tiles overlap, so after the first the reads hit L1/L2 and DRAM
sees u about once.

Backward, in one kernel: du is the same correlation of g = dout with the flipped filter and left
padding K-1-P; dw[d, k] = sum_t g[t, d] * u[t + k - P, d] and db[d] = sum_t g[t, d] accumulate
in registers while the program walks `steps` time tiles, then go out as per-program float32
partials reduced by one small jnp.sum (no atomics).

Minimal memory traffic, s bytes per element, Lo output length (L, or L + K - 1 for 'full'):
  forward : read u, write out      = (L + Lo) * B * D * s   (+ w, b)
  backward: read u, g; write du    = (2 L + Lo) * B * D * s (+ w, and the partials)
Backend: Triton lowering (pallas_kernels/triton_backend.py says why).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .reference import CONV_MODES, conv1d_padding
from .triton_backend import compiler_params, core_count, resolve_interpret

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_KERNEL = 7  # the K shifted loads are unrolled


class Config(NamedTuple):
    block_t: int
    block_d: int
    num_warps: int
    bwd_programs: int  # target number of backward programs (each walks several time tiles)
    num_stages: int = 1  # Triton software pipelining of the backward's time loop


def default_config(n_channels: int) -> Config:
    """Tile sizes. The H100 sweep (benchmarks/RESULTS.md) found 8x512 up to 9% faster for float32
    and 32x128 for bfloat16; 16x256 is within 9% of the best for both."""
    block_d = min(256, pl.next_power_of_2(n_channels))
    return Config(block_t=16, block_d=block_d, num_warps=4, bwd_programs=4 * core_count())


def _i32(x) -> jax.Array:
    """x as an int32 index. Under jax_enable_x64 Python ints and loop counters are int64 while
    program ids are int32, and interpret mode rejects slice starts of mixed integer types; int32
    is also what the GPU's index arithmetic wants."""
    return jax.lax.convert_element_type(x, jnp.int32)


def _span(start, size: int) -> jax.Array:
    """int32 indices start, ..., start + size - 1 of one tile."""
    return _i32(start) + jnp.arange(size, dtype=jnp.int32)


def _shifted(ref, batch, t, d, d_ok, shift):
    """float32 tile ref[batch, t + shift, d] with zeros outside [0, len): the in-kernel padding."""
    src = t + shift  # (T,)
    ok = ((src >= 0) & (src < ref.shape[1]))[:, None] & d_ok[None, :]
    return pltriton.load(ref.at[batch, src[:, None], d[None, :]], mask=ok, other=0.0).astype(
        jnp.float32
    )


def _correlate(in_ref, taps, batch, t, d, d_ok, pad):
    """sum_k taps[k] * in[t + k - pad]; also returns the k = pad (unshifted) tile."""
    acc, centre = None, None
    for k, tap in enumerate(taps):
        tile = _shifted(in_ref, batch, t, d, d_ok, k - pad)
        centre = tile if k == pad else centre
        acc = tile * tap[None, :] if acc is None else acc + tile * tap[None, :]
    return acc, centre


def _load_taps(w_ref, d, d_ok):
    """Rows of w transposed (K, D), as K float32 vectors over the tile's channels."""
    return [
        pltriton.load(w_ref.at[_i32(k), d], mask=d_ok, other=0.0).astype(jnp.float32)
        for k in range(w_ref.shape[0])
    ]


def _fwd_kernel(u_ref, wt_ref, b_ref, o_ref, *, cfg: Config, pad: int):
    batch, t_blk, d_blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t = _span(t_blk * cfg.block_t, cfg.block_t)
    d = _span(d_blk * cfg.block_d, cfg.block_d)
    d_ok = d < o_ref.shape[2]
    acc, _ = _correlate(u_ref, _load_taps(wt_ref, d, d_ok), batch, t, d, d_ok, pad)
    acc = acc + pltriton.load(b_ref.at[d], mask=d_ok, other=0.0).astype(jnp.float32)[None, :]
    out = o_ref.at[
        batch, pl.ds(t_blk * cfg.block_t, cfg.block_t), pl.ds(d_blk * cfg.block_d, cfg.block_d)
    ]
    pltriton.store(out, acc.astype(o_ref.dtype), mask=(t < o_ref.shape[1])[:, None] & d_ok[None, :])


def _bwd_kernel(
    u_ref, g_ref, wt_flip_ref, du_ref, dw_ref, db_ref, *, cfg: Config, pad: int, steps: int
):
    batch, chunk, d_blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_chunks = pl.num_programs(1)
    n_len, n_channels = du_ref.shape[1], du_ref.shape[2]
    k_size = wt_flip_ref.shape[0]
    d = _span(d_blk * cfg.block_d, cfg.block_d)
    d_ok = d < n_channels
    taps_flip = _load_taps(wt_flip_ref, d, d_ok)
    pad_flip = k_size - 1 - pad

    def step(i, acc):
        t_blk = chunk * steps + _i32(i)
        t = _span(t_blk * cfg.block_t, cfg.block_t)
        du, g = _correlate(g_ref, taps_flip, batch, t, d, d_ok, pad_flip)  # g: tile at t
        t_ok = t < n_len
        out = du_ref.at[
            batch, pl.ds(t_blk * cfg.block_t, cfg.block_t), pl.ds(d_blk * cfg.block_d, cfg.block_d)
        ]
        pltriton.store(out, du.astype(du_ref.dtype), mask=t_ok[:, None] & d_ok[None, :])
        dw_acc, db_acc = acc
        dw_acc = tuple(
            a + g * _shifted(u_ref, batch, t, d, d_ok, k - pad) for k, a in enumerate(dw_acc)
        )
        return dw_acc, db_acc + g

    zeros = jnp.zeros((cfg.block_t, cfg.block_d), jnp.float32)
    dw_acc, db_acc = jax.lax.fori_loop(0, steps, step, ((zeros,) * k_size, zeros))
    part = batch * n_chunks + chunk
    for k, a in enumerate(dw_acc):
        pltriton.store(dw_ref.at[part, _i32(k), d], jnp.sum(a, axis=0), mask=d_ok)
    pltriton.store(db_ref.at[part, d], jnp.sum(db_acc, axis=0), mask=d_ok)


def _forward(u, w, b, mode: str, interpret: bool, cfg: Config):
    n_batch, n_len, n_channels = u.shape
    left, right = conv1d_padding(w.shape[1], mode)
    out_len = n_len + left + right - w.shape[1] + 1
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, pad=left),
        out_shape=jax.ShapeDtypeStruct((n_batch, out_len, n_channels), u.dtype),
        grid=(n_batch, pl.cdiv(out_len, cfg.block_t), pl.cdiv(n_channels, cfg.block_d)),
        compiler_params=compiler_params(cfg.num_warps),
        interpret=interpret,
        name="depthwise_conv1d_fwd",
    )(u, w.T, b)  # w.T: (K, D), so each tap is a contiguous row


def _backward(u, w, g, mode: str, interpret: bool, cfg: Config):
    n_batch, n_len, n_channels = u.shape
    k_size = w.shape[1]
    left, _ = conv1d_padding(k_size, mode)
    n_tblocks = pl.cdiv(g.shape[1], cfg.block_t)  # g is at least as long as u
    n_dblocks = pl.cdiv(n_channels, cfg.block_d)
    per_batch = max(1, cfg.bwd_programs // (n_batch * n_dblocks))
    steps = pl.cdiv(n_tblocks, per_batch)
    n_chunks = pl.cdiv(n_tblocks, steps)
    n_parts = n_batch * n_chunks
    du, dw_part, db_part = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg, pad=left, steps=steps),
        out_shape=(
            jax.ShapeDtypeStruct(u.shape, u.dtype),
            jax.ShapeDtypeStruct((n_parts, k_size, n_channels), jnp.float32),
            jax.ShapeDtypeStruct((n_parts, n_channels), jnp.float32),
        ),
        grid=(n_batch, n_chunks, n_dblocks),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="depthwise_conv1d_bwd",
    )(u, g, w.T[::-1])  # flipped taps (K, D) for du
    return du, jnp.sum(dw_part, axis=0).T, jnp.sum(db_part, axis=0)  # dw (D, K)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _conv(u, w, b, mode, interpret, cfg):
    return _forward(u, w, b, mode, interpret, cfg)


def _conv_fwd(u, w, b, mode, interpret, cfg):
    return _forward(u, w, b, mode, interpret, cfg), (u, w, b)


def _conv_bwd(mode, interpret, cfg, res, g):
    u, w, b = res
    du, dw, db = _backward(u, w, g, mode, interpret, cfg)
    return du, dw.astype(w.dtype), db.astype(b.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)


def _check(u, w, b, mode) -> None:
    if u.ndim != 3:
        raise ValueError(f"u must be 3-D (B, L, D), got shape {u.shape}")
    if w.ndim != 2 or w.shape[0] != u.shape[2]:
        raise ValueError(f"w must be 2-D (D, K) with D = {u.shape[2]}, got shape {w.shape}")
    if b.shape != (u.shape[2],):
        raise ValueError(f"b must have shape ({u.shape[2]},), got {b.shape}")
    if not 1 <= w.shape[1] <= MAX_KERNEL:
        raise ValueError(f"kernel size K must be in [1, {MAX_KERNEL}], got {w.shape[1]}")
    if u.shape[1] < 1:
        raise ValueError(f"sequence length L must be at least 1, got {u.shape[1]}")
    for name, a in (("u", u), ("w", w), ("b", b)):
        if a.dtype not in DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {a.dtype}")
    if mode not in CONV_MODES:
        raise ValueError(f"mode must be one of {CONV_MODES}, got {mode!r}")


def depthwise_conv1d(
    u: jax.Array,
    w: jax.Array,
    b: jax.Array,
    mode: str = "same",
    interpret: bool | None = None,
    *,
    config: Config | None = None,
) -> jax.Array:
    """Depthwise conv1d: u (B, L, D), w (D, K), b (D,) -> (B, Lo, D) in u's dtype.

    Lo = L for 'same' and 'causal', L + K - 1 for 'full'. Math is float32. `config` overrides the
    tuned tile sizes (benchmarks use it).
    """
    _check(u, w, b, mode)
    cfg = config or default_config(u.shape[2])
    return _conv(u, w, b, mode, resolve_interpret(interpret), cfg)
