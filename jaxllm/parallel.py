"""Where every array of a run lives: the device mesh and the shardings of state and batch.

One mesh with axes ("pipeline", "data", "fsdp") (config `parallel`); the rest is XLA's job, and
the pipeline's (jaxllm/pipeline.py):

- The batch is split along its rows over data x fsdp (ZeRO: fsdp ranks see different rows too)
  and replicated over `pipeline`.
- Parameters and optimizer state are replicated over `data` and sharded over `fsdp` along
  their largest dimension that the fsdp size divides (replicated where none does). Adam's
  moments have the parameters' shapes, so one shape rule covers the whole train state. With
  execution.scan_layers the block stack's leaves (params["blocks"], leading axis n_layers) are
  sharded over fsdp on a non-layer dimension, and over `pipeline` on the layer axis: stage s
  holds layers s L/S .. (s + 1) L/S - 1 (and their Adam moments).
- The train step is `jax.jit` with these in/out shardings: XLA's SPMD partitioner inserts the
  all-gathers of sharded weights, the reduce(-scatter)s of the gradients and the reduction of
  the loss. With fsdp > 1 the block weights are gathered one layer at a time (unrolled blocks
  or the scanned loop), forward and again in the backward (ZeRO-3), instead of all at the
  start of the step. With pipeline > 1 the loss runs embed -> the stages (GPipe or circular,
  `pipeline_apply`: shard_map + ppermute) -> final norm + loss. `mesh_apply` picks the path.
  Under a pipeline, fsdp-sharded stage weights are gathered once per step, on entering the
  stages: a per-layer gather there would run once per tick, V M + S - 1 times a step instead of
  once (DeepSpeed does not combine ZeRO-3 with pipeline stages either).
  Dropout works on both paths: each layer (and under the pipeline each microbatch) gets its
  own key folded from the step's dropout rng (`Decoder.run_blocks`); the masks differ from the
  one-device model's, which splits its rng another way.

Pallas kernels are custom calls that the partitioner cannot split (it would gather their operands
and run them whole on every device), so on a mesh of several devices the model runs with a
`KernelShard` (`kernel_model`): each Pallas call is a `shard_map` over the mesh's axes (rows
split over data x fsdp x pipeline, ROW_AXES: with stages, they split the embedding, the final
norm and the loss too, in the order the pipeline reads and writes rows), weights whole.
Inside the pipeline's own shard_map the stages' kernels already see per-device arrays and run
as they are.
This module is the only place that decides a mesh or a sharding.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import Config, ConfigError, ExecutionConfig, ModelConfig, ParallelConfig
from jaxllm.functional import IGNORE
from jaxllm.models.decoder import BlockRunner, Decoder, is_layer_name, read_dtypes
from jaxllm.ops import KernelShard
from jaxllm.pipeline import bubble_fraction, pipeline_apply, rows_split

AXES = ParallelConfig.AXES  # ("data", "fsdp", "pipeline"): the config's names and order
# The devices' layout, outermost first: pipeline stages exchange the least (one activation per
# microbatch and tick, point to point), so across hosts; the fsdp groups the most, neighbours.
MESH_AXES = ("pipeline", "data", "fsdp")
BATCH_AXES = ("data", "fsdp")
BATCH = P(BATCH_AXES)  # rows split over data x fsdp, the rest of each batch array whole
# Rows over every axis, the stages innermost: each data x fsdp shard split over the stages,
# as pipeline_apply reads its input and places its output (no row moves in between).
ROW_AXES = (*BATCH_AXES, "pipeline")


def mesh_sizes(cfg: ParallelConfig, n_devices: int) -> dict[str, int]:
    """{axis: size} with a -1 filled so that the product is `n_devices`; ConfigError if the
    sizes cannot multiply to it."""
    sizes = {a: getattr(cfg, a) for a in AXES}
    fixed = math.prod(n for n in sizes.values() if n > 0)
    asked = " x ".join(f"{a}={n}" for a, n in sizes.items())
    if -1 in sizes.values():
        if n_devices % fixed:
            raise ConfigError(
                f"parallel mesh {asked}: the fixed sizes ({fixed}) must divide the device "
                f"count ({n_devices})"
            )
        sizes = {a: n_devices // fixed if n == -1 else n for a, n in sizes.items()}
    elif fixed != n_devices:
        raise ConfigError(
            f"parallel mesh {asked} needs {fixed} devices, but there are {n_devices}; set the "
            "sizes so their product is the device count, or one of them to -1 (fill)"
        )
    return sizes


def n_microbatches(cfg: ParallelConfig, n_stages: int) -> int:
    """GPipe's microbatch count: parallel.microbatches, or as many as stages when unset."""
    return cfg.microbatches or n_stages


