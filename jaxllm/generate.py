"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling, and
beam search.

`generate` left-pads a batch of prompts to the longest one (P tokens), runs all prompts through
the model once (prefill) into a cache of S = P + max_new_tokens slots, then feeds one token per
step inside a jitted `lax.while_loop`, which exits early once every row has emitted eos. Padding
slots are hidden by `key_mask` and positions count from each prompt's first real token, so each
row decodes as if it were alone. `generate_uncached` is the slow reference: no cache, no left
padding; it re-runs every sequence in full at each step.

Both draw step i's randomness from `fold_in(key, i)`, so at the same seed they give the same
tokens. Returned lists exclude the prompt and end just before the first eos (eos itself is not
returned); they never hold more than max_new_tokens ids. `beam_search` reuses the same cache
layout with beam_width rows per prompt; `sequence_logprob` scores a continuation teacher-forced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import functional as F
from jaxllm.config import ModelConfig, Section, TokensConfig, spec
from jaxllm.models import Decoder, cache_batch_axis, init_kv_cache

EosId = int | None | Literal["auto"]  # "auto": <|endoftext|> for GPT-2's vocab, else None
Seed = int | jax.Array  # an int seed or a jax PRNG key


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...


def sample_next(
    logits: jax.Array,
    rng: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array = 1.0,
) -> jax.Array:
    """Next token ids (B,) int32 from logits (B, V).

    temperature 0 is greedy (argmax). Otherwise sample from softmax(logits / temperature)
    restricted to the top_k most likely tokens (None: all), then to the nucleus: the smallest
    set of most likely tokens whose renormalized probability sums to >= top_p. The most likely
    token is always kept. The knobs may be traced arrays, so changing them does not recompile;
    concrete ones (Python, NumPy or jax scalars) are range-checked (temperature >= 0,
    top_k >= 1, 0 < top_p <= 1).
    """
    for name, value, ok, allowed in (
        ("temperature", temperature, lambda x: x >= 0, ">= 0"),
        ("top_k", top_k, lambda x: x >= 1, ">= 1 or None"),
        ("top_p", top_p, lambda x: 0 < x <= 1, "in (0, 1]"),
    ):
        concrete = _concrete_scalar(value)
        if concrete is not None and not ok(concrete):  # traced knobs: not checkable
            raise ValueError(f"{name} must be {allowed}, got {value}")
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(v if top_k is None else top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to
    # -inf, never several to +inf (a tie that the lowest id would win).
    z = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.where(
        temperature > 0, temperature, 1.0
    )
    # Work in rank order; argsort is stable, so ties rank the lower id first, as argmax does.
    order = jnp.argsort(-z, axis=-1)  # (B, V) token ids, most likely first
    z_sorted = jnp.where(
        jnp.arange(v) < top_k, jnp.take_along_axis(z, order, axis=-1), -jnp.inf
    )  # (B, V)
    probs = F.softmax(z_sorted, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # (B, V) mass of the more likely tokens
    # top_p = 1 keeps everything even where the cumulative sum rounds to 1 early.
    keep = (mass_before < top_p) | (top_p >= 1.0)
    rank = jax.random.categorical(rng, jnp.where(keep, z_sorted, -jnp.inf), axis=-1)  # (B,)
    sampled = jnp.take_along_axis(order, rank[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _concrete_scalar(value: Any) -> float | None:
    """value as a float if it is a concrete scalar (Python, NumPy, jax), else None (None, a
    traced value, an array)."""
    if value is None or np.ndim(value) != 0:
        return None
    try:
        return float(value)
    except TypeError:  # jax's ConcretizationTypeError is one: a traced knob
        return None


def mask_vocab(logits: jax.Array, vocab_limit: int | jax.Array | None) -> jax.Array:
    """logits (..., V) with the ids >= vocab_limit set to -inf (never drawn): a vocabulary
    padded past its tokenizer's (GPT-2's 50304 > 50257). None: unchanged."""
    if vocab_limit is None:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)


@dataclass(frozen=True)
class Sampling(Section):
    """How the next token is chosen (see `sample_next`), validated on construction."""

    PATH: ClassVar[str] = "sampling"

    temperature: float = spec(1.0, ge=0.0)  # 0 = greedy
    top_k: int | None = spec(None, ge=1)  # None: the whole vocabulary
    top_p: float = spec(1.0, gt=0.0, le=1.0)  # nucleus mass
    eos_id: int | None | Literal["auto"] = spec("auto", ge=0)  # "auto": see resolve_eos_id
    # ids >= this are never drawn (None: every id of the model's vocabulary); `generate_text`
    # sets it to the tokenizer's size where the model's vocabulary is padded past it
    vocab_limit: int | None = spec(None, ge=1)


def resolve_eos_id(cfg: ModelConfig, eos_id: EosId) -> int | None:
    """ "auto" -> <|endoftext|> (50256) for GPT-2's vocabulary, padded or not (vocab_size >=
    50257, e.g. nanoGPT's 50304: the token data's ids), else None; ints are range-checked."""
    if eos_id == "auto":
        n_vocab = TokensConfig.GPT2_VOCAB  # <|endoftext|> is its last id
        return n_vocab - 1 if cfg.vocab_size >= n_vocab else None
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(
            f"eos_id must be None, 'auto' or an int in [0, {cfg.vocab_size - 1}], got {eos_id!r}"
        )
    return eos_id


def _check_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """The prompts as int32 arrays: non-empty lists of ids in [0, V) (ValueError otherwise)."""
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    arrays = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(
                f"prompt {i} must be a non-empty list of int token ids, got shape {a.shape} "
                f"dtype {a.dtype}"
            )
        if a.min() < 0 or a.max() >= cfg.vocab_size:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {cfg.vocab_size - 1}] "
                f"(min {a.min()}, max {a.max()})"
            )
        arrays.append(a.astype(np.int32))
    return arrays


def _check_request(
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_to: int | None = None,
) -> list[np.ndarray]:
    """Raise ValueError for a request `generate` cannot serve; return the prompts as arrays."""
    arrays = _check_prompts(cfg, prompts)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(a.size for a in arrays)
    if pad_to is not None:
        if (
            isinstance(pad_to, bool)
            or not isinstance(pad_to, (int, np.integer))
            or pad_to < longest
        ):
            raise ValueError(
                f"pad_to must be an int >= the longest prompt ({longest}), got {pad_to!r}"
            )
        longest = pad_to
    if longest + max_new_tokens > cfg.context_length:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the model's context_length {cfg.context_length}"
        )
    return arrays


