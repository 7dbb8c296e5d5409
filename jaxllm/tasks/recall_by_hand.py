"""Associative recall solved by hand-set weights (CS229S project 0, part 1.2): no training.

    python -m jaxllm.tasks.recall_by_hand [--data.associative_recall.num_pairs=8 ...]

Overrides of data.associative_recall (vocab_size, num_pairs, num_test, seed; defaults as in
configs/ar.yaml, whose num_train the test split is kept disjoint from) set the task, of
execution.* how the hand-set model runs.

An example is `k1 v1 k2 v2 ... kP vP q` and the answer, read at the last position, is the value
that followed q. Our ordinary 2-layer GPT-2 (`jaxllm.models.gpt2`, one head per layer) does it
with two attention heads whose weights we write down:

  layer 1, previous-token head: every position t attends to t - 1 and copies that token's
           identity into a slot of its own, so the value v_i at position 2i + 1 now "knows" k_i;
  layer 2, induction head: the last position (token q) attends to the position whose
           *previous* token is q, i.e. the value right after the matching key, and copies that
           value's identity into the slot the (tied) LM head reads.

Residual stream. Every vector in it has the form x = [f; -f] (D = 2F): a feature vector f
of F = 2V + T coordinates, stored once with a plus sign and once with a minus sign. f has
three one-hot subspaces (V = vocab_size, T = context_length):

    TOK   f[0 : V]            the token at this position      (written by wte)
    POS   f[V : V + T]        the position                    (written by wpe)
    PREV  f[V + T : 2V + T]   the token at position - 1       (written by layer 1)

Weights read f from the plus half (rows 0..F-1 of a kernel) and write g as [g; -g] (columns
j and F + j), so every residual add keeps the form.

LayerNorm. GPT-2 is pre-LN: each block reads ln(x) and the head reads ln_f(x). For x = [f; -f]
the mean is exactly 0 and the variance is |x|^2 / D = |f|^2 / F. When f holds n one-hots,
|f|^2 = n and LN(x) = x / sqrt(n / F + eps) * scale + bias. We set bias = 0 and
scale = sqrt(n / F + eps), so ln(x) = x: LN becomes the identity on the stream it sees. n = 2
(TOK, POS) before layer 1 and n = 3 after it, at every position, because layer 1's attention
is hard and writes exactly one one-hot into PREV. (Layer 2 rewrites TOK at the last position
from one one-hot to another, so n stays 3 there for ln_f; at other positions its output is
not one-hot, but nothing is read there.)

Attention. Our attention computes softmax(q k^T / sqrt(Dh)) v with Dh = D (one head), q, k, v
= ln(x) W_{q,k,v} + b_{q,k,v}, and adds y W_out + b_out to the stream. Each head below is
built so that q_t . k_s / sqrt(D) = BETA (30) for the one key s that should be picked and
<= 0 for every other allowed key, so softmax puts weight >= 1 - T e^-30 on it: effectively a
hard, one-position attention. The head vectors live in the first coordinates of the D-wide head
space; the rest are 0. MLPs: every MLP weight and bias is 0, so gelu(0) = 0 and the MLPs add
nothing (their width d_ff is irrelevant; it is kept small).

Head. The LM head is tied to wte, whose row v is [e_v; -e_v] (TOK only), so the logit of v is
<ln_f(x), wte[v]> = 2 c f_TOK[v] with ln_f(x) = c x: the prediction is whichever token TOK
holds at the last position, and layer 2 puts the answer there. ln_f's scale sets c =
ANSWER_LOGIT / 2, so the answer's logit is 20 and every other ~0 (a near-zero loss). The head
stays tied: overwriting TOK makes an untied head unnecessary.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import (
    AssociativeRecallConfig,
    ConfigError,
    ExecutionConfig,
    ModelConfig,
    from_dict,
    parse_overrides,
)
from jaxllm.data.associative_recall import (
    RecallSplit,
    eval_batches,
    make_splits,
    num_distinct_examples,
)
from jaxllm.models import build_model

BETA = 30.0  # attention logit of the intended key; every other key scores <= 0
ANSWER_LOGIT = 20.0  # LM-head logit of the retrieved value; every other token scores ~0
D_FF = 8  # the MLPs are switched off (all zeros), so their width does not matter

Params = dict[str, Any]


def recall_config(vocab_size: int, num_pairs: int) -> ModelConfig:
    """The 2-layer, 1-head GPT-2 the hand-set weights are written for: d_model = 2 (2V + T)
    (the signed TOK, POS and PREV subspaces of the module docstring), context 2 * num_pairs + 1,
    biases on, tied head. Raises ConfigError for an AR setting the generator rejects (odd
    vocab, too many pairs)."""
    AssociativeRecallConfig(vocab_size=vocab_size, num_pairs=num_pairs)  # validates V and P
    t = 2 * num_pairs + 1
    return ModelConfig(
        arch="gpt2", vocab_size=vocab_size, context_length=t, d_model=2 * (2 * vocab_size + t),
        n_layers=2, n_heads=1, d_ff=D_FF, bias=True, qkv_bias=True, tie_embeddings=True,
    )  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """Where each feature lives in f (the residual stream is [f; -f])."""

    vocab_size: int  # V
    context_length: int  # T

    @property
    def features(self) -> int:  # F
        return 2 * self.vocab_size + self.context_length

    @property
    def d_model(self) -> int:  # D
        return 2 * self.features

    def tok(self, i: int) -> int:
        return i

    def pos(self, t: int) -> int:
        return self.vocab_size + t

    def prev(self, i: int) -> int:
        return self.vocab_size + self.context_length + i


def _layout(cfg: ModelConfig) -> Layout:
    lay = Layout(cfg.vocab_size, cfg.context_length)
    want = dict(arch="gpt2", n_layers=2, n_heads=1, d_model=lay.d_model, bias=True,
                qkv_bias=True, tie_embeddings=True, short_conv=False)  # fmt: skip
    wrong = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(
            f"hand_set_params needs recall_config's model ({want}); this config has {wrong}"
        )
    return lay


def _ln_scale(lay: Layout, n_onehots: int, eps: float) -> np.ndarray:
    """LN scale that undoes the normalization of a stream holding n one-hots: ln(x) = x."""
    return np.full(lay.d_model, math.sqrt(n_onehots / lay.features + eps), np.float32)


def _write(w: np.ndarray, row: int, feature: int, value: float, lay: Layout) -> None:
    """Make row `row` of a (*, D) kernel write value * e_feature as [g; -g]."""
    w[row, feature] += value
    w[row, lay.features + feature] -= value


def _block(lay: Layout, n_in: int, eps: float) -> Params:
    """A block that passes the stream through: attention weights to be filled, MLP zero."""
    d = lay.d_model

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    return {
        "ln1": {"scale": _ln_scale(lay, n_in, eps), "bias": zeros(d)},
        "attn": {
            "qkv": {"kernel": zeros(d, 3 * d), "bias": zeros(3 * d)},  # [W_q | W_k | W_v]
            "out": {"kernel": zeros(d, d), "bias": zeros(d)},
        },
        "ln2": {"scale": _ln_scale(lay, 3, eps), "bias": zeros(d)},
        "mlp": {
            "fc": {"kernel": zeros(d, D_FF), "bias": zeros(D_FF)},
            "proj": {"kernel": zeros(D_FF, d), "bias": zeros(d)},
        },
    }


def previous_token_head(lay: Layout, block: Params) -> None:
    """Layer 1: position t attends to t - 1 and writes e_{token[t-1]} into PREV.

    The stream is ln(x) = x = [f; -f] with f = e_tok(token_t) + e_pos(t), so a kernel row
    pos(t) is "the row that fires at position t".
      W_q: row pos(t) -> head coord t - 1, weight BETA sqrt(D)   (q_t = BETA sqrt(D) e_{t-1})
      W_k: row pos(s) -> head coord s, weight 1                  (k_s = e_s)
    so q_t . k_s / sqrt(D) = BETA [s == t - 1]: the previous position wins by BETA over every
    other s <= t. Position 0 has q = 0 and only itself to see: it copies its own token.
      W_v: row tok(i) -> head coord i                            (v_s = e_{token_s})
      W_out: head coord i -> +-e_prev(i)                         (writes token_{t-1} to PREV)
    """
    d, t_max, v_max = lay.d_model, lay.context_length, lay.vocab_size
    w = block["attn"]["qkv"]["kernel"]
    wq, wk, wv = w[:, :d], w[:, d : 2 * d], w[:, 2 * d :]  # views: writing fills the kernel
    for t in range(1, t_max):
        wq[lay.pos(t), t - 1] = BETA * math.sqrt(d)
    for s in range(t_max):
        wk[lay.pos(s), s] = 1.0
    for i in range(v_max):
        wv[lay.tok(i), i] = 1.0
        _write(block["attn"]["out"]["kernel"], i, lay.prev(i), 1.0, lay)


def induction_head(lay: Layout, block: Params) -> None:
    """Layer 2: the last position (token q) attends to the position s whose PREV is e_q, the
    value v* right after key q, and rewrites its own TOK from e_q to e_{v*}.

    Now f_s = e_tok(token_s) + e_pos(s) + e_prev(token_{s-1}) at every s.
      W_q: row tok(i) -> head coord i, weight BETA sqrt(D)       (q_t = BETA sqrt(D) e_{token_t})
      W_k: row prev(i) -> head coord i, weight 1                 (k_s = e_{token_{s-1}})
    so q . k_s / sqrt(D) = BETA [token_{s-1} == q]. Keys are distinct, so exactly one s (the
    value after the matching key) scores BETA. One exception: position 0 has no predecessor
    and layer 1 copied its own token k1 into PREV, so for q = k1 it would tie with v1. A
    constant in the query cancels that:
      b_q[V] = BETA sqrt(D); W_k: row pos(0) -> head coord V, weight -1
    add -BETA to position 0's score only (and nothing elsewhere, since k_s[V] = 0 for s > 0).
      W_v: row tok(i) -> +e_i, row prev(i) -> -e_i               (v_s = e_{token_s} - e_{prev_s})
      W_out: head coord i -> +-e_tok(i)
    At the picked s, v = e_{v*} - e_q, so the last position's TOK becomes e_q + e_{v*} - e_q =
    e_{v*}: the value has replaced the query in the slot the tied head reads.
    """
    d, v_max = lay.d_model, lay.vocab_size
    w = block["attn"]["qkv"]["kernel"]
    wq, wk, wv = w[:, :d], w[:, d : 2 * d], w[:, 2 * d :]
    for i in range(v_max):
        wq[lay.tok(i), i] = BETA * math.sqrt(d)
        wk[lay.prev(i), i] = 1.0
        wv[lay.tok(i), i] = 1.0
        wv[lay.prev(i), i] = -1.0
        _write(block["attn"]["out"]["kernel"], i, lay.tok(i), 1.0, lay)
    block["attn"]["qkv"]["bias"][v_max] = BETA * math.sqrt(d)  # the q bias (first D entries)
    wk[lay.pos(0), v_max] = -1.0


def hand_set_params(cfg: ModelConfig) -> Params:
    """`{"params": ...}` for `build_model(cfg)` (cfg from `recall_config`) that solves AR.

    Embeddings: wte[i] = +-e_tok(i), wpe[t] = +-e_pos(t). Blocks: `previous_token_head`,
    `induction_head`, LN scales that make every norm the identity (module docstring), zero
    MLPs. ln_f: scale = (ANSWER_LOGIT / 2) sqrt(3 / F + eps), so ln_f(x) = (ANSWER_LOGIT / 2) x
    and the tied head gives logit <ln_f(x), [e_v; -e_v]> = ANSWER_LOGIT [v == v*]."""
    lay = _layout(cfg)
    eps = cfg.norm_eps
    wte = np.zeros((lay.vocab_size, lay.d_model), np.float32)
    wpe = np.zeros((lay.context_length, lay.d_model), np.float32)
    for i in range(lay.vocab_size):
        _write(wte, i, lay.tok(i), 1.0, lay)
    for t in range(lay.context_length):
        _write(wpe, t, lay.pos(t), 1.0, lay)
    h0, h1 = _block(lay, 2, eps), _block(lay, 3, eps)
    previous_token_head(lay, h0)
    induction_head(lay, h1)
    ln_f = {
        "scale": ANSWER_LOGIT / 2 * _ln_scale(lay, 3, eps),
        "bias": np.zeros(lay.d_model, np.float32),
    }
    params = {"wte": {"embedding": wte}, "wpe": {"embedding": wpe}, "h0": h0, "h1": h1,
              "ln_f": ln_f}  # fmt: skip
    return {"params": jax.tree.map(jnp.asarray, params)}


# ----------------------------------------------------------------------------- evaluation


def evaluate(
    cfg: ModelConfig, params: Params, split: RecallSplit, execution: ExecutionConfig | None = None
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) at the answer position: argmax of the last position's
    logits (from the ordinary `model.apply(params, tokens)`, run as `execution` says; default
    float32 XLA) against its target, in batches of 1000."""
    model = build_model(cfg, execution)

    @jax.jit
    def last_logits(p: Params, tokens: jax.Array) -> jax.Array:
        return model.apply(p, tokens)[:, -1].astype(jnp.float32)  # (B, V)

    correct, loss_sum = 0, 0.0
    for batch in eval_batches(split, 1000):
        # float64: the answer's loss is ~1e-8 here, below float32's resolution next to 1
        logits = np.asarray(last_logits(params, jnp.asarray(batch["inputs"])), np.float64)
        target = batch["targets"][:, -1]
        correct += int(np.sum(logits.argmax(-1) == target))
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        loss_sum += float(-logp[np.arange(len(target)), target].sum())
    return correct / len(split), loss_sum / len(split)


