"""Translate a split with a trained translation run and score it with BLEU (jaxllm.bleu).

    python -m jaxllm.translate --run-dir runs/m30k --split test [--data.translation.beam_width=4]

Any config field can be overridden as in train.py: data.translation's beam_width and
length_penalty choose the search, train.batch_size the batch, execution.* how the model runs
(the model itself is the checkpoint's). The run's own tokenizer (`tokenizer.json` in the run
dir) encodes and decodes. Writes hyps_NAME.txt and bleu_NAME.json into the run dir.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxllm.atomic_file import write_text_atomic
from jaxllm.bleu import hypotheses_text, score_translations
from jaxllm.config import ConfigError
from jaxllm.console import use_one_line_warnings
from jaxllm.data.sources import (
    filter_translation_pairs,
    load_translation_split,
    translation_tokenizer,
)
from jaxllm.models import build_model
from jaxllm.runs import load_run


def main(argv: list[str] | None = None) -> int:
    use_one_line_warnings()
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.translate",
        description=__doc__.split("\n")[0],
        epilog="Config overrides: --data.translation.beam_width=5 --execution.kernels=pallas",
    )
    p.add_argument("--run-dir", required=True, help="a train.py translation run dir")
    p.add_argument("--split", choices=["valid", "test"], default="test")
    p.add_argument("--checkpoint", choices=["latest", "best"], default="best")
    p.add_argument("--limit", type=int, default=None, help="score only the first N pairs")
    args, overrides = p.parse_known_args(argv)
    if args.limit is not None and args.limit < 1:  # before the checkpoint loads
        p.error(f"--limit must be >= 1, got {args.limit}")
    try:
        cfg, variables, step = load_run(args.run_dir, args.checkpoint, overrides=overrides)
        if cfg.data.kind != "translation":
            raise ValueError(
                f"{args.run_dir} was trained on data.kind={cfg.data.kind}, not a translation run"
            )
        tc = cfg.data.translation
        tok = translation_tokenizer(cfg, [])
        pairs = load_translation_split(tc, args.split)
        pairs = filter_translation_pairs(pairs, args.split, cfg, tok)[: args.limit]
        model = build_model(cfg.model, cfg.execution)
        print(model.plan.describe(), file=sys.stderr)
        batch_size = cfg.train.batch_size
        metrics, hyps = score_translations(model, variables, tok, pairs, tc, batch_size)
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
