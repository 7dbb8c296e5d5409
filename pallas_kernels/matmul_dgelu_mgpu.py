"""GELU's backward in the epilogue of the MLP's dX GEMM, on Pallas' Mosaic GPU lowering (Hopper).

dh = (dy @ w) * gelu'(h): dy (M, K), w (K, N), h (M, N) 16-bit -> dh (M, N) in h's dtype, the
product accumulated in float32 and multiplied by gelu'(h) (GPT-2's tanh form, float32) before
the one rounding. XLA's cuBLAS path writes dy @ w and reads it back in a second kernel; here it
never leaves the SM.

Persistent, "ping-pong" (CUTLASS's name): one CUDA block per SM runs the output tiles p, p + P,
... (P CUDA blocks; block_m x block_n each, the N tiles of a row of tiles consecutive, so that
CUDA blocks running together read the same rows of dy from L2). Warpgroup 2 streams the tiles'
dy and w k-blocks, in tile order, through one ring of `stages` shared-memory slots; tile i
belongs to compute warpgroup i % 2, so the slots of the next tile fill while this one's last
matmuls run, and one warpgroup's epilogue (gelu'(h), the store) overlaps the other's matmuls.
Each compute warpgroup owns a block_m x block_n buffer: the copy warpgroup loads the tile's h
into it during the tile's matmuls, the epilogue overwrites it with dh in place and a TMA store
writes it out (the next h load waits until that store has read it).

Memory traffic (s bytes per element): read h and write dh once (2 M N s), read dy once per
column of tiles and w once per row of tiles, mostly from L2 (about M K s + K N s from memory);
the GEMM alone writes M N s. At GPT-2's shape on an H200 it takes 1.27x cuBLAS's time for
dy @ w alone, against 1.7x for cuBLAS's GEMM and XLA's fusion of gelu'; the matmuls alone run at
cuBLAS's speed, and the epilogue is not hidden, most of its excess h's load and dh's store; it
is not bound by shared-memory bandwidth (ncu: 59% of its peak; benchmarks/RESULTS.md).
Refused (ValueError): M not a multiple of block_m, N of block_n, K of block_k.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .common import core_count

COMPUTE_WGS = 2
_GELU_C = math.sqrt(2.0 / math.pi)


class Config(NamedTuple):
    block_m: int = 128  # rows of a tile (one compute warpgroup's accumulator: 2 x 64)
    block_n: int = 128  # columns of a tile
    block_k: int = 64  # depth of a ring slot (128 bytes of 16-bit values: one swizzle row)
    # ring slots; 5 at GPT-2's shape: 0.60-0.62 ms against 0.62-0.64 at 4 (H200, 2026-11-29,
    # benchmarks/logs/kernels_2026-11-29c); 5 x 32 KB + 2 x 32 KB fits in shared memory
    stages: int = 5
    ctas: int = 0  # at most this many CUDA blocks (0: one per SM)


def smem_bytes(cfg: Config, itemsize: int = 2) -> int:
    """The ring's dy and w slots and the two compute warpgroups' h / dh buffers."""
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * cfg.block_k
    return (ring + COMPUTE_WGS * cfg.block_m * cfg.block_n) * itemsize


def check(cfg: Config, m: int, n: int, k: int) -> None:
    """A config against the GEMM's (M, N, K) and the shared memory."""
    if cfg.block_m != 128 or cfg.block_n not in (64, 128, 192) or cfg.block_k != 64:
        raise ValueError(f"invalid matmul_dgelu config {cfg}: block_m 128, block_n 64, 128 or "
                         "192, block_k 64")  # fmt: skip
    if cfg.stages < 2 or cfg.ctas < 0:
        raise ValueError(f"invalid matmul_dgelu config {cfg}: stages >= 2, ctas >= 0")
    if smem_bytes(cfg) + 1024 > rows.SMEM_BYTES:
        raise ValueError(f"matmul_dgelu config {cfg} needs {smem_bytes(cfg)} bytes of shared "
                         f"memory; at most {rows.SMEM_BYTES - 1024}")  # fmt: skip
    for name, size, block in (("M", m, cfg.block_m), ("N", n, cfg.block_n), ("K", k, cfg.block_k)):
        if size % block:
            raise ValueError(f"matmul_dgelu needs {name} a multiple of {block}, got {size}")


