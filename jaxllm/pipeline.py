"""Pipeline parallelism: GPipe and circular schedules over a `pipeline` mesh axis.

The L layers of a block stack are split into S stages of L/S consecutive layers, one stage per
device along the mesh axis `pipeline`. The batch is cut into M microbatches that flow through
the stages like an assembly line: at clock tick k, stage s runs microbatch k - s (when that is
a microbatch at all), then hands its output to stage s + 1. GPipe runs all M forwards this way
(M + S - 1 ticks), then all backwards in the mirrored order; the S - 1 ticks at the start and
end of each phase where some stages have nothing to do are the bubble,
(S - 1) / (M + S - 1) of the step.

The circular schedule (`virtual_stages` V > 1; MaxText's pipeline repeats, Megatron's
interleaved stages) cuts the stack into S V chunks of L/(S V) layers and gives stage s the
chunks s, S + s, .., (V - 1) S + s: each microbatch goes round the ring of stages V times,
the last stage sending it back to stage 0 for its next chunk. A tick is then 1/V of a GPipe
tick, and the bubble shrinks to (S - 1) / (V M + S - 1), for V times the sends and
M >= S (stage 0 needs a microbatch back before it runs out of fresh ones). The stored
parameters keep their layer order (checkpoints do not depend on the schedule): each step
reorders the layer axis so that device s gets its V chunks, which XLA does with collectives
(an all-to-all of the block weights forward, of their gradients backward).
Why circular and not 1F1B: `jax.grad` transposes the forward tick loop, so the backward mirrors
whatever forward schedule is written here. Circular stages shrink the bubble that way; 1F1B
has GPipe's bubble, only saves activation memory, and would need its backward by hand.

- `gpipe_schedule`, `bubble_fraction`: the schedule as pure data (the course's
  `_clock_cycles` helper, llmsys 11-868 assignment 4) and its idle fraction.
- `pipeline_apply`: the forward written with `jax.shard_map` + `jax.lax.ppermute`. It works on
  any `layer_fn(layer_params, x) -> x` and parameters stacked along a leading layer axis (the
  layout of `execution.scan_layers`: params["blocks"] with leaves (L, ...)), not on model classes.
  The backward is not written: `jax.grad` transposes the (unrolled) tick loop into the reversed
  sequence of ticks whose ppermutes send cotangents stage s + 1 -> s (circular: and 0 -> S - 1),
  i.e. the GPipe (or circular) backward.

Composes with data parallelism: every mesh axis other than `pipeline` (e.g. `data`) splits the
batch, and each stage's parameters are replicated over those axes (their gradients are summed
over them by shard_map's transpose).

Training runs it through jaxllm.parallel (config `parallel.pipeline` > 1) as the decoder's
`BlockRunner`: `Decoder.loss` embeds, then `pipeline_apply` runs its scan body as `layer_fn`
over params["blocks"] (stored sharded over `pipeline` on the layer axis), then the final norm
and the loss; embed, norm and loss each run on 1/S of the rows per stage, and the carry (x, h)
crosses devices as one array x + h (`wire`). With dropout, `rng` gives every (layer,
microbatch) pair its own key.

Every tick, each stage runs its layers (under the named scope `pipeline_tick`, so the profiler
shows the V M + S - 1 ticks of the forward and of the backward) and sends its output to the next
stage with one ppermute. Stages in their bubble compute on a dummy microbatch whose results are
never used: on one accelerator per stage that costs no wall time (every tick waits for the
busiest stage anyway); fake CPU devices that share cores do pay for it. Memory per device: the
stage's L/S layers, the V M + S - 1 tick outputs and what the backward keeps of each tick (with
`remat`, only each tick's stage input).

The tick loop and each stage's layer loop are Python loops, unrolled into the jaxpr: a rolled
`lax.scan` pays fixed copies of slices and carries on every layer iteration, and even
`scan(unroll=True)` stacks every residual the backward keeps. The price is compile time, growing
with (V M + S - 1) x L/(S V). The measured bubble (benchmarks/parallel_throughput.py) is
1 - T_seq / (S T_pipe), T_pipe the pipelined step's time and
T_seq the whole stack's on one device, to compare with bubble_fraction(S, M, V).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

Schedule = list[list[tuple[int, int]]]  # [tick][(microbatch, stage), ...]
LayerFn = Callable[..., Any]  # (one layer's params, activations[, key]) -> activations


# ----------------------------------------------------------------------------- the schedule


def _check_positive(**sizes: int) -> None:
    for name, n in sizes.items():
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")


def gpipe_schedule(n_stages: int, n_microbatches: int) -> Schedule:
    """The GPipe forward as data: for each clock tick k = 0 .. M + S - 2, the (microbatch,
    stage) pairs that run at k, stages in increasing order. Stage s runs microbatch k - s, so
    microbatch i enters stage 0 at tick i and leaves stage S - 1 at tick i + S - 1. This is the
    course's `_clock_cycles(num_batches=M, num_partitions=S)`; for S = 3, M = 3:

        k=0: (0,0)
        k=1: (1,0) (0,1)
        k=2: (2,0) (1,1) (0,2)
        k=3:       (2,1) (1,2)
        k=4:             (2,2)

    The backward mirrors it: its tick k' runs the backward of the pairs of forward tick
    M + S - 2 - k' (the last stage of the last microbatch first), and a stage's backward of
    microbatch i runs only after stage s + 1 has sent the cotangent of its output.
    """
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches)
    return [
        [(k - s, s) for s in range(max(0, k - n_microbatches + 1), min(k + 1, n_stages))]
        for k in range(n_microbatches + n_stages - 1)
    ]


def bubble_fraction(n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle fraction (S - 1) / (V M + S - 1): each stage works V M of the V M + S - 1 ticks
    (GPipe: V = 1)."""
    _check_positive(n_stages=n_stages, n_microbatches=n_microbatches, virtual_stages=virtual_stages)
    return (n_stages - 1) / (virtual_stages * n_microbatches + n_stages - 1)


