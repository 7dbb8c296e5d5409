"""Fused LayerNorm and RMSNorm over the last axis on Pallas' Triton lowering: layer_norm's
default forward and backward kernels.

x (N, D). A program walks `steps` blocks of `block_rows` whole rows (padded to a power of two of
columns and masked), so each row's statistics stay in registers (one read of x) and gamma/beta
are read once per program, not once per row (at D = 8192 a per-row re-read of float32 gamma/beta
is 4x the bf16 row itself in L2 traffic). The backward recomputes xhat from the saved float32
mean/rstd; dgamma/dbeta are summed per program in registers, written as per-program partials
(G, D) float32 and reduced by one small jnp.sum (no atomics). RMSNorm runs the same kernel bodies
with the static flag `rms=True`: no mean, no beta, no dbeta partials.

Memory traffic, N rows of D, s bytes per element of x, G programs:
  forward : read x, write y       = 2 * N * D * s  (+ 8 N for mean/rstd, + gamma/beta per program)
  backward: read x, dy; write dx  = 3 * N * D * s  (+ 8 N for mean/rstd, + 8 G D partials)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import compiler_params, core_count, i32, pltriton
from .layer_norm_common import kernel_name, operands


class Config(NamedTuple):
    block_rows: int  # rows per loop step
    num_warps: int
    programs: int  # target number of programs; each loops over ceil(blocks / programs) steps
    num_stages: int = 1  # Triton software pipelining of the row loop


def default_configs(n_cols: int) -> tuple[Config, Config]:
    """(forward, backward) block sizes by padded row length, from the H100 sweep in
    benchmarks/RESULTS.md: 2048-element row blocks; the forward wants more programs (it keeps
    no partials), the backward fewer programs (smaller dgamma/dbeta partials) and pipelining."""
    width = pl.next_power_of_2(n_cols)
    block_rows = max(1, 2048 // width)
    fwd = Config(block_rows, 4 if width <= 2048 else 8, programs=8 * core_count())
    bwd = Config(block_rows, 4 if width <= 2048 else 16, programs=4 * core_count(), num_stages=3)
    return fwd, bwd


def _grid(n_rows: int, cfg: Config) -> tuple[int, int]:
    """(programs, steps per program) covering n_rows in blocks of cfg.block_rows."""
    n_blocks = pl.cdiv(n_rows, cfg.block_rows)
    steps = pl.cdiv(n_blocks, cfg.programs)
    return pl.cdiv(n_blocks, steps), steps


def _row_block(pid, block_rows: int, block_cols: int, n_rows: int, n_cols: int):
    # pid mixes program id and loop counter: int32 whatever x64 makes of the counter
    row0 = i32(pid) * block_rows
    rows = pl.ds(row0, block_rows)
    row_ok = row0 + jnp.arange(block_rows, dtype=jnp.int32) < n_rows  # (R,)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols  # (C,)
    return rows, row_ok, col_ok


def _fwd_kernel(*refs, eps: float, block_rows: int, steps: int, residual: bool, rms: bool):
    # with the residual, s = x + h is written out too: the pre-norm block's residual add, fused
    r = dict(zip(operands("fwd", residual, rms), refs, strict=True))
    n_rows, n_cols = r["x"].shape
    block_cols = pl.next_power_of_2(n_cols)
    cols = pl.ds(i32(0), block_cols)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols
    g = pltriton.load(r["g"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    if not rms:
        b = pltriton.load(r["b"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    part = pl.program_id(0)  # read outside the loop: interpret mode cannot lower it inside

    @pl.loop(0, steps)
    def step(i):
        rows, row_ok, _ = _row_block(part * steps + i, block_rows, block_cols, n_rows, n_cols)
        valid = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(r["x"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        if residual:
            h = pltriton.load(r["h"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
            s = (x + h).astype(r["s"].dtype)  # the stream as stored: its norm, as backward's
            pltriton.store(r["s"].at[rows, cols], s, mask=valid)
            x = s.astype(jnp.float32)
        if rms:  # no centring: masked loads already zeroed the padding columns
            xc = x
        else:
            mean = jnp.sum(x, axis=1) / n_cols  # (R,)
            xc = jnp.where(col_ok[None, :], x - mean[:, None], 0.0)
        rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1) / n_cols + eps)
        y = xc * rstd[:, None] * g[None, :]
        if not rms:
            y = y + b[None, :]
        pltriton.store(r["y"].at[rows, cols], y.astype(r["y"].dtype), mask=valid)
        if not rms:
            pltriton.store(r["mean"].at[rows], mean, mask=row_ok)
        pltriton.store(r["rstd"].at[rows], rstd, mask=row_ok)


def _bwd_kernel(*refs, block_rows: int, steps: int, residual: bool, rms: bool):
    # with the residual, dx = ds + norm'(dy): the residual stream's gradient joins in; dh = dx
    r = dict(zip(operands("bwd", residual, rms), refs, strict=True))
    n_rows, n_cols = r["x"].shape
    block_cols = pl.next_power_of_2(n_cols)
    cols = pl.ds(i32(0), block_cols)
    col_ok = jnp.arange(block_cols, dtype=jnp.int32) < n_cols
    g = pltriton.load(r["g"].at[cols], mask=col_ok, other=0.0).astype(jnp.float32)
    part = pl.program_id(0)  # read outside the loop: interpret mode cannot lower it inside

    def step(i, acc):
        rows, row_ok, _ = _row_block(part * steps + i, block_rows, block_cols, n_rows, n_cols)
        valid = row_ok[:, None] & col_ok[None, :]
        x = pltriton.load(r["x"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        dy = pltriton.load(r["dy"].at[rows, cols], mask=valid, other=0.0).astype(jnp.float32)
        mean = None if rms else pltriton.load(r["mean"].at[rows], mask=row_ok, other=0.0)
        rstd = pltriton.load(r["rstd"].at[rows], mask=row_ok, other=0.0)
        xc = x if rms else x - mean[:, None]
        xhat = jnp.where(valid, xc * rstd[:, None], 0.0)  # (R, C)
        gdy = g[None, :] * dy
        c1 = jnp.sum(xhat * gdy, axis=1) / n_cols
        c2 = None if rms else jnp.sum(gdy, axis=1) / n_cols
        dx = gdy - xhat * c1[:, None]
        if not rms:
            dx = dx - c2[:, None]
        dx = dx * rstd[:, None]
        if residual:
            ds = pltriton.load(r["ds"].at[rows, cols], mask=valid, other=0.0)
            dx = dx + ds.astype(jnp.float32)
            pltriton.store(r["dh"].at[rows, cols], dx.astype(r["dh"].dtype), mask=valid)
        pltriton.store(r["dx"].at[rows, cols], dx.astype(r["dx"].dtype), mask=valid)
        return (acc[0] + dy * xhat, *(() if rms else (acc[1] + dy,)))  # dgamma (, dbeta)

    zeros = jnp.zeros((block_rows, block_cols), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * (1 if rms else 2))
    for name, acc in zip(("dg", "db"), accs, strict=False):
        pltriton.store(r[name].at[part, cols], jnp.sum(acc, axis=0), mask=col_ok)


def forward(x, h, gamma, beta, eps: float, out_dtype, cfg: Config, interpret: bool):
    """(y, mean, rstd), or (s = x + h, y, mean, rstd) when h is given; x, h (N, D). beta None is
    RMSNorm (mean is then None)."""
    n_rows, n_cols = x.shape  # (N, D)
    n_programs, steps = _grid(n_rows, cfg)
    residual, rms = h is not None, beta is None
    stats = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    out_shape = (jax.ShapeDtypeStruct(x.shape, out_dtype), *(() if rms else (stats,)), stats)
    if residual:
        out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype), *out_shape)
    kernel = functools.partial(
        _fwd_kernel, eps=eps, block_rows=cfg.block_rows, steps=steps, residual=residual, rms=rms
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_programs,),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=kernel_name("fwd", residual, rms),
    )(*((x, h) if residual else (x,)), gamma, *(() if rms else (beta,)))
    return (*outs[:-1], None, outs[-1]) if rms else outs


def backward(x, gamma, dy, ds, h_dtype, mean, rstd, cfg: Config, interpret: bool):
    """(dx, dgamma, dbeta), or (dx, dh, dgamma, dbeta) when ds (the gradient of s) is given;
    mean None is RMSNorm (dbeta is then None)."""
    n_rows, n_cols = x.shape
    n_programs, steps = _grid(n_rows, cfg)
    part = jax.ShapeDtypeStruct((n_programs, n_cols), jnp.float32)
    residual, rms = ds is not None, mean is None
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), part, *(() if rms else (part,))]
    if residual:
        out_shape.insert(1, jax.ShapeDtypeStruct(x.shape, h_dtype))
    kernel = functools.partial(
        _bwd_kernel, block_rows=cfg.block_rows, steps=steps, residual=residual, rms=rms
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(n_programs,),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=kernel_name("bwd", residual, rms),
    )(x, gamma, dy, *((ds,) if residual else ()), *(() if rms else (mean,)), rstd)
    n_grads = 2 if residual else 1
    sums = [jnp.sum(p, axis=0) for p in outs[n_grads:]]
    return (*outs[:n_grads], *sums, *((None,) if rms else ()))
