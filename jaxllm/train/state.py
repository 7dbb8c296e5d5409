"""Train state and the pure, jitted train / eval steps."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def loss_and_sums(
    params: Any, apply_fn: Callable[..., Any], batch: Batch, rng: jax.Array | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The model's mean loss over non-IGNORE targets and its sums {loss_sum, correct, count};
    `rng` None: no dropout (evaluation)."""
    rngs = None if rng is None else {"dropout": rng}
    return apply_fn(
        {"params": params},
        batch["inputs"],
        batch["targets"],
        deterministic=rng is None,
        rngs=rngs,
        method="loss",
    )


@functools.partial(jax.jit, donate_argnums=0)  # update params/opt state in place
def train_step(state: TrainState, batch: Batch, rng: jax.Array) -> tuple[TrainState, dict]:
    """One AdamW update. `rng` drives dropout (folded with the step, so each step differs).

    Returns the new state and {loss, accuracy, grad_norm} (scalars, on device).
    """
    step_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(loss_and_sums, has_aux=True)
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
    _, aux = loss_and_sums(state.params, state.apply_fn, batch, None)
    return aux
