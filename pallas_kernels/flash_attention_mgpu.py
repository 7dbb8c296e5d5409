"""Flash attention on Pallas' Mosaic GPU lowering (Hopper): forward (FlashAttention-3 structure)
and backward (`backward`: dq and dk/dv kernels, see its docstring).

q, k, v (B, T, H, D) bfloat16/float16, D in {64, 128}, or packed as one (B, T, 3, H, D) array
read in place (head offsets, `_inputs`; the backward then writes dk and dv into one (B, T, 2, H,
D) array). Both directions are persistent: one CUDA
block per SM (at most `Config.ctas`), each running its share of the tiles (in the forward 2 *
block_q queries of one (batch, head)) in pairs, a long causal tile with a short one (`_tiles`),
so that the shares are equal; where the tiles fit on the SMs, a CUDA block per tile. A forward
CUDA block runs three warpgroups: warpgroups 0 and 1 each compute block_q queries of a tile,
warpgroup 2 only issues TMA copies of the K and V blocks into a ring of `stages` shared-memory
slots. Per key block a compute warpgroup does

  S = Q K^T (wgmma, f32)  ->  online softmax in f32 (base 2, the 1/sqrt(D) scale folded into the
  exp2 constant)  ->  O += P V (wgmma, P from registers)

and releases the slot with "consumed" barriers the copy warpgroup waits on before refilling it.
The ring runs on across tiles, and each compute warpgroup issues its next tile's Q load as soon
as its last matmul is done and stores O and lse without waiting: a tile's start and end overlap
its neighbours' work (a CUDA block per tile at GPT-2's shape: 0.41 ms against 0.35 on an H200,
RESULTS.md). A schedule barrier alternates the two compute warpgroups, so that
one's softmax overlaps the other's matmuls. Causal: key blocks past a warpgroup's last query are
skipped, blocks wholly below its diagonal run unmasked and only the diagonal block(s) are
masked; the copy warpgroup loads the blocks the later of the two warpgroups needs, and the
earlier one steps through the rest without computing (waits and arrivals only, which keep every
barrier's phases in step).

Memory traffic (causal, n = T / (2 * block_q) query tiles, s bytes per element): read q and write
o once (2 * B*T*H*D * s), read K and V once per query tile up to its diagonal (about
(n + 1) / 2 * 2 * B*T*H*D * s, mostly from L2: CUDA blocks running together hold neighbouring
tiles of the same (batch, head)), write lse (4 * B*H*T bytes).
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
from .common import core_count, i32

COMPUTE_WGS = 2
HEAD_DIMS = (64, 128)


class Config(NamedTuple):
    block_q: int = 64  # queries per compute warpgroup (a CUDA block holds 2 * block_q)
    block_kv: int = 128  # keys per K/V block
    stages: int = 2  # K/V blocks in flight (shared-memory ring slots)
    ctas: int = 0  # at most this many CUDA blocks, each running a share of the tiles (0: the SMs)


# head dim -> forward config. 3 stages at head dim 64: fwd+bwd at GPT-2's shape 1.2376 ms against
# 1.2492 at 2, the forward 0.5-3% faster at 4 shapes of T 512-2048 (fwd+bwd 0.8% slower at 8 x
# 512 x 16 x 64, within its spread; H200, 2026-11-29, benchmarks/logs/flash_2026-11-29b); head
# dim 128 fits 2 in shared memory
CONFIGS = {64: Config(64, 128, 3), 128: Config(64, 128, 2)}


# barriers and the 1024-byte alignment of swizzled buffers (a config that passed the sums below
# by 0.5 KB failed to lower: 233,704 bytes used)
SMEM_SLACK = 2048


def smem_bytes(cfg: Config, d: int, itemsize: int = 2) -> int:
    """Shared memory of one CUDA block: Q and O tiles, the K and V rings, lse rows, slack."""
    return (2 * COMPUTE_WGS * cfg.block_q + 2 * cfg.stages * cfg.block_kv) * d * itemsize + (
        COMPUTE_WGS * cfg.block_q * 4 + SMEM_SLACK
    )


def _check(what: str, cfg: Any, min_stages: int, smem: int, tile: int, t: int, d: int) -> None:
    """A forward or backward config against head dim d, sequence length t, shared memory."""
    if d not in HEAD_DIMS:
        raise ValueError(f"flash attention needs head dim D in {HEAD_DIMS}, got D = {d}")
    if cfg.block_q != 64 or cfg.block_kv not in (64, 128) or cfg.stages < min_stages:
        raise ValueError(f"invalid {what} {cfg}: block_q 64, block_kv 64 or 128, stages >= "
                         f"{min_stages}")  # fmt: skip
    if cfg.ctas < 0:
        raise ValueError(f"invalid {what} {cfg}: ctas >= 0 (0: one per SM)")
    if smem > rows.SMEM_BYTES:
        raise ValueError(f"{what} {cfg} needs {smem} bytes of shared memory at D = {d}; at most "
                         f"{rows.SMEM_BYTES}")  # fmt: skip
    if t % tile:
        raise ValueError(f"{what} {cfg} needs T to be a multiple of {tile}, got T = {t}")


def check(cfg: Config, t: int, d: int) -> None:
    """Stages >= 2: a warpgroup waits for the next K block before it releases this V block."""
    tile = math.lcm(COMPUTE_WGS * cfg.block_q, cfg.block_kv)
    _check("flash attention config", cfg, 2, smem_bytes(cfg, d), tile, t, d)


def _take_turn(sched) -> None:
    """The compute warpgroups alternate on the tensor cores (a two-arrival barrier)."""
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)


def grid_size(bsz: int, n_heads: int, n: int, ctas: int) -> int:
    """CUDA blocks of a persistent kernel over B * H groups of n tiles (see _tiles): a tile each
    where the tiles fit in `ctas` (or one per SM), else `ctas` at most, one per unit of work."""
    n_tiles, most = bsz * n_heads * n, ctas or core_count()
    return n_tiles if n_tiles <= most else min((n_tiles + 1) // 2, most)


def _tiles(bsz: int, n_heads: int, n: int, n_ctas: int):
    """(tiles of this CUDA block, tile i -> (b, h, j)): the B * H * n tiles of a persistent
    kernel, n per (b, h) group, j their index in the group (a causal tile's work grows or falls
    with j).

    All tiles in one order: the groups, heads fastest, and in each the tiles j = n - 1, 0, n - 2,
    1, ...; consecutive pairs in that order are the units, each a long and a short tile (causal
    work about n + 1 blocks; with n odd a unit may span two groups and be less even), and CUDA
    block p runs units p, p + n_ctas, ... (both tiles of each). Equal units balance the CUDA
    blocks (a static round robin of single causal tiles does not); consecutive units share
    (b, h), so that CUDA blocks running together read the same streamed blocks from L2. With a
    CUDA block per tile (grid_size: where the tiles fit on the SMs) CUDA block p runs tile p
    alone: pairs would halve the CUDA blocks there."""
    n_tiles = bsz * n_heads * n
    p = jax.lax.axis_index("p")

    def at(tt):  # position in the order -> (b, h, j)
        k = jax.lax.rem(tt, jnp.int32(n))
        j = jnp.where(jax.lax.rem(k, jnp.int32(2)) == 0, n - 1 - k // 2, k // 2)
        g = tt // n
        return g // n_heads, jax.lax.rem(g, jnp.int32(n_heads)), j

    if n_ctas == n_tiles:
        return jnp.int32(1), lambda i: at(p)
    units = (n_tiles + 1) // 2
    mine = (units - 1 - p) // n_ctas + 1
    last = jax.lax.rem(units - 1 - p, jnp.int32(n_ctas)) == 0
    count = 2 * mine - jnp.int32(n_tiles % 2) * last  # an odd count: the last unit one tile

    def tile(i):
        return at(2 * (p + (i // 2) * n_ctas) + jax.lax.rem(i, jnp.int32(2)))

    return count, tile


def _kernel(q_g, k_g, v_g, o_g, lse_g, sm, *, cfg: Config, scale: float, causal: bool,
            n_ctas: int, heads: tuple[int, int, int]):  # fmt: skip
    bsz, t, n_heads = o_g.shape[:3]
    n_q = t // (COMPUTE_WGS * cfg.block_q)
    count, tiles = _tiles(bsz, n_heads, n_q, n_ctas)

    def tile(i):  # (b, h, query tile, key blocks to load)
        b, h, qi = tiles(i)
        # key blocks this CUDA block loads (both compute warpgroups step through all of them);
        # block_kv divides 2 * block_q. int32 also under jax_enable_x64, as the axis indices.
        n_kv = i32((qi + 1) * (COMPUTE_WGS * cfg.block_q) // cfg.block_kv if causal
                   else t // cfg.block_kv)  # fmt: skip
        return b, h, qi, n_kv

    wg = jax.lax.axis_index("wg")

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        _compute_wg(q_g, o_g, lse_g, sm, wg, count, tile, cfg=cfg, scale=scale, causal=causal,
                    q_head=heads[0])  # fmt: skip

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")

        def tile_views(i):  # one ring for all tiles: the next one's first blocks load early
            b, h, _, n_kv = tile(i)
            return _kv_views(k_g, v_g, b, h, cfg.block_kv, heads), n_kv

        _ring_tiles(sm, ("k_free", "v_free"), cfg.stages, count, tile_views)


def _masked(s, q0, k0, transposed: bool):
    """Scores s (queries, keys) or, transposed, (keys, queries) with keys > query at -inf."""
    qd, kd = (1, 0) if transposed else (0, 1)
    qid = rows.iota(s.shape, qd, plgpu.Layout.WGMMA) + q0
    kid = rows.iota(s.shape, kd, plgpu.Layout.WGMMA) + k0
    return jnp.where(kid <= qid, s, -jnp.inf)


def _compute_wg(q_g, o_g, lse_g, sm, wg, count, tile, *, cfg: Config, scale: float,
                causal: bool, q_head: int):  # fmt: skip
    """Compute warpgroup wg: block_q queries of each of the CUDA block's tiles. The next tile's Q
    load is issued once this tile's last matmul is done; O and lse leave through their own
    buffers without waiting, so both overlap the next tile."""
    bq, dtype = cfg.block_q, q_g.dtype
    q_s, o_s, lse_s = sm["q"].at[wg], sm["o"].at[wg], sm["lse"].at[wg]

    def load_q(i):
        b, h, qi, _ = tile(i)
        q0 = qi * (COMPUTE_WGS * bq) + wg * bq
        plgpu.copy_gmem_to_smem(q_g.at[b, pl.ds(q0, bq), h + q_head], q_s, sm["q_bar"].at[wg])

    load_q(jnp.int32(0))

    def run_tile(i, base):
        b, h, qi, n_kv = tile(i)
        q0 = qi * (COMPUTE_WGS * bq) + wg * bq
        plgpu.barrier_wait(sm["q_bar"].at[wg])
        acc, m, l = _attend(sm, wg, q0, base, n_kv, cfg=cfg, scale=scale, causal=causal,
                            dtype=dtype, d=q_g.shape[3])  # fmt: skip
        pl.when(i + 1 < count)(lambda: load_q(i + 1))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's o and lse are out
        o_s[...] = (acc * jax.lax.broadcast_in_dim(1.0 / l, acc.shape, [0])).astype(dtype)
        lse_s[...] = (m + jnp.log2(l)) * math.log(2.0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, pl.ds(q0, bq), h])
        plgpu.copy_smem_to_gmem(lse_s, lse_g.at[b, h, pl.ds(q0, bq)])
        return base + n_kv

    jax.lax.fori_loop(jnp.int32(0), count, run_tile, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _attend(sm, wg, q0, base, n_kv, *, cfg: Config, scale: float, causal: bool, dtype, d):
    """Unnormalised O (block_q, d) f32, running max m (log2 units) and sum l of queries q0 ..
    q0 + block_q - 1 against key blocks 0 .. n_kv - 1, streamed as ring steps base + kv."""
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    k_bar, v_bar, sched = sm["k_bar"], sm["v_bar"], sm["sched"]
    q_s = sm["q"].at[wg]
    own = (q0 + bq + bkv - 1) // bkv if causal else n_kv  # key blocks with keys <= the last query
    row = plgpu.Layout.WGMMA.reduce(1)
    m = rows.cast(jnp.full((bq,), -jnp.inf, jnp.float32), row)  # running max, log2 units
    l = rows.cast(jnp.zeros((bq,), jnp.float32), row)  # running sum of exp2
    acc = rows.cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
    c = scale * math.log2(math.e)  # exp(scale * s) = exp2(c * s)

    def slot_of(kv):
        return jax.lax.rem(base + kv, jnp.int32(stages))

    plgpu.barrier_wait(k_bar.at[slot_of(0)])
    pl.when(wg == 1)(lambda: _take_turn(sched))

    def step(kv, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(kv)

        def qk(ref):
            plgpu.wgmma(ref, q_s, sm["k"].at[slot].T)
            _take_turn(sched)
            return ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))  # (bq, bkv)
        plgpu.barrier_arrive(sm["k_free"].at[slot])
        if masked:
            s = _masked(s, q0, kv * bkv, transposed=False)
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
                plgpu.barrier_wait(k_bar.at[slot_of(kv + 1)])

        acc = rows.acc_mma(acc, pv)
        plgpu.barrier_arrive(sm["v_free"].at[slot])
        return acc, m_new, l

    def skip(kv, carry):  # a block only the other warpgroup needs: barriers only
        slot = slot_of(kv)
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
    pl.when(wg == 0)(lambda: _take_turn(sched))
    return carry


def _kv_views(k_g, v_g, b, h, bkv: int, heads: tuple[int, int, int]) -> dict:
    """name -> (s -> streamed block s of K / V of (b, h): keys s * bkv .. (s + 1) * bkv - 1;
    head h of K is head heads[1] + h of k_g, of V heads[2] + h of v_g)."""
    return {name: (lambda s, ref=ref, hh=h + off: ref.at[b, pl.ds(s * bkv, bkv), hh])
            for name, ref, off in (("k", k_g, heads[1]), ("v", v_g, heads[2]))}  # fmt: skip


def _ring_tiles(sm, frees: tuple[str, ...], stages: int, count, tile_views) -> None:
    """Copy warpgroup: the streamed blocks of the CUDA block's `count` tiles through one ring
    (tile_views(i) -> (views, blocks) of tile i; _ring_load), then _ring_drain."""

    def copy_tile(i, g):
        views, n = tile_views(i)
        return _ring_load(sm, views, frees, n, stages, g)

    _ring_drain(sm, frees, jax.lax.fori_loop(jnp.int32(0), count, copy_tile, jnp.int32(0)), stages)


def _ring_load(sm, views: dict, frees: tuple[str, ...], n, stages: int, g0):
    """Copy warpgroup: step i = 0 .. n - 1 loads views[name](i) into slot (g0 + i) % stages of
    ring sm[name] (arriving on sm[name + "_bar"]), once the consumers released the slot's
    previous step on every barrier in `frees`. Returns g0 + n, the next ring step."""

    def load(i, g):
        slot = jax.lax.rem(g, jnp.int32(stages))

        @pl.when(g >= stages)
        def _():
            for name in frees:
                plgpu.barrier_wait(sm[name].at[slot])

        for name, view in views.items():
            plgpu.copy_gmem_to_smem(view(i), sm[name].at[slot], sm[f"{name}_bar"].at[slot])
        return g + 1

    return jax.lax.fori_loop(jnp.int32(0), n, load, g0)


def _ring_drain(sm, frees: tuple[str, ...], g, stages: int):
    """Wait for the releases of the last `stages` ring steps before g, so that every barrier
    phase is observed."""

    def drain(i, carry):
        for name in frees:
            plgpu.barrier_wait(sm[name].at[jax.lax.rem(i, jnp.int32(stages))])
        return carry

    jax.lax.fori_loop(jnp.maximum(g - stages, 0), g, drain, None)


def _inputs(q, k, v) -> tuple[tuple, tuple[int, int, int], tuple[int, ...]]:
    """(the kernels' q/k/v operands, the head offset of q, k, v in them, (B, T, H, D)): q, k, v
    (B, T, H, D) apart, or q packed (B, T, 3, H, D) and k = v = None, read in place as heads
    h, H + h, 2H + h of its (B, T, 3H, D) view (a fused q/k/v projection's output, no copy)."""
    if k is None and v is None:
        bsz, t, _, n_heads, d = q.shape
        packed = q.reshape(bsz, t, 3 * n_heads, d)
        return (packed,), (0, n_heads, 2 * n_heads), (bsz, t, n_heads, d)
    return (q, k, v), (0, 0, 0), q.shape


def _qkv_refs(refs, n: int) -> tuple:
    """The kernel's q, k, v refs from its first n (1: packed, 3: apart) and the rest."""
    return (refs[0],) * 3 + refs[1:] if n == 1 else refs


def forward(q, k, v, cfg: Config, scale: float, causal: bool, interpret: Any = None):
    """(o (B, T, H, D), lse (B, H, T) float32) of q, k, v (B, T, H, D), or of q packed
    (B, T, 3, H, D) with k = v = None (_inputs).

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    ins, heads, (bsz, t, n_heads, d) = _inputs(q, k, v)
    check(cfg, t, d)
    swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    kv_ring = (cfg.stages, cfg.block_kv, d)
    own = (COMPUTE_WGS, cfg.block_q, d)
    scratch = dict(
        q=plgpu.SMEM(own, q.dtype, **swizzled),
        o=plgpu.SMEM(own, q.dtype, **swizzled),
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

    def kernel(*refs, **sm):
        _kernel(*_qkv_refs(refs, len(ins)), sm, cfg=cfg, scale=scale, causal=causal,
                n_ctas=n_ctas, heads=heads)  # fmt: skip

    out_type = (
        jax.ShapeDtypeStruct((bsz, t, n_heads, d), q.dtype),
        jax.ShapeDtypeStruct((bsz, n_heads, t), jnp.float32),
    )
    n_ctas = grid_size(bsz, n_heads, t // (COMPUTE_WGS * cfg.block_q), cfg.ctas)
    grid = {"p": n_ctas}
    return rows.launch(kernel, "flash_attention_fwd_mgpu", out_type, scratch, grid, 0, interpret,
                       ins, approx_math=True, threads=COMPUTE_WGS + 1)  # fmt: skip


# ---------------------------------------------------------------- backward


class BwdConfig(NamedTuple):
    block_q: int = 64  # queries per compute warpgroup (dq kernel) or per streamed block (dk/dv)
    block_kv: int = 64  # keys per compute warpgroup (dk/dv kernel) or per streamed block (dq)
    # streamed blocks in flight (shared-memory ring slots); 3: GPT-2's shape fwd+bwd 1.545 ms
    # against 1.672 at 2 (H100, 2026-11-27, benchmarks/logs/flash_2026-11-27)
    stages: int = 3
    ctas: int = 0  # at most this many CUDA blocks a kernel, each running a share of the tiles
    # (0: the SMs)


def bwd_smem_bytes(cfg: BwdConfig, d: int, itemsize: int = 2) -> int:
    """Shared memory of the larger backward kernel's CUDA block: own tiles per compute warpgroup
    (q, do, o, dq; k, v) and two rings of `stages` streamed tiles (+ float32 lse and delta rows,
    slack)."""
    bq, bkv, st, w = cfg.block_q, cfg.block_kv, cfg.stages, COMPUTE_WGS
    dq = (4 * w * bq + 2 * st * bkv) * d * itemsize + 8 * w * bq
    dkv = (2 * w * bkv + 2 * st * bq) * d * itemsize + 8 * st * bq
    return max(dq, dkv) + SMEM_SLACK


def check_bwd(cfg: BwdConfig, t: int, d: int) -> None:
    """block_q 128 (128-row tiles per warpgroup in the dq kernel) is refused: its benchmark cell
    did not finish in minutes on an H200 (not investigated)."""
    tile = COMPUTE_WGS * max(cfg.block_q, cfg.block_kv)
    _check("flash attention backward config", cfg, 1, bwd_smem_bytes(cfg, d), tile, t, d)


def _mms(shape, operands, then):
    """then(*refs): a @ b for (a, b) in operands (shared-memory refs) issued into fresh float32
    `shape` accumulators, one wgmma group each in order, not waited for (rows.acc_load waits)."""

    def run(*refs):
        for ref, (a, b) in zip(refs, operands, strict=True):
            plgpu.wgmma(ref, a, b)
        return then(*refs)

    return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * len(operands))


def _load_own(sm, wg, views: dict, wait: bool = True) -> None:
    """Compute warpgroup wg's own tiles into sm[name].at[wg] (one TMA each), waited for unless
    `wait` is False (then _wait_own(sm, wg, len(views)) waits)."""
    n = len(views)
    for i, (name, view) in enumerate(views.items()):
        plgpu.copy_gmem_to_smem(view, sm[name].at[wg], sm["own_bar"].at[wg * n + i])
    if wait:
        _wait_own(sm, wg, n)


def _wait_own(sm, wg, n: int) -> None:
    for i in range(n):
        plgpu.barrier_wait(sm["own_bar"].at[wg * n + i])


def _skip(sm, names: tuple[str, ...], stages: int, base):
    """A streamed block (ring step base + i) only the other compute warpgroup needs: its arrivals
    waited for and its slot released, so that every barrier phase is observed."""

    def skip(i, carry):
        slot = jax.lax.rem(base + i, jnp.int32(stages))
        for name in names:
            plgpu.barrier_wait(sm[f"{name}_bar"].at[slot])
        plgpu.barrier_arrive(sm["free"].at[slot])
        return carry

    return skip


def _roles(copy, compute) -> None:
    """Warpgroup COMPUTE_WGS runs copy() on few registers, the others compute(wg)."""
    wg = jax.lax.axis_index("wg")

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        copy()

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(232, action="increase")
        compute(wg)


def _dq_kernel(q_g, k_g, v_g, do_g, lse_g, o_g, dq_g, delta_g, sm, *, cfg: BwdConfig,
               scale: float, causal: bool, n_ctas: int, heads: tuple[int, int, int]):  # fmt: skip
    """dq, and delta = rowsum(o * do) for the dk/dv kernel, of tiles of 2 * block_q queries of
    one (b, h), block_q per compute warpgroup, persistent (_tiles): a loop over the key blocks
    up to the later warpgroup's diagonal; the earlier one skips the blocks past its own. The ring
    runs on across tiles."""
    bq, bkv, stages, t = cfg.block_q, cfg.block_kv, cfg.stages, do_g.shape[1]
    tile = COMPUTE_WGS * bq
    count, tiles = _tiles(do_g.shape[0], do_g.shape[2], t // tile, n_ctas)

    def n_kv_of(j):
        return i32((j * tile + tile + bkv - 1) // bkv if causal else t // bkv)

    def copy():
        def tile_views(i):
            b, h, j = tiles(i)
            return _kv_views(k_g, v_g, b, h, bkv, heads), n_kv_of(j)

        _ring_tiles(sm, ("free",), stages, count, tile_views)

    def compute(wg):
        def load_own(i):  # tile i's q, do, o, lse rows of this warpgroup, not waited for
            b, h, j = tiles(i)
            qs = pl.ds(j * tile + wg * bq, bq)
            _load_own(sm, wg, {"q": q_g.at[b, qs, h + heads[0]], "do": do_g.at[b, qs, h],
                               "o": o_g.at[b, qs, h], "lse": lse_g.at[b, h, qs]},
                      wait=False)  # fmt: skip

        load_own(jnp.int32(0))

        def run_tile(i, base):
            b, h, j = tiles(i)
            qs, n_kv = pl.ds(j * tile + wg * bq, bq), n_kv_of(j)
            _wait_own(sm, wg, 4)
            delta = _delta(sm, wg)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the last tile's delta is out
            sm["delta"].at[wg][...] = delta
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sm["delta"].at[wg], delta_g.at[b, h, qs])
            dq = _dq_tile(sm, wg, delta, j * tile + wg * bq, base, n_kv, cfg=cfg, scale=scale,
                          causal=causal, d=q_g.shape[3])  # fmt: skip
            pl.when(i + 1 < count)(lambda: load_own(i + 1))  # its last matmul is done
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dq is out
            dq_s = sm["dq"].at[wg]
            dq_s[...] = (dq * scale).astype(dq_g.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dq_s, dq_g.at[b, qs, h])
            return base + n_kv

        jax.lax.fori_loop(jnp.int32(0), count, run_tile, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    _roles(copy, compute)


def _delta(sm, wg) -> jax.Array:
    """rowsum(o * do) (block_q,) float32 of warpgroup wg's o and do tiles."""
    o, do = (rows.cast(sm[name].at[wg][...], plgpu.Layout.WGMMA) for name in ("o", "do"))
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=1)


def _dq_tile(sm, wg, delta, q0, base, n_kv, *, cfg: BwdConfig, scale: float, causal: bool,
             d: int):  # fmt: skip
    """dq / scale (block_q, d) f32 of queries q0 .. q0 + block_q - 1, whose q, do, lse are in
    warpgroup wg's buffers (delta (block_q,) given); key block kv is ring step base + kv."""
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    q_s, do_s = sm["q"].at[wg], sm["do"].at[wg]
    row = plgpu.Layout.WGMMA.reduce(1)
    lse = rows.load(sm["lse"].at[wg], row) * math.log2(math.e)  # (bq,), log2 units
    delta = rows.cast(delta, row)
    c = scale * math.log2(math.e)

    def step(kv, dq, masked: bool):
        slot = jax.lax.rem(base + kv, jnp.int32(stages))
        k_s, v_s = sm["k"].at[slot], sm["v"].at[slot]
        plgpu.barrier_wait(sm["k_bar"].at[slot])
        plgpu.barrier_wait(sm["v_bar"].at[slot])

        def d_scores(s_ref, dp_ref):  # dS (bq, bkv)
            s = rows.acc_load(s_ref, pending=1)  # S (bq, bkv); dP still on the tensor cores
            if masked:
                s = _masked(s, q0, kv * bkv, transposed=False)
            p = jnp.exp2(s * c - jax.lax.broadcast_in_dim(lse, s.shape, [0]))
            dp = rows.acc_load(dp_ref, pending=0)  # dP (bq, bkv)
            return p * (dp - jax.lax.broadcast_in_dim(delta, s.shape, [0]))

        ds = _mms((bq, bkv), ((q_s, k_s.T), (do_s, v_s.T)), d_scores)
        dq = rows.acc_mma(dq, lambda ref: plgpu.wgmma(ref, ds.astype(k_s.dtype), k_s))
        plgpu.barrier_arrive(sm["free"].at[slot])
        return dq

    dq = rows.cast(jnp.zeros((bq, d), jnp.float32), plgpu.Layout.WGMMA)
    below = q0 // bkv if causal else n_kv  # key blocks with every key <= the first query
    own = (q0 + bq + bkv - 1) // bkv if causal else n_kv  # ... with a key <= the last one
    dq = jax.lax.fori_loop(jnp.int32(0), below, lambda i, x: step(i, x, False), dq)
    dq = jax.lax.fori_loop(below, own, lambda i, x: step(i, x, True), dq)
    jax.lax.fori_loop(own, n_kv, _skip(sm, ("k", "v"), stages, base), None)
    return dq


def _dkv_kernel(q_g, k_g, v_g, do_g, lse_g, delta_g, dk_g, dv_g, sm, *, cfg: BwdConfig,
                scale: float, causal: bool, n_ctas: int, heads: tuple[int, ...]):  # fmt: skip
    """dk, dv of tiles of 2 * block_kv keys of one (b, h), block_kv per compute warpgroup,
    persistent (_tiles): a loop over the query blocks from the earlier warpgroup's diagonal to
    the end (the later one skips those wholly before its keys), computed transposed (keys along
    the rows): no register transposes. The ring runs on across tiles. `heads`: the head offsets
    of q, k, v in their refs, then of dk, dv in theirs."""
    bq, bkv, stages, t = cfg.block_q, cfg.block_kv, cfg.stages, do_g.shape[1]
    tile = COMPUTE_WGS * bkv
    count, tiles = _tiles(do_g.shape[0], do_g.shape[2], t // tile, n_ctas)

    def first_of(j):  # the first query block with a query >= the tile's first key
        return i32(j * tile // bq if causal else 0)

    def copy():
        def tile_views(i):
            b, h, j = tiles(i)
            first = first_of(j)

            def view(ref, hh=h):
                return lambda i: ref.at[b, pl.ds((first + i) * bq, bq), hh]

            def row_view(ref):
                return lambda i: ref.at[b, h, pl.ds((first + i) * bq, bq)]

            views = {"q": view(q_g, h + heads[0]), "do": view(do_g), "lse": row_view(lse_g),
                     "delta": row_view(delta_g)}  # fmt: skip
            return views, i32(t // bq) - first

        _ring_tiles(sm, ("free",), stages, count, tile_views)

    def compute(wg):
        def run_tile(i, base):
            b, h, j = tiles(i)
            first = first_of(j)
            _dkv_tile(k_g, v_g, dk_g, dv_g, sm, wg, b, h, j * tile + wg * bkv, first, base,
                      cfg=cfg, scale=scale, causal=causal, t=t, heads=heads)  # fmt: skip
            return base + i32(t // bq) - first

        jax.lax.fori_loop(jnp.int32(0), count, run_tile, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    _roles(copy, compute)


def _dkv_tile(k_g, v_g, dk_g, dv_g, sm, wg, b, h, k0, first, base, *, cfg: BwdConfig,
              scale: float, causal: bool, t: int, heads: tuple[int, ...]):  # fmt: skip
    """dk, dv of keys k0 .. k0 + block_kv - 1 of (b, h) against query blocks first .. T / block_q
    - 1; query block first + i is ring step base + i."""
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    names = ("q", "do", "lse", "delta")
    n = i32(t // bq) - first
    ks = pl.ds(k0, bkv)
    _load_own(sm, wg, {"k": k_g.at[b, ks, h + heads[1]], "v": v_g.at[b, ks, h + heads[2]]})
    k_s, v_s = sm["k"].at[wg], sm["v"].at[wg]
    col = plgpu.Layout.WGMMA.reduce(0)
    c = scale * math.log2(math.e)

    def step(i, carry, masked: bool):
        dk, dv = carry
        slot = jax.lax.rem(base + i, jnp.int32(stages))
        q_s, do_s = sm["q"].at[slot], sm["do"].at[slot]
        for name in names:
            plgpu.barrier_wait(sm[f"{name}_bar"].at[slot])

        def mma(refs):  # S^T, dP^T into fresh accumulators, dV += P^T dO, dK += dS^T Q
            dk_r, dv_r, st_r, dpt_r = refs
            plgpu.wgmma(st_r, k_s, q_s.T)  # S^T (bkv, bq)
            plgpu.wgmma(dpt_r, v_s, do_s.T)  # dP^T (bkv, bq)
            st = rows.acc_load(st_r, pending=1)  # dP^T still on the tensor cores
            if masked:
                st = _masked(st, (first + i) * bq, k0, transposed=True)
            lse = rows.load(sm["lse"].at[slot], col) * math.log2(math.e)
            delta = rows.load(sm["delta"].at[slot], col)
            pt = jnp.exp2(st * c - jax.lax.broadcast_in_dim(lse, st.shape, [1]))
            plgpu.wgmma(dv_r, pt.astype(q_s.dtype), do_s)  # dV += P^T dO
            dpt = rows.acc_load(dpt_r, pending=1)  # dV still on the tensor cores
            dst = pt * (dpt - jax.lax.broadcast_in_dim(delta, st.shape, [1]))
            plgpu.wgmma(dk_r, dst.astype(q_s.dtype), q_s)  # dK += dS^T Q

        dk, dv, _, _ = rows.acc_mma((dk, dv, zeros_t, zeros_t), mma)
        plgpu.barrier_arrive(sm["free"].at[slot])
        return dk, dv

    zeros = rows.cast(jnp.zeros((bkv, k_g.shape[3]), jnp.float32), plgpu.Layout.WGMMA)
    zeros_t = rows.cast(jnp.zeros((bkv, bq), jnp.float32), plgpu.Layout.WGMMA)
    # query blocks wholly before the keys are skipped; those holding a query < the last key
    # need the mask
    skipped = i32(k0 // bq) - first if causal else 0
    masked = i32((k0 + bkv - 1) // bq + 1) - first if causal else 0
    jax.lax.fori_loop(jnp.int32(0), skipped, _skip(sm, names, stages, base), None)
    carry = jax.lax.fori_loop(skipped, masked, lambda i, x: step(i, x, True), (zeros, zeros))
    dk, dv = jax.lax.fori_loop(masked, n, lambda i, x: step(i, x, False), carry)
    k_s[...] = (dk * scale).astype(dk_g.dtype)  # dk, dv reuse k's and v's buffers
    v_s[...] = dv.astype(dv_g.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_s, dk_g.at[b, ks, h + heads[3]])
    plgpu.copy_smem_to_gmem(v_s, dv_g.at[b, ks, h + heads[4]])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # before the next tile's k, v overwrite them


def backward(q, k, v, o, lse, do, cfg: BwdConfig, scale: float, causal: bool,
             interpret: Any = None):  # fmt: skip
    """(dq, dk, dv) (B, T, H, D) in q's dtype of the attention whose forward gave o and lse; of
    q packed (B, T, 3, H, D) with k = v = None (_inputs): (dq, dkv (B, T, 2, H, D)), dk and dv
    written by one kernel into one array (a fused projection's backward reads it in place).

    Two kernels, neither needing atomics, each with two compute warpgroups sharing what a third
    streams, both persistent like the forward (`_tiles`): dq (tiles of 2 * block_q queries; K/V
    blocks 0 .. diagonal streamed), which also computes delta = rowsum(o * do) (B, H, T) from
    its own o and do tiles and writes it, and dk/dv (tiles of 2 * block_kv keys; Q, dO, lse,
    delta blocks diagonal .. end streamed). Both recompute
    P = exp(scale * q k^T - lse) and dS = P * (dO V^T - delta); dq = scale * dS K, dv = P^T dO,
    dk = scale * dS^T Q; f32 accumulation, only the diagonal blocks masked. A step's exponentials
    run while its dP matmul is on the tensor cores, and in dk/dv its dS^T while dV's is.

    Memory traffic (causal, s bytes per element, N = B*T*H*D): dq reads q, do, o, lse once, K and
    V about (n + 1) / 2 times (N s each pass, n = T / (2 * block_q)) and writes dq and delta
    (4 B*H*T bytes); dk/dv reads k, v once, q and do (plus
    lse, delta) about (n + 1) / 2 times (n = T / (2 * block_kv)) and writes dk, dv. Compute: S
    and dP are recomputed in both kernels (7 matmuls of B*H*T^2*D / 2 causal, against a fused
    backward's 5)."""
    ins, heads, (bsz, t, n_heads, d) = _inputs(q, k, v)
    check_bwd(cfg, t, d)
    sw = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    bq, bkv, st, dt = cfg.block_q, cfg.block_kv, cfg.stages, q.dtype
    kw = dict(cfg=cfg, scale=scale, causal=causal)

    def ring(name, shape, dtype, **kw_):  # a ring of `stages` blocks, its arrival barriers
        return {name: plgpu.SMEM((st, *shape), dtype, **kw_),
                f"{name}_bar": plgpu.Barrier(num_barriers=st)}  # fmt: skip

    w = COMPUTE_WGS
    free = plgpu.Barrier(num_arrivals=w, num_barriers=st)
    dq_scratch = dict(
        q=plgpu.SMEM((w, bq, d), dt, **sw), do=plgpu.SMEM((w, bq, d), dt, **sw),
        o=plgpu.SMEM((w, bq, d), dt, **sw), dq=plgpu.SMEM((w, bq, d), dt, **sw),
        lse=plgpu.SMEM((w, bq), jnp.float32), delta=plgpu.SMEM((w, bq), jnp.float32),
        own_bar=plgpu.Barrier(num_barriers=4 * w), free=free,
        **ring("k", (bkv, d), dt, **sw), **ring("v", (bkv, d), dt, **sw),
    )  # fmt: skip

    dq_ctas = grid_size(bsz, n_heads, t // (w * bq), cfg.ctas)

    def dq_body(*refs, **sm):
        _dq_kernel(*_qkv_refs(refs, len(ins)), sm, **kw, n_ctas=dq_ctas, heads=heads)

    grads = jax.ShapeDtypeStruct((bsz, t, n_heads, d), dt)
    rows_f32 = jax.ShapeDtypeStruct((bsz, n_heads, t), jnp.float32)
    dq, delta = rows.launch(dq_body, "flash_attention_dq_mgpu", (grads, rows_f32), dq_scratch,
                            {"p": dq_ctas}, 0, interpret, (*ins, do, lse, o), approx_math=True,
                            threads=w + 1)  # fmt: skip
    dkv_scratch = dict(
        k=plgpu.SMEM((w, bkv, d), dt, **sw), v=plgpu.SMEM((w, bkv, d), dt, **sw),
        own_bar=plgpu.Barrier(num_barriers=2 * w), free=free,
        **ring("q", (bq, d), dt, **sw), **ring("do", (bq, d), dt, **sw),
        **ring("lse", (bq,), jnp.float32), **ring("delta", (bq,), jnp.float32),
    )  # fmt: skip

    dkv_ctas = grid_size(bsz, n_heads, t // (w * bkv), cfg.ctas)

    packed = len(ins) == 1
    out_heads = (0, n_heads) if packed else (0, 0)  # dk's and dv's in their outputs

    def dkv_body(*refs, **sm):
        refs = _qkv_refs(refs, len(ins))
        refs = refs + refs[-1:] if packed else refs  # one (B, T, 2H, D) output for dk and dv
        _dkv_kernel(*refs, sm, **kw, n_ctas=dkv_ctas, heads=heads + out_heads)

    out = jax.ShapeDtypeStruct((bsz, t, 2 * n_heads, d), dt) if packed else (grads, grads)
    dkv = rows.launch(dkv_body, "flash_attention_dkv_mgpu", out, dkv_scratch,
                      {"p": dkv_ctas}, 0, interpret, (*ins, do, lse, delta), approx_math=True,
                      threads=w + 1)  # fmt: skip
    return (dq, dkv.reshape(bsz, t, 2, n_heads, d)) if packed else (dq, *dkv)
