"""Text files (or a `datasets` split) -> a stream of documents.

Text is read as UTF-8 with universal newlines. Invalid UTF-8 bytes are each replaced by U+FFFD
with a warning giving their count: a few bad bytes in a big corpus should not stop the run.
"""

import hashlib
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

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
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte
READ_CHARS = 1 << 22  # characters per read: documents may straddle reads
LONG_DOCUMENT = 1 << 26  # characters: a "document" this long means the split rule is wrong
NO_SEPARATOR = 1 << 16  # bytes: a file this large with no separator is said to be one document


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def iter_file_documents(
    paths: list[Path],
    doc_split: str,
    separator: str,
    sources: list[dict],
    read_chars: int = READ_CHARS,
) -> Iterator[str]:
    """Stripped, non-empty documents of the files in order; appends one stats dict per file
    to `sources`. Files are read `read_chars` characters at a time."""
    for path in paths:
        info = {"path": str(path.resolve()), "sha256": sha256_file(path)}
        info |= {"bytes": path.stat().st_size, "documents": 0, "invalid_utf8_bytes": 0}
        with path.open(encoding="utf-8", errors="surrogateescape") as f:
            pending, warned, found = "", False, False
            for block in iter(lambda f=f: f.read(read_chars), ""):
                try:
                    block.encode()  # fast check: only the lone surrogates of bad bytes fail
                except UnicodeEncodeError:
                    block, bad = _ESCAPED_BYTE.subn("\ufffd", block)
                    info["invalid_utf8_bytes"] += bad
                seen = len(pending)
                pending += block
                if doc_split == "separator":
                    # only the new text can hold a new separator (one may straddle the reads):
                    # a file without any is scanned once, not once per read
                    if separator in pending[max(0, seen - len(separator) + 1) :]:
                        *docs, pending = pending.split(separator)
                        found = True
                    else:
                        docs = []
                    if len(pending) > LONG_DOCUMENT and not warned:
                        warned = True
                        warnings.warn(
                            f"{path}: no {separator!r} in {len(pending):,} characters: they all "
                            "become one document (is --doc-split right for this file?)",
                            stacklevel=2,
                        )
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
        if doc_split == "separator" and not found and not warned and info["bytes"] > NO_SEPARATOR:
            warnings.warn(
                f"{path}: no {separator!r} in its {info['bytes']:,} bytes: the whole file is one "
                "document (--doc-split single-newline or blank-line cut it at newlines; "
                "--doc-split file keeps it whole without this warning)",
                stacklevel=2,
            )
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


def iter_hf_documents(dataset_id: str, split: str, text_field: str) -> Iterator[str]:
    """Stripped, non-empty `text_field` values of a Hugging Face `datasets` split (needs hub)."""
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