def check_batch(batch_size: int, sizes: dict[str, int], microbatches: int = 1) -> None:
    """The global batch must split evenly over data x fsdp, and with pipeline stages each of
    those shards into `microbatches`."""
    ways = sizes["data"] * sizes["fsdp"]
    if batch_size % ways:
        raise ConfigError(
            f"train.batch_size ({batch_size}) must be divisible by parallel.data x parallel.fsdp "
            f"= {sizes['data']} x {sizes['fsdp']} = {ways}: the batch is split over both"
        )
    if sizes.get("pipeline", 1) > 1 and batch_size % (ways * microbatches):
        raise ConfigError(
            f"train.batch_size ({batch_size}) must be divisible by parallel.data x parallel.fsdp "
            f"x parallel.microbatches = {sizes['data']} x {sizes['fsdp']} x {microbatches} = "
            f"{ways * microbatches}: each data x fsdp shard of the batch is cut into the "
            "pipeline's microbatches; change train.batch_size or parallel.microbatches"
        )


def _check_virtual(n_stages: int, virtual_stages: int) -> None:
    if virtual_stages > 1 and n_stages == 1:
        raise ConfigError(
            f"parallel.virtual_stages={virtual_stages} needs pipeline stages: it splits each "
            "stage's layers into chunks. Set parallel.pipeline > 1 or parallel.virtual_stages=1"
        )


def check_pipeline(
    model: ModelConfig,
    ex: ExecutionConfig,
    n_stages: int,
    virtual_stages: int = 1,
    microbatches: int | None = None,
) -> None:
    """What `pipeline` > 1 needs from the model: scanned layers that split evenly into the
    stages (and their `virtual_stages` chunks each, which need as many `microbatches` as
    stages at least)."""
    _check_virtual(n_stages, virtual_stages)
    if n_stages == 1:
        return
    if not ex.scan_layers:
        raise ConfigError(
            f"parallel.pipeline={n_stages} needs execution.scan_layers=true: the stages hold "
            "slices of the stacked block parameters. Set --execution.scan_layers=true (or "
            "parallel.pipeline=1)"
        )
    if model.short_conv and ex.kernels == "pallas":
        # Seen on 8 CPU devices: the step hung in a collective (the stages' other kernels run).
        raise ConfigError(
            f"parallel.pipeline={n_stages} with model.short_conv=true needs execution.kernels=xla: "
            "the Pallas depthwise conv inside pipeline stages is not supported yet"
        )
    chunks = n_stages * virtual_stages
    if model.n_layers % chunks:
        v = f" x parallel.virtual_stages ({virtual_stages})" if virtual_stages > 1 else ""
        raise ConfigError(
            f"model.n_layers ({model.n_layers}) must be divisible by parallel.pipeline "
            f"({n_stages}){v}: the stages run chunks of n_layers / {chunks} consecutive layers. "
            f"Change model.n_layers or parallel.pipeline{' or parallel.virtual_stages' * bool(v)}"
        )
    m = microbatches or n_stages
    if virtual_stages > 1 and m < n_stages:
        raise ConfigError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.microbatches >= "
            f"parallel.pipeline ({m} < {n_stages}): stage 0 starts a microbatch's next chunk "
            "once the last stage has sent it round. Raise parallel.microbatches (or leave it "
            "unset: one per stage) or set parallel.virtual_stages=1"
        )


