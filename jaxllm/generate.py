"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling.

`generate` left-pads a batch of prompts to the longest one (P tokens), runs all prompts through
the model once (prefill) into a cache of S = P + max_new_tokens slots, then feeds one token per
step inside a jitted `lax.while_loop`, which exits early once every row has emitted eos. Padding
slots are hidden by `key_mask` and positions count from each prompt's first real token, so each
row decodes as if it were alone. `generate_uncached` is the slow reference: no cache, no left
padding; it re-runs every sequence in full at each step.

Both draw step i's randomness from `fold_in(key, i)`, so at the same seed they give the same
tokens. Returned lists exclude the prompt and end just before the first eos (eos itself is not
returned); they never hold more than max_new_tokens ids.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import functional as F
from jaxllm.config import ModelConfig, Section, spec
from jaxllm.data.tokenizer import EOT_ID, N_VOCAB
from jaxllm.models import Decoder, init_kv_cache

EosId = int | None | Literal["auto"]  # "auto": <|endoftext|> if the vocab is GPT-2's, else None
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
    token is always kept. The knobs may be traced arrays, so changing them does not recompile.
    """
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(v if top_k is None else top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    z = logits / jnp.where(temperature > 0, temperature, 1.0)
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


@dataclass(frozen=True)
class Sampling(Section):
    """How the next token is chosen (see `sample_next`), validated on construction."""

    PATH: ClassVar[str] = "sampling"

    temperature: float = spec(1.0, ge=0.0)  # 0 = greedy
    top_k: int | None = spec(None, ge=1)  # None: the whole vocabulary
    top_p: float = spec(1.0, gt=0.0, le=1.0)  # nucleus mass
    eos_id: int | None | Literal["auto"] = spec("auto", ge=0)  # "auto": see resolve_eos_id


GREEDY = Sampling(temperature=0.0)


def resolve_eos_id(cfg: ModelConfig, eos_id: EosId) -> int | None:
    """ "auto" -> <|endoftext|> (50256) for GPT-2's vocab, else None; ints are range-checked."""
    if eos_id == "auto":
        return EOT_ID if cfg.vocab_size == N_VOCAB else None
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(
            f"eos_id must be None, 'auto' or an int in [0, {cfg.vocab_size - 1}], got {eos_id!r}"
        )
    return eos_id


def _check_request(
    cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[np.ndarray]:
    """Raise ValueError for a request `generate` cannot serve; return the prompts as arrays."""
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
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(a.size for a in arrays)
    if longest + max_new_tokens > cfg.context_length:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{longest + max_new_tokens} exceeds the model's context_length {cfg.context_length}"
        )
    return arrays


def _as_key(seed: Seed) -> jax.Array:
    return jax.random.PRNGKey(seed) if isinstance(seed, (int, np.integer)) else seed


def _until_eos(tokens: Sequence[int], eos_id: int | None) -> list[int]:
    tokens = [int(t) for t in tokens]
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens


@functools.lru_cache(maxsize=16)
def _decoder(model: Decoder, max_new_tokens: int) -> Callable[..., jax.Array]:
    """Jitted prefill + decode loop for one model and output length (cached, so repeat calls
    with new prompts of the same padded shape, seeds or sampling knobs do not recompile)."""

    def run(params, tokens, pad_len, key, temperature, top_k, top_p, eos_id) -> jax.Array:
        b, p = tokens.shape  # tokens (B, P) left-padded; pad_len (B,)
        slots = jnp.arange(p + max_new_tokens)
        key_mask = slots[None, :] >= pad_len[:, None]  # (B, S) False on padding
        positions = jnp.maximum(slots[None, :p] - pad_len[:, None], 0)  # (B, P)
        cache = init_kv_cache(model.cfg, b, p + max_new_tokens)
        logits, cache = model.apply(params, tokens, cache, 0, positions, key_mask, method="decode")

        def sample(logits: jax.Array, step: jax.Array | int) -> jax.Array:
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
) -> list[list[int]]:
    """Continue each prompt (a list of token ids; lengths may differ) by up to max_new_tokens.

    Returns one list per prompt: the new ids only, ending before the first eos (eos_id None:
    never stop early). Needs longest prompt + max_new_tokens <= context_length. seed is an int
    or a PRNG key.
    """
    cfg = model.cfg
    arrays = _check_request(cfg, prompts, max_new_tokens)
    eos = resolve_eos_id(cfg, sampling.eos_id)
    p = max(a.size for a in arrays)
    tokens = np.zeros((len(arrays), p), np.int32)  # pad id 0: any id works, pads are masked
    for row, a in zip(tokens, arrays, strict=True):
        row[p - a.size :] = a
    pad_len = np.array([p - a.size for a in arrays], np.int32)
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
    key = _as_key(seed)
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
                last, jax.random.fold_in(key, step), sampling.temperature, sampling.top_k,
                sampling.top_p,
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
    """Text in, text out: encode each prompt, `generate`, decode the new tokens (no prompt)."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single str")
    ids = [tokenizer.encode(p) for p in prompts]
    for i, t in enumerate(ids):
        if not t:
            raise ValueError(f"prompt {i} encodes to no tokens; prompts must be non-empty text")
    out = generate(model, params, ids, max_new_tokens, sampling, seed)
    return [tokenizer.decode(o) for o in out]
