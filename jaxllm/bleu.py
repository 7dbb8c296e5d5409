"""A model's translations and their BLEU: sacrebleu's corpus BLEU with default settings (what
CMU 11-868 llmsys hw2 reports) on the detokenized, cased output against the raw references.

The prompt of a source sentence is `src <eos_src>`; decoding (greedy, or beam search with a
length penalty, over the KV cache: jaxllm.generate) stops at `<eos_tgt>`. The signature (e.g.
"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0") travels with the score: BLEU
numbers are only comparable under the same tokenization and settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sacrebleu.metrics import BLEU

from jaxllm.config import TranslationConfig
from jaxllm.generate import BeamSearch, Sampling, beam_search, generate
from jaxllm.models import Decoder

PAD_MULTIPLE = 8  # prompt lengths a translation batch is padded to: ctx / 8 shapes at most


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str]) -> tuple[float, str]:
    """BLEU (0..100) of hypotheses[i] against the single reference references[i]."""
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: they must pair up"
        )
    if not hypotheses:
        raise ValueError("no hypotheses to score")
    for name, texts in (("hypotheses", hypotheses), ("references", references)):
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"{name}[{bad}] is {type(texts[bad]).__name__}, not str")
    bleu = BLEU()
    score = bleu.corpus_score(list(hypotheses), [list(references)])  # one reference stream
    return score.score, str(bleu.get_signature())  # signature needs a scored corpus first


def hypotheses_text(hyps: list[str]) -> str:
    """The hypotheses as a file's text, one per line: a newline inside one (a decoded newline
    token) becomes a space, so that line i stays hypothesis i (BLEU treats both as whitespace)."""
    return "".join(h.replace("\r", " ").replace("\n", " ") + "\n" for h in hyps)


def translate(
    model: Decoder,
    params: Any,
    tok: Any,
    sources: list[str],
    batch_size: int,
    beam_width: int = 1,
    length_penalty: float = 1.0,
) -> list[str]:
    """Translations of `sources`, in order, by `tok` (the run's TranslationTokenizer). Prompts
    are batched by length; each continues until <eos_tgt> or the context is full
    (max_new_tokens = context - the batch's prompt length, rounded up to a multiple of
    PAD_MULTIPLE so that few shapes compile)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [tok.encode(s) + [tok.eos_src_id] for s in sources]  # src <eos_src>
    ctx = model.cfg.context_length
    too_long = [i for i, p in enumerate(prompts) if len(p) >= ctx]
    if too_long:
        raise ValueError(
            f"{len(too_long)} source sentences (e.g. #{too_long[0]}) fill the context of {ctx} "
            "tokens; filter them or raise model.context_length"
        )
    # a tokenizer that learned fewer ids than model.vocab_size could not decode the others
    limit = tok.vocab_size if tok.vocab_size < model.cfg.vocab_size else None
    order = np.argsort([len(p) for p in prompts], kind="stable")
    out: list[str] = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [prompts[i] for i in idx]
        # Each batch's own prompt length (sorted: its last), so that a long source elsewhere
        # does not cut this batch's translations short; rounded up: few shapes to compile.
        pad_to = min(-(-len(batch[-1]) // PAD_MULTIPLE) * PAD_MULTIPLE, ctx - 1)
        max_new = ctx - pad_to
        batch += [batch[0]] * (min(batch_size, len(prompts)) - len(batch))  # filler rows
        if beam_width == 1:
            sampling = Sampling(temperature=0.0, eos_id=tok.eos_tgt_id, vocab_limit=limit)
            ids = generate(model, params, batch, max_new, sampling, pad_to=pad_to)
        else:
            search = BeamSearch(beam_width, length_penalty, tok.eos_tgt_id, limit)
            ids = beam_search(model, params, batch, max_new, search, pad_to=pad_to)
        for i, row in zip(idx, ids, strict=False):  # the filler rows' outputs are dropped
            out[i] = tok.decode(row)
    return out


def score_translations(
    model: Decoder,
    params: Any,
    tok: Any,
    pairs: list[tuple[str, str]],
    tc: TranslationConfig,
    batch_size: int,
) -> tuple[dict[str, Any], list[str]]:
    """({"bleu", "bleu_signature", "sentences"}, hypotheses) of the model on (source,
    reference) `pairs`, decoded as `tc` says (beam_width, length_penalty)."""
    hyps = translate(
        model, params, tok, [s for s, _ in pairs], batch_size, tc.beam_width, tc.length_penalty
    )
    bleu, signature = corpus_bleu(hyps, [t for _, t in pairs])
    return {"bleu": bleu, "bleu_signature": signature, "sentences": len(pairs)}, hyps
