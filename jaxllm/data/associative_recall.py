"""Associative recall (CS229S project 0): find the value bound to a queried key.

One example is `k1 v1 k2 v2 ... kN vN q` (length 2N + 1): N distinct keys drawn from the first
half of the vocabulary, each followed by a value from the second half, then a query that repeats
one of the keys. The target is that key's value, scored only at the last position. Solving it
needs an induction head (look up the query, copy the token after it), which takes two layers of
attention: one layer cannot move a key's identity onto its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxllm.config import AssociativeRecallConfig
from jaxllm.functional import IGNORE  # target id at positions that carry no loss


@dataclass(frozen=True)
class RecallSplit:
    inputs: np.ndarray  # (N, 2P + 1) int32
    targets: np.ndarray  # (N, 2P + 1) int32, IGNORE except the last column

    def __len__(self) -> int:
        return len(self.inputs)


def make_examples(n: int, vocab_size: int, num_pairs: int, rng: np.random.Generator) -> RecallSplit:
    """`n` random examples (see module docstring)."""
    half = vocab_size // 2
    if not 1 <= num_pairs <= half:
        raise ValueError(f"num_pairs must be in [1, {half}] for vocab_size {vocab_size}")
    keys = rng.permuted(np.tile(np.arange(half), (n, 1)), axis=1)[:, :num_pairs]  # (n, P)
    values = rng.integers(half, vocab_size, size=(n, num_pairs))  # (n, P)
    which = rng.integers(0, num_pairs, size=n)  # index of the queried pair
    seq = np.empty((n, 2 * num_pairs + 1), dtype=np.int32)
    seq[:, 0:-1:2], seq[:, 1:-1:2] = keys, values
    seq[:, -1] = keys[np.arange(n), which]
    targets = np.full_like(seq, IGNORE)
    targets[:, -1] = values[np.arange(n), which]
    return RecallSplit(seq, targets)


def make_splits(cfg: AssociativeRecallConfig) -> tuple[RecallSplit, RecallSplit]:
    """Train and test sets from fixed seeds; test examples that also occur in train are
    dropped and redrawn, so the two are disjoint."""
    train = make_examples(
        cfg.num_train, cfg.vocab_size, cfg.num_pairs, np.random.default_rng([cfg.seed, 0])
    )
    seen = {row.tobytes() for row in train.inputs}
    rng = np.random.default_rng([cfg.seed, 1])
    inputs, targets = [], []
    count, idle = 0, 0
    while count < cfg.num_test:
        cand = make_examples(cfg.num_test, cfg.vocab_size, cfg.num_pairs, rng)
        fresh = np.array([row.tobytes() not in seen for row in cand.inputs])
        idle = 0 if fresh.any() else idle + 1
        if idle == 20:  # the task has too few distinct sequences: never loop forever
            distinct = num_distinct_examples(cfg.vocab_size, cfg.num_pairs)
            raise ValueError(
                f"data.associative_recall: vocab {cfg.vocab_size} with {cfg.num_pairs} pairs has "
                f"{distinct} distinct sequences; only {count} test examples outside the training "
                f"set could be drawn of num_test {cfg.num_test}: lower num_train or num_test"
            )
        inputs.append(cand.inputs[fresh])
        targets.append(cand.targets[fresh])
        seen.update(row.tobytes() for row in cand.inputs[fresh])
        count += int(fresh.sum())
    test = RecallSplit(
        np.concatenate(inputs)[: cfg.num_test], np.concatenate(targets)[: cfg.num_test]
    )
    return train, test


def train_batch(
    split: RecallSplit, batch_size: int, step: int, seed: int, rows: slice | None = None
) -> dict[str, np.ndarray]:
    """The batch for `step`: epochs are fixed permutations of the set (drop-last), so the
    batch depends only on (seed, step) and a resumed run sees the same data. `rows`: only
    those rows of it (one process's share of the global batch; None: all)."""
    per_epoch = len(split) // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size {batch_size} exceeds the {len(split)} training examples")
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(split))
    idx = order[i * batch_size : (i + 1) * batch_size]
    if rows is not None:
        idx = idx[rows]
    return {"inputs": split.inputs[idx], "targets": split.targets[idx]}


def eval_batches(split: RecallSplit, batch_size: int):
    """All of `split` in order, in batches (the last one may be smaller)."""
    for i in range(0, len(split), batch_size):
        yield {
            "inputs": split.inputs[i : i + batch_size],
            "targets": split.targets[i : i + batch_size],
        }


def num_distinct_examples(vocab_size: int, num_pairs: int) -> int:
    """How many different AR sequences exist: ordered distinct keys, any values, a query."""
    half = vocab_size // 2
    return math.perm(half, num_pairs) * half**num_pairs * num_pairs