def kernel_model(model: Decoder, mesh: Mesh) -> Decoder:
    """`model` as it runs on `mesh`: on several devices a clone whose Pallas calls run per
    shard of the batch (`KernelShard` over data x fsdp x pipeline; its plan's describe() says
    so); on one device, or without a Pallas path, `model` itself. Same parameters either way."""
    if mesh.size == 1 or model.kernel_shard is not None:
        return model
    # Rows over every mesh axis. With stages, the pipeline's output rows are split over them too
    # (pipeline_apply): the final norm and the loss run on 1/S of the rows per stage (the
    # stages' own kernels run inside the pipeline's shard_map, per device:
    # BlockRunner.per_device). With
    # one stage the axis has size 1 and splits nothing; left out, shard_map's transpose would
    # all-reduce every kernel input's cotangent over it (a collective per call, of 1 device).
    shard = KernelShard(mesh, ROW_AXES)
    sharded = model.clone(kernel_shard=shard)
    return sharded if sharded.plan.shard is not None else model


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The run's mesh over `devices` (default: all), after checking sizes, the model against
    the pipeline, and the batch (ConfigError naming the fix)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(cfg.parallel, len(devices))
    par = cfg.parallel
    check_pipeline(
        cfg.model, cfg.execution, sizes["pipeline"], par.virtual_stages, par.microbatches
    )
    check_batch(cfg.train.batch_size, sizes, n_microbatches(cfg.parallel, sizes["pipeline"]))
    shape = tuple(sizes[a] for a in MESH_AXES)
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)


def describe(
    mesh: Mesh,
    microbatches: int | None = None,
    batch_size: int | None = None,
    virtual_stages: int = 1,
) -> str:
    """One line for the start of a run, e.g. 'parallel: mesh data=4 fsdp=2 over 8 cpu devices'
    ('... pipeline=4 (4 microbatches, bubble 43%) ...' with pipeline stages, '... (4
    microbatches, circular, 3 virtual stages, bubble 20%) ...' with virtual ones). With fsdp > 1 it
    says where the weights are gathered: per layer (no pipeline) or once at
    the start of the step. With stages and `batch_size` it says how the rows enter the pipeline
    (pipeline.rows_split): split over the stages, or replicated over them and why."""
    sizes = " ".join(f"{a}={mesh.shape[a]}" for a in AXES if a != "pipeline")
    stages = mesh.shape["pipeline"]
    if stages > 1:
        m = microbatches or stages
        circular = f"circular, {virtual_stages} virtual stages, " if virtual_stages > 1 else ""
        bubble = bubble_fraction(stages, m, virtual_stages)
        sizes += f" pipeline={stages} ({m} microbatches, {circular}bubble {bubble:.0%}"
        if batch_size is not None:
            ways = mesh.shape["data"] * mesh.shape["fsdp"]
            if rows_split(batch_size, ways, stages):
                sizes += ", rows split over the stages"
            else:  # a valid layout, but it moves more: say so rather than take it silently
                sizes += (
                    f", rows replicated over the stages: batch {batch_size} is not divisible by "
                    f"data x fsdp x pipeline = {ways * stages}"
                )
        sizes += ")"
    elif microbatches is not None:  # set, but there is nothing to pipeline: say so
        sizes += f" (parallel.microbatches={microbatches} unused: no pipeline stages)"
    if mesh.shape["fsdp"] > 1:
        sizes += f" (fsdp weights gathered per {'layer' if stages == 1 else 'step'})"
    platform = mesh.devices.flat[0].platform
    return f"parallel: mesh {sizes} over {mesh.size} {platform} device{'s' * (mesh.size > 1)}"


# ----------------------------------------------------------------------------- shardings


def param_spec(shape: Sequence[int], fsdp: int) -> P:
    """FSDP's rule for one array: shard its largest dimension divisible by `fsdp` (the first
    of equals), replicate it if none is (scalars, odd vectors) or fsdp is 1."""
    dims = [i for i, n in enumerate(shape) if fsdp > 1 and n % fsdp == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda i: shape[i])  # max keeps the first of equal sizes
    return P(*(["fsdp" if i == best else None for i in range(len(shape))]))


