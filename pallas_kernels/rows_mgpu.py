"""Building blocks shared by the Mosaic GPU kernels (layer_norm_mgpu, attention_softmax_mgpu,
depthwise_conv1d_mgpu, cross_entropy_mgpu).

A row kernel sees a 2-D array of rows (N, W), W a multiple of 128, stored as sub-rows of one
column chunk ((N * W / chunk, chunk), a free reshape), so that every tile a thread group reads is
contiguous in shared memory. Each program (one CUDA block of one warpgroup) owns a contiguous run of
`block_rows`-row blocks and walks it with `pipelined_blocks`: a block of whole rows is contiguous in
memory, so one bulk TMA copy moves it into shared memory (the next block's copy runs while this one
is computed), and one bulk copy writes each output block back. A ragged last block is clamped by
the copy engine (rows past N are neither read nor written); kernels must keep its stale rows out of
sums across rows.

In registers (`Tiles`) a block is processed `rows` rows at a time, in column chunks: with
`row_layout(rows, vec)` each row is spread over the whole warpgroup (vec consecutive elements per
lane), the rows of a group are registers of every thread, so a row sum is in-thread adds, warp
shuffles and one cross-warp exchange through shared memory for all the rows at once, and a sum over
the rows (dgamma) is in-thread only. One-row groups use the WG_STRIDED layout on (chunk,) vectors.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import core_count

# The one jax-version difference in the Mosaic GPU kernels, found by feature, not by version:
# plgpu.load takes (ref, idx) on jax 0.10; 0.11 makes idx optional and deprecates passing it.
_IDX = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_NEEDS_IDX = _IDX is not None and _IDX.default is inspect.Parameter.empty

SMEM_BYTES = 227 * 1024  # H100 shared memory per block (opt-in maximum)
SM_SMEM_BYTES = 228 * 1024  # ... per SM, shared by its resident blocks
BLOCK_RESERVED_BYTES = 1024  # ... of which the driver reserves this much per resident block
BARRIER_BYTES = 128  # a kernel's barriers (8 bytes each), a bound
ONE_BLOCK_EACH = 1 << 30  # programs_per_sm that gives every block a program of its own
LANES = 128  # threads of one warpgroup: the width one layout tile spreads a row over


# Register layouts are a compile-time annotation: jax's Mosaic GPU interpreter (CPU tests of these
# kernels) has no rule for them, and the numbers do not depend on them.
_LAYOUTS = contextvars.ContextVar("mosaic_gpu_layouts", default=True)


def cast(x: jax.Array, layout) -> jax.Array:
    """plgpu.layout_cast when compiling (a no-op for the interpreter)."""
    return plgpu.layout_cast(x, layout) if _LAYOUTS.get() else x


def iota(shape: tuple[int, int], dim: int, layout) -> jax.Array:
    """int32 broadcasted iota in `layout`."""
    return cast(jax.lax.broadcasted_iota(jnp.int32, shape, dim), layout)


WARPS = 4  # warps of one warpgroup


def row_layout(rows: int, vec: int, warp_rows: bool = False) -> plgpu.SomeLayout:
    """Layout of a (rows, W) array, W % (128 * vec) == 0: warps and lanes along the columns (vec
    consecutive elements per lane), the rows in registers. `warp_rows`: each warp holds whole
    rows instead (rows % 4 == 0, W % (32 * vec) == 0; lanes along the columns), so that a row
    sum is in-thread adds and warp shuffles only, no exchange between warps."""
    if warp_rows:
        return plgpu.Layout.TILED(
            plgpu.Tiling(((WARPS, 32 * vec), (vec,))),
            warp_dims=(-3,),
            lane_dims=(-2,),
            vector_dim=-1,
        )
    return plgpu.Layout.TILED(
        plgpu.Tiling(((rows, LANES * vec), (32 * vec,), (vec,))),
        warp_dims=(-3,),
        lane_dims=(-2,),
        vector_dim=-1,
    )


class Tiles(NamedTuple):
    """How a kernel reads (rows, chunk) tiles of a block buffer stored as sub-rows of `chunk`
    columns (n_chunks per row, so that every tile is contiguous: rows > 1 only when n_chunks == 1).

    rows > 1: `row_layout`; row sums are (rows,) arrays broadcast back along the columns.
    rows == 1: a tile is a (chunk,) vector in the WG_STRIDED layout; row sums are scalars (a
    one-row tiled array cannot be reduced to, nor stored as, a scalar)."""

    rows: int
    chunk: int
    n_chunks: int
    vec: int
    warp_rows: bool = False  # row_layout(warp_rows=True): a warp per row (rows % 4 == 0)

    @property
    def layout(self):
        if self.rows == 1:
            return plgpu.Layout.WG_STRIDED((self.chunk,), self.vec)
        return row_layout(self.rows, self.vec, self.warp_rows)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.chunk,) if self.rows == 1 else (self.rows, self.chunk)

    def view(self, ref, row0, ci):
        """Rows row0 .. row0 + rows - 1, chunk ci, of a (rows * n_chunks, chunk) buffer."""
        sub = row0 * self.n_chunks + ci
        return ref.at[sub] if self.rows == 1 else ref.at[pl.ds(sub, self.rows)]

    def load(self, ref, row0, ci) -> jax.Array:
        return load(self.view(ref, row0, ci), self.layout).astype(jnp.float32)

    def store(self, ref, row0, ci, value: jax.Array) -> None:
        self.view(ref, row0, ci)[...] = value.astype(ref.dtype)

    def col(self, ref) -> jax.Array:
        """A (chunk,) parameter vector ref as float32, broadcast over the rows of a tile."""
        if self.rows == 1:
            return load(ref, self.layout).astype(jnp.float32)
        v = load(ref, self.layout.reduce(0)).astype(jnp.float32)
        return cast(jax.lax.broadcast_in_dim(v, self.shape, (1,)), self.layout)

    def col_load(self, ref) -> jax.Array:
        """A (chunk,) float32 accumulator ref, in the layout of `col_sum`."""
        return load(ref, self.layout if self.rows == 1 else self.layout.reduce(0))

    def col_sum(self, x: jax.Array) -> jax.Array:
        """Sum over the rows of a tile: (chunk,)."""
        return x if self.rows == 1 else jnp.sum(x, axis=0)

    def row_sum(self, x: jax.Array) -> jax.Array:
        return jnp.sum(x) if self.rows == 1 else jnp.sum(x, axis=1)

    def row_max(self, x: jax.Array) -> jax.Array:
        return jnp.max(x) if self.rows == 1 else jnp.max(x, axis=1)

    def bcast(self, v: jax.Array) -> jax.Array:
        """Per-row values (row_sum's shape) broadcast over the columns of a tile."""
        if self.rows == 1:
            return v
        return cast(jax.lax.broadcast_in_dim(v, self.shape, (0,)), self.layout)

    def row_init(self, value: float) -> jax.Array:
        """Per-row float32 loop carry (it must start in the layout the loop produces)."""
        if self.rows == 1:
            return jnp.float32(value)
        return cast(jnp.full((self.rows,), value, jnp.float32), self.layout.reduce(1))

    def col_zeros(self) -> jax.Array:
        layout = self.layout if self.rows == 1 else self.layout.reduce(0)
        return cast(jnp.zeros((self.chunk,), jnp.float32), layout)

    def row_ids(self, row0) -> jax.Array | None:
        """Row index of every element of a tile (None for one-row tiles: no masking needed)."""
        if self.rows == 1:
            return None
        return iota(self.shape, 0, self.layout) + row0

    def col_ids(self, c0) -> jax.Array:
        """Column index of every element of a tile."""
        if self.rows == 1:
            return cast(jax.lax.iota(jnp.int32, self.chunk), self.layout) + c0
        return iota(self.shape, 1, self.layout) + c0

    def store_rows(self, ref, row0, v: jax.Array) -> None:
        """Per-row values into the (n,) float32 ref at row0."""
        if self.rows == 1:
            ref[row0] = v
        else:
            ref[pl.ds(row0, self.rows)] = v

    def load_rows(self, ref, row0) -> jax.Array:
        if self.rows == 1:
            return ref[row0]
        return load(ref.at[pl.ds(row0, self.rows)], self.layout.reduce(1))

    def once(self, read: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`read(chunk index)` for the sweeps over a row group: with one chunk it is read once
        and held in registers for every sweep (one shared-memory read), else read each time."""
        if self.n_chunks > 1:
            return read
        held = read(jnp.int32(0))
        return lambda ci: held

    def chunks(
        self, body: Callable[[Any, Any], Any], init: Any, lo: int = 0, hi: int | None = None
    ) -> Any:
        """fori_loop over the column chunks lo .. hi - 1 (all by default; straight-line code
        for one chunk, none for an empty range)."""
        hi = self.n_chunks if hi is None else hi
        if hi - lo <= 1:
            return body(jnp.int32(lo), init) if hi > lo else init
        return jax.lax.fori_loop(jnp.int32(lo), jnp.int32(hi), body, init)


def launch(body, name: str, out_type, scratch: dict, grid: dict[str, int], scratch_bytes: int,
           interpret: Any, args: tuple, approx_math: bool = False, threads: int = 1):  # fmt: skip
    """Run `body` as a Mosaic GPU kernel named `name` over `grid` (axis name -> size), with
    `threads` warpgroups per CUDA block (axis "wg" when more than one).

    `scratch_bytes`: shared memory for cross-warp row reductions (more lets one reduction exchange
    more rows at once). `approx_math`: the GPU's approximate exp/log/divide instructions. Lane
    lowering semantics: the kernels state every register layout themselves (jax 0.11's default,
    Warpgroup semantics, infers layouts instead)."""
    body.__name__ = name  # the kernel's name in profiles
    params = plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Lane,
        reduction_scratch_bytes=scratch_bytes,
        approx_math=approx_math,
    )
    call = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        compiler_params=params,
        interpret=interpret,
        **(dict(num_threads=threads, thread_name="wg") if threads > 1 else {}),
    )
    token = _LAYOUTS.set(interpret is None)  # trace for the compiler, or for jax's interpreter
    try:
        return call(*args)
    finally:
        _LAYOUTS.reset(token)


def smem_bytes(buffers: Sequence[int], scratch_bytes: int) -> int:
    """Shared memory a kernel requests: each scratch buffer of `buffers` (bytes) and the
    cross-warp reduction scratch rounded up to 1 KB, as jax's lowering places them, and the
    barriers."""
    kb = 1024
    return sum(-(-b // kb) * kb for b in (*buffers, scratch_bytes)) + BARRIER_BYTES


def programs_per_sm(program_bytes: int) -> int:
    """Persistent programs an SM runs at once, 1 to 4: as many as are resident together. A
    program more than fit runs in a second wave after the others: that took the LayerNorm
    forward to 1.13-1.24x Triton's time (H200, 2026-11-28, benchmarks/RESULTS.md)."""
    return max(1, min(4, SM_SMEM_BYTES // (program_bytes + BLOCK_RESERVED_BYTES)))


def pick_vec(width: int, itemsize: int, lanes: int = LANES) -> int:
    """Elements per lane access: up to 16 bytes, such that lanes * vec divides the row width
    (`lanes`: the threads a row is spread over, 32 for warp_rows)."""
    vec = 16 // itemsize
    while vec > 1 and width % (lanes * vec):
        vec //= 2
    return vec


def pick_chunk(width: int, vec: int, max_elems: int) -> int:
    """Widest column chunk <= max_elems that is a multiple of 128 * vec and divides width."""
    unit = LANES * vec
    best = unit
    for mult in range(1, width // unit + 1):
        if width % (unit * mult) == 0 and unit * mult <= max_elems:
            best = unit * mult
    return best


def check_width(name: str, width: int, what: str) -> None:
    """The row kernels tile rows in 128-column units (one warpgroup) and copy rows with TMA."""
    if width % LANES:
        raise ValueError(
            f"backend='mosaic_gpu' needs {what} to be a multiple of {LANES}, got {name} = {width}; "
            "use backend='triton' for this shape"
        )


def copy_in(src, dst, barrier) -> None:
    """GMEM -> SMEM copy of a contiguous region as one bulk copy (not a tensor TMA copy, which
    moves at most 256 elements per dimension): `OOBFillMode.UNDEFINED` selects it, and lets
    Mosaic clamp a region that runs past the end of the array to the part inside (those rows
    stay stale). A bulk copy moves a multiple of 16 bytes: a region whose clamped part might not
    be (a run of 4-byte values) must be padded by the caller instead."""
    plgpu.copy_gmem_to_smem(src, dst, barrier, oob_mode=plgpu.OOBFillMode.UNDEFINED)


def pipelined_blocks(
    *,
    first: jax.Array,
    count: jax.Array,
    stages: int,
    loads: Sequence[tuple[Callable[[jax.Array], Any], Any]],
    stores: Sequence[tuple[Callable[[jax.Array], Any], Any]],
    barrier: Any,
    compute: Callable[[jax.Array, jax.Array, Any], Any],
    init: Any = None,
    copy: Callable[[Any, Any, Any], None] = copy_in,
) -> Any:
    """Run `compute(block, slot, carry) -> carry` over blocks first .. first + count - 1.

    loads / stores: (block -> GMEM ref view, SMEM buffer (stages, ...)) pairs; the view and one
    slot of the buffer have the same shape. With stages > 1 the next stages - 1 blocks' loads are
    in flight while this one is computed, and the last stages - 1 blocks' stores. Loads are
    `copy(src, dst, barrier)`: by default contiguous bulk copies (`copy_in`: the copy engine clamps
    a ragged last block); plgpu.copy_gmem_to_smem for tensor copies that zero-fill out of bounds.
    """

    def fetch(k, slot):
        for view, smem in loads:
            copy(view(first + k), smem.at[slot], barrier.at[slot])

    fetch(jnp.int32(0), jnp.int32(0))
    for k in range(1, stages - 1):

        @pl.when(k < count)
        def _(k=k):
            fetch(jnp.int32(k), jnp.int32(k))

    n_slots = jnp.int32(stages)  # int32 also under jax_enable_x64 (k is int32)

    def step(k, carry):
        slot = jax.lax.rem(k, n_slots)
        if stages > 1:  # prefetch into the slot the previous step finished with
            ahead = k + n_slots - 1

            @pl.when(ahead < count)
            def _():
                fetch(ahead, jax.lax.rem(ahead, n_slots))

        plgpu.barrier_wait(barrier.at[slot])
        # this slot's output buffer was last sent `stages` steps ago: its copy must have read it
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
        carry = compute(first + k, slot, carry)
        plgpu.commit_smem()  # register writes to SMEM visible to the copy engine, reads done
        for view, smem in stores:
            plgpu.copy_smem_to_gmem(smem.at[slot], view(first + k), commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        if stages == 1:  # single buffer: the next load may only start after this compute

            @pl.when(k + 1 < count)
            def _():
                fetch(k + 1, jnp.int32(0))

        return carry

    carry = jax.lax.fori_loop(jnp.int32(0), count, step, init)
    plgpu.wait_smem_to_gmem(0)
    return carry


def direct_blocks(first: jax.Array, count: jax.Array, compute: Callable[[jax.Array], None]) -> None:
    """`compute(block)` over blocks first .. first + count - 1 on the block's global-memory views:
    registers load from and store to global memory directly, with no shared memory and no
    copies, so the loads other resident programs have in flight hide each one's latency."""

    def step(k, carry):
        compute(first + k)
        return carry

    jax.lax.fori_loop(jnp.int32(0), count, step, None)


def my_blocks(steps: int, n_blocks: int) -> tuple[jax.Array, jax.Array]:
    """(first block, block count) of this program (grid axis "p")."""
    first = jax.lax.axis_index("p").astype(jnp.int32) * steps
    return first, jnp.minimum(jnp.int32(steps), jnp.int32(n_blocks) - first)


def acc_mma(acc: Any, mma: Callable[[Any], None]) -> Any:
    """acc + the wgmma products `mma(acc_refs)` issues into (zeroed) accumulator refs; acc an
    array or a tuple of arrays (their wgmmas then run concurrently, waited for once). Compiled,
    the accumulators are acc itself (plgpu.ACC.init); jax's interpreter has no rule for
    run_state, so there the products go to fresh accumulators that are added to acc."""
    if _LAYOUTS.get():
        return pl.run_state(mma)(jax.tree.map(plgpu.ACC.init, acc))
    leaves, tree = jax.tree.flatten(acc)

    def fresh(*refs):
        mma(jax.tree.unflatten(tree, refs))
        return [ref[...] for ref in refs]

    outs = pl.run_scoped(fresh, *[plgpu.ACC(x.shape, x.dtype) for x in leaves])
    return jax.tree.unflatten(tree, [x + y for x, y in zip(leaves, outs, strict=True)])


def acc_load(ref, pending: int) -> jax.Array:
    """The accumulator ref's value once at most `pending` wgmma groups of this warpgroup are
    still running (groups complete in issue order). jax's interpreter runs wgmmas at once."""
    if not _LAYOUTS.get():
        return ref[...]
    return plgpu.wgmma_accumulator_load(ref, wait_n=pending)


def load(ref, layout) -> jax.Array:
    """ref[...] in `layout`. Unoptimized: plain vector loads, as the tile offsets are dynamic and
    the lowering cannot prove the wide transfers it would plan aligned (each lane reads `vec`
    consecutive elements, so these loads are conflict-free anyway)."""
    if not _LAYOUTS.get():  # jax's interpreter has no rule for plgpu.load
        return ref[...]
    idx = ((),) if _LOAD_NEEDS_IDX else ()  # jax 0.10 needs the index; 0.11 deprecates it
    return plgpu.load(ref, *idx, layout=layout, optimized=False)


def load_column(ref, n_cols: int, k: int, layout) -> jax.Array:
    """Column k of a flat (n * n_cols,) ref viewed as (n, n_cols), in `layout` (a strided read:
    one value a lane)."""
    if not _LAYOUTS.get():  # jax's interpreter has no rule for a reshaped ref
        return ref[...].reshape(-1, n_cols)[:, k]
    return load(ref.reshape(ref.shape[0] // n_cols, n_cols).at[:, k], layout)


class BlockPlan(NamedTuple):
    """Static facts of one call of a row kernel that its body needs."""

    block_rows: int
    rows: int  # rows per register group
    stages: int
    n_rows: int  # N
    tiles: Tiles
    steps: int  # blocks per program

    @property
    def width(self) -> int:
        return self.tiles.chunk * self.tiles.n_chunks

    def block_view(self, ref):
        """block -> its rows of a (N * n_chunks, chunk) GMEM array."""
        n = self.block_rows * self.tiles.n_chunks
        return lambda blk: ref.at[pl.ds(blk * n, n)]

    def n_valid(self, blk) -> jax.Array:
        """Rows < N in this block (the last block may be ragged)."""
        return jnp.minimum(
            jnp.int32(self.block_rows), jnp.int32(self.n_rows) - blk * self.block_rows
        )

    def groups(self, blk, body) -> None:
        """body(row0) for the row groups of this block that hold rows < N."""
        n_groups = (self.n_valid(blk) + self.rows - 1) // self.rows

        def step(gi, carry):
            body(gi * self.rows)
            return carry

        jax.lax.fori_loop(jnp.int32(0), n_groups, step, None)


def plan(cfg: Any, n_rows: int, width: int, itemsize: int) -> tuple[BlockPlan, int, int]:
    """(plan, programs, blocks) of a row kernel over (N, width) operands of up to `itemsize`
    bytes per element; cfg has block_rows, rows, chunk, programs_per_sm, stages and warp_rows."""
    n_blocks = pl.cdiv(n_rows, cfg.block_rows)
    # contiguous runs of `steps` blocks, the last run possibly shorter
    steps = pl.cdiv(n_blocks, max(1, cfg.programs_per_sm * core_count()))
    programs = pl.cdiv(n_blocks, steps)
    vec = pick_vec(cfg.chunk, itemsize, 32 if cfg.warp_rows else LANES)
    tiles = Tiles(cfg.rows, cfg.chunk, width // cfg.chunk, vec, cfg.warp_rows)
    return BlockPlan(cfg.block_rows, cfg.rows, cfg.stages, n_rows, tiles, steps), programs, n_blocks


def tiling_ok(cfg: Any, n_rows: int, width: int) -> bool:
    """The tiling rules of `plan`'s row kernels: `rows`-row groups (a power of two) tile a block,
    column chunks of whole warpgroup tiles divide the row, and a group of several rows holds
    whole rows (so that its tile is contiguous)."""
    return (
        cfg.rows >= 1
        and cfg.rows & (cfg.rows - 1) == 0
        and cfg.block_rows % cfg.rows == 0
        and 1 <= cfg.block_rows <= n_rows
        and cfg.chunk % LANES == 0
        and width % cfg.chunk == 0
        and (cfg.chunk == width or cfg.rows == 1)
        and (not cfg.warp_rows or cfg.rows % WARPS == 0)
        and cfg.stages >= 1
        and cfg.programs_per_sm >= 1
    )
