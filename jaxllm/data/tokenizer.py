"""GPT-2 BPE tokenizer (tiktoken) built offline from local, hash-checked BPE files.

The files are looked up, in order, in: the directory passed in (config/flag), the directory in
$JAXLLM_BPE_DIR, then tiktoken's own download cache (where `tiktoken.get_encoding("gpt2")` leaves
them on a machine with internet). A directory may hold `gpt2.tiktoken` (same bytes as OpenAI's
`r50k_base.tiktoken`) or the original pair `vocab.bpe` + `encoder.json`.
"""

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

TOKENIZER_NAME = "gpt2"
EOT_TEXT = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257
BPE_DIR_ENV = "JAXLLM_BPE_DIR"

# sha256 of the files tiktoken downloads for the "gpt2" / "r50k_base" encodings
# (tiktoken_ext/openai_public.py). Both forms give the same merge ranks.
TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# Identifies the merge ranks whichever form they were read from (recorded in token sidecars).
BPE_SHA256 = TIKTOKEN_SHA256

_TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"


class BPEFilesNotFoundError(FileNotFoundError):
    """No location holds the GPT-2 BPE files."""


class BPEFilesFallbackWarning(UserWarning):
    """The BPE directory given held no complete set; another location's files are used."""


class BPEHashMismatchError(ValueError):
    """A GPT-2 BPE file exists but its sha256 is not the expected one (corrupt or wrong file)."""


@dataclass(frozen=True)
class BPEFiles:
    """Located BPE files: `tiktoken` (one file) or `vocab` + `encoder` (the data-gym pair)."""

    source: str  # "explicit", "env" or "tiktoken-cache"
    tiktoken: Path | None = None
    vocab: Path | None = None
    encoder: Path | None = None


def tiktoken_cache_dir() -> Path | None:
    """tiktoken's download cache directory (same rule as tiktoken/load.py); None if disabled."""
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR"))
    if cache_dir is None:
        return Path(tempfile.gettempdir()) / "data-gym-cache"
    return Path(cache_dir) if cache_dir else None


def _cache_name(url: str) -> str:
    return hashlib.sha1(url.encode()).hexdigest()  # tiktoken's cache key for a download


def _files_in(directory: Path, source: str) -> BPEFiles | None:
    if source == "tiktoken-cache":
        tiktoken_names = (_cache_name(_TIKTOKEN_URL),)
        vocab = directory / _cache_name(_VOCAB_BPE_URL)
        encoder = directory / _cache_name(_ENCODER_JSON_URL)
    else:
        tiktoken_names = ("gpt2.tiktoken", "r50k_base.tiktoken")
        vocab, encoder = directory / "vocab.bpe", directory / "encoder.json"
    for name in tiktoken_names:
        if (directory / name).is_file():
            return BPEFiles(source, tiktoken=directory / name)
    if vocab.is_file() and encoder.is_file():
        return BPEFiles(source, vocab=vocab, encoder=encoder)
    return None


def find_gpt2_bpe_files(bpe_dir: str | Path | None = None) -> BPEFiles:
    """Locate the GPT-2 BPE files: `bpe_dir`, then $JAXLLM_BPE_DIR, then tiktoken's cache.

    The first location holding a complete set wins; where that is not the directory given, a
    BPEFilesFallbackWarning says so. Raises BPEFilesNotFoundError listing every location tried
    when none does.
    """
    candidates = []
    if bpe_dir is not None:
        candidates.append(("explicit", Path(bpe_dir)))
    if os.environ.get(BPE_DIR_ENV):
        candidates.append(("env", Path(os.environ[BPE_DIR_ENV])))
    cache = tiktoken_cache_dir()
    if cache is not None:
        candidates.append(("tiktoken-cache", cache))
    for source, directory in candidates:
        found = _files_in(directory, source)
        if found is not None:
            if bpe_dir is not None and source != "explicit":
                warnings.warn(
                    f"no GPT-2 BPE files in {bpe_dir} (the directory given): using {directory} "
                    f"({'$' + BPE_DIR_ENV if source == 'env' else source})",
                    BPEFilesFallbackWarning,
                    stacklevel=2,
                )
            return found
    tried = "\n".join(f"  {source}: {directory}" for source, directory in candidates)
    raise BPEFilesNotFoundError(
        "GPT-2 BPE files not found. Looked for gpt2.tiktoken (or r50k_base.tiktoken), or "
        f"vocab.bpe + encoder.json, in:\n{tried or '  (nowhere: no directory given)'}\n"
        f"Pass the directory explicitly, set ${BPE_DIR_ENV}, or run "
        "`tiktoken.get_encoding('gpt2')` once on a machine with internet to fill tiktoken's cache."
    )


def _read_verified(path: Path, expected_sha256: str) -> bytes:
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise BPEHashMismatchError(
            f"BPE file {path} has sha256 {actual}, expected {expected_sha256}: the file is "
            "corrupt or not the GPT-2 one. Replace it (or delete it to fall back to the next "
            "location)."
        )
    return data


def _mergeable_ranks(files: BPEFiles) -> dict[bytes, int]:
    # Check the hashes first for an error that names our file; tiktoken's loaders check again.
    if files.tiktoken is not None:
        _read_verified(files.tiktoken, TIKTOKEN_SHA256)
        return load_tiktoken_bpe(str(files.tiktoken), expected_hash=TIKTOKEN_SHA256)
    _read_verified(files.vocab, VOCAB_BPE_SHA256)
    _read_verified(files.encoder, ENCODER_JSON_SHA256)
    return data_gym_to_mergeable_bpe_ranks(
        str(files.vocab), str(files.encoder), VOCAB_BPE_SHA256, ENCODER_JSON_SHA256
    )


def gpt2_encoding(files: BPEFiles) -> tiktoken.Encoding:
    """The GPT-2 tiktoken Encoding from already located files (hashes checked)."""
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=r50k_pat_str,
        mergeable_ranks=_mergeable_ranks(files),
        special_tokens={EOT_TEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )


def load_gpt2_tokenizer(bpe_dir: str | Path | None = None) -> tiktoken.Encoding:
    """GPT-2 tokenizer (n_vocab 50257, <|endoftext|> = 50256) from local files; no network."""
    return gpt2_encoding(find_gpt2_bpe_files(bpe_dir))
