"""Where every array of a run lives: the device mesh and the shardings of state and batch.

One mesh with axes ("data", "fsdp") (config `parallel`); everything else is XLA's job:

- The batch is split along its rows over both axes (ZeRO: fsdp ranks see different rows too).
- Parameters and optimizer state are replicated over `data` and sharded over `fsdp` along
  their largest dimension that the fsdp size divides (replicated where none does). Adam's
  moments have the parameters' shapes, so one shape rule covers the whole train state.
- The train step is plain `jax.jit` with these in/out shardings: XLA's SPMD partitioner
  inserts the all-gathers of sharded weights, the reduce(-scatter)s of the gradients and the
  reduction of the loss. There is no hand-written communication.

Pallas kernels are custom calls that the partitioner cannot split, so a mesh of more than one
device refuses a plan with a Pallas path (`check_plan`) instead of running it replicated.
This module is the only place that decides a mesh or a sharding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.config import Config, ConfigError, ParallelConfig
from jaxllm.ops import OpPlan

AXES = ParallelConfig.AXES  # ("data", "fsdp")
BATCH = P(AXES)  # rows split over data x fsdp, the rest of each batch array whole


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


def check_batch(batch_size: int, sizes: dict[str, int]) -> None:
    """The global batch must split evenly over data x fsdp."""
    ways = sizes["data"] * sizes["fsdp"]
    if batch_size % ways:
        raise ConfigError(
            f"train.batch_size ({batch_size}) must be divisible by parallel.data x parallel.fsdp "
            f"= {sizes['data']} x {sizes['fsdp']} = {ways}: the batch is split over both"
        )


def check_plan(plan: OpPlan, mesh: Mesh) -> None:
    """Refuse Pallas paths on a mesh of more than one device (see the module docstring)."""
    pallas = [f for f in ("norm", "attention", "loss", "conv") if getattr(plan, f) == "pallas"]
    if mesh.size > 1 and pallas:
        raise ConfigError(
            f"the Pallas path of {', '.join(pallas)} cannot run on a mesh of {mesh.size} "
            "devices: Pallas kernels are opaque to XLA's partitioner (shard_map wrapping is "
            "not implemented yet). Set model.kernels=xla and model.loss_impl=xla, or run on "
            "one device"
        )


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The run's mesh over `devices` (default: all), after checking sizes and batch."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(cfg.parallel, len(devices))
    check_batch(cfg.train.batch_size, sizes)
    # Data outermost: on a multi-GPU host the fsdp groups (more traffic) are neighbours.
    return Mesh(np.array(devices).reshape(tuple(sizes.values())), AXES)


def describe(mesh: Mesh) -> str:
    """One line for the start of a run, e.g. 'parallel: mesh data=4 fsdp=2 over 8 cpu devices'."""
    sizes = " ".join(f"{a}={n}" for a, n in mesh.shape.items())
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


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array of `state` (a train state, or params alone); works on
    abstract (jax.eval_shape) states too."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(np.shape(x), fsdp)), state)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def create_sharded(create: Callable[[], Any], mesh: Mesh) -> Any:
    """Run `create()` (e.g. parameter init) under jit with the state's shardings as outputs, so
    each device only ever holds its shards. Random init gives the same values on any mesh
    (jax's threefry is partitionable)."""
    shardings = state_shardings(jax.eval_shape(create), mesh)
    return jax.jit(create, out_shardings=shardings)()


def shard_batch(batch: dict[str, Any], mesh: Mesh) -> dict[str, jax.Array]:
    """Put a host batch on the mesh, rows split over data x fsdp. A batch whose rows do not
    split evenly (the last evaluation batch) is replicated instead: same sums, more work."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]

    def put(x: Any) -> jax.Array:
        spec = BATCH if np.ndim(x) and np.shape(x)[0] % ways == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {k: put(v) for k, v in batch.items()}


def jit_train_step(step: Callable, state: Any, mesh: Mesh) -> Callable:
    """`step(state, batch, rng) -> (state, metrics)` jitted with the state's shardings pinned on
    both sides (so XLA cannot pick another layout for the new state) and metrics replicated;
    the batch keeps the sharding `shard_batch` gave it. The old state is donated.

    With fsdp > 1 the parameters are gathered once, at the start of the step: left to itself,
    XLA's sharding propagation follows the weights' fsdp split into the activations and then
    has to undo it ("involuntary full rematerialization" warnings; the embeddings' gradients,
    batch-sharded sums written into fsdp-sharded tables, still raise one or two at compile
    time: slower, still exact). The stored state stays sharded; a per-layer gather (lower peak
    memory) needs sharding constraints inside the model: future work."""
    shardings = state_shardings(state, mesh)
    step = getattr(step, "__wrapped__", step)  # a jitted step: its body, not a nested call

    def gathered_step(state: Any, batch: Any, rng: jax.Array) -> Any:
        params = jax.lax.with_sharding_constraint(state.params, replicated(mesh))
        return step(state.replace(params=params), batch, rng)

    return jax.jit(
        gathered_step if mesh.shape["fsdp"] > 1 else step,
        in_shardings=(shardings, None, replicated(mesh)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


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