def _request(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: EosId,
    pad_to: int | None,
) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Check a decoding request; (tokens (B, P) left-padded to the longest prompt or to
    pad_to, pad_len (B,), eos id or None)."""
    arrays = _check_request(model.cfg, prompts, max_new_tokens, pad_to)
    p = pad_to or max(a.size for a in arrays)  # _check_request: pad_to >= the longest prompt
    tokens = np.zeros((len(arrays), p), np.int32)  # pad id 0: any id works, pads are masked
    for row, a in zip(tokens, arrays, strict=True):
        row[p - a.size :] = a
    pad_len = np.array([p - a.size for a in arrays], np.int32)
    return tokens, pad_len, resolve_eos_id(model.cfg, eos_id)


def _as_key(seed: Seed) -> jax.Array:
    """A PRNG key from an int seed in [0, 2^32) (jax's keys take 32 bits: 2^32 + 7 would draw
    as 7), or the key itself (typed, or raw uint32 data of shape (2,))."""
    if isinstance(seed, (jax.Array, np.ndarray)):
        if jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
            return seed
        if seed.shape == (2,) and seed.dtype == np.uint32:
            return seed
        if seed.ndim == 0:
            seed = seed.item()  # a 0-d array: its value is the seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        shown = repr(seed)
        if isinstance(seed, (jax.Array, np.ndarray)):
            shown = f"an array of shape {seed.shape} and dtype {seed.dtype}"
        raise ValueError(f"seed must be an int in [0, 2^32 - 1] or a PRNG key, got {shown}")
    return jax.random.PRNGKey(seed)


def _vocab_limit(cfg: ModelConfig, settings: Sampling | BeamSearch) -> int:
    """The id bound decoding draws below: settings.vocab_limit, checked, or the vocab size."""
    if settings.vocab_limit is None:
        return cfg.vocab_size
    if settings.vocab_limit > cfg.vocab_size:
        raise ValueError(
            f"{settings.PATH}.vocab_limit must be in [1, {cfg.vocab_size}] (the model's vocab "
            f"size), got {settings.vocab_limit}"
        )
    return settings.vocab_limit


def _until_eos(tokens: Sequence[int], eos_id: int | None) -> list[int]:
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


def _prefill(
    model: Decoder, params: Any, tokens: jax.Array, pad_len: jax.Array, max_new_tokens: int
) -> tuple[jax.Array, list, jax.Array]:
    """Run the left-padded prompts (B, P) into a fresh cache of P + max_new_tokens slots.
    Returns (logits (B, P, V), cache, key_mask (B, S)): padding slots are masked and positions
    count from each prompt's first real token, so a row decodes as if it were alone."""
    b, p = tokens.shape
    slots = jnp.arange(p + max_new_tokens)
    key_mask = slots[None, :] >= pad_len[:, None]  # (B, S) False on padding
    positions = jnp.maximum(slots[None, :p] - pad_len[:, None], 0)  # (B, P)
    cache = init_kv_cache(model, b, p + max_new_tokens)
    logits, cache = model.apply(params, tokens, cache, 0, positions, key_mask, method="decode")
    return logits, cache, key_mask


