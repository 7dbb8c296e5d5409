"""Train state and the pure, jitted train / eval steps."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

Batch = dict[str, jax.Array]  # inputs (B, T) int32, targets (B, T) int32 (IGNORE = -1)


def create_state(
    model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array, example: jax.Array
) -> TrainState:
    """Initialise parameters from `rng` (float32) and the optimizer state."""
    params = model.init(rng, example)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _loss_and_metrics(params: Any, apply_fn, batch: Batch, rng: jax.Array | None):
    """The model's mean loss over non-IGNORE targets and its sums {loss_sum, correct, count}."""
    deterministic = rng is None
    rngs = None if deterministic else {"dropout": rng}
    return apply_fn(
        {"params": params},
        batch["inputs"],
        targets=batch["targets"],
        deterministic=deterministic,
        rngs=rngs,
    )


@functools.partial(jax.jit, donate_argnums=0)  # update params/opt state in place
def train_step(state: TrainState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict]:
    """One AdamW update. `rng` drives dropout (folded with the step, so each step differs).

    Returns the new state and {loss, accuracy, grad_norm} (scalars, on device).
    """
    step_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(_loss_and_metrics, has_aux=True)
    (loss, aux), grads = grad_fn(state.params, state.apply_fn, batch, step_rng)
    state = state.apply_gradients(grads=grads)
    metrics = {
        "loss": loss,
        "accuracy": aux["correct"] / jnp.maximum(aux["count"], 1),
        "grad_norm": optax.tree_utils.tree_norm(grads),
    }
    return state, metrics


@jax.jit
def eval_step(state: TrainState, batch: Batch) -> dict:
    """Sums over the batch (loss_sum, correct, count), so batches of any size add up exactly."""
    _, aux = _loss_and_metrics(state.params, state.apply_fn, batch, None)
    return aux
