"""Tokenize text into a flat token file: `python -m jaxllm.data.prepare --help`.

    python -m jaxllm.data.prepare stories.txt --out data/ts/train.bin \\
        --val-fraction 0.05 --val-out data/ts/val.bin --workers 8
    python -m jaxllm.data.prepare --hf-dataset roneneldan/TinyStories --hf-split train \\
        --out data/ts/train.bin
"""

import argparse
import os
import sys
import time
from pathlib import Path

from jaxllm.data.tokenizer import BPE_DIR_ENV, EOT_TEXT
from jaxllm.data.tokens import DOC_SPLITS, prepare_hf_dataset, prepare_text_files


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxllm.data.prepare",
        description="Text -> GPT-2 token file (uint16) + JSON sidecar; each document ends with "
        "<|endoftext|>.",
    )
    p.add_argument("inputs", nargs="*", type=Path, help="UTF-8 text file(s), in order")
    p.add_argument("--hf-dataset", help="Hugging Face datasets id instead of files (needs hub)")
    p.add_argument("--hf-split", default="train", help="datasets split (default: train)")
    p.add_argument("--hf-text-field", default="text", help="column holding the text")
    p.add_argument("--out", type=Path, required=True, help="output token file, e.g. train.bin")
    p.add_argument(
        "--doc-split",
        choices=DOC_SPLITS,
        default="separator",
        help="how files are cut into documents: on --separator (default; TinyStories .txt), "
        "on blank lines, on a newline with no newline beside it (HF TinyStories rows dumped "
        "one per line, paragraphs separated by blank lines), or one document per file",
    )
    p.add_argument("--separator", default=EOT_TEXT, help=f"document separator (default {EOT_TEXT})")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="fraction of documents (evenly spaced, deterministic) written to --val-out",
    )
    p.add_argument(
        "--val-out", type=Path, help="validation token file (default: <out dir>/val.bin)"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    p.add_argument(
        "--bpe-dir", type=Path, help=f"GPT-2 BPE files (else ${BPE_DIR_ENV}, tiktoken cache)"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if bool(args.inputs) == bool(args.hf_dataset):
        _parser().error("give either input files or --hf-dataset (exactly one)")
    val_out = args.val_out
    if args.val_fraction > 0 and val_out is None:
        val_out = args.out.parent / "val.bin"
    kwargs = {
        "val_out_path": val_out,
        "val_fraction": args.val_fraction,
        "bpe_dir": args.bpe_dir,
        "workers": args.workers,
    }
    start = time.perf_counter()
    try:
        if args.hf_dataset:
            metas = prepare_hf_dataset(
                args.hf_dataset,
                args.out,
                split=args.hf_split,
                text_field=args.hf_text_field,
                **kwargs,
            )
        else:
            metas = prepare_text_files(
                args.inputs, args.out, doc_split=args.doc_split, separator=args.separator, **kwargs
            )
    except (ValueError, OSError, ImportError) as e:
        sys.exit(f"error: {e}")
    seconds = time.perf_counter() - start
    outs = [args.out] + ([val_out] if val_out is not None else [])
    for out, meta in zip(outs, metas, strict=True):
        counts = f"{meta['num_tokens']:,} tokens, {meta['num_documents']:,} documents"
        print(f"{out}: {counts}, {meta['dtype']}")
    print(f"done in {seconds:.2f} s")


if __name__ == "__main__":
    main()
