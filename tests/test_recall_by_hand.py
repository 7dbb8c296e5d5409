"""Hand-set weights for associative recall (jaxllm.tasks.recall_by_hand): 100% on the test
split across vocab sizes and pair counts, the parameter tree of the ordinary GPT-2, and an
ablation showing the previous-token head is what makes it work."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT

from jaxllm.config import AssociativeRecallConfig, ConfigError
from jaxllm.data.associative_recall import num_distinct_examples
from jaxllm.models import build_model
from jaxllm.tasks import recall_by_hand as rbh

AR = "data.associative_recall."


def split_for(vocab: int, pairs: int, num_test: int = 1000):
    """The make_splits test split (as configs/ar.yaml: 10k train, seed 0), shrunk where the
    task has too few distinct examples for that."""
    possible = num_distinct_examples(vocab, pairs)
    n_train = min(10_000, possible // 4)
    n_test = min(num_test, possible // 4)
    ar = AssociativeRecallConfig(
        vocab_size=vocab, num_pairs=pairs, num_train=n_train, num_test=n_test, seed=0
    )
    return rbh.test_split(ar)


# (vocab, pairs, test examples): fewer examples where d_model = 2 (2V + 2P + 1) makes the
# dense (mostly zero) kernels costly on a CPU.
SWEEP = [(32, 8, 1000), (16, 1, 1000), (16, 8, 1000), (64, 4, 1000), (64, 32, 300),
         (256, 16, 200), (4, 2, 1000)]  # fmt: skip


@pytest.mark.parametrize("vocab,pairs,num_test", SWEEP)
def test_hand_set_model_solves_recall(vocab, pairs, num_test):
    cfg = rbh.recall_config(vocab, pairs)
    assert (cfg.n_layers, cfg.n_heads) == (2, 1)
    split = split_for(vocab, pairs, num_test)
    acc, loss = rbh.evaluate(cfg, rbh.hand_set_params(cfg), split)
    assert acc == 1.0, f"vocab {vocab}, {pairs} pairs: accuracy {acc}"
    assert loss < 1e-4  # the answer's logit is ANSWER_LOGIT above every other


def test_params_match_init_structure_and_shapes():
    cfg = rbh.recall_config(32, 8)
    model = build_model(cfg)
    tokens = jnp.zeros((1, cfg.context_length), jnp.int32)
    ref = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
    got = rbh.hand_set_params(cfg)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), got)
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), ref)


def test_training_loss_path_agrees():
    """model.loss (what training and evaluation run) counts every answer as correct."""
    cfg = rbh.recall_config(32, 8)
    split = split_for(32, 8, num_test=200)
    model = build_model(cfg)
    loss_fn = jax.jit(lambda p, x, y: model.apply(p, x, y, method=model.loss))
    loss, sums = loss_fn(
        rbh.hand_set_params(cfg), jnp.asarray(split.inputs), jnp.asarray(split.targets)
    )
    assert int(sums["correct"]) == int(sums["count"]) == len(split)
    assert float(loss) < 1e-4


@pytest.mark.parametrize("layer", ["h0", "h1"])
def test_ablating_a_head_drops_accuracy_to_chance(layer):
    """Zero a layer's attention output. Without layer 1 (h0) PREV stays empty, so layer 2 has
    nothing to match and averages over all positions; without layer 2 (h1) nothing is copied.
    Either way the last position's TOK still holds the query key, which the head echoes: a
    key is never the answer, so accuracy falls to 0, below the 2 / V of guessing a value."""
    vocab, pairs = 32, 8
    cfg = rbh.recall_config(vocab, pairs)
    params = rbh.hand_set_params(cfg)
    out = params["params"][layer]["attn"]["out"]
    out["kernel"] = jnp.zeros_like(out["kernel"])
    acc, _ = rbh.evaluate(cfg, params, split_for(vocab, pairs, num_test=500))
    assert acc <= 2 / vocab


def test_rejects_configs_it_was_not_built_for():
    cfg = rbh.recall_config(32, 8)
    with pytest.raises(ValueError, match="n_heads"):
        rbh.hand_set_params(cfg.__class__(**{**cfg.__dict__, "n_heads": 2}))
    with pytest.raises(ConfigError, match="even"):
        rbh.recall_config(15, 2)


def test_cli_prints_full_accuracy():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm.tasks.recall_by_hand", f"--{AR}num_test=300"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "test accuracy 100.00% (300 examples, vocab 32, 8 pairs)" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        ([f"--{AR}vocab_size=15"], f"{AR}vocab_size must be even"),
        ([f"--{AR}num_pairs=17"], f"{AR}num_pairs must be in"),
        ([f"--{AR}num_test=0"], f"{AR}num_test must be > 0"),
        ([f"--{AR}vocab_size=16", f"--{AR}num_pairs=1"], "only 64 distinct examples"),
        (["--model.n_layers=3"], "--model.n_layers: only --data.associative_recall.* and"),
        (["--execution.kernels=cuda"], "execution.kernels must be one of"),
    ],
)
def test_cli_rejects_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        rbh.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_limits_what_would_not_fit_in_memory(capsys):
    """A vocabulary of 20000 would need 72 GiB of one-hot-wide weights."""
    with pytest.raises(SystemExit) as e:
        rbh.main([f"--{AR}vocab_size=20000"])
    assert e.value.code == 2 and f"{AR}vocab_size must be <= 1,024" in capsys.readouterr().err
