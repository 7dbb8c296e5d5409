"""Sampling rules, cached vs uncached decoding, padding, eos, seeds, beam search, input errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.generate import (
    BeamSearch,
    Sampling,
    beam_search,
    beam_search_nbest,
    generate,
    generate_text,
    generate_uncached,
    resolve_eos_id,
    sample_next,
    sequence_logprob,
)
from jaxllm.models import build_model, stack_blocks

ARCHS = {
    # init_std 0.3 spreads GPT-2's logits (std ~1.7) so greedy ties and near-ties are unlikely.
    "gpt2": tiny_config("gpt2", context_length=32, init_std=0.3),
    "transformer_lm": tiny_config("transformer_lm", context_length=32),
}
# One batch shape (3 prompts, longest 5) and one length for most tests, so the decoder compiles
# once per arch; the sampling knobs, seed and eos_id are traced and do not recompile.
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 10, 11]]
N = 8


# The fast run decodes GPT-2; `pytest -m slow` repeats every test on the TransformerLM (its cache
# and rotary positions are checked in the fast run by test_models.py).
@pytest.fixture(
    scope="module", params=["gpt2", pytest.param("transformer_lm", marks=pytest.mark.slow)]
)
def lm(request):
    cfg = ARCHS[request.param]
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    return model, params


def run(lm, prompts=PROMPTS, n=N, seed=0, **sampling):
    return generate(*lm, prompts, n, Sampling(**sampling), seed)


def uncached(lm, prompts=PROMPTS, n=N, seed=0, **sampling):
    return generate_uncached(*lm, prompts, n, Sampling(**sampling), seed)


# ----------------------------------------------------------------------------- sample_next


def hand_logits(probs, perm_seed=0):
    """(V,) logits with the given probabilities, placed at shuffled ids; returns (logits, ids by
    decreasing probability)."""
    probs = np.asarray(probs, np.float64)
    ids = np.random.default_rng(perm_seed).permutation(probs.size)
    logits = np.empty(probs.size, np.float32)
    logits[ids] = np.log(probs)
    return jnp.asarray(logits), ids


def draw(logits, n=4000, seed=0, **kw):
    """n independent draws (one per batch row) from the same (V,) logits."""
    batch = jnp.broadcast_to(logits, (n, logits.size))
    return np.asarray(sample_next(batch, jax.random.PRNGKey(seed), **kw))


PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]


@pytest.mark.parametrize(
    ("kw", "nucleus"),
    [
        (dict(top_p=0.75), [0.5, 0.3]),  # 0.5 < 0.75 <= 0.8
        (dict(top_p=0.85), [0.5, 0.3, 0.1]),  # 0.8 < 0.85 <= 0.9
        (dict(top_p=0.4), [0.5]),  # the top token alone already holds >= p
        (dict(top_k=2), [0.5, 0.3]),
        # top_k first, then top_p on the renormalized top 3: [.556, .333, .111], .889 >= .85
        (dict(top_k=3, top_p=0.85), [0.5, 0.3]),
        (dict(), PROBS),
    ],
)
def test_sample_next_draws_only_from_the_nucleus_in_proportion(kw, nucleus):
    logits, ids = hand_logits(PROBS)
    toks = draw(logits, **kw)
    allowed = ids[: len(nucleus)]
    assert np.isin(toks, allowed).all()
    want = np.asarray(nucleus) / np.sum(nucleus)
    got = np.array([(toks == i).mean() for i in allowed])
    # 4000 draws: binomial std <= 0.008, so 0.03 is ~4 sigma
    np.testing.assert_allclose(got, want, atol=0.03)


def test_sample_next_temperature_sharpens_and_flattens():
    logits, ids = hand_logits(PROBS)
    for t in (0.5, 2.0):
        toks = draw(logits, temperature=t)
        want = np.asarray(PROBS) ** (1 / t)
        want /= want.sum()
        got = np.array([(toks == i).mean() for i in ids])
        np.testing.assert_allclose(got, want, atol=0.03)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(temperature=0.0, top_k=5, top_p=0.5),  # greedy ignores the filters
        dict(temperature=1e-6),
        dict(top_k=1),
        dict(top_p=1e-9),
        dict(temperature=3.0, top_p=1e-9),
    ],
)
def test_sample_next_limits_equal_argmax(kw):
    logits = jax.random.normal(jax.random.PRNGKey(1), (256, 61)) * 2.0
    want = np.asarray(jnp.argmax(logits, axis=-1))
    for seed in range(3):
        got = np.asarray(sample_next(logits, jax.random.PRNGKey(seed), **kw))
        assert got.dtype == np.int32 and got.shape == (256,)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
        (dict(top_k=0), "top_k must be >= 1 or None, got 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=2.0), r"top_p must be in \(0, 1\], got 2.0"),
    ],
)
def test_sample_next_refuses_settings_out_of_range(kw, message):
    """They used to turn into greedy decoding (or top_p 2 into 1) without a word."""
    with pytest.raises(ValueError, match=message):
        sample_next(jnp.zeros((1, 4)), jax.random.PRNGKey(0), **kw)


def test_sample_next_greedy_breaks_ties_like_argmax():
    logits = jnp.array([[0.0, 3.0, 1.0, 3.0]])
    assert int(sample_next(logits, jax.random.PRNGKey(0), top_k=1)[0]) == 1
    assert int(sample_next(logits, jax.random.PRNGKey(0), temperature=0.0)[0]) == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=np.float32(-1.0)),
        dict(top_k=np.int32(0)),
        dict(top_p=np.float32(0.0)),
        dict(temperature=jnp.float32(-1.0)),
    ],
)
def test_sample_next_checks_numpy_and_jax_scalars_too(kw):
    """A NumPy or concrete jax scalar out of range was not checked and decoded greedily."""
    with pytest.raises(ValueError, match="must be"):
        sample_next(jnp.zeros((1, 4)), jax.random.PRNGKey(0), **kw)


def test_a_tiny_temperature_still_takes_the_most_likely_token():
    """logits / 2e-38 overflowed to +inf for several ids; the tie went to the lowest id."""
    logits = jnp.array([[20.0, 30.0, -1.0]])
    for seed in range(3):
        assert int(sample_next(logits, jax.random.PRNGKey(seed), temperature=2e-38)[0]) == 1


def test_vocab_limit_masks_the_padding_ids(lm):
    """sampling.vocab_limit: ids at or above it are never drawn (a vocabulary padded past its
    tokenizer's), hot sampling included, the cached and uncached paths alike; generate_text
    sets it from a tokenizer's n_vocab (a GPT-2 run with vocab 50304 sampled an id tiktoken
    cannot decode: KeyError)."""
    hot = dict(temperature=5.0, top_k=None, vocab_limit=20)
    out = run(lm, seed=3, **hot)
    assert max(max(r) for r in out) < 20 and sum(map(len, out)) == 3 * N
    assert run(lm, seed=3, temperature=5.0) != out  # without the limit: higher ids come up
    assert max(max(r) for r in run(lm, seed=3, temperature=5.0)) >= 20
    assert uncached(lm, seed=3, **hot) == out

    class SmallTokenizer(CharTokenizer):
        n_vocab = 20

        def decode(self, tokens):
            if max(tokens, default=0) >= self.n_vocab:
                raise KeyError(f"Invalid token for decoding: {max(tokens)}")
            return super().decode(tokens)

    texts = generate_text(*lm, SmallTokenizer(), ["bcdef", "h"], N, Sampling(temperature=5.0))
    assert all(len(t) == N for t in texts)
    with pytest.raises(ValueError, match=r"vocab_limit must be in \[1, 61\]"):
        run(lm, vocab_limit=62)


def test_beam_search_vocab_limit(lm):
    """ids >= vocab_limit never extend a beam (translation's tokenizer may hold fewer ids than
    the model: decoding one crashed), and the width must fit under the limit."""
    search = BeamSearch(beam_width=4, length_penalty=0.0, eos_id=None, vocab_limit=6)
    for row in beam_search(*lm, PROMPTS, N, search):
        assert len(row) == N and max(row) < 6
    assert max(max(r) for r in beam_search(*lm, PROMPTS, N, BeamSearch(eos_id=None))) >= 6
    with pytest.raises(ValueError, match=r"beam_width must be in \[1, 6\] \(beam_search.vocab"):
        beam_search(*lm, PROMPTS, N, dataclasses.replace(search, beam_width=7))


@pytest.mark.parametrize("seed", [2**32 + 7, 2**64, -1, 1.5, True, np.zeros(2, np.float32)])
def test_bad_seeds_are_refused(lm, seed):
    """2^64 was an OverflowError, 2^32 + 7 drew as seed 7, a float array failed deep in jax."""
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^32 - 1\]"):
        run(lm, seed=seed)


def test_a_zero_d_array_seed_is_a_seed_and_a_key_is_a_key(lm):
    assert run(lm, seed=np.int64(5)) == run(lm, seed=5) == run(lm, seed=jnp.int32(5))
    assert run(lm, seed=jax.random.PRNGKey(5)) == run(lm, seed=5)
    assert run(lm, seed=2**32 - 1) != run(lm, seed=0)
    typed = jax.random.key(5)
    assert run(lm, seed=typed) == run(lm, seed=jax.random.key_data(typed))


# ----------------------------------------------------------------------------- decoding


def test_cached_equals_uncached_greedy_on_a_padded_batch(lm):
    cached = run(lm, temperature=0.0, eos_id=None)
    assert cached == uncached(lm, temperature=0.0, eos_id=None)
    assert all(len(row) == N for row in cached)
    assert len({tuple(r) for r in cached}) > 1  # the rows really differ


def test_padded_row_equals_that_prompt_alone(lm):
    # The uncached reference above already decodes each row unpadded; this checks the cached
    # path itself on the most padded row (4 pad slots), at its own batch shape.
    batch = run(lm, temperature=0.0, eos_id=None)
    assert run(lm, [PROMPTS[1]], temperature=0.0, eos_id=None) == [batch[1]]


def test_cached_equals_uncached_when_sampling(lm):
    kw = dict(temperature=0.9, top_k=40, top_p=0.95, seed=5, eos_id=None)
    assert run(lm, **kw) == uncached(lm, **kw)


@pytest.mark.parametrize(
    "kw", [dict(temperature=1e-6), dict(top_k=1), dict(top_p=1e-9), dict(temperature=0.0)]
)
def test_decoding_limits_equal_greedy(lm, kw):
    greedy = uncached(lm, temperature=0.0, eos_id=None)
    assert run(lm, eos_id=None, seed=3, **kw) == greedy


def test_same_seed_same_output_other_seed_differs(lm):
    kw = dict(temperature=1.5, eos_id=None)
    a, b, c = run(lm, seed=0, **kw), run(lm, seed=0, **kw), run(lm, seed=1, **kw)
    assert a == b
    assert a != c
    assert run(lm, seed=jax.random.PRNGKey(0), **kw) == a  # a key works as the seed too


def test_output_never_exceeds_max_new_tokens(lm):
    # N = 8 is covered by every test above; n = 1 is prefill only, no decode step.
    out = run(lm, n=1, temperature=1.0, eos_id=None)
    assert [len(r) for r in out] == [1] * len(PROMPTS)


def last_new_token(row):
    """Index j of the last token that does not occur before it (0 if the row repeats one)."""
    return max(j for j in range(len(row)) if row[j] not in row[:j])


def test_stops_at_eos_and_excludes_it(lm):
    full = run(lm, temperature=0.0, eos_id=None)
    for i, row in enumerate(full):
        j = last_new_token(row)
        out = run(lm, temperature=0.0, eos_id=row[j])
        assert out[i] == row[:j]  # cut before the first eos
        assert uncached(lm, temperature=0.0, eos_id=row[j]) == out
        for other, got in zip(full, out, strict=True):  # other rows stop at their own eos, if any
            assert got == (other[: other.index(row[j])] if row[j] in other else other)


def test_first_token_eos_gives_empty_rows(lm):
    first = run(lm, temperature=0.0, eos_id=None)[0][0]
    assert run(lm, [PROMPTS[0]] * 3, temperature=0.0, eos_id=first) == [[], [], []]


def test_stops_at_eos_when_sampling(lm):
    # Step i's randomness does not depend on eos_id, so the run with eos is a prefix of the one
    # without: every row stops exactly before its first sampled eos.
    kw = dict(temperature=1.0, seed=7)
    full = run(lm, eos_id=None, **kw)
    eos = full[2][last_new_token(full[2])]
    out = run(lm, eos_id=eos, **kw)
    assert out == [r[: r.index(eos)] if eos in r else r for r in full]
    assert out == uncached(lm, eos_id=eos, **kw)
    assert len(out[2]) < N


def test_eos_auto_is_endoftext_only_for_gpt2_vocab():
    assert resolve_eos_id(ModelConfig(), "auto") == 50256
    assert resolve_eos_id(ModelConfig(vocab_size=50304), "auto") == 50256  # padded GPT-2 vocab
    assert resolve_eos_id(ARCHS["gpt2"], "auto") is None
    assert resolve_eos_id(ARCHS["gpt2"], 7) == 7 and resolve_eos_id(ARCHS["gpt2"], None) is None


class CharTokenizer:
    """a..z <-> 0..25."""

    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, tokens):
        return "".join(chr(ord("a") + t % 26) for t in tokens)


def test_generate_text_round_trips_through_the_tokenizer(lm):
    tok = CharTokenizer()
    texts = ["bcdef", "h", "jkl"]  # encodes to PROMPTS
    assert [tok.encode(t) for t in texts] == PROMPTS
    out = generate_text(*lm, tok, texts, N, Sampling(temperature=0.0, top_k=None), seed=0)
    assert out == [tok.decode(r) for r in run(lm, temperature=0.0)]
    with pytest.raises(ValueError, match="prompt 1 encodes to no tokens"):
        generate_text(*lm, tok, ["ab", ""], N)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("prompts", "n", "match"),
    [
        ([], 4, "prompts must be a non-empty list"),
        ([[1, 2], []], 4, r"prompt 1 must be a non-empty list"),
        ([[1, 61]], 4, r"outside \[0, 60\]"),
        ([[-1]], 4, r"outside \[0, 60\]"),
        ([[1]], 0, "max_new_tokens must be >= 1"),
        ([[1] * 30], 3, r"\(30 tokens\) \+ max_new_tokens \(3\) = 33 exceeds .* 32"),
    ],
)
@pytest.mark.parametrize("fn", [generate, generate_uncached])
def test_bad_requests_raise(lm, fn, prompts, n, match):
    with pytest.raises(ValueError, match=match):
        fn(*lm, prompts, n)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(temperature=-0.1), r"sampling.temperature must be >= 0"),
        (dict(temperature=float("nan")), r"sampling.temperature must be a finite number"),
        (dict(top_p=0.0), r"sampling.top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"sampling.top_p must be in \(0, 1\]"),
        (dict(top_k=0), "sampling.top_k must be >= 1"),
        (dict(top_k=2.5), "sampling.top_k must be an integer"),
        (dict(eos_id=-3), "sampling.eos_id must be >= 0"),
        (dict(eos_id="end"), "one of \\['auto'\\]"),
    ],
)
def test_bad_sampling_is_refused_on_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


def test_eos_id_beyond_the_vocabulary_is_refused(lm):
    with pytest.raises(ValueError, match=r"eos_id must be None, 'auto' or an int in \[0, 60\]"):
        run(lm, [[1]], 4, eos_id=61)


# ----------------------------------------------------------------------------- beam search
# Beam tests reuse PROMPTS and N (beam widths 1 and 4) so the beam decoder compiles few shapes.


def beam(lm, prompts=PROMPTS, n=N, k=4, alpha=0.0, eos_id=None):
    return beam_search(*lm, prompts, n, BeamSearch(k, alpha, eos_id))


def nbest(lm, prompts=PROMPTS, n=N, k=4, alpha=0.0, eos_id=None):
    return beam_search_nbest(*lm, prompts, n, BeamSearch(k, alpha, eos_id))


def logprob(lm, prompt, continuation):
    return sequence_logprob(*lm, prompt, continuation)


def greedy_eos(lm):
    """An eos id that greedy decoding emits mid-row in PROMPTS[2] (like test_stops_at_eos)."""
    row = run(lm, temperature=0.0, eos_id=None)[2]
    return row[last_new_token(row)]


@pytest.mark.parametrize("with_eos", [False, True])
def test_beam_width_1_equals_greedy(lm, with_eos):
    eos = greedy_eos(lm) if with_eos else None
    greedy = run(lm, temperature=0.0, eos_id=eos)
    assert beam(lm, k=1, eos_id=eos) == greedy
    assert beam(lm, k=1, alpha=2.0, eos_id=eos) == greedy  # one beam: the penalty cannot matter
    assert any(len(r) < N for r in greedy) == with_eos


def test_beam_search_beats_greedy_in_logprob(lm):
    # No eos: every continuation has N tokens, so raw log-prob sums compare.
    greedy = run(lm, temperature=0.0, eos_id=None)
    found = beam(lm)
    gains = []
    for prompt, g, b in zip(PROMPTS, greedy, found, strict=True):
        assert len(b) == N
        gains.append(logprob(lm, prompt, b) - logprob(lm, prompt, g))
    assert min(gains) >= -1e-4, gains
    assert max(gains) > 0.1, gains  # strictly better somewhere (here: on every prompt)


def test_full_width_beam_is_exact_over_two_tokens(lm):
    # Beam width V keeps every first token, so over 2 new tokens beam search is exhaustive: for
    # each 1-token prompt it must find the best of all V * V continuations, which greedy (myopic)
    # misses for some of them.
    model, params = lm
    v = model.cfg.vocab_size
    prompts = [[t] for t in range(v)]
    found = np.array(beam(lm, prompts, n=2, k=v))  # (V, 2)
    pairs = np.stack(np.meshgrid(np.arange(v), np.arange(v), indexing="ij"), -1).reshape(-1, 2)
    logits = jax.jit(model.apply)(params, jnp.asarray(pairs))  # (V*V, 2, V): prompt, first token
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)).reshape(v, v, 2, v)
    first = logp[:, 0, 0]  # (prompt, first token)
    table = first[:, :, None] + logp[:, :, 1]  # (prompt, first, second): the 2-token log-prob
    best = table.reshape(v, -1).max(axis=1)  # (V,)
    rows = np.arange(v)
    np.testing.assert_array_less(best - 1e-4, table[rows, found[:, 0], found[:, 1]])
    g1 = first.argmax(axis=1)
    greedy = table[rows, g1, logp[rows, g1, 1].argmax(axis=1)]
    assert (greedy < best - 0.05).sum() >= 3  # myopic greedy loses on several prompts


def test_nbest_beams_are_scored_by_their_teacher_forced_logprob(lm):
    eos = greedy_eos(lm)
    for alpha in (0.0, 1.0):
        hyps = nbest(lm, eos_id=eos, alpha=alpha)
        for prompt, beams in zip(PROMPTS, hyps, strict=True):
            assert len(beams) == 4
            assert len({(tuple(h.tokens), h.finished) for h in beams}) == 4  # all distinct
            for h in beams:
                assert eos not in h.tokens and len(h.tokens) <= N
                assert h.finished or len(h.tokens) == N
                length = len(h.tokens) + h.finished  # eos counts
                assert h.score == pytest.approx(h.logprob / ((5 + length) / 6) ** alpha)
                full = h.tokens + [eos] * h.finished
                assert h.logprob == pytest.approx(logprob(lm, prompt, full), abs=1e-4)
            assert [h.score for h in beams] == sorted((h.score for h in beams), reverse=True)
        assert beam(lm, eos_id=eos, alpha=alpha) == [beams[0].tokens for beams in hyps]
        finished = [h.finished for beams in hyps for h in beams]
        assert any(finished) and not all(finished)


def test_beam_search_stops_at_eos_per_row(lm):
    # eos = the first token greedy picks for PROMPTS[0]: the 1-token hypothesis [eos] outscores
    # every longer one there (each extra token adds a log-prob < 0), so with alpha 0 that row is
    # empty; the other rows go on on their own.
    eos = run(lm, temperature=0.0, eos_id=None)[0][0]
    out = beam(lm, eos_id=eos)
    assert out[0] == []
    for row, full in zip(out[1:], beam(lm)[1:], strict=True):
        assert eos not in row
        assert row == full or len(row) < N
    assert beam(lm, [PROMPTS[0]] * 3, eos_id=eos) == [[], [], []]


@pytest.mark.parametrize("eos", [None, "greedy"])
def test_beam_padded_row_equals_that_prompt_alone(lm, eos):
    eos = greedy_eos(lm) if eos else None
    batch = nbest(lm, eos_id=eos, alpha=1.0)
    alone = nbest(lm, [PROMPTS[1]], eos_id=eos, alpha=1.0)[0]
    assert [h.tokens for h in alone] == [h.tokens for h in batch[1]]
    np.testing.assert_allclose([h.score for h in alone], [h.score for h in batch[1]], atol=1e-4)


def test_sequence_logprob_of_greedy_matches_width_1_beam(lm):
    greedy = run(lm, temperature=0.0, eos_id=None)
    hyps = nbest(lm, k=1)
    for prompt, g, (h,) in zip(PROMPTS, greedy, hyps, strict=True):
        assert h.tokens == g and not h.finished
        assert logprob(lm, prompt, g) == pytest.approx(h.logprob, abs=1e-4)
    assert logprob(lm, [1, 2], []) == 0.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(beam_width=0), "beam_search.beam_width must be >= 1, got 0"),
        (dict(beam_width=2.0), "beam_search.beam_width must be an integer"),
        (dict(length_penalty=-0.5), r"beam_search.length_penalty must be in \[0, 10\]"),
        (dict(length_penalty=float("inf")), "beam_search.length_penalty must be a finite number"),
        (dict(eos_id=-1), "beam_search.eos_id must be >= 0"),
    ],
)
def test_bad_beam_search_settings_are_refused_on_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        BeamSearch(**kw)


@pytest.mark.parametrize(
    ("prompts", "n", "search", "match"),
    [
        ([], 4, BeamSearch(), "prompts must be a non-empty list"),
        ([[1, 61]], 4, BeamSearch(), r"outside \[0, 60\]"),
        ([[1]], 0, BeamSearch(), "max_new_tokens must be >= 1"),
        ([[1] * 30], 3, BeamSearch(), r"\(30 tokens\) \+ max_new_tokens \(3\) = 33 exceeds"),
        ([[1]], 4, BeamSearch(beam_width=62), r"beam_search.beam_width must be in \[1, 61\]"),
        ([[1]], 4, BeamSearch(eos_id=61), r"eos_id must be None, 'auto' or an int in \[0, 60\]"),
    ],
)
def test_bad_beam_search_requests_raise(lm, prompts, n, search, match):
    with pytest.raises(ValueError, match=match):
        beam_search(*lm, prompts, n, search)


@pytest.mark.parametrize(
    ("prompt", "cont", "match"),
    [
        ([], [1], "prompts must be a non-empty list|prompt 0 must be a non-empty list"),
        ([1], [61], r"continuation has token ids outside \[0, 60\]"),
        ([1], [0.5], "continuation must be a list of int token ids"),
        ([1], [1] * 33, r"exceeds|context_length 32"),
    ],
)
def test_bad_sequence_logprob_requests_raise(lm, prompt, cont, match):
    with pytest.raises(ValueError, match=match):
        sequence_logprob(*lm, prompt, cont)


def test_sequence_logprob_takes_a_prompt_that_fills_the_context(lm):
    """prompt + continuation - 1 inputs must fit (the docstring's rule): a 32-token prompt and
    one continuation token do, though generate could add nothing to that prompt."""
    assert np.isfinite(sequence_logprob(*lm, [1] * 32, [2]))
    with pytest.raises(ValueError, match="needs 33 input positions, more than context_length 32"):
        sequence_logprob(*lm, [1] * 32, [2, 3])


def test_pad_to_changes_nothing_but_the_shape(lm):
    greedy = dict(temperature=0.0, eos_id=None)
    want = run(lm, **greedy)
    assert generate(*lm, PROMPTS, N, Sampling(**greedy), pad_to=9) == want
    with pytest.raises(ValueError, match=r"pad_to must be an int >= the longest prompt \(5\)"):
        generate(*lm, PROMPTS, N, pad_to=4)
    with pytest.raises(ValueError, match="exceeds the model's context_length"):
        generate(*lm, PROMPTS, N, pad_to=30)


def test_scan_layers_cache_decodes_and_beam_searches_like_the_unrolled_model(lm):
    """execution.scan_layers keeps one (L, B, S, H, Dh) cache: greedy and beam search (which
    repeats and gathers that cache on its batch axis 1) give the unrolled model's tokens."""
    model, params = lm
    smodel = build_model(model.cfg, ExecutionConfig(scan_layers=True))
    sparams = {"params": stack_blocks(params["params"], model.cfg.n_layers)}
    assert run((smodel, sparams)) == run(lm)
    search = BeamSearch(3, 0.6, None)
    assert beam_search(smodel, sparams, PROMPTS, N, search) == beam_search(*lm, PROMPTS, N, search)
