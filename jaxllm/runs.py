"""A trained run dir -> (config, model variables, step): what generate.py and translate load.

The model is the one the checkpoint was trained as (its recorded `model` section); how it runs
here (`execution`: kernels, dtypes, scan_layers, ...) is the caller's, by default the run's
config.yaml. A checkpoint saved with the other block layout (execution.scan_layers) is
restacked on load.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.config import (
    Config,
    ConfigError,
    ModelConfig,
    from_dict,
    load_config,
    parse_overrides,
)
from jaxllm.models import build_model, stack_blocks, unstack_blocks
from jaxllm.train.checkpoint import Checkpointer, CheckpointMismatchError
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state


class CheckpointConfigWarning(UserWarning):
    """A run dir's config.yaml describes another model than its checkpoint was trained as."""


def recorded_config(meta: dict, fallback: Config) -> Config:
    """The config a checkpoint recorded (`Checkpointer.recorded_meta`), else `fallback`."""
    recorded = meta.get("config")
    if recorded is None:
        return fallback
    try:
        return from_dict(Config, recorded)
    except ConfigError as e:
        raise ConfigError(f"the config checkpoint {meta.get('step')} recorded: {e}") from None


def model_changes(trained: ModelConfig, current: ModelConfig) -> list[str]:
    """'key: trained -> current' for every model field that differs."""
    a, b = dataclasses.asdict(trained), dataclasses.asdict(current)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]


def load_run(
    run_dir: str | Path,
    which: str = "latest",
    overrides: list[str] | None = None,
) -> tuple[Config, dict[str, Any], int]:
    """(config, model variables {'params': ...}, step) of a train.py run dir's checkpoint.

    `which` is 'latest' or 'best' (lowest eval loss); the newest intact one (see
    `Checkpointer.restore`). The returned config holds the checkpoint's model, config.yaml's
    `execution` (with `overrides`) and the dir it was loaded from as train.run_dir (a run dir may
    have moved). The optimizer state is restored into an abstract template and dropped. The run
    dir is only read, never repaired. Where config.yaml's model differs from the checkpoint's,
    a CheckpointConfigWarning names the differences. `overrides` (a command line's
    `--section.key=value`) apply over config.yaml: execution.* to how the model runs, the other
    sections to the returned config; model.* are refused (ConfigError): it is the checkpoint's.
    """
    run_dir = Path(run_dir)
    if which not in ("latest", "best"):
        raise ValueError(f"which must be 'latest' or 'best', got {which!r}")
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a train.py run dir (no config.yaml)")
    if fixed := [f"--{k}" for k in parse_overrides(overrides or []) if k.startswith("model.")]:
        raise ConfigError(f"{', '.join(fixed)}: a trained run's model is its checkpoint's")
    cfg = load_config(run_dir / "config.yaml")
    wanted = load_config(run_dir / "config.yaml", overrides) if overrides else cfg
    ckpt = Checkpointer(run_dir, cfg.train.keep_checkpoints, repair=False)
    try:
        newest = (ckpt.latest if which == "latest" else ckpt.best).latest_step()
        if newest is None:
            raise FileNotFoundError(f"no {which} checkpoint in {run_dir}")
        trained = recorded_config(ckpt.recorded_meta(newest, which), cfg)
        if diffs := model_changes(trained.model, cfg.model):
            warnings.warn(
                f"{run_dir / 'config.yaml'} describes another model than {which} checkpoint "
                f"{newest} was trained as ({'; '.join(diffs)}): the checkpoint's is used",
                CheckpointConfigWarning,
                stacklevel=2,
            )
        # The template in the layout the checkpoint was saved in (its execution.scan_layers).
        saved_as = build_model(trained.model, trained.execution)
        example = jnp.zeros((1, 1), jnp.int32)
        # The optimizer state's structure does not depend on the schedule's length.
        tx = make_optimizer(cfg.optim, cfg.optim.warmup_steps + 1)
        abstract = jax.eval_shape(
            lambda: create_state(saved_as, tx, jax.random.PRNGKey(0), example)
        )
        # On one device of this process: without a sharding orbax would use the saved one,
        # which names devices (of a multi-device run) that may not exist here.
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
        )
        state, meta = ckpt.restore(abstract, which=which)
    finally:
        ckpt.close()
    if meta["step"] != newest and model_changes(recorded_config(meta, cfg).model, trained.model):
        raise CheckpointMismatchError(  # an older checkpoint was restored (with a warning)
            f"{run_dir}: {which} checkpoint {meta['step']}, restored because {newest} was "
            "unusable, was trained as another model than the one built for it"
        )
    execution = wanted.execution
    params = state.params
    if execution.scan_layers and not trained.execution.scan_layers:
        params = stack_blocks(params, trained.model.n_layers)
    elif trained.execution.scan_layers and not execution.scan_layers:
        params = unstack_blocks(params)
    train = dataclasses.replace(wanted.train, run_dir=str(run_dir))
    cfg = dataclasses.replace(wanted, model=trained.model, execution=execution, train=train)
    return cfg, {"params": params}, meta["step"]
