"""LayerNorm and RMSNorm (optionally with the fused residual add) on Pallas' Mosaic GPU lowering.

The Mosaic GPU counterpart of layer_norm_triton.py's kernels, same math and same outputs; it is
picked with `backend="mosaic_gpu"` on `layer_norm` / `add_layer_norm` / `rms_norm` /
`add_rms_norm`, which keep the custom VJP. RMSNorm is the same kernel bodies with `rms=True`
(beta None in `forward`, mean None in `backward`): no mean sweep (the first sweep sums x^2 instead
of x), no beta, no mean saved, no dbeta partials.

x (N, D), D % 128 == 0. The forward, where DIRECT_COLS says, gives each block of rows a program
of its own that reads it from global memory into registers and writes y and the statistics
back from them (rows_mgpu.direct_blocks; gamma and beta read by every row group). Otherwise each
program walks a contiguous run of `block_rows`-row blocks
(rows_mgpu.pipelined_blocks: one bulk TMA copy per block and operand into shared memory, a ring of
`stages` buffers, one bulk copy back per output), and computes a block `rows` rows at a time in
column chunks (rows_mgpu.row_layout): mean, then the centred variance, then the normalised output,
each a sweep over the row, so any D up to the shared memory budget works. A tile of whole rows is
read from shared memory once and held in registers for the three sweeps; chunked rows are re-read.
gamma/beta are copied into shared memory once per program, or read from global memory
(`global_params`) where that lets two programs share an SM. The backward recomputes xhat from the
saved mean/rstd, keeps per-program float32 dgamma/dbeta partials in shared memory (each thread adds
its own columns: no synchronisation) and writes them once; one small jnp.sum reduces them (no
atomics).

mean/rstd are saved per block, (blocks, round_up(block_rows, 32)) float32 (a copy moves a
multiple of 128 bytes); only this module's backward reads them. RMSNorm saves rstd only.

Minimal memory traffic, N rows of D, s bytes per element (as the Triton kernels):
  forward : read x, write y       = 2 * N * D * s  (+ 8 N for mean/rstd, + gamma/beta per program)
  backward: read x, dy; write dx  = 3 * N * D * s  (+ 8 N for mean/rstd, + 8 P D for partials)
  residual: + read h, write s forward; + read ds, write dh backward
  RMSNorm: the same, less 4 N for the mean, beta and the dbeta partials
Refused (ValueError): D % 128 != 0, and blocks that do not fit in shared memory (e.g. float32
rows above 6400 in the residual backward, above 7168 for RMSNorm).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import rows_mgpu as rows
from .layer_norm_common import kernel_name, operands


class Config(NamedTuple):
    block_rows: int  # rows per TMA block (a multiple of `rows`)
    rows: int  # rows computed together in registers (a power of two; 1 when chunk < D)
    chunk: int  # columns per register chunk: divides D, a multiple of 128
    programs_per_sm: int  # persistent programs per streaming multiprocessor
    stages: int = 2  # shared memory buffers per operand (2: copy the next block during compute)
    warp_rows: bool = False  # a warp per row (rows_mgpu.row_layout): slower for the norms
    direct: bool = False  # forward: rows_mgpu.direct_blocks, one block a program (N % rows == 0)
    global_params: bool = False  # forward: gamma, beta read from global memory (always if direct)


def rows_round(n: int) -> int:
    """Entries of a per-block statistics vector: a copy moves a multiple of 128 bytes."""
    return -(-n // 32) * 32


def _scratch_bytes(cfg: Config, backward: bool) -> int:
    """Cross-warp reduction scratch: room to exchange every row of a group at once (the
    backward sums two per row)."""
    return (8 if backward else 4) * rows.LANES * cfg.rows


def _smem_bytes(
    cfg: Config, n_cols: int, itemsizes: tuple[int, ...], columns: tuple[int, ...], backward: bool
) -> int:
    """Shared memory of one program: a block buffer per operand of `itemsizes` bytes per element
    (`stages` blocks each), mean and rstd per block, a (D,) buffer per entry of `columns`
    (bytes per element: gamma, beta, dgamma and dbeta partials; none with global_params) and the
    reduction scratch."""
    blocks = [cfg.stages * cfg.block_rows * n_cols * s for s in itemsizes]
    stats = [cfg.stages * 4 * rows_round(cfg.block_rows)] * 2
    params = [] if cfg.global_params else [n_cols * c for c in columns]
    return rows.smem_bytes([*blocks, *stats, *params], _scratch_bytes(cfg, backward))


# The forward reads whole rows straight from global memory (Config.direct) up to this width, and
# at any width held whole for 4-byte elements: on an H200 (2026-11-28, benchmarks/RESULTS.md)
# 0.90-0.97x Triton's time at 768-8192 columns, where the TMA blocks took 0.98-1.09x; at 8192
# bf16 columns direct took 1.18x, TMA 1.13x.
DIRECT_COLS = 4096


def default_config(
    n_rows: int,
    n_cols: int,
    itemsizes: tuple[int, ...],
    columns: tuple[int, ...],
    *,
    backward: bool,
) -> Config:
    """Block sizes for an (N, D) input whose per-block operands have `itemsizes` bytes per element
    and (D,) buffers of `columns` bytes per element: about 16 KB per operand block; rows of up to
    8192 held whole in registers (one shared-memory read for all sweeps), short ones grouped up to
    4096 (forward) or 2048 (backward: more live arrays) float32 values; as many programs per SM as
    are resident together (rows_mgpu.programs_per_sm). Where only one is, the forward of whole rows
    wider than DIRECT_COLS without the residual add reads gamma and beta from global memory if that
    lets two programs share an SM (`global_params`), else takes up to 4 stages. Whole rows rather
    than 2048-column chunks in the backward, 16384 x 8192 on an H100 (2026-11-28): the kernel alone
    1.11x -> 0.89x (bf16) and 1.01x -> 0.93x (f32) Triton's time. The forward goes `direct` (one
    block a program, rows read from and written to global memory by registers, no shared memory)
    where whole rows are held, N is a multiple of the row group and D <= DIRECT_COLS or the operands
    have 4-byte elements."""
    rows.check_width("D", n_cols, "the hidden size D")
    budget = 2048 if backward else 4096
    if n_cols <= 8192:  # whole rows in registers
        group = max(1, min(8, pl.next_power_of_2(budget // n_cols + 1) // 2))
        group = min(group, pl.next_power_of_2(n_rows + 1) // 2)  # never more than N rows
        chunk = n_cols
    else:  # one row at a time, in chunks (a tile of several rows would not be contiguous)
        group = 1
        chunk = rows.pick_chunk(n_cols, rows.pick_vec(n_cols, max(itemsizes)), budget)
    block = max(group, 16384 // (n_cols * max(itemsizes)) // group * group)
    cfg = Config(min(block, n_rows // group * group), group, chunk, programs_per_sm=1)

    def smem(cfg: Config) -> int:
        return _smem_bytes(cfg, n_cols, itemsizes, columns, backward)

    while smem(cfg) > rows.SMEM_BYTES:
        if cfg.block_rows > cfg.rows:
            cfg = cfg._replace(block_rows=max(group, cfg.block_rows // 2 // group * group))
        elif cfg.stages > 1:
            cfg = cfg._replace(stages=1)
        else:
            raise ValueError(
                f"backend='mosaic_gpu': rows of D = {n_cols} do not fit in shared memory for "
                "this layer norm; use backend='triton'"
            )
    wide = n_cols > DIRECT_COLS and max(itemsizes) < 4
    if not backward and chunk == n_cols and n_rows % group == 0 and not wide:
        return cfg._replace(programs_per_sm=rows.ONE_BLOCK_EACH, stages=1, direct=True)
    per_sm = rows.programs_per_sm(smem(cfg))
    lean = cfg._replace(global_params=True, stages=2)
    plain = len(itemsizes) == 2  # x and y: no residual add (not timed with global_params)
    if not backward and per_sm == 1 and wide and plain and rows.programs_per_sm(smem(lean)) > 1:
        # 8192-16384 x 8192 bf16 on an H200 (2026-11-29, benchmarks/RESULTS.md): 1.09-1.14x ->
        # 0.89-0.91x Triton's time (4 stages, gamma and beta in shared memory -> this). Three
        # programs an SM took 1.13x, four 0.90x: as if the registers of rows this wide hold two.
        return lean._replace(programs_per_sm=2)
    # one program: more blocks in flight (16384 x 8192 bf16 on an H100, 2026-11-28, before
    # global_params: 1.09x -> 0.95x Triton's time)
    while not backward and per_sm == 1 and cfg.stages < 4:
        if smem(cfg._replace(stages=cfg.stages + 1)) > rows.SMEM_BYTES:
            break
        cfg = cfg._replace(stages=cfg.stages + 1)
    return cfg._replace(programs_per_sm=per_sm)


def check_config(cfg: Config, n_rows: int, n_cols: int) -> None:
    """The tiling rules the kernels rely on (default_config obeys them; benchmarks may not)."""
    rows.check_width("D", n_cols, "the hidden size D")
    if not rows.tiling_ok(cfg, n_rows, n_cols) or (cfg.direct and n_rows % cfg.rows):
        raise ValueError(
            f"invalid Mosaic GPU layer norm config {cfg} for x of ({n_rows}, {n_cols})"
        )


def _plan(n_rows: int, n_cols: int, cfg: Config, itemsize: int):
    """(plan, programs, blocks) of a call on (N, D) operands of up to `itemsize` bytes."""
    check_config(cfg, n_rows, n_cols)
    return rows.plan(cfg, n_rows, n_cols, itemsize)


def _present(**scratch) -> dict:
    """Scratch buffers in allocation order, less those this variant lacks (None)."""
    return {k: v for k, v in scratch.items() if v is not None}


def _fwd_kernel(*refs, p: rows.BlockPlan, eps: float, residual: bool, rms: bool, cfg: Config):
    r = dict(zip((*operands("fwd", residual, rms), "sm"), refs, strict=True))
    sm = r["sm"]
    t = p.tiles
    direct = cfg.direct
    if direct or cfg.global_params:  # gamma and beta read from global memory (L2) by every group
        params = r
    else:  # copied into shared memory once per program
        params = sm
        rows.copy_in(r["g"], sm["g"], sm["params_bar"])
        if not rms:
            rows.copy_in(r["b"], sm["b"], sm["params_bar"])
        plgpu.barrier_wait(sm["params_bar"])
    first, count = rows.my_blocks(p.steps, r["rstd"].shape[0])

    def compute(blk, v):  # v: this block's refs by operand name
        # with the residual, s = x + h (in x's dtype) is written out and the statistics read it
        src = v["s"] if residual else v["x"]

        def group(row0):
            def first(ci):  # x, or s = x + h rounded to x's dtype (and written out)
                x = t.load(v["x"], row0, ci)
                if residual:
                    x = (x + t.load(v["h"], row0, ci)).astype(src.dtype)
                    t.store(src, row0, ci, x)
                return x.astype(jnp.float32)

            first = t.once(first)
            # the later sweeps: the held tile, or s as the first sweep wrote it
            read = first if t.n_chunks == 1 else (lambda ci: t.load(src, row0, ci))

            def total(ci, acc):  # sum of x (LayerNorm) or of x^2 (RMSNorm)
                x = first(ci)
                return acc + t.row_sum(x * x if rms else x)

            moment = t.chunks(total, t.row_init(0.0)) / p.width
            mean_t = None if rms else t.bcast(moment)

            def centre(x):  # RMSNorm: no centring
                return x if rms else x - mean_t

            def centred(ci, acc):  # LayerNorm's second sweep: the centred variance
                xc = centre(read(ci))
                return acc + t.row_sum(xc * xc)

            var = moment if rms else t.chunks(centred, t.row_init(0.0)) / p.width
            rstd = jax.lax.rsqrt(var + eps)
            rstd_t = t.bcast(rstd)

            def write(ci, carry):
                y = centre(read(ci)) * rstd_t * t.col(params["g"].at[ci])
                t.store(v["y"], row0, ci, y if rms else y + t.col(params["b"].at[ci]))
                return carry

            t.chunks(write, None)
            if not rms:
                t.store_rows(v["mean"], row0, moment)
            t.store_rows(v["rstd"], row0, rstd)

        p.groups(blk, group)

    views = {k: p.block_view(r[k]) for k in ("x", "h", "y", "s") if k in r}
    views.update({k: (lambda blk, g=r[k]: g.at[blk]) for k in ("mean", "rstd") if k in r})
    if direct:
        rows.direct_blocks(first, count, lambda b: compute(b, {k: f(b) for k, f in views.items()}))
        return

    def staged(blk, slot, carry):
        compute(blk, {k: sm[k].at[slot] for k in views})

    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=[(views[k], sm[k]) for k in ("x", "h") if k in views],
        stores=[(views[k], sm[k]) for k in ("y", "s", "mean", "rstd") if k in views],
        barrier=sm["bar"],
        compute=staged,
    )


def forward(x, h, gamma, beta, eps: float, out_dtype, cfg: Config, interpret: Any = None):
    """(y, mean, rstd), or (s = x + h, y, mean, rstd) when h is given; x, h (N, D). beta None is
    RMSNorm (mean is then None).

    `interpret`: jax's Mosaic GPU interpreter parameters, for CPU tests of the kernel itself."""
    n_rows, n_cols = x.shape
    residual, rms = h is not None, beta is None
    sizes = [x.dtype.itemsize, jnp.dtype(out_dtype).itemsize] + (
        [h.dtype.itemsize] if residual else []
    )
    p, programs, n_blocks = _plan(n_rows, n_cols, cfg, max(sizes))
    nc = p.tiles.n_chunks
    sub = (n_rows * nc, cfg.chunk)  # rows as sub-rows of one chunk: a tile is contiguous
    stats = jax.ShapeDtypeStruct((n_blocks, rows_round(cfg.block_rows)), jnp.float32)
    out_type = [jax.ShapeDtypeStruct(sub, out_dtype), *([] if rms else [stats]), stats]
    blk = (cfg.stages, cfg.block_rows * nc, cfg.chunk)
    stat_blk = (cfg.stages, rows_round(cfg.block_rows))
    params = [p for p in (gamma, beta) if p is not None]
    in_smem = not cfg.global_params  # gamma and beta copied into shared memory
    scratch = _present(
        x=plgpu.SMEM(blk, x.dtype),
        y=plgpu.SMEM(blk, out_dtype),
        mean=None if rms else plgpu.SMEM(stat_blk, jnp.float32),
        rstd=plgpu.SMEM(stat_blk, jnp.float32),
        g=plgpu.SMEM((nc, cfg.chunk), gamma.dtype) if in_smem else None,
        b=plgpu.SMEM((nc, cfg.chunk), beta.dtype) if in_smem and not rms else None,
        bar=plgpu.Barrier(num_arrivals=2 if residual else 1, num_barriers=cfg.stages),
        params_bar=plgpu.Barrier(num_arrivals=len(params)) if in_smem else None,
    )
    args = (x.reshape(sub), *[q.reshape(nc, cfg.chunk) for q in params])
    if residual:
        out_type.insert(0, jax.ShapeDtypeStruct(sub, x.dtype))
        scratch.update(h=plgpu.SMEM(blk, h.dtype), s=plgpu.SMEM(blk, x.dtype))
        args = (args[0], h.reshape(sub), *args[1:])

    def kernel(*refs, **scratch_refs):
        _fwd_kernel(*refs, scratch_refs, p=p, eps=eps, residual=residual, rms=rms, cfg=cfg)

    if cfg.direct:
        scratch = {}

    name = kernel_name("fwd", residual, rms) + "_mgpu"
    outs = rows.launch(kernel, name, tuple(out_type), scratch, {"p": programs},
                       _scratch_bytes(cfg, False), interpret, args)  # fmt: skip
    n_big = 2 if residual else 1
    big = [o.reshape(x.shape) for o in outs[:n_big]]
    return (*big, None, outs[-1]) if rms else (*big, *outs[n_big:])