@functools.lru_cache(maxsize=16)
def _decoder(model: Decoder, max_new_tokens: int) -> Callable[..., jax.Array]:
    """Jitted prefill + decode loop for one model and output length (cached, so repeat calls
    with new prompts of the same padded shape, seeds or sampling knobs do not recompile)."""

    def run(params, tokens, pad_len, key, temperature, top_k, top_p, eos_id, limit) -> jax.Array:
        b, p = tokens.shape  # tokens (B, P) left-padded; pad_len (B,)
        logits, cache, key_mask = _prefill(model, params, tokens, pad_len, max_new_tokens)

        def sample(logits: jax.Array, step: jax.Array | int) -> jax.Array:
            logits = mask_vocab(logits, limit)
            return sample_next(logits, jax.random.fold_in(key, step), temperature, top_k, top_p)

        tok = sample(logits[:, -1], 0)  # (B,)
        out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok)

        def cond(carry: tuple) -> jax.Array:
            i, _, _, _, done = carry
            return (i < max_new_tokens) & ~jnp.all(done)

        def body(carry: tuple) -> tuple:
            i, cache, tok, out, done = carry
            slot = p + i - 1  # where the previous token's key/value go
            logits, cache = model.apply(
                params, tok[:, None], cache, slot, (slot - pad_len)[:, None], key_mask,
                method="decode",
            )  # fmt: skip
            tok = sample(logits[:, 0], i)
            return i + 1, cache, tok, out.at[:, i].set(tok), done | (tok == eos_id)

        carry = (jnp.int32(1), cache, tok, out, tok == eos_id)
        return jax.lax.while_loop(cond, body, carry)[3]  # (B, max_new_tokens)

    return jax.jit(run)


