"""Translate with a trained decoder-only model and score it with BLEU.

    python -m jaxllm.translate --run-dir runs/multi30k --split test [--beam-width 4]

The prompt of a source sentence is `src <eos_src>`; decoding (greedy, or beam search with a
length penalty, over the KV cache) stops at `<eos_tgt>`, and the new ids are detokenized by
the run's own tokenizer (`tokenizer.json` in the run dir). BLEU is sacreBLEU's corpus BLEU with
default settings, on the detokenized cased output against the raw references.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxllm.atomic_file import write_text_atomic
from jaxllm.bleu import corpus_bleu, hypotheses_text
from jaxllm.config import TranslationConfig
from jaxllm.console import use_one_line_warnings
from jaxllm.data import translation as mt
from jaxllm.generate import BeamSearch, Sampling, beam_search, generate
from jaxllm.models import Decoder

PAD_MULTIPLE = 8  # prompt lengths a translation batch is padded to: ctx / 8 shapes at most


def translate(
    model: Decoder,
    params: Any,
    tok: mt.TranslationTokenizer,
    sources: list[str],
    batch_size: int,
    beam_width: int = 1,
    length_penalty: float = 1.0,
) -> list[str]:
    """Translations of `sources`, in order. Prompts are batched by length; each continues until
    <eos_tgt> or the context is full (max_new_tokens = context - the batch's prompt length,
    rounded up to a multiple of PAD_MULTIPLE so that few shapes compile)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    prompts = [mt.encode_prompt(tok, s) for s in sources]
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
    tok: mt.TranslationTokenizer,
    pairs: list[mt.Pair],
    tc: TranslationConfig,
    batch_size: int,
) -> tuple[dict[str, Any], list[str]]:
    """({"bleu", "bleu_signature", "sentences"}, hypotheses) of the model on `pairs`."""
    hyps = translate(
        model, params, tok, [s for s, _ in pairs], batch_size, tc.beam_width, tc.length_penalty
    )
    bleu, signature = corpus_bleu(hyps, [t for _, t in pairs])
    return {"bleu": bleu, "bleu_signature": signature, "sentences": len(pairs)}, hyps


def main(argv: list[str] | None = None) -> int:
    use_one_line_warnings()
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.translate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--run-dir", required=True, help="a train.py translation run dir")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--checkpoint", choices=["latest", "best"], default="best")
    p.add_argument("--beam-width", type=int, default=None, help="default: the run's config")
    p.add_argument("--length-penalty", type=float, default=None, help="GNMT alpha (beam search)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N pairs")
    p.add_argument("--batch-size", type=int, default=None, help="default: train.batch_size")
    args = p.parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:  # before the checkpoint loads
            p.error(f"{flag} must be >= 1, got {value}")
    from jaxllm.config import ConfigError
    from jaxllm.data.sources import (
        filter_translation_pairs,
        load_translation_split,
        translation_tokenizer,
    )
    from jaxllm.models import build_model
    from jaxllm.runs import load_run

    try:
        cfg, params, step = load_run(args.run_dir, args.checkpoint)
        if cfg.data.kind != "translation":
            raise ValueError(
                f"{args.run_dir} was trained on data.kind={cfg.data.kind}, not a translation run"
            )
        tc = cfg.data.translation
        overrides = {"beam_width": args.beam_width, "length_penalty": args.length_penalty}
        tc = dataclasses.replace(tc, **{k: v for k, v in overrides.items() if v is not None})
        tok = translation_tokenizer(cfg, [])
        pairs = load_translation_split(tc, args.split)
        pairs = filter_translation_pairs(pairs, args.split, cfg, tok)[: args.limit]
        model = build_model(cfg.model, cfg.execution)
        print(model.plan.describe(), file=sys.stderr)
        batch_size = cfg.train.batch_size if args.batch_size is None else args.batch_size
        metrics, hyps = score_translations(model, params, tok, pairs, tc, batch_size)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        p.error(str(e))
    run_dir = Path(args.run_dir)
    first = f"_first{args.limit}" if args.limit is not None else ""
    alpha = f"_lp{tc.length_penalty:g}" if tc.beam_width > 1 else ""  # alpha ranks beams only
    name = f"{args.split}{first}_step{step}_beam{tc.beam_width}{alpha}"
    record = {"split": args.split, "step": step, "checkpoint": args.checkpoint, **metrics}
    record |= {"beam_width": tc.beam_width, "length_penalty": tc.length_penalty}
    record |= {"batch_size": batch_size}  # a batch's longest prompt caps unfinished outputs
    try:
        write_text_atomic(run_dir / f"hyps_{name}.txt", hypotheses_text(hyps))
        write_text_atomic(run_dir / f"bleu_{name}.json", json.dumps(record, indent=2) + "\n")
    except OSError as e:  # e.g. a read-only run dir: one line, as for the inputs
        p.error(f"cannot write the results into {run_dir}: {e}")
    print(f"BLEU {metrics['bleu']:.2f} on {len(pairs)} {args.split} pairs (step {step}, "
          f"beam {tc.beam_width})\n{metrics['bleu_signature']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
