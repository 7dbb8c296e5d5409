"""Text -> flat token file on disk (+ JSON sidecar), and batch sampling from it through np.memmap.

Token file: the token ids of every document, each document followed by <|endoftext|>, as raw
uint16 (uint32 if the vocabulary needs it). Sidecar `<file>.json`: tokenizer, dtype, counts and
source hashes, checked by `load_tokens` so a stale or mismatched file is an error, not garbage.

Text is read as UTF-8 with universal newlines. Invalid UTF-8 bytes are each replaced by U+FFFD
with a warning giving their count: a few bad bytes in a big corpus should not stop the run.
"""

import hashlib
import json
import multiprocessing
import os
import re
import uuid
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import closing
from itertools import chain, islice
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

from jaxllm.data.tokenizer import (
    BPE_SHA256,
    EOT_ID,
    EOT_TEXT,
    N_VOCAB,
    TOKENIZER_NAME,
    BPEFiles,
    find_gpt2_bpe_files,
    gpt2_encoding,
)

FORMAT = "jaxllm-tokens"
FORMAT_VERSION = 1
# How a text file is cut into documents:
#   separator      - on a literal separator (default "<|endoftext|>", TinyStories V1/V2 files)
#   blank-line     - on one or more blank lines
#   single-newline - on a newline with no newline beside it (paragraphs inside a document are
#                    separated by blank lines: HF TinyStories rows written one per line)
#   file           - each file is one document (running text with no document boundaries)
DOC_SPLITS = ("separator", "blank-line", "single-newline", "file")
_WHITESPACE_SPLITS = {
    "blank-line": re.compile(r"\n\s*\n"),
    "single-newline": re.compile(r"(?<!\n)\n(?!\n)"),
}
_READ_CHARS = 1 << 22
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte


class StaleTokensError(ValueError):
    """A token file and its sidecar disagree, or don't match what the caller expects."""


def token_dtype(n_vocab: int) -> np.dtype:
    """Smallest unsigned dtype holding ids 0..n_vocab-1 (uint16 or uint32)."""
    return np.dtype(np.uint16 if n_vocab <= 1 << 16 else np.uint32)


def sidecar_path(path: str | Path) -> Path:
    """Path of the JSON sidecar of a token file: `<path>.json`."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            sha.update(block)
    return sha.hexdigest()


def _iter_file_documents(
    paths: list[Path], doc_split: str, separator: str, sources: list[dict]
) -> Iterator[str]:
    """Stripped, non-empty documents of the files in order; appends one stats dict per file."""
    for path in paths:
        info = {"path": str(path.resolve()), "sha256": _sha256_file(path)}
        info |= {"bytes": path.stat().st_size, "documents": 0, "invalid_utf8_bytes": 0}
        with path.open(encoding="utf-8", errors="surrogateescape") as f:
            pending = ""
            for block in iter(lambda f=f: f.read(_READ_CHARS), ""):
                try:
                    block.encode()  # fast check: only the lone surrogates of bad bytes fail
                except UnicodeEncodeError:
                    block, bad = _ESCAPED_BYTE.subn("\ufffd", block)
                    info["invalid_utf8_bytes"] += bad
                pending += block
                if doc_split == "separator":
                    *docs, pending = pending.split(separator)
                elif doc_split in _WHITESPACE_SPLITS:
                    # Separators are all whitespace: cutting after the last non-space character
                    # keeps a separator that straddles two reads in one piece.
                    cut = len(pending.rstrip())
                    *docs, last = _WHITESPACE_SPLITS[doc_split].split(pending[:cut])
                    pending = last + pending[cut:]
                else:
                    docs = []
                yield from _clean_documents(docs, info)
            yield from _clean_documents([pending], info)
        if info["documents"] == 0:
            raise ValueError(f"{path}: no documents (the file is empty or only whitespace)")
        if info["invalid_utf8_bytes"]:
            warnings.warn(
                f"{path}: {info['invalid_utf8_bytes']} invalid UTF-8 bytes replaced by U+FFFD",
                stacklevel=2,
            )
        sources.append(info)


def _clean_documents(docs: list[str], info: dict) -> Iterator[str]:
    for doc in map(str.strip, docs):
        if doc:
            info["documents"] += 1
            yield doc


def _iter_hf_documents(dataset_id: str, split: str, text_field: str) -> Iterator[str]:
    try:
        import datasets  # optional dependency, only for hub users
    except ImportError as e:
        raise ImportError(
            "--hf-dataset needs the `datasets` package: pip install 'jaxllm[datasets]'"
        ) from e
    for row in datasets.load_dataset(dataset_id, split=split):
        if text_field not in row:
            raise ValueError(
                f"{dataset_id} [{split}] rows have no field {text_field!r}; fields: {sorted(row)}"
            )
        if doc := row[text_field].strip():
            yield doc


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


_worker_encoding: tiktoken.Encoding | None = None  # one per pool worker process


def _init_worker(files: BPEFiles) -> None:
    global _worker_encoding
    _worker_encoding = gpt2_encoding(files)


def _encode_in_worker(docs: list[str]) -> np.ndarray:
    return _encode_docs(_worker_encoding, docs)


def _encode_chunks(
    chunks: Iterator[tuple[int, list[str]]], files: BPEFiles, workers: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(split, number of documents, token ids) per chunk, in input order."""
    head = list(islice(chunks, 2))
    chunks = chain(head, chunks)
    if workers == 1 or len(head) < 2:  # one chunk: starting processes would only cost time
        encoding = gpt2_encoding(files)
        for split, docs in chunks:
            yield split, len(docs), _encode_docs(encoding, docs)
        return
    # spawn, not fork: forking a process that runs JAX's threads can deadlock.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(files,)) as pool:
        pending: deque = deque()
        for split, docs in chunks:  # at most 2 * workers chunks in flight bounds memory
            pending.append((split, len(docs), pool.apply_async(_encode_in_worker, (docs,))))
            if len(pending) >= 2 * workers:
                split, n_docs, result = pending.popleft()
                yield split, n_docs, result.get()
        for split, n_docs, result in pending:
            yield split, n_docs, result.get()