def _bwd_kernel(*refs, p: rows.BlockPlan, residual: bool, rms: bool):
    # with the residual, dx = ds + norm'(dy); dh = dx in h's dtype
    r = dict(zip((*operands("bwd", residual, rms), "sm"), refs, strict=True))
    sm = r["sm"]
    partials = ("dg",) if rms else ("dg", "db")
    t = p.tiles
    rows.copy_in(r["g"], sm["g"], sm["params_bar"])
    plgpu.barrier_wait(sm["params_bar"])

    def zero(ci, carry):  # the per-program dgamma/dbeta partial sums start at zero
        for name in partials:
            sm[name][ci] = t.col_zeros()
        return carry

    t.chunks(zero, None)
    first, count = rows.my_blocks(p.steps, r["rstd"].shape[0])

    def compute(blk, slot, carry):
        x_s, dy_s, dx_s = sm["x"].at[slot], sm["dy"].at[slot], sm["dx"].at[slot]
        n_valid = p.n_valid(blk)

        def group(row0):
            mean_t = None if rms else t.bcast(t.load_rows(sm["mean"].at[slot], row0))

            def centre(x):  # RMSNorm: no centring
                return x if rms else x - mean_t

            rstd_t = t.bcast(t.load_rows(sm["rstd"].at[slot], row0))
            # rows past N in a ragged last block hold stale data: kept out of dgamma/dbeta
            row_ids = t.row_ids(row0)

            @t.once  # the two sweeps' inputs
            def terms(ci):
                xhat = centre(t.load(x_s, row0, ci)) * rstd_t
                dy = t.load(dy_s, row0, ci)
                return xhat, dy, t.col(sm["g"].at[ci]) * dy

            def sums(ci, acc):
                xhat, dy, gdy = terms(ci)
                if row_ids is not None:
                    dy_ok = jnp.where(row_ids < n_valid, dy, 0.0)
                    xhat_ok = jnp.where(row_ids < n_valid, xhat, 0.0)
                else:
                    dy_ok, xhat_ok = dy, xhat
                for name, term in zip(partials, (dy_ok * xhat_ok, dy_ok), strict=False):
                    acc_ref = sm[name].at[ci]  # each thread adds to its own columns
                    acc_ref[...] = t.col_load(acc_ref) + t.col_sum(term)
                terms_sums = (xhat * gdy,) if rms else (xhat * gdy, gdy)
                return tuple(a + t.row_sum(v) for a, v in zip(acc, terms_sums, strict=True))

            cs = t.chunks(sums, tuple(t.row_init(0.0) for _ in partials))  # c1 (, c2)
            c1_t, *c2_t = (t.bcast(c / p.width) for c in cs)

            def write(ci, carry):
                xhat, _, gdy = terms(ci)
                dx = gdy - xhat * c1_t
                dx = (dx if rms else dx - c2_t[0]) * rstd_t
                if residual:
                    dx = dx + t.load(sm["ds"].at[slot], row0, ci)
                    t.store(sm["dh"].at[slot], row0, ci, dx)
                t.store(dx_s, row0, ci, dx)
                return carry

            t.chunks(write, None)

        p.groups(blk, group)
        return carry

    loads = [(p.block_view(r["x"]), sm["x"]), (p.block_view(r["dy"]), sm["dy"])]
    loads += [(lambda blk, g=r[k]: g.at[blk], sm[k]) for k in ("mean", "rstd") if k in r]
    stores = [(p.block_view(r["dx"]), sm["dx"])]
    if residual:
        loads.append((p.block_view(r["ds"]), sm["ds"]))
        stores.append((p.block_view(r["dh"]), sm["dh"]))
    rows.pipelined_blocks(
        first=first,
        count=count,
        stages=p.stages,
        loads=loads,
        stores=stores,
        barrier=sm["bar"],
        compute=compute,
    )
    part = jax.lax.axis_index("p")
    plgpu.commit_smem()
    for i, name in enumerate(partials):  # one commit group for all
        last = i == len(partials) - 1
        plgpu.copy_smem_to_gmem(sm[name], r[name].at[part], commit_group=last)
    plgpu.wait_smem_to_gmem(0)


