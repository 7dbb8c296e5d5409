"""Batch sources for the training loop: `train_batch(step)` and `eval_batches()`.

A train batch is a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would: the data-sampler state is just the step number.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from jaxllm.config import Config
from jaxllm.data import associative_recall as ar

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


def make_source(cfg: Config) -> BatchSource:
    if cfg.data.kind == "associative_recall":
        train, test = ar.make_splits(cfg.data.associative_recall)
        return RecallSource(train, test, cfg.train.batch_size, cfg.train.seed)
    raise ValueError(f"unknown data.kind {cfg.data.kind!r}")