def gelu_grad(x: jax.Array) -> jax.Array:
    """d/dx of GPT-2's tanh GELU, x * 0.5 * (1 + tanh(u)), u = c (x + 0.044715 x^3):
    0.5 (1 + t) + 0.5 x u' (1 - t^2), t = tanh(u), with 0.5 x u' = 1.5 u - c x. Written in 3
    multiplies and 5 multiply-adds an element (the textbook form compiled to 7 multiplies, 4
    multiply-adds and an add: 0.05 ms of the kernel at GPT-2's batch 64, this one 0.02;
    benchmarks/RESULTS.md). u overflows float32 past |x| ~ 2e13 (NaN there, a diverged run)."""
    x2 = x * x
    u = x * (_GELU_C + (_GELU_C * 0.044715) * x2)
    t = jnp.tanh(u)
    return (0.5 + 0.5 * t) + (1.5 * u - _GELU_C * x) * (1.0 - t * t)


def _kernel(dy_g, w_g, h_g, dh_g, sm, *, cfg: Config, n_ctas: int):
    m, k = dy_g.shape
    tiles_n, steps = w_g.shape[1] // cfg.block_n, k // cfg.block_k
    p = jax.lax.axis_index("p")
    count = (m // cfg.block_m * tiles_n - 1 - p) // n_ctas + 1  # tiles p, p + n_ctas, ...

    def origin(i):  # (first row, first column) of tile i of this CUDA block
        t = p + i * n_ctas
        return (t // tiles_n) * cfg.block_m, jax.lax.rem(t, jnp.int32(tiles_n)) * cfg.block_n

    wg = jax.lax.axis_index("wg")

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        _copy_wg(dy_g, w_g, h_g, sm, count, origin, steps, cfg)

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        _compute_wg(dh_g, sm, wg, count, origin, steps, cfg)


def _slot(g, stages: int):
    return jax.lax.rem(g, jnp.int32(stages))


def _copy_wg(dy_g, w_g, h_g, sm, count, origin, steps: int, cfg: Config) -> None:
    """The copy warpgroup: ring step g (tile g // steps, k-block g % steps) into slot g % stages
    once its last use is released, arriving on the tile owner's barriers; each tile's h into its
    owner's output buffer."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages

    def tile(i, g):
        m0, n0 = origin(i)
        owner = jax.lax.rem(i, jnp.int32(COMPUTE_WGS))

        def step(kk, g):
            slot = _slot(g, stages)
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(sm["free"].at[slot]))
            bar = owner * stages + slot
            plgpu.copy_gmem_to_smem(dy_g.at[pl.ds(m0, bm), pl.ds(kk * bk, bk)],
                                    sm["dy"].at[slot], sm["dy_bar"].at[bar])  # fmt: skip
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(kk * bk, bk), pl.ds(n0, bn)],
                                    sm["w"].at[slot], sm["w_bar"].at[bar])  # fmt: skip

            # h once the owner has started this tile (its last store has then read the buffer):
            # waited for once the ring is full, it lands during the tile's matmuls
            @pl.when(kk == min(stages, steps) - 1)
            def _():
                pl.when(i >= COMPUTE_WGS)(lambda: plgpu.barrier_wait(sm["h_free"].at[owner]))
                plgpu.copy_gmem_to_smem(h_g.at[pl.ds(m0, bm), pl.ds(n0, bn)],
                                        sm["out"].at[owner], sm["h_bar"].at[owner])  # fmt: skip

            return g + 1

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(steps), step, g)

    g = jax.lax.fori_loop(jnp.int32(0), count, tile, jnp.int32(0))

    def drain(i, carry):  # observe every release
        plgpu.barrier_wait(sm["free"].at[_slot(i, stages)])
        return carry

    jax.lax.fori_loop(jnp.maximum(g - stages, 0), g, drain, None)


def _compute_wg(dh_g, sm, wg, count, origin, steps: int, cfg: Config) -> None:
    """Compute warpgroup wg: tiles wg, wg + 2, ... of the CUDA block, each accumulated in
    float32 (wgmma, one k-block in flight while the next is issued), then multiplied by gelu'(h)
    and stored from the output buffer without waiting."""
    stages, out = cfg.stages, sm["out"].at[wg]

    def tile(j, carry):
        i = COMPUTE_WGS * j + wg
        m0, n0 = origin(i)
        base = i * steps  # the ring step of the tile's first k-block

        def matmuls(acc_ref):
            def step(kk, carry):
                slot = _slot(base + kk, stages)
                plgpu.barrier_wait(sm["dy_bar"].at[wg * stages + slot])
                plgpu.barrier_wait(sm["w_bar"].at[wg * stages + slot])
                plgpu.wgmma(acc_ref, sm["dy"].at[slot], sm["w"].at[slot])

                @pl.when((kk == 0) & (j > 0))
                def _():  # the last tile's dh has left `out`: the next h may come in
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(sm["h_free"].at[wg])

                plgpu.wgmma_wait(1)  # the previous k-block's matmul is done: release it
                last = sm["free"].at[_slot(base + kk - 1, stages)]
                pl.when(kk > 0)(lambda: plgpu.barrier_arrive(last))
                return carry

            jax.lax.fori_loop(jnp.int32(0), jnp.int32(steps), step, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(sm["free"].at[_slot(base + steps - 1, stages)])
            return acc_ref[...]

        acc = pl.run_scoped(matmuls, plgpu.ACC((cfg.block_m, cfg.block_n), jnp.float32))
        plgpu.barrier_wait(sm["h_bar"].at[wg])
        h = rows.cast(out[...], plgpu.Layout.WGMMA).astype(jnp.float32)
        out[...] = (acc * gelu_grad(h)).astype(dh_g.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, dh_g.at[pl.ds(m0, cfg.block_m), pl.ds(n0, cfg.block_n)])
        return carry

    jax.lax.fori_loop(jnp.int32(0), (count - wg + 1) // COMPUTE_WGS, tile, None)
    plgpu.wait_smem_to_gmem(0)


def matmul_dgelu(dy: jax.Array, w: jax.Array, h: jax.Array, cfg: Config | None = None,
                 interpret: Any = None) -> jax.Array:  # fmt: skip
    """(dy @ w) * gelu'(h): dy (M, K), w (K, N), h (M, N) -> (M, N) in h's dtype.

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    (m, k), n, cfg = dy.shape, w.shape[1], cfg or Config()
    check(cfg, m, n, k)
    n_ctas = min(m // cfg.block_m * (n // cfg.block_n), cfg.ctas or core_count())
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    st = cfg.stages
    scratch = dict(
        dy=plgpu.SMEM((st, cfg.block_m, cfg.block_k), dy.dtype, **swizzled),
        w=plgpu.SMEM((st, cfg.block_k, cfg.block_n), w.dtype, **swizzled),
        out=plgpu.SMEM((COMPUTE_WGS, cfg.block_m, cfg.block_n), h.dtype, **swizzled),
        dy_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS * st),  # per owner: each waits its own
        w_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS * st),
        free=plgpu.Barrier(num_barriers=st),
        h_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        h_free=plgpu.Barrier(num_barriers=COMPUTE_WGS),
    )

    def kernel(dy_g, w_g, h_g, dh_g, **sm):
        _kernel(dy_g, w_g, h_g, dh_g, sm, cfg=cfg, n_ctas=n_ctas)

    out_type = jax.ShapeDtypeStruct((m, n), h.dtype)
    return rows.launch(kernel, "matmul_dgelu_mgpu", out_type, scratch, {"p": n_ctas}, 0, interpret,
                       (dy, w, h), approx_math=True, threads=COMPUTE_WGS + 1)  # fmt: skip
