"""Text -> token file: the prepare API (documents -> a process pool of tiktoken encoders ->
an atomic token file + sidecar) and its CLI, `python -m jaxllm.data.prepare --help`.

    python -m jaxllm.data.prepare stories.txt --out data/ts/train.bin \\
        --val-fraction 0.05 --val-out data/ts/val.bin --workers 8
    python -m jaxllm.data.prepare --hf-dataset roneneldan/TinyStories --hf-split train \\
        --out data/ts/train.bin
"""

import argparse
import functools
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import closing
from itertools import chain, islice
from multiprocessing.context import BaseContext
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

from jaxllm.console import use_one_line_warnings
from jaxllm.data.documents import (
    DOC_SPLITS,
    READ_CHARS,
    iter_file_documents,
    iter_hf_documents,
)
from jaxllm.data.token_file import IDENTITY, AtomicTokenFile, token_dtype
from jaxllm.data.tokenizer import (
    BPE_DIR_ENV,
    EOT_ID,
    EOT_TEXT,
    N_VOCAB,
    BPEFiles,
    find_gpt2_bpe_files,
    gpt2_encoding,
)


def _chunks(
    documents: Iterable[str], val_fraction: float, chunk_chars: int
) -> Iterator[tuple[int, list[str]]]:
    """(split, documents) groups of about chunk_chars characters; split 1 = validation.

    Validation takes documents at evenly spaced indices (floor((i + 1) f) > floor(i f)): the
    split depends only on document order, never on worker count or randomness.
    """
    buffers: list[list[str]] = [[], []]
    sizes = [0, 0]
    for i, doc in enumerate(documents):
        split = int(int((i + 1) * val_fraction) > int(i * val_fraction))
        buffers[split].append(doc)
        sizes[split] += len(doc)
        if sizes[split] >= chunk_chars:
            yield split, buffers[split]
            buffers[split], sizes[split] = [], 0
    for split in (0, 1):
        if buffers[split]:
            yield split, buffers[split]


def _encode_docs(encoding: tiktoken.Encoding, docs: list[str]) -> np.ndarray:
    ids: list[int] = []
    for doc in docs:
        ids += encoding.encode_ordinary(doc)  # special-token text in data stays plain text
        ids.append(EOT_ID)
    return np.asarray(ids, dtype=token_dtype(encoding.n_vocab))


@functools.lru_cache(maxsize=1)  # built once per worker process, on its first chunk
def _worker_encoding(files: BPEFiles) -> tiktoken.Encoding:
    return gpt2_encoding(files)


def _encode_in_worker(files: BPEFiles, docs: list[str]) -> np.ndarray:
    return _encode_docs(_worker_encoding(files), docs)