def generate(
    model: Decoder,
    params: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: Seed = 0,
    *,
    pad_to: int | None = None,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids; lengths may differ) by up to max_new_tokens.

    Returns one list per prompt: the new ids only, ending before the first eos (eos_id None:
    never stop early). Needs longest prompt + max_new_tokens <= context_length. seed is an int
    or a PRNG key. `pad_to` left-pads every prompt to that many tokens, so batches of other
    lengths reuse one compiled decoder (the padding is masked: results do not change).
    """
    cfg = model.cfg
    tokens, pad_len, eos = _request(model, prompts, max_new_tokens, sampling.eos_id, pad_to)
    top_k = cfg.vocab_size if sampling.top_k is None else min(sampling.top_k, cfg.vocab_size)
    out = _decoder(model, int(max_new_tokens))(
        params,
        tokens,
        pad_len,
        _as_key(seed),
        np.float32(sampling.temperature),
        np.int32(top_k),
        np.float32(sampling.top_p),
        np.int32(-1 if eos is None else eos),
        np.int32(_vocab_limit(cfg, sampling)),
    )
    return [_until_eos(row, eos) for row in np.asarray(out)]


def generate_uncached(
    model: Decoder,
    params: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: Seed = 0,
) -> list[list[int]]:
    """Reference for `generate` (same arguments and result): no cache, no left padding, no
    key_mask, no jit. Each step re-runs every full sequence, right-padded to one fixed length
    (causal attention keeps the padding after a sequence from touching its logits, and the fixed
    shape keeps eager ops from recompiling). Slow; meant for tests."""
    cfg = model.cfg
    arrays = _check_request(cfg, prompts, max_new_tokens)
    eos = resolve_eos_id(cfg, sampling.eos_id)
    key, limit = _as_key(seed), _vocab_limit(cfg, sampling)
    lengths = np.array([a.size for a in arrays])
    tokens = np.zeros((len(arrays), lengths.max() + max_new_tokens - 1), np.int32)  # (B, L)
    for row, a in zip(tokens, arrays, strict=True):
        row[: a.size] = a
    rows = np.arange(len(arrays))
    new: list[list[int]] = [[] for _ in arrays]
    done = np.zeros(len(arrays), bool)
    for step in range(max_new_tokens):
        logits = model.apply(params, jnp.asarray(tokens))  # (B, L, V)
        last = logits[rows, lengths + step - 1]  # (B, V) at each sequence's last token
        toks = np.asarray(
            sample_next(
                mask_vocab(last, limit), jax.random.fold_in(key, step), sampling.temperature,
                sampling.top_k, sampling.top_p,
            )
        )  # fmt: skip
        for out, t in zip(new, toks, strict=True):
            out.append(int(t))
        done |= toks == (-1 if eos is None else eos)
        if done.all() or step + 1 == max_new_tokens:
            break
        tokens[rows, lengths + step] = toks
    return [_until_eos(out, eos) for out in new]


def generate_text(
    model: Decoder,
    params: Any,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seed: Seed = 0,
) -> list[str]:
    """Text in, text out: encode each prompt, `generate`, decode the new tokens (no prompt).
    Where the model's vocabulary is padded past the tokenizer's `n_vocab` (GPT-2's 50304 >
    50257) and sampling.vocab_limit is unset, the padding ids are never drawn: the tokenizer
    could not decode them."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single str")
    n_vocab = getattr(tokenizer, "n_vocab", None)
    if sampling.vocab_limit is None and n_vocab is not None and n_vocab < model.cfg.vocab_size:
        sampling = dataclasses.replace(sampling, vocab_limit=n_vocab)
    ids = [tokenizer.encode(p) for p in prompts]
    for i, t in enumerate(ids):
        if not t:
            raise ValueError(f"prompt {i} encodes to no tokens; prompts must be non-empty text")
    out = generate(model, params, ids, max_new_tokens, sampling, seed)
    return [tokenizer.decode(o) for o in out]


# ----------------------------------------------------------------------------- beam search


MAX_LENGTH_PENALTY = 10.0  # ((5 + len) / 6) ** alpha stays finite for any context length


@dataclass(frozen=True)
class BeamSearch(Section):
    """Beam search settings (see `beam_search`), validated on construction."""

    PATH: ClassVar[str] = "beam_search"

    beam_width: int = spec(4, ge=1)  # 1 = greedy; at most the vocab size (or vocab_limit)
    # GNMT alpha; 0 = rank by the raw log-prob sum; at most 10 (the penalty is a power)
    length_penalty: float = spec(1.0, ge=0.0, le=MAX_LENGTH_PENALTY)
    eos_id: int | None | Literal["auto"] = spec("auto", ge=0)  # "auto": see resolve_eos_id
    vocab_limit: int | None = spec(None, ge=1)  # ids >= this never extend a beam (Sampling's)


class Beam(NamedTuple):
    """One final hypothesis of `beam_search_nbest`."""

    tokens: list[int]  # the new ids, cut before eos
    logprob: float  # sum of the generated tokens' log-probs, eos included
    score: float  # logprob / ((5 + length) / 6) ** length_penalty; length counts eos
    finished: bool  # emitted eos


