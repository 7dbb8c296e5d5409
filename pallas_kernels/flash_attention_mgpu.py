"""Flash attention forward on Pallas' Mosaic GPU lowering (Hopper, FlashAttention-3 structure).

q, k, v (B, T, H, D) bfloat16/float16, D in {64, 128}. One CUDA block owns 2 * block_q queries of
one (batch, head) and runs three warpgroups: warpgroups 0 and 1 each compute block_q queries,
warpgroup 2 only issues TMA copies of the K and V blocks into a ring of `stages` shared-memory
slots. Per key block a compute warpgroup does

  S = Q K^T (wgmma, f32)  ->  online softmax in f32 (base 2, the 1/sqrt(D) scale folded into the
  exp2 constant)  ->  O += P V (wgmma, P from registers)

and releases the slot with "consumed" barriers the copy warpgroup waits on before refilling it.
A schedule barrier alternates the two compute warpgroups, so that one's softmax overlaps the
other's matmuls. Causal: key blocks past a warpgroup's last query are skipped, blocks wholly
below its diagonal run unmasked and only the diagonal block(s) are masked; the copy warpgroup
loads the blocks the later of the two warpgroups needs, and the earlier one steps through the
rest without computing (waits and arrivals only, which keep every barrier's phases in step).
Q tiles run longest first (reverse order) so that short causal tiles fill the tail of the grid.

Memory traffic (causal, n = T / (2 * block_q) query tiles, s bytes per element): read q and write
o once (2 * B*T*H*D * s), read K and V once per query tile up to its diagonal (about
(n + 1) / 2 * 2 * B*T*H*D * s), write lse (4 * B*H*T bytes).
Outputs: o (B, T, H, D) and lse (B, H, T) float32, the natural-log logsumexp of each query's
scaled scores (what the backward needs to recompute P). Refused (ValueError): other head dims,
T not a multiple of 2 * block_q and of block_kv.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .common import i32

COMPUTE_WGS = 2
HEAD_DIMS = (64, 128)


class Config(NamedTuple):
    block_q: int = 64  # queries per compute warpgroup (a CUDA block holds 2 * block_q)
    block_kv: int = 128  # keys per K/V block
    stages: int = 2  # K/V blocks in flight (shared-memory ring slots)


# head dim -> forward config (to be replaced by measured tables in tuning/ once timed)
CONFIGS = {64: Config(64, 128, 2), 128: Config(64, 128, 2)}


def smem_bytes(cfg: Config, d: int, itemsize: int = 2) -> int:
    """Shared memory of one CUDA block: Q/O tiles, the K and V rings, lse rows."""
    return (COMPUTE_WGS * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * d * itemsize + (
        COMPUTE_WGS * cfg.block_q * 4
    )


def check(cfg: Config, t: int, d: int) -> None:
    """Stages >= 2: a warpgroup waits for the next K block before it releases this V block."""
    if d not in HEAD_DIMS:
        raise ValueError(f"flash attention needs head dim D in {HEAD_DIMS}, got D = {d}")
    if cfg.block_q != 64 or cfg.block_kv not in (64, 128) or cfg.stages < 2:
        raise ValueError(f"invalid flash attention config {cfg}: block_q 64, block_kv 64 or 128, "
                         "stages >= 2")  # fmt: skip
    if smem_bytes(cfg, d) > rows.SMEM_BYTES:
        raise ValueError(f"flash attention config {cfg} needs {smem_bytes(cfg, d)} bytes of shared "
                         f"memory at D = {d}; at most {rows.SMEM_BYTES}")  # fmt: skip
    if t % (COMPUTE_WGS * cfg.block_q) or t % cfg.block_kv:
        raise ValueError(f"flash attention needs T to be a multiple of {COMPUTE_WGS * cfg.block_q} "
                         f"and of {cfg.block_kv}, got T = {t}")  # fmt: skip


def _take_turn(sched) -> None:
    """The compute warpgroups alternate on the tensor cores (a two-arrival barrier)."""
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)


def _kernel(q_g, k_g, v_g, o_g, lse_g, sm, *, cfg: Config, scale: float, causal: bool):
    t = q_g.shape[1]
    n_q = t // (COMPUTE_WGS * cfg.block_q)
    b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")
    qi = n_q - 1 - jax.lax.axis_index("q")  # longest causal tiles first
    wg = jax.lax.axis_index("wg")
    # key blocks this CUDA block loads (both compute warpgroups step through all of them);
    # block_kv divides 2 * block_q. int32 also under jax_enable_x64, as the axis indices.
    n_kv = i32(
        (qi + 1) * (COMPUTE_WGS * cfg.block_q) // cfg.block_kv if causal else t // cfg.block_kv
    )

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        q0 = qi * (COMPUTE_WGS * cfg.block_q) + wg * cfg.block_q
        _compute_wg(q_g, o_g, lse_g, sm, wg, b, h, q0, n_kv, cfg=cfg, scale=scale, causal=causal)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        _copy_wg(k_g, v_g, sm, b, h, n_kv, cfg)


def _compute_wg(q_g, o_g, lse_g, sm, wg, b, h, q0, n_kv, *, cfg: Config, scale: float,
                causal: bool):  # fmt: skip
    """Queries q0 .. q0 + block_q - 1 of (b, h): o and lse."""
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    dtype, d = q_g.dtype, q_g.shape[3]
    k_bar, v_bar, sched = sm["k_bar"], sm["v_bar"], sm["sched"]
    q_s, lse_s = sm["qo"].at[wg], sm["lse"].at[wg]
    own = (q0 + bq + bkv - 1) // bkv if causal else n_kv  # key blocks with keys <= the last query
    plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(q0, bq), h], q_s, sm["q_bar"].at[wg])
    plgpu.barrier_wait(sm["q_bar"].at[wg])
    row = plgpu.Layout.WGMMA.reduce(1)
    m = rows.cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)  # running max, log2 units
    l = rows.cast(jnp.zeros((bq,), jnp.float32), row)  # running sum of exp2
    acc = rows.cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
    c = scale * math.log2(math.e)  # exp(scale * s) = exp2(c * s)
    plgpu.barrier_wait(k_bar.at[0])
    pl.when(wg == 1)(lambda: _take_turn(sched))

    def step(kv, carry, masked: bool):
        acc, m, l = carry
        slot = jax.lax.rem(kv, jnp.int32(stages))

        def qk(ref):
            plgpu.wgmma(ref, q_s, plgpu.transpose_ref(sm["k"].at[slot], (1, 0)))
            _take_turn(sched)
            return ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))  # (bq, bkv)
        plgpu.barrier_arrive(sm["k_free"].at[slot])
        if masked:
            qid = rows.iota((bq, bkv), 0, plgpu.Layout.WGMMA) + q0
            kid = rows.iota((bq, bkv), 1, plgpu.Layout.WGMMA) + kv * bkv
            s = jnp.where(kid <= qid, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1) * c)  # finite: each row has a key <= its query
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * c - jax.lax.broadcast_in_dim(m_new, s.shape, [0]))  # one FMA
        l = l * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        p = p.astype(dtype)
        acc, l, m_new, p = jax.lax.optimization_barrier((acc, l, m_new, p))
        plgpu.barrier_arrive(sched)  # softmax done
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_wait(sched)  # tensor cores free

        def pv(ref):
            plgpu.wgmma(ref, p, sm["v"].at[slot])

            @pl.when(kv + 1 < own)
            def _():
                plgpu.barrier_wait(k_bar.at[jax.lax.rem(kv + 1, jnp.int32(stages))])

        acc = rows.acc_mma(acc, pv)
        plgpu.barrier_arrive(sm["v_free"].at[slot])
        return acc, m_new, l

    def skip(kv, carry):  # a block only the other warpgroup needs: barriers only
        slot = jax.lax.rem(kv, jnp.int32(stages))
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        plgpu.barrier_arrive(sm["k_free"].at[slot])
        plgpu.barrier_arrive(sm["v_free"].at[slot])
        _take_turn(sched)
        _take_turn(sched)
        return carry

    carry = (acc, m, l)
    if causal:
        below = q0 // bkv  # blocks with every key <= the warpgroup's first query
        carry = jax.lax.fori_loop(jnp.int32(0), below, lambda i, c: step(i, c, False), carry)
        carry = jax.lax.fori_loop(below, own, lambda i, c: step(i, c, True), carry)
        jax.lax.fori_loop(own, n_kv, skip, None)
    else:
        carry = jax.lax.fori_loop(jnp.int32(0), n_kv, lambda i, c: step(i, c, False), carry)
    acc, m, l = carry
    pl.when(wg == 0)(lambda: _take_turn(sched))

    acc = acc * jax.lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
    q_s[...] = acc.astype(dtype)  # O reuses Q's buffer
    lse_s[...] = (m + jnp.log2(l)) * math.log(2.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, o_g.at[b, pl.ds(q0, bq), h])
    plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, pl.ds(q0, bq)])
    plgpu.wait_smem_to_gmem(0)


def _copy_wg(k_g, v_g, sm, b, h, n_kv, cfg: Config):
    """K/V blocks 0 .. n_kv - 1 of (b, h) through the ring of `stages` slots."""
    views = {name: (lambda i, ref=ref: ref.at[b, pl.ds(i * cfg.block_kv, cfg.block_kv), h])
             for name, ref in (("k", k_g), ("v", v_g))}  # fmt: skip
    _ring_copy(sm, views, ("k_free", "v_free"), n_kv, cfg.stages)


def _ring_copy(sm, views: dict, frees: tuple[str, ...], n, stages: int):
    """Copy warpgroup: step i = 0 .. n - 1 loads views[name](i) into slot i % stages of ring
    sm[name] (arriving on sm[name + "_bar"]) once the consumers released the slot's previous
    step on every barrier in `frees`; then waits for the last releases, so that every barrier
    phase is observed."""

    def load(i, slot):
        for name, view in views.items():
            plgpu.copy_gmem_to_smem(view(i), sm[name].at[slot], sm[f"{name}_bar"].at[slot])

    def wait_free(i):
        slot = jax.lax.rem(i, jnp.int32(stages))
        for name in frees:
            plgpu.barrier_wait(sm[name].at[slot])
        return slot

    for i in range(stages):
        pl.when(jnp.int32(i) < n)(lambda i=i: load(jnp.int32(i), jnp.int32(i)))

    def refill(i, carry):  # step i + stages into step i's slot
        load(i + stages, wait_free(i))
        return carry

    def drain(i, carry):
        wait_free(i)
        return carry

    refills = jnp.maximum(n - stages, 0)
    jax.lax.fori_loop(jnp.int32(0), refills, refill, None)
    jax.lax.fori_loop(refills, n, drain, None)


def forward(q, k, v, cfg: Config, scale: float, causal: bool, interpret: Any = None):
    """(o (B, T, H, D), lse (B, H, T) float32) of q, k, v (B, T, H, D).

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    bsz, t, n_heads, d = q.shape
    check(cfg, t, d)
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    kv_ring = (cfg.stages, cfg.block_kv, d)
    scratch = dict(
        qo=plgpu.SMEM((COMPUTE_WGS, cfg.block_q, d), q.dtype, **swizzled),
        k=plgpu.SMEM(kv_ring, q.dtype, **swizzled),
        v=plgpu.SMEM(kv_ring, q.dtype, **swizzled),
        lse=plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32),
        q_bar=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        k_bar=plgpu.Barrier(num_barriers=cfg.stages),
        v_bar=plgpu.Barrier(num_barriers=cfg.stages),
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),
        sched=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )

    def kernel(q_g, k_g, v_g, o_g, lse_g, **sm):
        _kernel(q_g, k_g, v_g, o_g, lse_g, sm, cfg=cfg, scale=scale, causal=causal)

    out_type = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((bsz, n_heads, t), jnp.float32),
    )
    grid = {"h": n_heads, "q": t // (COMPUTE_WGS * cfg.block_q), "b": bsz}
    return rows.launch(kernel, "flash_attention_fwd_mgpu", out_type, scratch, grid, 0, interpret,
                       (q, k, v), approx_math=True, threads=COMPUTE_WGS + 1)  # fmt: skip