def _encode_chunks(
    chunks: Iterator[tuple[int, list[str]]],
    files: BPEFiles,
    workers: int,
    mp_context: BaseContext | None,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(split, number of documents, token ids) per chunk, in input order."""
    head = list(islice(chunks, workers))  # no more processes than there are chunks to encode
    chunks, workers = chain(head, chunks), min(workers, len(head))
    if workers <= 1:  # one chunk: starting processes would only cost time
        encoding = gpt2_encoding(files)
        for split, docs in chunks:
            yield split, len(docs), _encode_docs(encoding, docs)
        return
    # spawn, not fork: forking a process that runs JAX's threads can deadlock.
    context = mp_context or multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        pending: deque = deque()
        for split, docs in chunks:  # at most 2 * workers chunks in flight bounds memory
            pending.append((split, len(docs), pool.apply_async(_encode_in_worker, (files, docs))))
            if len(pending) >= 2 * workers:
                split, n_docs, result = pending.popleft()
                yield split, n_docs, result.get()
        for split, n_docs, result in pending:
            yield split, n_docs, result.get()


def write_token_files(
    documents: Iterable[str],
    out_path: str | Path,
    *,
    source_meta: dict,
    val_out_path: str | Path | None = None,
    val_fraction: float = 0.0,
    bpe_dir: str | Path | None = None,
    workers: int = 1,
    chunk_chars: int = 1 << 20,
    mp_context: BaseContext | None = None,
) -> list[dict]:
    """Tokenize documents into `out_path` (and `val_out_path`) atomically; returns the sidecars.

    source_meta is recorded in the sidecars; it is read after `documents` is exhausted, so a
    generator may fill it as it goes. With workers > 1, chunks of ~chunk_chars characters are
    encoded by a process pool from `mp_context` (default: spawn).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if (val_fraction > 0) != (val_out_path is not None):
        raise ValueError("val_out_path and val_fraction > 0 must be given together")
    if workers < 1 or chunk_chars < 1:
        raise ValueError(f"workers and chunk_chars must be >= 1, got {workers}, {chunk_chars}")
    paths = [Path(out_path)] + ([Path(val_out_path)] if val_out_path is not None else [])
    if len(set(p.resolve() for p in paths)) != len(paths):
        raise ValueError(f"train and validation outputs are the same file: {out_path}")
    for p in paths:  # before any tokenizing: the renames at the end must succeed
        if p.is_dir():
            raise ValueError(f"output {p} is a directory; give a file path such as {p}/train.bin")
    files = find_gpt2_bpe_files(bpe_dir)  # fail on missing/corrupt BPE before reading any text
    outputs: list[AtomicTokenFile] = []
    try:
        for p in paths:  # one at a time: a second that fails to open leaves no first temp file
            outputs.append(AtomicTokenFile(p))
        chunks = _chunks(documents, val_fraction, chunk_chars)
        with (
            closing(_encode_chunks(chunks, files, workers, mp_context)) as encoded,
            tqdm(unit="doc", desc=f"tokenizing -> {paths[0].name}") as bar,
        ):
            for split, num_docs, ids in encoded:
                outputs[split].write(ids, num_docs)
                bar.update(num_docs)
                bar.set_postfix(tokens=sum(o.num_tokens for o in outputs), refresh=False)
        total_docs = sum(o.num_documents for o in outputs)
        if total_docs == 0:
            raise ValueError("no documents to tokenize")
        if len(outputs) == 2 and outputs[1].num_documents == 0:
            split = source_meta.get("doc_split")
            hint = f", or check how the input is cut into documents (--doc-split is {split})"
            raise ValueError(
                f"val_fraction={val_fraction} gives no validation documents out of {total_docs}; "
                f"use a larger fraction{hint if split else ''}"
            )
        meta = IDENTITY | {"n_vocab": N_VOCAB, "eot_id": EOT_ID, "val_fraction": val_fraction}
        meta |= source_meta
        names = ["train", "val"] if len(outputs) == 2 else ["all"]
        # both files complete on disk before either is renamed into place: a pair stays a pair
        metas = [o.finish(meta | {"split": n}) for o, n in zip(outputs, names, strict=True)]
        for output in outputs:
            output.publish()
        return metas
    except BaseException:
        for output in outputs:
            output.discard()
        raise


def prepare_text_files(
    paths: Iterable[str | Path],
    out_path: str | Path,
    *,
    doc_split: str = "separator",
    separator: str = EOT_TEXT,
    read_chars: int = READ_CHARS,
    **kwargs,
) -> list[dict]:
    """Tokenize text files into a token file; kwargs as `write_token_files` (val split, workers).
    Files are read `read_chars` characters at a time."""
    paths = [Path(p) for p in paths]
    if doc_split not in DOC_SPLITS:
        raise ValueError(f"doc_split must be one of {DOC_SPLITS}, got {doc_split!r}")
    if not separator:
        raise ValueError("separator must be a non-empty string")
    if not paths:
        raise ValueError("no input files given")
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input text file not found: {path}")
        if path.stat().st_size == 0:
            raise ValueError(f"input text file is empty: {path}")
    outputs = [Path(out_path)] + ([Path(v)] if (v := kwargs.get("val_out_path")) else [])
    clash = {p.resolve() for p in paths} & {o.resolve() for o in outputs}
    if clash:  # the rename at the end would replace the user's text with tokens
        raise ValueError(f"an output is also an input: {sorted(map(str, clash))}")
    sources: list[dict] = []
    meta = {"doc_split": doc_split, "separator": separator, "sources": sources}
    documents = iter_file_documents(paths, doc_split, separator, sources, read_chars)
    return write_token_files(documents, out_path, source_meta=meta, **kwargs)


def prepare_hf_dataset(
    dataset_id: str,
    out_path: str | Path,
    *,
    split: str = "train",
    text_field: str = "text",
    **kwargs,
) -> list[dict]:
    """Tokenize a Hugging Face `datasets` split (one document per row); needs hub access."""
    meta = {"sources": [{"hf_dataset": dataset_id, "split": split, "text_field": text_field}]}
    documents = iter_hf_documents(dataset_id, split, text_field)
    return write_token_files(documents, out_path, source_meta=meta, **kwargs)


# ----------------------------------------------------------------------------- CLI


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
    use_one_line_warnings()
    args = _parser().parse_args(argv)
    if bool(args.inputs) == bool(args.hf_dataset):
        _parser().error("give either input files or --hf-dataset (exactly one)")
    # options that cannot apply are errors, not ignored
    if args.separator != EOT_TEXT and (args.hf_dataset or args.doc_split != "separator"):
        _parser().error("--separator applies only to input files with --doc-split separator")
    if args.hf_dataset and args.doc_split != "separator":
        _parser().error("--doc-split applies to input files, not --hf-dataset (a row a document)")
    if not args.hf_dataset and (args.hf_split != "train" or args.hf_text_field != "text"):
        _parser().error("--hf-split and --hf-text-field apply only with --hf-dataset")
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
        _parser().exit(2, f"error: {e}\n")
    seconds = time.perf_counter() - start
    outs = [args.out] + ([val_out] if val_out is not None else [])
    for out, meta in zip(outs, metas, strict=True):
        counts = f"{meta['num_tokens']:,} tokens, {meta['num_documents']:,} documents"
        print(f"{out}: {counts}, {meta['dtype']}, max id {meta['max_id']}")
    print(f"done in {seconds:.2f} s")


if __name__ == "__main__":
    main()