def _expand(
    scores: jax.Array, done: jax.Array, logits: jax.Array, eos_id: jax.Array, limit: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One beam step. scores, done (B, K); logits (B*K, V), or (B, V) when every beam of a
    prompt shares them; ids >= limit never extend a beam -> new (scores, parent, token, done),
    each (B, K). A finished beam's only continuation is eos at +0, so it keeps its score; top_k
    ranks ties by the lower index."""
    b, k = scores.shape
    v = logits.shape[-1]
    logits = mask_vocab(logits.astype(jnp.float32), limit)
    logp = jax.nn.log_softmax(logits, axis=-1).reshape(b, -1, v)
    frozen = jnp.where(jnp.arange(v) == eos_id, 0.0, -jnp.inf)  # (V,)
    logp = jnp.where(done[..., None], frozen, logp)  # (B, K, V)
    scores, idx = jax.lax.top_k((scores[..., None] + logp).reshape(b, k * v), k)  # (B, K)
    parent, tok = idx // v, (idx % v).astype(jnp.int32)
    done = jnp.take_along_axis(done, parent, axis=1) | (tok == eos_id)
    return scores, parent, tok, done


@functools.lru_cache(maxsize=16)
def _beam_decoder(model: Decoder, max_new_tokens: int, beam_width: int) -> Callable[..., tuple]:
    """Jitted prefill + beam loop for one model, output length and width (cached like
    `_decoder`; eos_id is traced). Returns tokens (B, K, N), log-prob sums (B, K), done (B, K)."""
    n, k = max_new_tokens, beam_width

    def run(params, tokens, pad_len, eos_id, limit) -> tuple[jax.Array, jax.Array, jax.Array]:
        b, p = tokens.shape  # tokens (B, P) left-padded; pad_len (B,)
        logits, cache, key_mask = _prefill(model, params, tokens, pad_len, n)
        # All K beams of a prompt start identical: beams 1..K-1 at -inf, so the first expansion
        # takes the K best first tokens of beam 0 (K <= V keeps them all finite).
        scores = jnp.full((b, k), -jnp.inf, jnp.float32).at[:, 0].set(0.0)
        scores, _, tok, done = _expand(
            scores, jnp.zeros((b, k), bool), logits[:, -1], eos_id, limit
        )
        out = jnp.zeros((b, k, n), jnp.int32).at[:, :, 0].set(tok)
        # Row b * K + j holds beam j of prompt b.
        ax = cache_batch_axis(model)  # (B, S, H, Dh) per layer, or (L, B, S, H, Dh)
        cache = jax.tree.map(lambda c: jnp.repeat(c, k, axis=ax), cache)  # B -> B*K rows
        key_mask = jnp.repeat(key_mask, k, axis=0)  # (B*K, S)
        pad_len = jnp.repeat(pad_len, k)  # (B*K,)
        prompt_row = jnp.arange(b)[:, None]  # (B, 1)

        def cond(carry: tuple) -> jax.Array:
            i, _, _, _, _, done = carry
            return (i < n) & ~jnp.all(done)

        def body(carry: tuple) -> tuple:
            i, cache, scores, tok, out, done = carry
            slot = p + i - 1  # where the previous token's key/value go
            logits, cache = model.apply(
                params, tok.reshape(-1, 1), cache, slot, (slot - pad_len)[:, None], key_mask,
                method="decode",
            )  # fmt: skip
            scores, parent, tok, done = _expand(scores, done, logits[:, 0], eos_id, limit)
            src = (prompt_row * k + parent).reshape(-1)  # (B*K,) each new beam's parent row
            cache = jax.tree.map(lambda c: jnp.take(c, src, axis=ax), cache)
            out = out[prompt_row, parent].at[:, :, i].set(tok)  # (B, K, N)
            return i + 1, cache, scores, tok, out, done

        carry = (jnp.int32(1), cache, scores, tok, out, done)
        _, _, scores, _, out, done = jax.lax.while_loop(cond, body, carry)
        return out, scores, done

    return jax.jit(run)


def beam_search_nbest(
    model: Decoder,
    params: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    search: BeamSearch = BeamSearch(),
    *,
    pad_to: int | None = None,
) -> list[list[Beam]]:
    """Like `beam_search`, but every prompt's beam_width final beams, best score first."""
    cfg = model.cfg
    tokens, pad_len, eos = _request(model, prompts, max_new_tokens, search.eos_id, pad_to)
    k, limit = search.beam_width, _vocab_limit(cfg, search)
    if k > limit:
        what = "the vocab size" if search.vocab_limit is None else "beam_search.vocab_limit"
        raise ValueError(f"beam_search.beam_width must be in [1, {limit}] ({what}), got {k}")
    out, logprob, done = _beam_decoder(model, int(max_new_tokens), k)(
        params, tokens, pad_len, np.int32(-1 if eos is None else eos), np.int32(limit)
    )
    out, logprob, done = np.asarray(out), np.asarray(logprob, np.float64), np.asarray(done)
    result = []
    for b in range(len(tokens)):
        beams = []
        for j in range(k):
            new = _until_eos(out[b, j], eos)
            length = len(new) + bool(done[b, j])  # an unfinished beam ran all max_new_tokens
            penalty = ((5.0 + length) / 6.0) ** search.length_penalty
            score = float(logprob[b, j] / penalty)
            beams.append(Beam(new, float(logprob[b, j]), score, bool(done[b, j])))
        result.append(sorted(beams, key=lambda h: -h.score))  # stable: ties keep beam order
    return result


def beam_search(
    model: Decoder,
    params: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    search: BeamSearch = BeamSearch(),
    *,
    pad_to: int | None = None,
) -> list[list[int]]:
    """The most likely continuation of each prompt found by beam search (new ids, cut before
    eos, as `generate` returns them).

    Algorithm: prefill the B left-padded prompts once, repeat the cache to B*K rows (K =
    beam_width). Each step scores every beam's V continuations, beam logprob + log_softmax(logits)
    in float32 (a beam that emitted eos only continues with eos at +0, so it stays as it is), keeps
    the top K of the K*V candidates per prompt, and gathers the cache rows of the chosen parent
    beams. The loop (jitted `lax.while_loop`) stops when every beam has emitted eos or after
    max_new_tokens. The answer per prompt is the beam with the best logprob / ((5 + len) / 6) **
    length_penalty (GNMT; len counts eos). beam_width 1 is greedy decoding.
    """
    return [
        beams[0].tokens
        for beams in beam_search_nbest(
            model, params, prompts, max_new_tokens, search, pad_to=pad_to
        )
    ]


@functools.lru_cache(maxsize=16)
def _forward(model: Decoder) -> Callable[..., jax.Array]:
    """Jitted `model.apply(params, tokens)` -> logits (cached per model)."""
    return jax.jit(model.apply)


def sequence_logprob(
    model: Decoder, params: Any, prompt: Sequence[int], continuation: Sequence[int]
) -> float:
    """Teacher-forced sum of log p(continuation[j] | prompt + continuation[:j]), log_softmax in
    float32 (an empty continuation gives 0). len(prompt) + len(continuation) - 1 must fit in
    context_length. Inputs are right-padded to a power of two (causal attention keeps the pad
    from touching the logits read), so a few shapes compile."""
    cfg = model.cfg
    (prompt_ids,) = _check_prompts(cfg, [prompt])  # its length: checked with the continuation
    cont = np.asarray(continuation)
    if cont.size == 0:
        return 0.0
    if cont.ndim != 1 or not np.issubdtype(cont.dtype, np.integer):
        raise ValueError(f"continuation must be a list of int token ids, got shape {cont.shape}")
    if cont.min() < 0 or cont.max() >= cfg.vocab_size:
        raise ValueError(f"continuation has token ids outside [0, {cfg.vocab_size - 1}]")
    ids = np.concatenate([prompt_ids, cont.astype(np.int32)])[:-1]  # the last id is only a target
    if ids.size > cfg.context_length:
        raise ValueError(
            f"prompt + continuation ({ids.size + 1} tokens) needs {ids.size} input positions, "
            f"more than context_length {cfg.context_length}"
        )
    length = min(max(16, 1 << (ids.size - 1).bit_length()), cfg.context_length)
    tokens = np.zeros((1, length), np.int32)
    tokens[0, : ids.size] = ids
    p = prompt_ids.size
    logits = _forward(model)(params, tokens)[0, p - 1 : p - 1 + cont.size]  # (C, V)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return float(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(cont)[:, None], axis=-1)))
