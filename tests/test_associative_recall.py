"""The associative-recall generator: layout, answers, determinism, disjoint splits."""

import numpy as np
import pytest

from jaxllm.config import AssociativeRecallConfig, ConfigError
from jaxllm.data import associative_recall as ar


def test_layout_and_answers():
    s = ar.make_examples(200, 32, 8, np.random.default_rng(0))
    assert s.inputs.shape == (200, 17) and s.inputs.dtype == np.int32
    keys, values, query = s.inputs[:, 0:-1:2], s.inputs[:, 1:-1:2], s.inputs[:, -1]
    assert keys.max() < 16 and values.min() >= 16 and values.max() < 32
    assert all(len(set(row)) == 8 for row in keys)  # distinct keys
    for i in range(200):
        j = list(keys[i]).index(query[i])
        assert s.targets[i, -1] == values[i, j]
    assert np.all(s.targets[:, :-1] == ar.IGNORE)


def test_splits_deterministic_and_disjoint():
    cfg = AssociativeRecallConfig(vocab_size=8, num_pairs=2, num_train=300, num_test=100)
    train, test = ar.make_splits(cfg)
    train2, test2 = ar.make_splits(cfg)
    np.testing.assert_array_equal(train.inputs, train2.inputs)
    np.testing.assert_array_equal(test.inputs, test2.inputs)
    # this tiny space (4*3*4*4*2 = 384 sequences) forces collisions, which must be redrawn
    assert len(test) == 100
    assert not {r.tobytes() for r in train.inputs} & {r.tobytes() for r in test.inputs}


def test_train_batches_are_epoch_permutations():
    cfg = AssociativeRecallConfig(num_train=100, num_test=10)
    train, _ = ar.make_splits(cfg)
    seen = np.concatenate([ar.train_batch(train, 20, s, seed=0)["inputs"] for s in range(5)])
    assert {r.tobytes() for r in seen} == {r.tobytes() for r in train.inputs}
    b = ar.train_batch(train, 20, 7, seed=0)
    np.testing.assert_array_equal(b["inputs"], ar.train_batch(train, 20, 7, seed=0)["inputs"])
    with pytest.raises(ValueError, match="exceeds"):
        ar.train_batch(train, 101, 0, seed=0)


def test_bad_config():
    with pytest.raises(ConfigError, match="num_pairs"):
        ar.make_splits(AssociativeRecallConfig(vocab_size=8, num_pairs=5))


def test_a_task_too_small_for_its_splits_is_an_error_not_a_hang():
    from jaxllm.config import AssociativeRecallConfig
    from jaxllm.data.associative_recall import make_splits

    cfg = AssociativeRecallConfig(vocab_size=16, num_pairs=1, num_train=10_000, num_test=1_000)
    with pytest.raises(ValueError, match="has 64 distinct sequences"):
        make_splits(cfg)