def backward(x, gamma, dy, ds, h_dtype, mean, rstd, cfg: Config, interpret: Any = None):
    """(dx, dgamma, dbeta), or (dx, dh, dgamma, dbeta) when ds (the gradient of s) is given;
    mean None is RMSNorm (dbeta is then None).

    cfg.block_rows must be the forward's: mean/rstd are saved per forward block."""
    n_rows, n_cols = x.shape
    residual, rms = ds is not None, mean is None
    sizes = [x.dtype.itemsize, dy.dtype.itemsize] + (
        [jnp.dtype(h_dtype).itemsize] if residual else []
    )
    p, programs, n_blocks = _plan(n_rows, n_cols, cfg, max(sizes))
    nc = p.tiles.n_chunks
    if rstd.shape != (n_blocks, rows_round(cfg.block_rows)):
        raise ValueError(f"mean/rstd of shape {rstd.shape} do not match {cfg} for {n_rows} rows")
    sub = (n_rows * nc, cfg.chunk)
    part = jax.ShapeDtypeStruct((programs, nc, cfg.chunk), jnp.float32)
    n_parts = 1 if rms else 2
    out_type = [jax.ShapeDtypeStruct(sub, x.dtype), *[part] * n_parts]
    blk = (cfg.stages, cfg.block_rows * nc, cfg.chunk)
    stat_blk = (cfg.stages, rows_round(cfg.block_rows))
    params = (nc, cfg.chunk)
    stats = [rstd] if rms else [mean, rstd]
    scratch = _present(
        x=plgpu.SMEM(blk, x.dtype),
        dy=plgpu.SMEM(blk, dy.dtype),
        dx=plgpu.SMEM(blk, x.dtype),
        mean=None if rms else plgpu.SMEM(stat_blk, jnp.float32),
        rstd=plgpu.SMEM(stat_blk, jnp.float32),
        g=plgpu.SMEM(params, gamma.dtype),
        dg=plgpu.SMEM(params, jnp.float32),
        db=None if rms else plgpu.SMEM(params, jnp.float32),
        # one arrival per load of a block: x, dy, the statistics (and ds)
        bar=plgpu.Barrier(num_arrivals=2 + len(stats) + residual, num_barriers=cfg.stages),
        params_bar=plgpu.Barrier(num_arrivals=1),
    )
    args = (x.reshape(sub), gamma.reshape(params), dy.reshape(sub), *stats)
    if residual:
        out_type.insert(1, jax.ShapeDtypeStruct(sub, h_dtype))
        scratch.update(ds=plgpu.SMEM(blk, ds.dtype), dh=plgpu.SMEM(blk, h_dtype))
        args = (*args[:3], ds.reshape(sub), *stats)

    def kernel(*refs, **scratch_refs):
        _bwd_kernel(*refs, scratch_refs, p=p, residual=residual, rms=rms)

    name = kernel_name("bwd", residual, rms) + "_mgpu"
    outs = rows.launch(kernel, name, tuple(out_type), scratch, {"p": programs},
                       _scratch_bytes(cfg, True), interpret, args)  # fmt: skip
    grads = [g.reshape(x.shape) for g in outs[:-n_parts]]
    sums = [jnp.sum(q, axis=0).reshape(-1) for q in outs[-n_parts:]]
    return (*grads, *sums, *((None,) if rms else ()))