def in_blocks(path: Sequence[Any]) -> bool:
    """Whether a leaf's tree path runs through a "blocks" entry: the stacked layers of
    execution.scan_layers (params["blocks"], and the Adam moments of the same parameters)."""
    return any(getattr(k, "key", None) == "blocks" for k in path)


def leaf_spec(path: Sequence[Any], shape: Sequence[int], mesh: Mesh) -> P:
    """The PartitionSpec of one state array: `param_spec`, except that a stacked block leaf
    (L, ...) keeps its layer axis for `pipeline` (None without stages) and is fsdp-sharded on
    one of its other dimensions, so that one layer's slice is a shard of that layer."""
    fsdp = mesh.shape["fsdp"]
    if in_blocks(path) and len(shape) >= 1:
        stage = "pipeline" if mesh.shape["pipeline"] > 1 else None
        return P(stage, *param_spec(shape[1:], fsdp))
    return param_spec(shape, fsdp)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array of `state` (a train state, or params alone); works on
    abstract (jax.eval_shape) states too."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, leaf_spec(path, np.shape(x), mesh)), state
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def create_sharded(create: Callable[[], Any], mesh: Mesh) -> Any:
    """Run `create()` (e.g. parameter init) under jit with the state's shardings as outputs, so
    each device only ever holds its shards. Random init gives the same values on any mesh
    (jax's threefry is partitionable)."""
    shardings = state_shardings(jax.eval_shape(create), mesh)
    return jax.jit(create, out_shardings=shardings)()


