import hashlib
import shutil
from pathlib import Path

import pytest
import tiktoken.load
from conftest import BPE_DIR, needs_bpe
from tiktoken_ext import openai_public

from jaxllm.data import tokenizer as tok


@pytest.fixture(autouse=True)
def isolated_lookup(monkeypatch, tmp_path):
    """No env dir, and an empty tiktoken cache, so only what a test sets up is found."""
    monkeypatch.delenv(tok.BPE_DIR_ENV, raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))


def _copy(tmp_path: Path, name: str, files: tuple[str, ...]) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in files:
        shutil.copy(BPE_DIR / f, d / f)
    return d


@needs_bpe
@pytest.mark.parametrize("files", [("gpt2.tiktoken",), ("vocab.bpe", "encoder.json")])
def test_encode_known_ids(tmp_path, files):
    enc = tok.load_gpt2_tokenizer(_copy(tmp_path, "bpe", files))
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == tok.N_VOCAB == 50257
    assert enc.eot_token == tok.EOT_ID == 50256
    assert enc.encode(tok.EOT_TEXT, allowed_special="all") == [50256]
    text = "Tom’s café — naïve 😀\n\n\tend"
    assert enc.decode(enc.encode(text)) == text


@needs_bpe
def test_both_file_forms_match_tiktoken_ranks(monkeypatch):
    # Our parser of the data-gym pair must give exactly tiktoken's ranks.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # keep tiktoken from caching local paths
    expected = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        str(BPE_DIR / "vocab.bpe"), str(BPE_DIR / "encoder.json")
    )
    pair = tok.BPEFiles("explicit", vocab=BPE_DIR / "vocab.bpe", encoder=BPE_DIR / "encoder.json")
    single = tok.BPEFiles("explicit", tiktoken=BPE_DIR / "gpt2.tiktoken")
    assert tok._mergeable_ranks(pair) == expected
    assert tok._mergeable_ranks(single) == expected


@needs_bpe
@pytest.mark.parametrize("files", [("gpt2.tiktoken",), ("vocab.bpe", "encoder.json")])
def test_corrupt_file_is_hash_error(tmp_path, files):
    d = _copy(tmp_path, "bpe", files)
    bad = d / files[-1]
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    with pytest.raises(tok.BPEHashMismatchError, match="sha256") as info:
        tok.load_gpt2_tokenizer(d)
    assert str(bad) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_files_error_lists_every_place(tmp_path, monkeypatch):
    env_dir, cache_dir = tmp_path / "env", tmp_path / "cache"
    env_dir.mkdir()
    (env_dir / "vocab.bpe").write_text("#version: 0.2\n")  # half a pair is not a set
    monkeypatch.setenv(tok.BPE_DIR_ENV, str(env_dir))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache_dir))
    with pytest.raises(tok.BPEFilesNotFoundError) as info:
        tok.load_gpt2_tokenizer(tmp_path / "nope")
    message = str(info.value)
    for place in (tmp_path / "nope", env_dir, cache_dir):
        assert str(place) in message
    assert isinstance(info.value, FileNotFoundError)


def test_cache_dir_follows_tiktoken_rules(monkeypatch, tmp_path):
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "dg"))
    assert tok.tiktoken_cache_dir() == tmp_path / "dg"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tt"))
    assert tok.tiktoken_cache_dir() == tmp_path / "tt"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken: caching disabled
    assert tok.tiktoken_cache_dir() is None
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR")
    monkeypatch.delenv("DATA_GYM_CACHE_DIR")
    assert tok.tiktoken_cache_dir().name == "data-gym-cache"


def _fill_cache_like_tiktoken(monkeypatch) -> None:
    # Let tiktoken itself "download" the gpt2 files (served from disk) into its cache.
    local = {"vocab.bpe": BPE_DIR / "vocab.bpe", "encoder.json": BPE_DIR / "encoder.json"}
    with monkeypatch.context() as m:
        m.setattr(tiktoken.load, "read_file", lambda url: local[url.rsplit("/", 1)[1]].read_bytes())
        openai_public.gpt2()


@needs_bpe
def test_lookup_order_explicit_env_cache(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache_dir))
    _fill_cache_like_tiktoken(monkeypatch)
    explicit = _copy(tmp_path, "explicit", ("gpt2.tiktoken",))
    env = _copy(tmp_path, "env", ("vocab.bpe", "encoder.json"))

    found = tok.find_gpt2_bpe_files()
    assert found.source == "tiktoken-cache"
    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
    assert found.vocab == cache_dir / hashlib.sha1(url.encode()).hexdigest()
    assert tok.load_gpt2_tokenizer().encode("Hello world") == [15496, 995]

    monkeypatch.setenv(tok.BPE_DIR_ENV, str(env))
    found = tok.find_gpt2_bpe_files()
    assert (found.source, found.vocab) == ("env", env / "vocab.bpe")

    found = tok.find_gpt2_bpe_files(explicit)
    assert (found.source, found.tiktoken) == ("explicit", explicit / "gpt2.tiktoken")

    # A location without a complete set is skipped, not an error, but a directory given
    # explicitly that holds none is said out loud (a switch never falls back silently).
    with pytest.warns(tok.BPEFilesFallbackWarning, match="does_not_exist .the directory given"):
        found = tok.find_gpt2_bpe_files(tmp_path / "does_not_exist")
    assert found.source == "env"
