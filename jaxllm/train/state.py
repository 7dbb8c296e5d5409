"""Train state and the pure, jitted train / eval steps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training.train_state import TrainState

from jaxllm.functional import IGNORE

Batch = dict[str, jax.Array]  # inputs (B, T) int32, targets (B, T) int32 (IGNORE = -1)


class LMTrainState(TrainState):
    """A TrainState that knows its model's vocabulary, so the jitted steps can count bad ids.

    vocab_size is static (not a pytree leaf): checkpoints still hold params, opt_state, step.
    """

    vocab_size: int = struct.field(pytree_node=False)


class BadTokenIdsError(ValueError):
    """A batch held token ids outside the model's vocabulary (metrics["bad_ids"] > 0)."""


def create_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    rng: jax.Array,
    example: jax.Array,
) -> LMTrainState:
    """Initialise parameters from `rng` (float32) and the optimizer state; the state's
    vocab_size is `model.cfg.vocab_size`."""
    params = model.init(rng, example)["params"]
    vocab = model.cfg.vocab_size
    return LMTrainState.create(apply_fn=model.apply, params=params, tx=tx, vocab_size=vocab)


def count_bad_ids(batch: Batch, vocab_size: int) -> jax.Array:
    """int32 scalar: inputs outside [0, V) plus targets outside [IGNORE, V), IGNORE = -1.

    Inside jit the model cannot raise on bad ids: an input id >= V gives a NaN loss, a target
    < -1 a finite wrong one. The count is four compares and two sums over (B, T) ints: next to
    nothing in a train step (XLA's cost analysis, GPT-2 124M: +1e-6 of its memory traffic).
    """
    inputs, targets = batch["inputs"], batch["targets"]
    bad_in = (inputs < 0) | (inputs >= vocab_size)
    bad_tgt = (targets < IGNORE) | (targets >= vocab_size)
    return jnp.sum(bad_in, dtype=jnp.int32) + jnp.sum(bad_tgt, dtype=jnp.int32)


def raise_for_bad_ids(count: int | jax.Array, step: int, where: str, vocab_size: int) -> None:
    """Raise BadTokenIdsError when `count` (a fetched metrics["bad_ids"]) is > 0.

    `step` and `where` ("train", "eval", ...) name the batch in the message; vocab_size (the
    state's `vocab_size`) gives the allowed range.
    """
    count = int(count)
    if count <= 0:
        return
    top = vocab_size - 1
    raise BadTokenIdsError(
        f"{where} batch at step {step} holds {count} token ids outside the model's vocabulary: "
        f"inputs must be in [0, {top}], targets in [0, {top}] or -1 (no loss) (vocab_size "
        f"{vocab_size}). The data was made for another vocabulary, or model.vocab_size is too "
        "small; re-run jaxllm.data.prepare or fix the config"
    )


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
def train_step(
    state: LMTrainState, batch: Batch, rng: jax.Array
) -> tuple[LMTrainState, dict[str, jax.Array]]:
    """One AdamW update. `rng` drives dropout (folded with the step, so each step differs).

    Returns the new state and {loss, accuracy, grad_norm, bad_ids} (scalars, on device);
    bad_ids > 0 (count_bad_ids) means the loss is garbage: pass it to raise_for_bad_ids.
    """
    step_rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(loss_and_sums, has_aux=True)
    (loss, aux), grads = grad_fn(state.params, state.apply_fn, batch, step_rng)
    bad_ids = count_bad_ids(batch, state.vocab_size)
    with jax.named_scope("optimizer"):  # global-norm clipping + AdamW (the trace's name)
        state = state.apply_gradients(grads=grads)
    metrics = {
        "loss": loss,
        "accuracy": aux["correct"] / jnp.maximum(aux["count"], 1),
        "grad_norm": optax.tree_utils.tree_norm(grads),
        "bad_ids": bad_ids,
    }
    return state, metrics


@jax.jit
def eval_step(state: LMTrainState, batch: Batch) -> dict[str, jax.Array]:
    """Sums over the batch (loss_sum, correct, count), so batches of any size add up exactly,
    and bad_ids (count_bad_ids; > 0: the sums are garbage)."""
    _, aux = loss_and_sums(state.params, state.apply_fn, batch, None)
    return aux | {"bad_ids": count_bad_ids(batch, state.vocab_size)}