def eval_rows_multiple(mesh: Mesh, microbatches: int | None = None) -> int:
    """Evaluation batches are padded (pad_rows) to a multiple of this many rows, so that every
    one runs as the training batches do: rows split over data x fsdp (shard_batch) and, with
    pipeline stages, into the microbatches and over the stages (MeshApply), rather than
    replicated or through the plain model (a partial last batch otherwise would)."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]
    stages = mesh.shape["pipeline"]
    if stages == 1:
        return ways
    return math.lcm(ways * (microbatches or stages), mesh.size)


def pad_rows(batch: dict[str, Any], multiple: int) -> dict[str, np.ndarray]:
    """`batch` with rows appended up to a multiple of `multiple`: inputs 0 and targets IGNORE,
    so they add nothing to eval_step's sums (loss_sum, correct, count)."""
    fill = {"inputs": 0, "targets": IGNORE}
    if set(batch) - set(fill):
        raise ValueError(f"pad_rows pads 'inputs' and 'targets' only, got keys {sorted(batch)}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    out = {k: np.asarray(v) for k, v in batch.items()}
    extra = -out["inputs"].shape[0] % multiple
    if extra:
        out = {
            k: np.concatenate([v, np.full((extra, *v.shape[1:]), fill[k], v.dtype)])
            for k, v in out.items()
        }
    return out


def shard_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Put a host batch on the mesh, rows split over data x fsdp. A batch whose rows do not
    split evenly is replicated instead: same sums, more work (the training loop pads its
    evaluation batches with pad_rows, so they always split)."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]

    def put(x: Any) -> jax.Array:
        spec = BATCH if np.ndim(x) and np.shape(x)[0] % ways == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {k: put(v) for k, v in batch.items()}


# ----------------------------------------------------------------------------- the steps


# Ops that only move, cast or re-shape data: recomputed in the backward, never saved (see
# gathered_layers). Weights pass through nothing else between their gather and their matmul.
_DATA_MOVEMENT = frozenset({
    "sharding_constraint", "convert_element_type", "slice", "dynamic_slice", "split",
    "squeeze", "expand_dims", "reshape", "broadcast_in_dim", "transpose", "concatenate",
    "pad", "rev", "copy", "copy_p",
})  # fmt: skip


def _save_computed(prim: Any, *_: Any, **__: Any) -> bool:
    """A jax.checkpoint policy: save what `prim` outputs unless it only moves data."""
    return prim.name not in _DATA_MOVEMENT


def _gathered(mesh: Mesh, w: jax.Array, dtype: Any) -> jax.Array:
    """`w` whole on every device (a sharding constraint to replicated: XLA all-gathers its
    shards), cast to `dtype` first where it is not None, so that the gather moves the cast
    shards. The cast is pinned to w's own layout: else sharding propagation would carry the
    gather back through it onto w as stored."""
    whole = replicated(mesh)
    if dtype is None or jnp.dtype(dtype) == w.dtype:
        return jax.lax.with_sharding_constraint(w, whole)
    shard = NamedSharding(mesh, param_spec(w.shape, mesh.shape["fsdp"]))
    return jax.lax.with_sharding_constraint(
        jax.lax.with_sharding_constraint(w.astype(dtype), shard), whole
    )


def gathered_layers(
    mesh: Mesh, read_dtypes: Callable[[Any], Any], remat: bool = False
) -> Callable[..., Any]:
    """A `BlockRunner.run` for `Decoder.loss` that all-gathers each layer's fsdp-sharded weights
    just before the layer runs (`_gathered`; those `read_dtypes(layer_params)` names already in
    the dtype the layer reads them in, e.g. bfloat16 matmul kernels): a `lax.scan` over the
    stacked layers (execution.scan_layers), else a Python loop over the unrolled blocks, which
    leaves XLA free to fuse across layers and to start the next layer's gather during this one.
    Each layer's weight gradients are reduced into the shard layout as the backward reaches it
    (a reduce-scatter where XLA forms one; the CPU backend writes all-reduce + slice).

    Nothing derived from the gathered weights is kept for the backward: each layer runs under
    `jax.checkpoint` with `_save_computed`, which saves the outputs of the ops that compute
    (matmuls, kernels, elementwise math, reductions) and recomputes the ones that only move,
    cast or re-shape data, which is all the weights go through before a matmul. So the backward
    gathers each layer again, re-casts and re-slices it, and recomputes nothing else (ZeRO-3: in
    the scanned loop at most a layer or two are whole on a device at a time; unrolled, XLA's
    scheduler may start a gather earlier). Without a policy the backward would keep every
    layer's gathered weights: all of them whole. (The `dots_saveable` policy keeps them out too,
    but recomputes the norms, activations and attention in the backward.) `remat`
    (execution.remat=block): `nothing_saveable` instead, each layer saves only its inputs.

    With `rng` (dropout), layer i runs as `layer_fn(params_i, carry, fold_in(rng, i))`; the
    recomputation in the backward draws the same masks from the same keys."""

    def run(layer_fn: Callable, layers: Any, carry: Any, rng: jax.Array | None = None) -> Any:
        def layer(c: Any, p: Any, i: jax.Array | int) -> Any:
            p = jax.tree.map(functools.partial(_gathered, mesh), p, read_dtypes(p))
            return layer_fn(p, c) if rng is None else layer_fn(p, c, jax.random.fold_in(rng, i))

        # prevent_cse only between unrolled blocks: a scan's body is one program anyway
        policy = jax.checkpoint_policies.nothing_saveable if remat else _save_computed
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=isinstance(layers, list))
        if isinstance(layers, list):  # unrolled blocks
            for i, p in enumerate(layers):
                with jax.named_scope(f"block_{i}"):
                    carry = layer(carry, p, i)
            return carry
        n_layers = jax.tree.leaves(layers)[0].shape[0]
        body = lambda c, p_i: (layer(c, *p_i), None)  # noqa: E731
        return jax.lax.scan(body, carry, (layers, jnp.arange(n_layers)))[0]

    return run