def configs(
    n_rows: int, n_cols: int, dtype, out_dtype, h_dtype=None, param_bytes: int = 8
) -> tuple[Config, Config]:
    """(forward, backward) default configs for x (N, D) of `dtype`, y of `out_dtype`, h of
    `h_dtype` (residual variant) and gamma + beta (RMSNorm: gamma) of `param_bytes` bytes per
    column (the backward's dgamma/dbeta partials are counted as 8 bytes either way).

    Both use the same block_rows (the backward reads the forward's per-block mean/rstd): the
    smaller of the two directions' choices."""
    s, o = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    fwd_sizes, bwd_sizes = (s, o), (s, o, s)
    if h_dtype is not None:
        hs = jnp.dtype(h_dtype).itemsize
        fwd_sizes, bwd_sizes = fwd_sizes + (hs, s), bwd_sizes + (s, hs)
    # (D,) buffers: forward gamma and beta (two buffers, each rounded to 1 KB); backward gamma
    # and the float32 dgamma and dbeta partials
    fwd = default_config(n_rows, n_cols, fwd_sizes, (param_bytes // 2,) * 2, backward=False)
    bwd = default_config(n_rows, n_cols, bwd_sizes, (4, 4, 4), backward=True)
    group = max(fwd.rows, bwd.rows)  # both powers of two: a multiple of both
    block = max(group, min(fwd.block_rows, bwd.block_rows) // group * group)
    return fwd._replace(block_rows=block), bwd._replace(block_rows=block)
