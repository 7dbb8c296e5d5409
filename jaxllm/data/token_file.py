"""The token file format: flat token ids on disk plus a JSON sidecar, written atomically.

Token file: the token ids of every document, each document followed by <|endoftext|>, as raw
uint16 (uint32 if the vocabulary needs it). Sidecar `<file>.json`: tokenizer, dtype, counts,
the largest id (`max_id`) and source hashes, checked by `load_tokens` so a stale or mismatched
file, or one with ids the model has no embedding for, is an error, not garbage.
"""

import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np

from jaxllm.atomic_file import write_synced
from jaxllm.data.documents import sha256_file
from jaxllm.data.tokenizer import BPE_SHA256, N_VOCAB, TOKENIZER_NAME

FORMAT = "jaxllm-tokens"
FORMAT_VERSION = 1


class StaleTokensError(ValueError):
    """A token file and its sidecar disagree, or don't match what the caller expects."""


def token_dtype(n_vocab: int) -> np.dtype:
    """Smallest unsigned dtype holding ids 0..n_vocab-1 (uint16 or uint32)."""
    return np.dtype(np.uint16 if n_vocab <= 1 << 16 else np.uint32)


# What every sidecar records and load_tokens checks: this format, the GPT-2 BPE, its dtype
IDENTITY = {
    "format": FORMAT,
    "version": FORMAT_VERSION,
    "tokenizer": TOKENIZER_NAME,
    "bpe_sha256": BPE_SHA256,
    "dtype": token_dtype(N_VOCAB).name,
}


def sidecar_path(path: str | Path) -> Path:
    """Path of the JSON sidecar of a token file: `<path>.json`."""
    path = Path(path)
    return path.with_name(path.name + ".json")


class AtomicTokenFile:
    """Token file written under a temp name in the target directory, renamed by `publish`
    (after `finish`)."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        self.file = self.tmp.open("wb")
        self.sha = hashlib.sha256()
        self.num_tokens = self.num_documents = 0
        self.max_id = -1  # -1: no token yet

    def write(self, ids: np.ndarray, num_documents: int) -> None:
        data = ids.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.num_tokens += ids.size
        self.num_documents += num_documents
        if ids.size:  # one pass over a chunk already in memory: cheap next to tokenizing it
            self.max_id = max(self.max_id, int(ids.max()))

    def finish(self, meta: dict) -> dict:
        """Complete the temp file and its temp sidecar on disk (nothing renamed yet)."""
        self.file.flush()
        os.fsync(self.file.fileno())  # on disk before the rename: a power cut keeps old or new
        self.file.close()
        meta = meta | {"num_tokens": self.num_tokens, "num_documents": self.num_documents}
        meta |= {"max_id": self.max_id, "tokens_sha256": self.sha.hexdigest()}
        write_synced(sidecar_path(self.tmp), (json.dumps(meta, indent=2) + "\n").encode())
        return meta

    def publish(self) -> None:
        """Rename the finished temp file and sidecar into place."""
        # Old sidecar goes first: a crash in between leaves a token file without a sidecar,
        # which load_tokens refuses, never a new file described by an old sidecar.
        sidecar_path(self.path).unlink(missing_ok=True)
        os.replace(self.tmp, self.path)
        os.replace(sidecar_path(self.tmp), sidecar_path(self.path))

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
        sidecar_path(self.tmp).unlink(missing_ok=True)


def file_max_id(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    """Largest id of a (memmapped) token array, read chunk by chunk: one sequential read of
    the file (measured 0.02-0.06 s per GB from the page cache; disk speed when cold)."""
    return max(int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk))


def recorded_sha256(path: str | Path) -> str | None:
    """The tokens_sha256 a token file's sidecar recorded (what `prepare` hashed), or None."""
    try:
        meta = json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("tokens_sha256") if isinstance(meta, dict) else None


def load_tokens(
    path: str | Path,
    verify_hash: bool = False,
    vocab_size: int | None = None,
) -> np.memmap:
    """Read-only memmap (num_tokens,) of a token file after checking its sidecar.

    Raises StaleTokensError if the sidecar is missing, the size on disk is not num_tokens *
    itemsize, the tokenizer/dtype differ from what is expected, or (vocab_size given) the
    sidecar's max_id is >= vocab_size: the model would have no embedding for those ids.
    verify_hash also re-hashes the whole file and checks max_id against the data (two reads,
    slow for big files); without it the sidecar's max_id is trusted. A sidecar from before
    max_id was recorded gets the max from the data (file_max_id, one read) when vocab_size is
    given; re-running jaxllm.data.prepare records it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"token file not found: {path} (make it: python -m jaxllm.data.prepare)"
        )
    sidecar = sidecar_path(path)
    if not sidecar.is_file():
        raise StaleTokensError(f"{path} has no sidecar {sidecar}; re-run jaxllm.data.prepare")
    try:
        meta = json.loads(sidecar.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StaleTokensError(
            f"{sidecar} is not valid JSON ({e}); re-run jaxllm.data.prepare"
        ) from None
    if not isinstance(meta, dict):
        raise StaleTokensError(
            f"{sidecar} holds a {type(meta).__name__}, not a sidecar object; re-run "
            "jaxllm.data.prepare"
        )
    problems = [
        f"{k}={meta.get(k)!r}, expected {v!r}" for k, v in IDENTITY.items() if meta.get(k) != v
    ]
    num_tokens, max_id = meta.get("num_tokens"), meta.get("max_id")
    if max_id is not None and (type(max_id) is not int or max_id < 0):
        problems.append(f"max_id={max_id!r}, expected an id >= 0")
    if not problems:
        size, itemsize = path.stat().st_size, np.dtype(meta["dtype"]).itemsize
        if not isinstance(num_tokens, int) or num_tokens < 1 or size != num_tokens * itemsize:
            problems.append(
                f"file is {size} bytes, sidecar says {num_tokens} tokens x {itemsize} B"
            )
        elif verify_hash or (max_id is None and vocab_size is not None):
            tokens = np.memmap(path, dtype=meta["dtype"], mode="r", shape=(num_tokens,))
            actual = file_max_id(tokens)
            if max_id is not None and max_id != actual:
                problems.append(
                    f"sidecar's max_id is {max_id} but the file's largest id is {actual}"
                )
            max_id = actual
            if verify_hash and sha256_file(path) != meta.get("tokens_sha256"):
                problems.append("sha256 of the file differs from the sidecar's tokens_sha256")
    if problems:
        raise StaleTokensError(
            f"{path} is stale or mismatched ({'; '.join(problems)}); re-run jaxllm.data.prepare"
        )
    if vocab_size is not None and max_id >= vocab_size:
        raise StaleTokensError(
            f"{path} holds token ids up to max id {max_id}, but the model's vocab_size is "
            f"{vocab_size} (ids must be < {vocab_size}): the file was made for a larger "
            "vocabulary, or model.vocab_size is too small"
        )
    return np.memmap(path, dtype=meta["dtype"], mode="r", shape=(num_tokens,))