# ----------------------------------------------------------------------------- the engine


def rows_split(batch: int, ways: int, n_stages: int) -> bool:
    """Whether pipeline_apply splits the batch's rows over the stages too (B divisible by
    ways x S, ways the size of the batch axes) or reads them replicated over the stages."""
    return batch % (ways * n_stages) == 0


def pipeline_apply(
    layer_fn: LayerFn,
    stacked_params: Any,
    x: Any,
    *,
    mesh: Mesh,
    n_microbatches: int,
    virtual_stages: int = 1,
    axis: str = "pipeline",
    batch_axes: Sequence[str] | None = None,
    remat: bool = False,
    rng: jax.Array | None = None,
    check_vma: bool = True,
    wire: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None,
) -> Any:
    """Run L stacked layers as an S-stage pipeline over mesh axis `axis`: GPipe, or with
    `virtual_stages` V > 1 the circular schedule (see the module docstring).

    layer_fn(layer_params, x) -> x: one layer; layer_params are stacked_params' leaves without
        their leading axis, x a pytree of arrays (B, ...) that keeps its shapes (e.g. (x, h)).
    stacked_params: a pytree whose leaves all have a leading layer axis L divisible by
        S V (S = mesh.shape[axis]), in layer order, split over `axis` (L/S layers a stage).
        Stage s runs the chunks v S + s (v = 0 .. V - 1) of L/(S V) layers, in order
        (`remat`: recompute them in the backward, GPipe's re-materialisation).
    x: the batch, a pytree of arrays (B, ...). B is split over `batch_axes` (default: every
        other mesh axis, e.g. `data`), then each shard into `n_microbatches` (M, at least S
        when V > 1) microbatches of consecutive rows.
    rng: a PRNG key (e.g. for dropout), or None. When given, layer_fn(layer_params, x, key)
        gets key = fold_in(fold_in(rng, layer), microbatch), both global indices (shard d of
        the batch axes, row-major, has microbatches d M .. d M + M - 1): a key per layer and
        microbatch, the same on any run with the same rng (bubble ticks reuse a microbatch's).
    check_vma: jax.shard_map's type check of what varies across devices; layers that call
        Pallas kernels need it off (a pallas_call declares no such types).
    wire: (pack, unpack), or None: every send carries pack(carry), the receiver goes on with
        unpack(received), which must act on layer_fn like carry (e.g. a residual stream and a
        pending branch output summed into one array); both keep the row axis.
    Returns the last stage's outputs, same structure and shapes as x, rows in their order:
    equal (up to float rounding) to running the L layers one after another on all of x. Where
    B divides by ways x S, x is read and the output placed with rows split over
    (*batch_axes, axis), so whatever comes before or after (an embedding, a final norm, an LM
    head) runs on 1/S of the rows on each stage: stage 0 gathers its shard's rows and the last
    stage scatters its results with S - 1 point-to-point sends each. Otherwise x is read
    replicated over the stages and the output comes back that way.
    """
    batch_axes, ways, n_layers, batch = _check_inputs(
        stacked_params, x, mesh, n_microbatches, virtual_stages, axis, batch_axes
    )
    n_stages = mesh.shape[axis]

    # Rows split over the stages too (where they divide): device (stage s, shard d) holds rows
    # chunk s of shard d, in and out (stage 0 gathers them, the last stage scatters). Replicated
    # over the stages, the input's cotangent would be all-reduced and the output moved twice.
    split = rows_split(batch, ways, n_stages)
    rows_spec = P((*batch_axes, axis))
    if split:
        in_spec, out_spec = rows_spec, rows_spec
    else:
        in_spec = P(batch_axes) if batch_axes else P()
        out_spec = P(axis, batch_axes) if batch_axes else P(axis)
    if virtual_stages > 1:  # device s gets its chunks s, S + s, .. (an all-to-all)
        stacked_params = _by_stage(stacked_params, n_stages, virtual_stages)
    stage_fn = _stage_fn(layer_fn, remat, keyed=rng is not None)
    pack, unpack = wire or (lambda c: c, lambda c: c)

    def per_device(params: Any, x: Any, *key: jax.Array) -> Any:
        # params: leaves (L/S, ...) of this stage (its V chunks); x: leaves (B', ...),
        # B' = B / ways, or with `split` (B'/S, ...), this stage's chunk of them
        if split:
            x = unpack(jax.tree.map(lambda a: _gather_rows(a, axis, n_stages), pack(x)))
        if check_vma and batch_axes:  # once: else the backward psums each tick's weight grads
            params = jax.tree.map(lambda p: jax.lax.pcast(p, batch_axes, to="varying"), params)
        stage = jax.lax.axis_index(axis)
        shard = 0  # this device's index over the batch axes, row-major
        for a in batch_axes:
            shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
        # (M, B'/M, ...): microbatch i is rows i B'/M .. (i + 1) B'/M - 1 of this shard
        mbs = jax.tree.map(lambda a: a.reshape(n_microbatches, -1, *a.shape[1:]), x)
        # What this stage received from the previous one; varying over `axis` like the sends.
        # (zeros_like keeps a's type: with `split`, x already varies over `axis`)
        recv = jax.tree.map(lambda a: jnp.zeros_like(a[0]), mbs)
        if not split:
            recv = jax.tree.map(lambda a: jax.lax.pcast(a, axis, to="varying"), recv)
        keyed = (key[0], shard) if key else None
        outs = _ticks(stage_fn, params, virtual_stages, mbs, recv, stage, axis, n_stages,
                      (pack, unpack), keyed)  # fmt: skip
        done = jax.tree.map(lambda *o: jnp.concatenate(o), *outs)  # (B', ...)
        if split:
            done = jax.tree.map(lambda a: _scatter_rows(a, stage, axis, n_stages), pack(done))
            return unpack(done)
        return jax.tree.map(lambda o: o[None], done)  # (1, B', ...)

    keys = () if rng is None else (rng,)
    out = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis), in_spec, *(P() for _ in keys)),
        out_specs=out_spec,
        check_vma=check_vma,
    )(stacked_params, x, *keys)  # split: (B, ...); else (S, B, ...), one slice per stage
    return out if split else jax.tree.map(lambda o: o[-1], out)  # (B, ...)


