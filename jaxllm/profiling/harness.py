"""The one benchmark harness: a random batch, a train state, and a device-synced step timer.

Every script in benchmarks/ and every `profile.py` subcommand that times a model builds its
inputs here, so all numbers come from the same recipe: random token ids (never zeros), a fresh
AdamW state, warm-up calls (compilation included) that are not timed, then `repeats` samples of
`steps` back-to-back calls each closed by `jax.block_until_ready`, reported as the median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.training.train_state import TrainState

from jaxllm.config import Config
from jaxllm.models import build_model
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import Batch, create_state


def random_batch(cfg: Config, batch_size: int | None = None, seed: int = 0) -> Batch:
    """inputs, targets (B, T) int32: random ids of a (T + 1)-token window, T = context_length."""
    b = batch_size or cfg.train.batch_size
    t, v = cfg.model.context_length, cfg.model.vocab_size
    ids = np.random.default_rng(seed).integers(0, v, (b, t + 1))
    return {
        "inputs": jnp.asarray(ids[:, :-1], jnp.int32),
        "targets": jnp.asarray(ids[:, 1:], jnp.int32),
    }


def make_state(cfg: Config, batch: Batch, seed: int = 0) -> TrainState:
    """Fresh float32 parameters and AdamW state for cfg. The schedule's length does not change
    what a step costs: it spans train.steps, or just past the warm-up for an epochs run."""
    model = build_model(cfg.model, cfg.execution)
    tx = make_optimizer(cfg.optim, cfg.train.steps or cfg.optim.warmup_steps + 1)
    return create_state(model, tx, jax.random.PRNGKey(seed), batch["inputs"])


@dataclass(frozen=True)
class Timing:
    median_s: float  # seconds per call
    spread_s: float  # max - min over the repeats, seconds per call
    samples: tuple[float, ...]


def time_calls(
    fn: Callable[[], Any], *, warmup: int = 3, steps: int = 10, repeats: int = 5
) -> Timing:
    """Median seconds per `fn()` call. Each sample runs `steps` calls back to back (dispatch
    overlaps device work, as in a training loop) and waits for the last result on the device."""
    out = None
    for _ in range(warmup):  # compile + warm-up
        out = fn()
    jax.block_until_ready(out)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / steps)
    return Timing(statistics.median(samples), max(samples) - min(samples), tuple(samples))
