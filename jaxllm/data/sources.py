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
from jaxllm.data import tokens as tok

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
        x, y = tok.get_batch(self.train, self.batch_size, self.context_length, rng)
        return {"inputs": x, "targets": y}

    def eval_batches(self) -> Iterator[Batch]:
        for x, y in tok.iter_eval_batches(
            self.val, self.batch_size, self.context_length, self.eval_batches_count
        ):
            yield {"inputs": x, "targets": y}


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
    train = tok.load_tokens(resolve_data_path(tc.train_path))
    val = tok.load_tokens(resolve_data_path(tc.val_path))
    if cfg.model.vocab_size < 50257:
        raise ValueError(
            f"token files use the GPT-2 vocabulary (50257 ids); model.vocab_size is "
            f"{cfg.model.vocab_size}"
        )
    return TokenSource(
        train,
        val,
        cfg.train.batch_size,
        cfg.model.context_length,
        cfg.train.eval_batches,
        cfg.train.seed,
    )
