"""GELU in the epilogues of the MLP's GEMMs, on Pallas' Mosaic GPU lowering (Hopper).

Forward (`matmul_gelu`): h = x @ w + b and a = gelu(h): x (M, K), w (K, N) 16-bit, b (N,)
float32 -> h, a (M, N) in x's dtype, from one float32 accumulator (what cuBLAS's GELU-aux-bias
epilogue writes). Backward (`matmul_dgelu`): dh = (dy @ w) * gelu'(h): dy (M, K), w (K, N), h
(M, N) -> dh (M, N) in h's dtype, the product multiplied by gelu'(h) (GPT-2's tanh form,
float32) before the one rounding. XLA's cuBLAS path writes dy @ w and reads it back in a second
kernel; here it never leaves the SM.

Persistent, "ping-pong" (CUTLASS's name): one CUDA block per SM runs the output tiles p, p + P,
... (P CUDA blocks; block_m x block_n each, column by column within each group of group_m
rows of tiles, row by row at group_m 1, so that CUDA blocks running together read the same
rows of the left operand and columns of w from L2; default_config groups only where w outgrows
L2). Warpgroup 2
streams the tiles' k-blocks, in tile order, through one ring of `stages` shared-memory slots;
tile i belongs to compute warpgroup i % 2, so the slots of the next tile fill while this one's
last matmuls run, and one warpgroup's epilogue overlaps the other's matmuls. Each compute
warpgroup owns a block_m x block_n output buffer. Backward: the copy warpgroup loads the
tile's h into it during the tile's matmuls, the epilogue overwrites it with dh in place and a
TMA store writes it out (the next h load waits until that store has read it). Forward: the
epilogue writes h into it, stores it, computes gelu(h) meanwhile, and writes and stores that
once h's store has read the buffer.

Memory traffic (s bytes per element): read h and write dh (backward) or write h and a
(forward) once, 2 M N s; read the left operand once per column of tiles and w once per row of
tiles, mostly from L2 (about M K s + K N s from memory where w stays in L2; otherwise w about
once per group of group_m rows of tiles); the GEMM alone writes M N s. At GPT-2's
shape on an H200 the backward takes 1.27x cuBLAS's time for dy @ w alone, against 1.7x for
cuBLAS's GEMM and XLA's fusion of gelu'; the matmuls alone run at cuBLAS's speed, and the
epilogue is not hidden, most of its excess h's load and dh's store; it is not bound by
shared-memory bandwidth (ncu: 59% of its peak; benchmarks/RESULTS.md). The forward takes 0.92x
the time of cuBLAS's GEMM with its GELU-aux-bias epilogue (1.30x its plain GEMM).
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
    group_m: int = 1  # rows of tiles per group (default_config): a wave spans fewer columns of w


GROUP_W_BYTES = 32 * 2**20  # w larger than this: tiles in groups of 8 rows of tiles


def default_config(k: int, n: int, itemsize: int = 2) -> Config:
    """The kernels' config for w (K, N). A row of tiles after another (group_m 1) has the
    CUDA blocks running together read all of w, which then comes from memory once per row of
    tiles where it does not stay in L2 (50 MB); groups of 8 rows of tiles read it once per
    group. At 32768 rows, bf16, H200 (benchmarks/RESULTS.md, 2026-11-30): w 2560 x 10240
    (52 MB) 3.23 -> 2.84 ms backward, 3.26 -> 2.87 forward; w 1280 x 5120 (13 MB) 0.77 -> 0.79
    backward, 0.78 either way forward. The threshold lies between those; 20-52 MB untimed."""
    return Config(group_m=8) if k * n * itemsize > GROUP_W_BYTES else Config()


def smem_bytes(cfg: Config, itemsize: int = 2) -> int:
    """The ring's left-operand and w slots and the two compute warpgroups' output buffers."""
    ring = cfg.stages * (cfg.block_m + cfg.block_n) * cfg.block_k
    return (ring + COMPUTE_WGS * cfg.block_m * cfg.block_n) * itemsize


def check(cfg: Config, m: int, n: int, k: int, kernel: str = "matmul_dgelu") -> None:
    """A config against the GEMM's (M, N, K) and the shared memory; `kernel` names the caller."""
    if cfg.block_m != 128 or cfg.block_n not in (64, 128, 192) or cfg.block_k != 64:
        raise ValueError(f"invalid {kernel} config {cfg}: block_m 128, block_n 64, 128 or 192, "
                         "block_k 64")  # fmt: skip
    if cfg.stages < 2 or cfg.ctas < 0 or cfg.group_m < 1:
        raise ValueError(f"invalid {kernel} config {cfg}: stages >= 2, ctas >= 0, group_m >= 1")
    if smem_bytes(cfg) + 1024 > rows.SMEM_BYTES:
        raise ValueError(f"{kernel} config {cfg} needs {smem_bytes(cfg)} bytes of shared "
                         f"memory; at most {rows.SMEM_BYTES - 1024}")  # fmt: skip
    for name, size, block in (("M", m, cfg.block_m), ("N", n, cfg.block_n), ("K", k, cfg.block_k)):
        if size % block:
            raise ValueError(f"{kernel} needs {name} a multiple of {block}, got {size}")


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh GELU, x * 0.5 * (1 + tanh(c (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + jnp.tanh(x * (_GELU_C + (_GELU_C * 0.044715) * (x * x))))


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


def _kernel(lhs_g, w_g, h_g, sm, *, cfg: Config, n_ctas: int, epilogue):
    """lhs_g (M, K) @ w_g (K, N) by tiles; h_g the backward's h, loaded for each tile's epilogue
    (None: the forward); epilogue(acc, wg, m0, n0) writes a tile's outputs."""
    m, k = lhs_g.shape
    tiles_n, steps = w_g.shape[1] // cfg.block_n, k // cfg.block_k
    tiles_m, group = m // cfg.block_m, cfg.group_m * tiles_n
    p = jax.lax.axis_index("p")
    count = (tiles_m * tiles_n - 1 - p) // n_ctas + 1  # tiles p, p + n_ctas, ...

    def origin(i):  # (first row, first column) of tile i of this CUDA block
        t = p + i * n_ctas  # down the group's group_m rows of tiles, then the next column
        first = t // group * cfg.group_m
        rows_g = jnp.minimum(cfg.group_m, tiles_m - first)  # the last group may be shorter
        within = jax.lax.rem(t, jnp.int32(group))
        return (first + jax.lax.rem(within, rows_g)) * cfg.block_m, within // rows_g * cfg.block_n

    wg = jax.lax.axis_index("wg")

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        _copy_wg(lhs_g, w_g, h_g, sm, count, origin, steps, cfg)

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        _compute_wg(sm, wg, count, origin, steps, cfg, h_g is not None, epilogue)


def _slot(g, stages: int):
    return jax.lax.rem(g, jnp.int32(stages))


def _copy_wg(lhs_g, w_g, h_g, sm, count, origin, steps: int, cfg: Config) -> None:
    """The copy warpgroup: ring step g (tile g // steps, k-block g % steps) into slot g % stages
    once its last use is released, arriving on the tile owner's barriers; each tile's h (if
    any) into its owner's output buffer."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages

    def tile(i, g):
        m0, n0 = origin(i)
        owner = jax.lax.rem(i, jnp.int32(COMPUTE_WGS))

        def step(kk, g):
            slot = _slot(g, stages)
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(sm["free"].at[slot]))
            bar = owner * stages + slot
            plgpu.copy_gmem_to_smem(lhs_g.at[pl.ds(m0, bm), pl.ds(kk * bk, bk)],
                                    sm["lhs"].at[slot], sm["lhs_bar"].at[bar])  # fmt: skip
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(kk * bk, bk), pl.ds(n0, bn)],
                                    sm["w"].at[slot], sm["w_bar"].at[bar])  # fmt: skip

            if h_g is not None:  # h once the owner has started this tile (its last store has then
                # read the buffer): waited for once the ring is full, it lands during the matmuls

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


def _compute_wg(sm, wg, count, origin, steps: int, cfg: Config, loads_h: bool, epilogue):
    """Compute warpgroup wg: tiles wg, wg + 2, ... of the CUDA block, each accumulated in
    float32 (wgmma, one k-block in flight while the next is issued), then handed to the
    epilogue, whose stores are not waited for."""
    stages = cfg.stages

    def tile(j, carry):
        i = COMPUTE_WGS * j + wg
        m0, n0 = origin(i)
        base = i * steps  # the ring step of the tile's first k-block

        def matmuls(acc_ref):
            def step(kk, carry):
                slot = _slot(base + kk, stages)
                plgpu.barrier_wait(sm["lhs_bar"].at[wg * stages + slot])
                plgpu.barrier_wait(sm["w_bar"].at[wg * stages + slot])
                plgpu.wgmma(acc_ref, sm["lhs"].at[slot], sm["w"].at[slot])

                if loads_h:

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
        epilogue(acc, wg, m0, n0)
        return carry

    jax.lax.fori_loop(jnp.int32(0), (count - wg + 1) // COMPUTE_WGS, tile, None)
    plgpu.wait_smem_to_gmem(0)


def _launch(name, lhs, w, extra, out_type, cfg, interpret, body, loads_h: bool):
    """The kernel `name` over lhs (M, K) @ w (K, N): body(lhs_g, w_g, extra_g, *out_gs, sm,
    n_ctas=) with `extra` (h if `loads_h`, else b) as the third operand."""
    (m, k), n = lhs.shape, w.shape[1]
    check(cfg, m, n, k, name.removesuffix("_mgpu"))
    n_ctas = min(m // cfg.block_m * (n // cfg.block_n), cfg.ctas or core_count())
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    st = cfg.stages
    scratch = dict(
        lhs=plgpu.SMEM((st, cfg.block_m, cfg.block_k), lhs.dtype, **swizzled),
        w=plgpu.SMEM((st, cfg.block_k, cfg.block_n), w.dtype, **swizzled),
        out=plgpu.SMEM((COMPUTE_WGS, cfg.block_m, cfg.block_n), lhs.dtype, **swizzled),
        lhs_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS * st),  # per owner: each waits its own
        w_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS * st),
        free=plgpu.Barrier(num_barriers=st),
    )
    if loads_h:  # h's arrival in a compute warpgroup's buffer, and the buffer's release
        scratch.update(h_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS),
                       h_free=plgpu.Barrier(num_barriers=COMPUTE_WGS))  # fmt: skip

    def kernel(*refs, **sm):
        body(*refs, sm, n_ctas=n_ctas)

    return rows.launch(kernel, name, out_type, scratch, {"p": n_ctas}, 0, interpret,
                       (lhs, w, extra), approx_math=True, threads=COMPUTE_WGS + 1)  # fmt: skip


def matmul_dgelu(dy: jax.Array, w: jax.Array, h: jax.Array, cfg: Config | None = None,
                 interpret: Any = None) -> jax.Array:  # fmt: skip
    """(dy @ w) * gelu'(h): dy (M, K), w (K, N), h (M, N) -> (M, N) in h's dtype.

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    cfg = cfg or default_config(*w.shape, w.dtype.itemsize)

    def body(dy_g, w_g, h_g, dh_g, sm, n_ctas):
        def epilogue(acc, wg, m0, n0):
            out = sm["out"].at[wg]
            plgpu.barrier_wait(sm["h_bar"].at[wg])
            h = rows.cast(out[...], plgpu.Layout.WGMMA).astype(jnp.float32)
            out[...] = (acc * gelu_grad(h)).astype(dh_g.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, dh_g.at[pl.ds(m0, cfg.block_m), pl.ds(n0, cfg.block_n)])

        _kernel(dy_g, w_g, h_g, sm, cfg=cfg, n_ctas=n_ctas, epilogue=epilogue)

    out_type = jax.ShapeDtypeStruct((dy.shape[0], w.shape[1]), h.dtype)
    return _launch("matmul_dgelu_mgpu", dy, w, h, out_type, cfg, interpret, body, loads_h=True)


def matmul_gelu(x: jax.Array, w: jax.Array, b: jax.Array, cfg: Config | None = None,
                interpret: Any = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """(h, gelu(h)), h = x @ w + b: x (M, K), w (K, N), b (N,) float32 -> two (M, N) in x's
    dtype, both from the float32 h. `interpret` as in matmul_dgelu."""
    cfg = cfg or default_config(*w.shape, w.dtype.itemsize)

    def body(x_g, w_g, b_g, h_g, a_g, sm, n_ctas):
        def epilogue(acc, wg, m0, n0):
            out, tile = sm["out"].at[wg], (pl.ds(m0, cfg.block_m), pl.ds(n0, cfg.block_n))
            bias = rows.load(b_g.at[pl.ds(n0, cfg.block_n)], plgpu.Layout.WGMMA.reduce(0))
            h = acc + jax.lax.broadcast_in_dim(bias, acc.shape, [1])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's a has left `out`
            out[...] = h.astype(h_g.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, h_g.at[tile])
            a = gelu(h).astype(a_g.dtype)  # while h's store reads the buffer
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out[...] = a
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, a_g.at[tile])

        _kernel(x_g, w_g, None, sm, cfg=cfg, n_ctas=n_ctas, epilogue=epilogue)

    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return _launch("matmul_gelu_mgpu", x, w, b, (out, out), cfg, interpret, body, loads_h=False)