def _ticks(
    stage_fn: Callable[..., Any],
    params: Any,
    n_rep: int,
    mbs: Any,
    recv: Any,
    stage: jax.Array,
    axis: str,
    n_stages: int,
    wire: tuple[Callable[[Any], Any], Callable[[Any], Any]],
    keyed: tuple[jax.Array, jax.Array] | None,
) -> list[Any]:
    """The V M + S - 1 forward ticks on one device, V = n_rep (unrolled: see the module
    docstring). `params`: this stage's leaves (L/S, ...), its V chunks in order. At tick k
    this stage runs item j = k - stage, microbatch j % M in its chunk j // M (clipped to a
    dummy item in its bubble), and sends the result to the next stage, with V > 1 the last
    stage's to stage 0. Stage 0 reads microbatch k of `mbs` (leaves (M, B'/M, ...)) while
    k < M, then what the last stage sent M - S + 1 ticks before (that microbatch's previous
    chunk), then zeros; the others what they received (`recv`). `keyed` (rng, this device's
    batch shard): each layer of each microbatch gets its own key. Returns the outputs of the
    last M ticks: on the last stage, microbatches 0 .. M - 1 done."""
    pack, unpack = wire
    per_chunk = jax.tree.leaves(params)[0].shape[0] // n_rep
    # One pytree per layer of each chunk, sliced once per step (not once per tick and layer).
    chunks = [
        [jax.tree.map(lambda p, i=v * per_chunk + i: p[i], params) for i in range(per_chunk)]
        for v in range(n_rep)
    ]
    m = jax.tree.leaves(mbs)[0].shape[0]
    items, n_ticks = n_rep * m, n_rep * m + n_stages - 1
    # stage s -> s + 1, and with V > 1 the last round to stage 0
    shift = [(s, (s + 1) % n_stages) for s in range(n_stages - (n_rep == 1))]
    received, outs = [], []  # what this stage received at the end of each tick; its outputs
    for k in range(n_ticks):
        with jax.named_scope("pipeline_tick"):
            if k < m:
                feed = jax.tree.map(lambda a, k=k: a[k], mbs)
            elif k < items:
                feed = received[k - m + n_stages - 1]
            else:
                feed = jax.tree.map(jnp.zeros_like, recv)
            inp = jax.tree.map(lambda f, r: jnp.where(stage == 0, f, r), feed, recv)
            # (B'/M, ...) this stage's microbatch (a dummy one in the bubble)
            j = jnp.clip(k - stage, 0, items - 1)
            # The chunk: the same on every stage at tick k, or one of two (M >= S).
            lo, hi = (min(max(i, 0), items - 1) // m for i in (k - n_stages + 1, k))
            if lo == hi:
                rep, chunk = lo, chunks[lo]
            else:
                rep = j // m
                chunk = jax.tree.map(
                    functools.partial(jnp.where, rep == lo), chunks[lo], chunks[hi]
                )
            if keyed:
                rng, shard = keyed
                layers = [(rep * n_stages + stage) * per_chunk + i for i in range(per_chunk)]
                out = stage_fn(chunk, inp, rng, layers, shard * m + j % m)
            else:
                out = stage_fn(chunk, inp)
            if shift and k < n_ticks - 1:  # the last tick's output goes nowhere
                recv = unpack(jax.lax.ppermute(pack(out), axis, shift))
                received.append(recv)
        outs.append(out)
    return outs[-m:]


def _check_inputs(
    stacked_params: Any,
    x: Any,
    mesh: Mesh,
    n_microbatches: int,
    virtual_stages: int,
    axis: str,
    batch_axes: Sequence[str] | None,
) -> tuple[tuple[str, ...], int, int, int]:
    """pipeline_apply's arguments checked: (the batch axes, the number of batch shards, L, B)."""
    _check_positive(n_microbatches=n_microbatches, virtual_stages=virtual_stages)
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
    if batch_axes is None:
        batch_axes = tuple(a for a in mesh.axis_names if a != axis)
    batch_axes = tuple(batch_axes)
    for a in batch_axes:
        if a == axis or a not in mesh.shape:
            raise ValueError(f"batch axis {a!r} must be a mesh axis other than {axis!r}")
    n_stages = mesh.shape[axis]
    n_layers = _leading_size(stacked_params, "stacked_params", "layer")
    chunks = n_stages * virtual_stages
    if n_layers % chunks:
        virtual = f" x {virtual_stages} virtual stages" if virtual_stages > 1 else ""
        raise ValueError(
            f"the {n_layers} stacked layers must split evenly into {n_stages} pipeline stages"
            f"{virtual} (mesh axis {axis!r}): n_layers % {chunks} = {n_layers % chunks}"
        )
    if virtual_stages > 1 and n_microbatches < n_stages:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs n_microbatches >= the {n_stages} stages, "
            f"got {n_microbatches}: stage 0 starts a microbatch's next chunk once the last "
            "stage has sent it round; raise n_microbatches or set virtual_stages=1"
        )
    ways = 1
    for a in batch_axes:
        ways *= mesh.shape[a]
    batch = _leading_size(x, "x", "batch")
    if batch % ways or (batch // ways) % n_microbatches:
        raise ValueError(
            f"batch size {batch} must split over the batch axes {batch_axes} ({ways} ways) and "
            f"then into n_microbatches={n_microbatches}: {batch} must be divisible by "
            f"{ways} x {n_microbatches} = {ways * n_microbatches}"
        )
    return batch_axes, ways, n_layers, batch


def _by_stage(stacked: Any, n_stages: int, n_rep: int) -> Any:
    """Leaves (L, ...) in layer order -> (L, ...) with stage s's chunks of L/(S V) layers, s,
    S + s, .., (V - 1) S + s, at rows s L/S .. (s + 1) L/S - 1: (V, S, L/(S V), ...) ->
    (S, V, L/(S V), ...)."""
    return jax.tree.map(
        lambda p: p.reshape(n_rep, n_stages, -1, *p.shape[1:]).swapaxes(0, 1).reshape(p.shape),
        stacked,
    )


def _gather_rows(a: jax.Array, axis: str, n_stages: int) -> jax.Array:
    """(B'/S, ...) this stage's rows -> (B', ...): on stage 0 the shard's rows in order."""
    parts = [a] + [jax.lax.ppermute(a, axis, [(s, 0)]) for s in range(1, n_stages)]
    return jnp.concatenate(parts)


def _scatter_rows(a: jax.Array, stage: jax.Array, axis: str, n_stages: int) -> jax.Array:
    """(B', ...) on the last stage -> (B'/S, ...) on stage s: its chunk s."""
    last, c = n_stages - 1, a.shape[0] // n_stages
    mine = a[last * c :]
    for s in range(last):
        got = jax.lax.ppermute(a[s * c : (s + 1) * c], axis, [(last, s)])
        mine = jnp.where(stage == s, got, mine)
    return mine


def _stage_fn(layer_fn: LayerFn, remat: bool, keyed: bool = False) -> Callable[..., Any]:
    """(one params pytree per layer, x) -> x after this stage's L/S layers, in order; `keyed`:
    (layer params, x, rng, layers: their global indices, microbatch) -> x, each layer given the
    key fold_in(fold_in(rng, layer), microbatch)."""

    def stage(params: Sequence[Any], x: Any) -> Any:
        for p in params:
            x = layer_fn(p, x)
        return x

    def keyed_stage(
        params: Sequence[Any], x: Any, rng: jax.Array, layers: Sequence[Any], mb: Any
    ) -> Any:
        for p, i in zip(params, layers, strict=True):
            x = layer_fn(p, x, jax.random.fold_in(jax.random.fold_in(rng, i), mb))
        return x

    stage = keyed_stage if keyed else stage
    return jax.checkpoint(stage) if remat else stage


def _leading_size(tree: Any, what: str, axis: str) -> int:
    """The leading axis size that every leaf of `tree` shares; ValueError if there is none."""
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else 0 for a in jax.tree.leaves(tree)}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            f"{what} must be a non-empty pytree whose leaves all share one leading {axis} axis; "
            f"got leading sizes {sorted(sizes)}"
        )
    return sizes.pop()