class _AtomicTokenFile:
    """Token file written under a temp name in the target directory, renamed on commit."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()
        self.num_tokens = self.num_documents = 0

    def write(self, ids: np.ndarray, num_documents: int) -> None:
        data = ids.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.num_tokens += ids.size
        self.num_documents += num_documents

    def commit(self, meta: dict) -> dict:
        self.file.close()
        meta = meta | {"num_tokens": self.num_tokens, "num_documents": self.num_documents}
        meta["tokens_sha256"] = self.sha.hexdigest()
        sidecar, sidecar_tmp = sidecar_path(self.path), sidecar_path(self.tmp)
        sidecar_tmp.write_text(json.dumps(meta, indent=2) + "\n")
        # Old sidecar goes first: a crash in between leaves a token file without a sidecar,
        # which load_tokens refuses, never a new file described by an old sidecar.
        sidecar.unlink(missing_ok=True)
        os.replace(self.tmp, self.path)
        os.replace(sidecar_tmp, sidecar)
        return meta

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
        sidecar_path(self.tmp).unlink(missing_ok=True)


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
) -> list[dict]:
    """Tokenize documents into `out_path` (and `val_out_path`) atomically; returns the sidecars.

    source_meta is recorded in the sidecars; it is read after `documents` is exhausted, so a
    generator may fill it as it goes.
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
    files = find_gpt2_bpe_files(bpe_dir)  # fail on missing/corrupt BPE before reading any text
    outputs: list[_AtomicTokenFile] = []
    try:
        outputs += [_AtomicTokenFile(p) for p in paths]
        chunks = _chunks(documents, val_fraction, chunk_chars)
        with (
            closing(_encode_chunks(chunks, files, workers)) as encoded,
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
            raise ValueError(
                f"val_fraction={val_fraction} gives no validation documents out of {total_docs}; "
                "use a larger fraction"
            )
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": TOKENIZER_NAME,
            "bpe_sha256": BPE_SHA256,
            "n_vocab": N_VOCAB,
            "eot_id": EOT_ID,
            "dtype": token_dtype(N_VOCAB).name,
            "val_fraction": val_fraction,
        } | source_meta
        names = ["train", "val"] if len(outputs) == 2 else ["all"]
        return [o.commit(meta | {"split": n}) for o, n in zip(outputs, names, strict=True)]
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
    **kwargs,
) -> list[dict]:
    """Tokenize text files into a token file; kwargs as `write_token_files` (val split, workers)."""
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
    sources: list[dict] = []
    meta = {"doc_split": doc_split, "separator": separator, "sources": sources}
    documents = _iter_file_documents(paths, doc_split, separator, sources)
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
    documents = _iter_hf_documents(dataset_id, split, text_field)
    return write_token_files(documents, out_path, source_meta=meta, **kwargs)