def test_split(ar: AssociativeRecallConfig) -> RecallSplit:
    """The AR test split of `make_splits` (disjoint from the training set of the same config).
    Raises ConfigError when there are too few distinct examples to draw it (make_splits would
    search forever)."""
    possible = num_distinct_examples(ar.vocab_size, ar.num_pairs)
    if 2 * (ar.num_train + ar.num_test) > possible:
        raise ConfigError(
            f"vocab {ar.vocab_size} with {ar.num_pairs} pair(s) has only {possible} distinct "
            f"examples; num_train + num_test ({ar.num_train} + {ar.num_test}) must be at most "
            f"half of that"
        )
    return make_splits(ar)[1]


test_split.__test__ = False  # not a pytest test, despite the name


# The hand-set model is as wide as its one-hot codes of ids and positions: its matrices grow
# with the square of vocabulary + context, its activations with both (batches of 1000).
LIMITS = {"vocab_size": 1024, "num_pairs": 64, "num_test": 100_000, "num_train": 10_000_000}
AR, EXECUTION = "data.associative_recall.", "execution."


def _section(cls: type, overrides: dict[str, Any], prefix: str) -> Any:
    """Config section `cls` from the overrides under `prefix` (its defaults elsewhere)."""
    fields = {k.removeprefix(prefix): v for k, v in overrides.items() if k.startswith(prefix)}
    return from_dict(cls, fields, prefix[:-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.tasks.recall_by_hand",
        description="Evaluate the hand-set 2-layer GPT-2 on the associative-recall test split.",
        epilog=f"Config overrides: --{AR}vocab_size=64 --{AR}num_pairs=4 --{EXECUTION}kernels=xla",
    )
    _, args = p.parse_known_args(argv)
    try:
        overrides = parse_overrides(args)
        if other := [f"--{k}" for k in overrides if not k.startswith((AR, EXECUTION))]:
            raise ConfigError(f"{', '.join(other)}: only --{AR}* and --{EXECUTION}* apply here")
        ar = _section(AssociativeRecallConfig, overrides, AR)
        for name, most in LIMITS.items():
            if (value := getattr(ar, name)) > most:
                raise ConfigError(f"{AR}{name} must be <= {most:,} here, got {value:,}")
        execution = _section(ExecutionConfig, overrides, EXECUTION)
        split = test_split(ar)
    except ConfigError as e:
        p.error(str(e))
    cfg = recall_config(ar.vocab_size, ar.num_pairs)
    acc, loss = evaluate(cfg, hand_set_params(cfg), split, execution)
    print(
        f"hand-set 2-layer GPT-2: test accuracy {100 * acc:.2f}% ({len(split)} examples, "
        f"vocab {ar.vocab_size}, {ar.num_pairs} pairs); answer loss {loss:.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