class MeshApply:
    """`model.apply` as the steps call it on a mesh: method "loss" runs the model's own loss with
    its block stack run by `blocks` (`Decoder.loss(..., blocks=...)`) when the batch has a
    multiple of `rows` rows; everything else (other methods, an evaluation batch that does not
    split into the microbatches) runs the plain `model.apply`."""

    def __init__(
        self,
        model: Decoder,
        blocks: BlockRunner,
        rows: int,
        what: str,
        split_rows: NamedSharding | None = None,
    ) -> None:
        self.model, self.blocks, self.rows, self.what = model, blocks, rows, what
        self.split_rows = split_rows

    def __call__(self, variables: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        if method == "loss" and np.shape(args[0])[0] % self.rows == 0:
            rows = self.split_rows  # over every mesh axis (ROW_AXES): one chunk a device
            if rows is not None and np.shape(args[0])[0] % rows.mesh.size == 0:
                # tokens and targets split over the stages too: the embedding runs on 1/S of
                # the rows per stage, as the pipeline reads them (pipeline_apply)
                tokens, targets = (jax.lax.with_sharding_constraint(a, rows) for a in args[:2])
                args = (tokens, targets, *args[2:])
            return self.model.apply(variables, *args, method="loss", blocks=self.blocks, **kwargs)
        if method == "loss":  # said once per compile (this runs while jit traces)
            warnings.warn(
                f"a batch of {np.shape(args[0])[0]} rows does not split into {self.rows} "
                f"({self.what}): its loss runs as the plain model, weights gathered whole",
                stacklevel=2,
            )
        return self.model.apply(variables, *args, method=method, **kwargs)

    def __repr__(self) -> str:
        return f"MeshApply({type(self.model).__name__}, {self.what})"


def pending_folded(ex: ExecutionConfig) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """pipeline_apply's `wire` for the blocks' carry (x, h) (residual stream, pending branch
    output): send x + h, go on from (x + h, 0). The next layer adds h first thing (add_and_norm,
    in x's dtype), so the result is the same, while each send is one array of x's dtype
    instead of two."""
    pending = jnp.dtype(ex.compute_dtype)

    def pack(carry: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, h = carry
        return x + h.astype(x.dtype)

    def unpack(y: jax.Array) -> tuple[jax.Array, jax.Array]:
        return y, jnp.zeros_like(y, dtype=pending)  # zeros_like: y's device variance too

    return pack, unpack


def mesh_apply(
    apply_fn: Callable, mesh: Mesh, microbatches: int | None = None, virtual_stages: int = 1
) -> Callable:
    """The apply function the train and eval steps use on `mesh` in place of a state's
    `apply_fn` (a Decoder's `model.apply`): with execution.scan_layers and pipeline > 1, a
    `MeshApply` whose loss runs the stages with `pipeline_apply` (`microbatches`, default one
    per stage; `virtual_stages`); with fsdp > 1, one whose loss gathers the block weights layer
    by layer (`gathered_layers`); else the model's apply. Both thread dropout keys per layer
    (`Decoder.run_blocks`). A Decoder runs as `kernel_model` makes it (Pallas calls per batch
    shard)."""
    model = getattr(apply_fn, "__self__", None)
    if isinstance(model, Decoder):
        sharded = kernel_model(model, mesh)
        if sharded is not model:  # else keep apply_fn itself: _on_mesh compares identities
            model, apply_fn = sharded, sharded.apply
    stages, fsdp = mesh.shape["pipeline"], mesh.shape["fsdp"]
    scanned = isinstance(model, Decoder) and model.execution.scan_layers
    _check_virtual(stages, virtual_stages)
    if stages > 1:
        if not scanned:
            raise ConfigError(
                f"a mesh with pipeline={stages} needs a Decoder with execution.scan_layers=true, "
                f"got the apply function {apply_fn!r}"
            )
        check_pipeline(model.cfg, model.execution, stages, virtual_stages, microbatches)
        m = microbatches or stages
        plan = model.plan
        stage_ops = (plan.norm, plan.attention, plan.conv, plan.mlp)
        pallas = plan.attention == "flash" or any(p.startswith("pallas") for p in stage_ops)
        run = functools.partial(
            pipeline_apply,
            mesh=mesh,
            n_microbatches=m,
            virtual_stages=virtual_stages,
            batch_axes=BATCH_AXES,
            check_vma=not pallas,
            wire=pending_folded(model.execution),
        )
        ways = mesh.shape["data"] * fsdp * m
        what = f"pipeline {stages} stages x {m} microbatches"
        what += f", {virtual_stages} virtual stages" if virtual_stages > 1 else ""
        split = NamedSharding(mesh, P(ROW_AXES))
        return MeshApply(model, BlockRunner(run, per_device=True), ways, what, split_rows=split)
    if isinstance(model, Decoder) and fsdp > 1:
        remat = model.execution.remat == "block"
        runner = BlockRunner(gathered_layers(mesh, read_dtypes(model.execution), remat))
        return MeshApply(model, runner, 1, f"fsdp {fsdp}, gathered per layer")
    return apply_fn


def _gather_params(params: Any, mesh: Mesh, keep_layers: bool) -> Any:
    """Every parameter constrained to replicated (gathered at the start of the step), except
    the blocks' (params["blocks"], or h0, h1, ...) when `keep_layers`: their runner gathers
    them layer by layer."""
    whole = replicated(mesh)

    def layer(path: Sequence[Any]) -> bool:
        return in_blocks(path) or any(is_layer_name(str(getattr(k, "key", ""))) for k in path)

    return jax.tree_util.tree_map_with_path(
        lambda path, x: x if keep_layers and layer(path) else
        jax.lax.with_sharding_constraint(x, whole),
        params,
    )  # fmt: skip


def _on_mesh(
    step: Callable, state: Any, mesh: Mesh, microbatches: int | None, virtual_stages: int
) -> Callable:
    """`step(state, ...)` with the state's apply function swapped for `mesh_apply`'s (and
    swapped back in a returned state) and, with fsdp > 1, the parameters that no per-layer
    path gathers gathered at its start."""
    step = getattr(step, "__wrapped__", step)  # a jitted step: its body, not a nested call
    apply = mesh_apply(state.apply_fn, mesh, microbatches, virtual_stages)
    swapped, gather = apply is not state.apply_fn, mesh.shape["fsdp"] > 1
    if not swapped and not gather:
        return step

    def run(state: Any, *args: Any) -> Any:
        orig, params = state.apply_fn, state.params
        if gather:
            params = _gather_params(params, mesh, keep_layers=isinstance(apply, MeshApply))
        out = step(state.replace(params=params, apply_fn=apply), *args)
        if isinstance(out, tuple) and hasattr(out[0], "apply_fn"):  # (new state, metrics)
            out = (out[0].replace(apply_fn=orig), *out[1:])
        return out

    return run


def jit_train_step(
    step: Callable,
    state: Any,
    mesh: Mesh,
    microbatches: int | None = None,
    virtual_stages: int = 1,
) -> Callable:
    """`step(state, batch, rng) -> (state, metrics)` jitted with the state's shardings pinned on
    both sides (so XLA cannot pick another layout for the new state) and metrics replicated;
    the batch keeps the sharding `shard_batch` gave it. The old state is donated.

    The loss runs as `mesh_apply` says: through the pipeline stages (`microbatches`,
    `virtual_stages`), or with the block weights gathered per layer (a Decoder, fsdp > 1).
    Otherwise, with
    fsdp > 1, the parameters are gathered once, at the start of the step: left to itself, XLA's
    sharding propagation follows the weights' fsdp split into the activations and then has to
    undo it ("involuntary full rematerialization" warnings; the embeddings' gradients,
    batch-sharded sums written into fsdp-sharded tables, still raise one or two at compile
    time: slower, still exact). The stored state stays sharded either way."""
    shardings = state_shardings(state, mesh)
    return jax.jit(
        _on_mesh(step, state, mesh, microbatches, virtual_stages),
        in_shardings=(shardings, None, replicated(mesh)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(
    step: Callable,
    state: Any,
    mesh: Mesh,
    microbatches: int | None = None,
    virtual_stages: int = 1,
) -> Callable:
    """`step(state, batch) -> sums` (jaxllm.train.state.eval_step) jitted for `mesh`, its loss
    run as in `jit_train_step`; state and batch keep the shardings they have."""
    return jax.jit(_on_mesh(step, state, mesh, microbatches, virtual_stages))


def state_bytes_per_device(state: Any) -> int:
    """Bytes of params + optimizer state held by one device: each array's shard, not its whole
    (FSDP divides the sharded arrays by the fsdp size; replicated ones count in full)."""
    leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        if hasattr(x, "sharding") and x.sharding is not None
        else x.nbytes
        for x in leaves
    )