def load_tokens(
    path: str | Path, expect_tokenizer: str = TOKENIZER_NAME, verify_hash: bool = False
) -> np.memmap:
    """Read-only memmap (num_tokens,) of a token file after checking its sidecar.

    Raises StaleTokensError if the sidecar is missing, the size on disk is not num_tokens *
    itemsize, or the tokenizer/dtype differ from what is expected; verify_hash also re-hashes
    the whole file (slow for big files).
    """
    path = Path(path)
    if expect_tokenizer != TOKENIZER_NAME:
        raise ValueError(f"unknown tokenizer {expect_tokenizer!r}; supported: {TOKENIZER_NAME!r}")
    if not path.is_file():
        raise FileNotFoundError(
            f"token file not found: {path} (make it: python -m jaxllm.data.prepare)"
        )
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise StaleTokensError(f"{path} has no sidecar {sidecar}; re-run jaxllm.data.prepare")
    meta = json.loads(sidecar.read_text())
    expected = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": expect_tokenizer,
        "bpe_sha256": BPE_SHA256,
        "dtype": token_dtype(N_VOCAB).name,
    }
    problems = [
        f"{k}={meta.get(k)!r}, expected {v!r}" for k, v in expected.items() if meta.get(k) != v
    ]
    num_tokens = meta.get("num_tokens")
    if not problems:
        size, itemsize = path.stat().st_size, np.dtype(meta["dtype"]).itemsize
        if not isinstance(num_tokens, int) or num_tokens < 1 or size != num_tokens * itemsize:
            problems.append(
                f"file is {size} bytes, sidecar says {num_tokens} tokens x {itemsize} B"
            )
        elif verify_hash and _sha256_file(path) != meta.get("tokens_sha256"):
            problems.append("sha256 of the file differs from the sidecar's tokens_sha256")
    if problems:
        raise StaleTokensError(
            f"{path} is stale or mismatched ({'; '.join(problems)}); re-run jaxllm.data.prepare"
        )
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(num_tokens,))


def _check_batch_args(tokens: np.ndarray, batch_size: int, context_length: int) -> None:
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if batch_size < 1 or context_length < 1:
        raise ValueError(
            f"batch_size and context_length must be >= 1, got {batch_size}, {context_length}"
        )
    if tokens.shape[0] < context_length + 1:
        raise ValueError(
            f"need at least context_length + 1 = {context_length + 1} tokens, got {tokens.shape[0]}"
        )


def _windows(
    tokens: np.ndarray, starts: np.ndarray, context_length: int
) -> tuple[np.ndarray, np.ndarray]:
    # Row slices read only these windows from a memmap, never the whole file.
    rows = np.stack([tokens[s : s + context_length + 1] for s in starts]).astype(np.int32)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])  # (B, T) each


def get_batch(
    tokens: np.ndarray, batch_size: int, context_length: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs (B, T) int32 and targets (B, T) int32 = inputs shifted by one.

    Window starts are uniform over every valid offset; rng's bit_generator.state can be saved in
    a checkpoint to resume the same sample stream.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    _check_batch_args(tokens, batch_size, context_length)
    starts = rng.integers(0, tokens.shape[0] - context_length, size=batch_size)
    return _windows(tokens, starts, context_length)


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, context_length: int, num_batches: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """num_batches fixed (inputs, targets) batches, (B, T) int32, at evenly spaced offsets."""
    _check_batch_args(tokens, batch_size, context_length)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    last_start = tokens.shape[0] - context_length - 1
    starts = np.linspace(0, last_start, batch_size * num_batches).round().astype(np.int64)
    return (
        _windows(tokens, starts[i : i + batch_size], context_length)
        for i in range(0, starts.size, batch_size)
    )
