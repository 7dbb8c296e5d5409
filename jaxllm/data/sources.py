"""Batch sources for the training loop: `train_batch(step)` and `eval_batches()`.

A train batch is a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would: the data-sampler state is just the step number.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxllm.config import Config
from jaxllm.data import associative_recall as ar
from jaxllm.data.token_file import load_tokens

DATA_DIR_ENV = "JAXLLM_DATA_DIR"

Batch = dict[str, np.ndarray]


class BatchSource(Protocol):
    def train_batch(self, step: int) -> Batch: ...

    def eval_batches(self) -> Iterator[Batch]: ...


@dataclass
class RecallSource:
    train: ar.RecallSplit
    test: ar.RecallSplit
    batch_size: int
    seed: int

    def train_batch(self, step: int) -> Batch:
        return ar.train_batch(self.train, self.batch_size, step, self.seed)

    def eval_batches(self) -> Iterator[Batch]:
        return ar.eval_batches(self.test, self.batch_size)


@dataclass
class TokenSource:
    """Random windows of a token file for training; fixed evenly spaced windows for eval."""

    train: np.ndarray  # (N,) memmap
    val: np.ndarray  # (M,) memmap
    batch_size: int
    context_length: int
    eval_batches_count: int
    seed: int

    def train_batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        x, y = get_batch(self.train, self.batch_size, self.context_length, rng)
        return {"inputs": x, "targets": y}

    def eval_batches(self) -> Iterator[Batch]:
        for x, y in iter_eval_batches(
            self.val, self.batch_size, self.context_length, self.eval_batches_count
        ):
            yield {"inputs": x, "targets": y}


def _check_batch_args(tokens: np.ndarray, batch_size: int, context_length: int) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if batch_size < 1 or context_length < 1:
        raise ValueError(
            f"batch_size and context_length must be >= 1, got {batch_size}, {context_length}"
        )
    if tokens.shape[0] < context_length + 1:
        raise ValueError(
            f"need at least context_length + 1 = {context_length + 1} tokens, got {tokens.shape[0]}"
        )


def _windows(
    tokens: np.ndarray, starts: np.ndarray, context_length: int
) -> tuple[np.ndarray, np.ndarray]:
    # Row slices read only these windows from a memmap, never the whole file.
    rows = np.stack([tokens[s : s + context_length + 1] for s in starts]).astype(np.int32)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])  # (B, T) each


def get_batch(
    tokens: np.ndarray, batch_size: int, context_length: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs (B, T) int32 and targets (B, T) int32 = inputs shifted by one.

    Window starts are uniform over every valid offset. `TokenSource` seeds rng with
    (seed, step), so a batch is a pure function of both and a resumed run needs no saved state.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    _check_batch_args(tokens, batch_size, context_length)
    starts = rng.integers(0, tokens.shape[0] - context_length, size=batch_size)
    return _windows(tokens, starts, context_length)


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, context_length: int, num_batches: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """num_batches fixed (inputs, targets) batches, (B, T) int32, at evenly spaced offsets."""
    _check_batch_args(tokens, batch_size, context_length)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    last_start = tokens.shape[0] - context_length - 1
    starts = np.linspace(0, last_start, batch_size * num_batches).round().astype(np.int64)
    return (
        _windows(tokens, starts[i : i + batch_size], context_length)
        for i in range(0, starts.size, batch_size)
    )


def resolve_data_path(path: str) -> Path:
    """Relative paths resolve against $JAXLLM_DATA_DIR when it is set, else the cwd."""
    p = Path(path).expanduser()
    base = os.environ.get(DATA_DIR_ENV)
    return p if p.is_absolute() or not base else Path(base) / p


def make_source(cfg: Config) -> BatchSource:
    if cfg.data.kind == "associative_recall":
        train, test = ar.make_splits(cfg.data.associative_recall)
        return RecallSource(train, test, cfg.train.batch_size, cfg.train.seed)
    tc = cfg.data.tokens
    train = load_tokens(resolve_data_path(tc.train_path))
    val = load_tokens(resolve_data_path(tc.val_path))
    return TokenSource(
        train,
        val,
        cfg.train.batch_size,
        cfg.model.context_length,
        cfg.train.eval_batches,
        cfg.train.seed,
    )
