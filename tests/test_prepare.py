import hashlib
import json
import multiprocessing
import re
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import BPE_DIR, ROOT, SHARED_DATA, needs_bpe

from jaxllm.data import prepare, sources, token_file
from jaxllm.data.tokenizer import EOT_TEXT, load_gpt2_tokenizer

# Stories with paragraphs, curly quotes and non-ASCII, like TinyStories.
DOCS = [
    f"Story {i}: Lily saw a “shiny” {'car' if i % 2 else 'café'}.\n\nShe said, “Wow!” "
    f"{'The end.' * (i % 3)}".strip()
    for i in range(24)
]


def _decode(ids) -> str:
    return load_gpt2_tokenizer(BPE_DIR).decode([int(t) for t in ids])


def _joined(docs) -> str:
    return "".join(d + EOT_TEXT for d in docs)


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


def _tinystories_v2(path: Path, docs=DOCS) -> Path:
    return _write(path, "\n" + "".join(f"{d}\n{EOT_TEXT}\n" for d in docs))


def _prepare(src, out, **kw):
    return prepare.prepare_text_files([src], out, bpe_dir=BPE_DIR, **kw)


@needs_bpe
def test_prepare_round_trip_and_sidecar(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt")
    out = tmp_path / "out" / "train.bin"
    (meta,) = _prepare(src, out, chunk_chars=200)
    data = token_file.load_tokens(out)
    assert isinstance(data, np.memmap) and data.dtype == np.uint16
    assert _decode(data) == _joined(DOCS)
    assert data[-1] == 50256
    on_disk = json.loads(token_file.sidecar_path(out).read_text())
    assert on_disk == meta
    assert (meta["num_tokens"], meta["num_documents"]) == (data.size, len(DOCS))
    assert (meta["tokenizer"], meta["dtype"], meta["split"]) == ("gpt2", "uint16", "all")
    assert meta["bpe_sha256"].startswith("306cd27f")
    assert meta["sources"] == [
        {
            "path": str(src.resolve()),
            "sha256": hashlib.sha256(src.read_bytes()).hexdigest(),
            "bytes": src.stat().st_size,
            "documents": len(DOCS),
            "invalid_utf8_bytes": 0,
        }
    ]
    assert meta["tokens_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.bin", "train.bin.json"]


def test_token_dtype():
    assert token_file.token_dtype(50257) == np.uint16
    assert token_file.token_dtype(65536) == np.uint16
    assert token_file.token_dtype(65537) == np.uint32


@needs_bpe
@pytest.mark.parametrize("read_chars", [5, 1 << 22])  # tiny reads: separators straddle reads
@pytest.mark.parametrize(
    "doc_split, text, docs",
    [
        ("separator", "A b.\n<|endoftext|>\nC\n\nd.\n<|endoftext|>\n", ["A b.", "C\n\nd."]),
        ("blank-line", "\n\nA b.\nc.\n\n \n\nD e.\n\n", ["A b.\nc.", "D e."]),
        ("single-newline", "A b.\n\nc.\nD e.\n\n\nf.\nG.\n", ["A b.\n\nc.", "D e.\n\n\nf.", "G."]),
        ("file", "A b.\n<|endoftext|>\n\nC.\n", ["A b.\n<|endoftext|>\n\nC."]),
    ],
)
def test_document_splits(tmp_path, read_chars, doc_split, text, docs):
    src = _write(tmp_path / "in.txt", text)
    (meta,) = _prepare(src, tmp_path / "t.bin", doc_split=doc_split, read_chars=read_chars)
    assert meta["num_documents"] == len(docs)
    data = token_file.load_tokens(tmp_path / "t.bin")
    # A literal "<|endoftext|>" inside a document is encoded as text, not as the EOT id.
    assert int((data == 50256).sum()) == len(docs)
    assert _decode(data) == _joined(docs)


def test_a_file_without_its_separator_is_one_document_with_a_warning(tmp_path, monkeypatch):
    from jaxllm.data import documents

    monkeypatch.setattr(documents, "LONG_DOCUMENT", 40)
    src = _write(tmp_path / "in.txt", "word " * 30)  # 150 characters, no <|endoftext|>
    with pytest.warns(UserWarning, match=r"in.txt: no '<\|endoftext\|>' in \d+ characters"):
        docs = list(documents.iter_file_documents([src], "separator", EOT_TEXT, [], 16))
    assert docs == [("word " * 30).strip()]


@needs_bpe
def test_custom_separator_and_crlf(tmp_path):
    src = _write(tmp_path / "in.txt", "one\r\ntwo\r\n===\r\nthree\r\n===")
    _prepare(src, tmp_path / "t.bin", separator="===")
    assert _decode(token_file.load_tokens(tmp_path / "t.bin")) == _joined(["one\ntwo", "three"])


@needs_bpe
def test_several_files_in_order(tmp_path):
    a = _tinystories_v2(tmp_path / "a.txt", DOCS[:3])
    b = _tinystories_v2(tmp_path / "b.txt", DOCS[3:5])
    (meta,) = prepare.prepare_text_files([a, b], tmp_path / "t.bin", bpe_dir=BPE_DIR)
    assert [s["documents"] for s in meta["sources"]] == [3, 2]
    assert _decode(token_file.load_tokens(tmp_path / "t.bin")) == _joined(DOCS[:5])


class _CountingContext:
    """A spawn context that counts the pools started from it."""

    def __init__(self):
        self.pools = 0
        self._spawn = multiprocessing.get_context("spawn")

    def Pool(self, *args, **kwargs):  # noqa: N802 (multiprocessing's name)
        self.pools += 1
        return self._spawn.Pool(*args, **kwargs)


@needs_bpe
def test_two_workers_same_output_as_one(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt")
    context = _CountingContext()
    metas = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}" / "train.bin"
        metas[workers] = _prepare(
            src,
            out,
            workers=workers,
            mp_context=context,
            chunk_chars=150,
            val_fraction=0.2,
            val_out_path=out.parent / "val.bin",
        )
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()
    assert metas[1] == metas[2]
    assert context.pools == 1  # only workers=2 started processes


def test_a_large_file_without_its_separator_is_said_to_be_one_document(tmp_path, monkeypatch):
    from jaxllm.data import documents

    monkeypatch.setattr(documents, "NO_SEPARATOR", 100)
    small = _write(tmp_path / "small.txt", "one story per line\n" * 3)  # 57 bytes: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(documents.iter_file_documents([small], "separator", EOT_TEXT, []))) == 1
    big = _write(tmp_path / "big.txt", "one story per line\n" * 10)  # 190 bytes
    with pytest.warns(UserWarning, match=r"big.txt: no '<\|endoftext\|>' in its 190 bytes: the "
                      r"whole file is one document \(--doc-split single-newline"):  # fmt: skip
        assert len(list(documents.iter_file_documents([big], "separator", EOT_TEXT, []))) == 1
    docs = list(documents.iter_file_documents([big], "single-newline", EOT_TEXT, []))
    assert len(docs) == 10


@needs_bpe
def test_cli_says_how_to_split_a_file_without_separators(tmp_path, capsys, monkeypatch):
    from jaxllm.data import documents

    monkeypatch.setattr(documents, "NO_SEPARATOR", 100)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main sets it
    src = _write(tmp_path / "stories.txt", "".join(f"Story {i} is here.\n" for i in range(20)))
    out = tmp_path / "train.bin"
    args = [str(src), "--out", str(out), "--bpe-dir", str(BPE_DIR), "--workers", "1"]
    with pytest.raises(SystemExit) as e:
        prepare.main([*args, "--val-fraction", "0.1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(
        r"error: .*no validation documents out of 1; use a larger fraction, or check .* "
        r"\(--doc-split is separator\)", err
    )  # fmt: skip
    warned = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warned) == 1 and warned[0].startswith("warning: ")  # one line, no source line
    assert "stories.txt: no '<|endoftext|>'" in warned[0]
    prepare.main([*args, "--val-fraction", "0.1", "--doc-split", "single-newline"])
    assert "18 documents" in capsys.readouterr().out


@needs_bpe
def test_val_fraction_split_by_documents(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt", DOCS[:20])
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    metas = _prepare(src, train, val_fraction=0.25, val_out_path=val, chunk_chars=100)
    val_docs = [DOCS[i] for i in (3, 7, 11, 15, 19)]  # evenly spaced, no randomness
    train_docs = [d for d in DOCS[:20] if d not in val_docs]
    assert _decode(token_file.load_tokens(val)) == _joined(val_docs)
    assert _decode(token_file.load_tokens(train)) == _joined(train_docs)
    assert [(m["split"], m["num_documents"]) for m in metas] == [("train", 15), ("val", 5)]


@needs_bpe
def test_val_fraction_too_small_is_error_and_leaves_nothing(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt", DOCS[:3])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="no validation documents out of 3"):
        _prepare(src, out / "train.bin", val_fraction=0.1, val_out_path=out / "val.bin")
    assert list(out.iterdir()) == []
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        _prepare(src, out / "train.bin", val_fraction=1.0, val_out_path=out / "val.bin")
    with pytest.raises(ValueError, match="given together"):
        _prepare(src, out / "train.bin", val_fraction=0.5)


@needs_bpe
def test_failure_midway_leaves_no_partial_file(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt")
    out_dir = tmp_path / "out"
    out = out_dir / "train.bin"
    _prepare(src, out)
    good = out.read_bytes(), token_file.sidecar_path(out).read_text()

    def documents_then_fail():  # a source that dies after two chunks were written
        yield from DOCS[:6]
        raise RuntimeError("source died")

    for target in (out, out_dir / "fresh.bin"):
        with pytest.raises(RuntimeError, match="source died"):
            prepare.write_token_files(
                documents_then_fail(), target, source_meta={}, bpe_dir=BPE_DIR, chunk_chars=100
            )
    # The old good output is untouched, the new one never appeared, no temp file lingers.
    assert sorted(p.name for p in out_dir.iterdir()) == ["train.bin", "train.bin.json"]
    assert (out.read_bytes(), token_file.sidecar_path(out).read_text()) == good


@needs_bpe
def test_stale_or_mismatched_files_are_refused(tmp_path):
    src = _tinystories_v2(tmp_path / "stories.txt")
    out = tmp_path / "train.bin"
    _prepare(src, out)
    sidecar = token_file.sidecar_path(out)
    meta = json.loads(sidecar.read_text())

    def rewrite(**changes):
        sidecar.write_text(json.dumps(meta | changes))

    rewrite(num_tokens=meta["num_tokens"] + 1)
    with pytest.raises(token_file.StaleTokensError, match="bytes"):
        token_file.load_tokens(out)
    rewrite(tokenizer="llama")
    with pytest.raises(token_file.StaleTokensError, match="tokenizer='llama'"):
        token_file.load_tokens(out)
    rewrite(bpe_sha256="0" * 64)
    with pytest.raises(token_file.StaleTokensError, match="bpe_sha256"):
        token_file.load_tokens(out)
    rewrite(dtype="uint32")
    with pytest.raises(token_file.StaleTokensError, match="dtype"):
        token_file.load_tokens(out)
    rewrite()
    assert token_file.load_tokens(out).size == meta["num_tokens"]

    data = bytearray(out.read_bytes())
    data[0] ^= 1  # same size, different content: only the hash check sees it
    out.write_bytes(bytes(data))
    token_file.load_tokens(out)
    with pytest.raises(token_file.StaleTokensError, match="sha256"):
        token_file.load_tokens(out, verify_hash=True)
    with out.open("ab") as f:
        f.write(b"\0\0")  # a token file that grew after its sidecar was written
    with pytest.raises(token_file.StaleTokensError, match="stale"):
        token_file.load_tokens(out)
    for text, problem in (('{"format": "jaxllm', "is not valid JSON"), ("[1, 2]", "holds a list")):
        sidecar.write_text(text)  # cut by a crash, or not ours: named, not a traceback
        with pytest.raises(token_file.StaleTokensError, match=rf"train.bin.json {problem}"):
            token_file.load_tokens(out)
    sidecar.unlink()
    with pytest.raises(token_file.StaleTokensError, match="no sidecar"):
        token_file.load_tokens(out)
    with pytest.raises(FileNotFoundError):
        token_file.load_tokens(tmp_path / "missing.bin")


@needs_bpe
def test_invalid_utf8_replaced_with_warning(tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"ok story\n<|endoftext|>\nbad \xff\xfe bytes \xe2\x80\n<|endoftext|>\n")
    with pytest.warns(UserWarning, match="4 invalid UTF-8 bytes"):
        (meta,) = _prepare(src, tmp_path / "t.bin")
    assert meta["sources"][0]["invalid_utf8_bytes"] == 4
    text = _decode(token_file.load_tokens(tmp_path / "t.bin"))
    assert text == _joined(["ok story", "bad \ufffd\ufffd bytes \ufffd\ufffd"])


@needs_bpe
def test_empty_and_missing_inputs(tmp_path):
    empty = _write(tmp_path / "empty.txt", "")
    blank = _write(tmp_path / "blank.txt", "\n  \n<|endoftext|>\n\n")
    good = _tinystories_v2(tmp_path / "good.txt", DOCS[:2])
    with pytest.raises(ValueError, match="empty.txt"):
        _prepare(empty, tmp_path / "a.bin")
    with pytest.raises(ValueError, match="blank.txt: no documents"):
        prepare.prepare_text_files([good, blank], tmp_path / "b.bin", bpe_dir=BPE_DIR)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        _prepare(tmp_path / "nope.txt", tmp_path / "c.bin")
    with pytest.raises(ValueError, match="doc_split"):
        _prepare(good, tmp_path / "d.bin", doc_split="paragraph")
    before = good.read_bytes()
    for kw in ({}, {"val_out_path": good, "val_fraction": 0.5}):  # either output on an input
        out = good if not kw else tmp_path / "e.bin"
        with pytest.raises(ValueError, match=r"an output is also an input: .*good.txt"):
            _prepare(good, out, **kw)
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt", "empty.txt", "good.txt"]


@needs_bpe
def test_hf_dataset_with_fake_loader(tmp_path, monkeypatch):
    rows = [{"text": " Once upon a time.\n"}, {"text": "  "}, {"text": "The end.\n\nBye."}]
    calls = []

    def load_dataset(dataset_id, split):
        calls.append((dataset_id, split))
        return iter(rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    (meta,) = prepare.prepare_hf_dataset(
        "roneneldan/TinyStories", tmp_path / "t.bin", split="validation", bpe_dir=BPE_DIR
    )
    assert calls == [("roneneldan/TinyStories", "validation")]
    assert meta["num_documents"] == 2
    assert meta["sources"] == [
        {"hf_dataset": "roneneldan/TinyStories", "split": "validation", "text_field": "text"}
    ]
    assert _decode(token_file.load_tokens(tmp_path / "t.bin")) == _joined(
        ["Once upon a time.", "The end.\n\nBye."]
    )
    with pytest.raises(ValueError, match="no field 'story'"):
        prepare.prepare_hf_dataset("x", tmp_path / "u.bin", text_field="story", bpe_dir=BPE_DIR)
    monkeypatch.setitem(sys.modules, "datasets", None)  # package not installed
    with pytest.raises(ImportError, match="pip install"):
        prepare.prepare_hf_dataset("x", tmp_path / "v.bin", bpe_dir=BPE_DIR)
    assert not (tmp_path / "u.bin").exists() and not (tmp_path / "v.bin").exists()


@needs_bpe
def test_cli(tmp_path, capsys):
    src = _tinystories_v2(tmp_path / "stories.txt", DOCS[:10])
    out = tmp_path / "data" / "train.bin"
    args = [str(src), "--out", str(out), "--bpe-dir", str(BPE_DIR), "--workers", "1"]
    prepare.main([*args, "--val-fraction", "0.2"])
    printed = capsys.readouterr().out
    assert "8 documents" in printed and "2 documents" in printed
    val = token_file.load_tokens(out.parent / "val.bin")
    assert _decode(val) == _joined([DOCS[4], DOCS[9]])
    with pytest.raises(SystemExit) as e:
        prepare.main([str(_write(tmp_path / "ws.txt", " \n")), *args[1:]])
    assert e.value.code == 2 and "ws.txt: no documents" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare.main(["--out", str(out)])  # neither files nor --hf-dataset
    with pytest.raises(SystemExit):
        prepare.main([*args[:-1], "0"])  # --workers 0
    assert "workers and chunk_chars must be >= 1, got 0" in capsys.readouterr().err
    # options that cannot apply are refused, not ignored
    for extra, says in (
        (["--separator", "XYZ", "--doc-split", "single-newline"], "--separator applies only"),
        (["--hf-split", "test"], "--hf-split and --hf-text-field apply only with --hf-dataset"),
    ):
        with pytest.raises(SystemExit) as e:
            prepare.main([*args, *extra])
        assert e.value.code == 2 and says in capsys.readouterr().err


@needs_bpe
def test_outputs_are_checked_first_and_renamed_as_a_pair(tmp_path, capsys):
    """--val-out an existing directory: train.bin was replaced, then the rename of val failed
    (no val.bin); a val path that cannot open left the train temp file behind."""
    src = _tinystories_v2(tmp_path / "stories.txt", DOCS[:10])
    out = tmp_path / "train.bin"
    args = [str(src), "--out", str(out), "--bpe-dir", str(BPE_DIR), "--workers", "1"]
    prepare.main([*args, "--val-fraction", "0.2"])
    before = out.read_bytes()
    (tmp_path / "vdir").mkdir()
    for val in ("vdir", "stories.txt/v.bin"):
        with pytest.raises(SystemExit) as e:
            prepare.main([*args, "--val-fraction", "0.5", "--val-out", str(tmp_path / val)])
        assert e.value.code == 2 and "error: " in capsys.readouterr().err
        assert out.read_bytes() == before  # the old pair stands
        assert not list(tmp_path.glob(".*.tmp*"))  # no temp file left


@needs_bpe
@pytest.mark.skipif(not (SHARED_DATA / "tinystories").is_dir(), reason="no shared TinyStories")
def test_real_tinystories_fixture(tmp_path):
    (meta,) = _prepare(
        SHARED_DATA / "tinystories/tinystories_sample_cs336_fixture.txt", tmp_path / "t.bin"
    )
    text = _decode(token_file.load_tokens(tmp_path / "t.bin"))
    assert meta["num_documents"] == 5
    assert text.startswith("Once upon a time there was a little boy named Ben.")
    assert text.count(EOT_TEXT) == 5 and text.endswith(EOT_TEXT)


def _arange_memmap(tmp_path: Path, n: int) -> np.memmap:
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "a.bin")
    return np.memmap(tmp_path / "a.bin", dtype=np.uint16, mode="r")


def test_get_batch(tmp_path):
    data = _arange_memmap(tmp_path, 1000)
    x, y = sources.get_batch(data, 16, 32, np.random.default_rng(0))
    assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == np.int32
    assert x.flags.c_contiguous and y.flags.c_contiguous
    np.testing.assert_array_equal(y, x + 1)  # data is arange: target = next token
    np.testing.assert_array_equal(x, x[:, :1] + np.arange(32))  # contiguous windows
    assert x.min() >= 0 and y.max() <= 999
    # Same seed, same batch; the generator state round-trips through a checkpoint-able dict.
    x2, _ = sources.get_batch(data, 16, 32, np.random.default_rng(0))
    np.testing.assert_array_equal(x, x2)
    rng = np.random.default_rng(1)
    state = rng.bit_generator.state
    first = sources.get_batch(data, 4, 8, rng)[0]
    assert not np.array_equal(first, sources.get_batch(data, 4, 8, rng)[0])
    rng2 = np.random.default_rng(123)
    rng2.bit_generator.state = json.loads(json.dumps(state))
    np.testing.assert_array_equal(first, sources.get_batch(data, 4, 8, rng2)[0])


def test_get_batch_reaches_both_ends(tmp_path):
    data = _arange_memmap(tmp_path, 12)
    x, y = sources.get_batch(data, 2000, 8, np.random.default_rng(0))
    assert set(x[:, 0]) == {0, 1, 2, 3}  # every start 0..N-T-1, nothing past the end
    assert y.max() == 11
    x, y = sources.get_batch(data, 3, 11, np.random.default_rng(0))  # exactly T + 1 tokens
    np.testing.assert_array_equal(x, np.tile(np.arange(11), (3, 1)))


def test_get_batch_bad_args(tmp_path):
    data = _arange_memmap(tmp_path, 10)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="at least context_length \\+ 1 = 11 tokens, got 10"):
        sources.get_batch(data, 1, 10, rng)
    for batch_size, context_length in ((0, 4), (4, 0), (-1, 4)):
        with pytest.raises(ValueError, match=">= 1"):
            sources.get_batch(data, batch_size, context_length, rng)
    with pytest.raises(TypeError, match="Generator"):
        sources.get_batch(data, 1, 4, np.random.RandomState(0))
    with pytest.raises(ValueError, match="1-D"):
        sources.get_batch(np.zeros((4, 4), np.uint16), 1, 2, rng)


def test_iter_eval_batches(tmp_path):
    data = _arange_memmap(tmp_path, 1000)
    batches = list(sources.iter_eval_batches(data, 4, 16, 3))
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
        np.testing.assert_array_equal(y, x + 1)
    starts = np.concatenate([x[:, 0] for x, _ in batches])
    np.testing.assert_array_equal(starts, np.linspace(0, 1000 - 17, 12).round())
    again = list(sources.iter_eval_batches(data, 4, 16, 3))
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))


@needs_bpe
def test_ids_beyond_the_model_vocab_are_refused_on_open(tmp_path, monkeypatch):
    """A file with ids >= model.vocab_size used to train until the loss blew up (and the message
    blamed the learning rate); the sidecar's max_id now refuses it when the file is opened."""
    src = _tinystories_v2(tmp_path / "stories.txt")
    out = tmp_path / "train.bin"
    (meta,) = _prepare(src, out, chunk_chars=200)
    data = np.fromfile(out, np.uint16)
    assert meta["max_id"] == data.max() == 50256  # every document ends with <|endoftext|>
    token_file.load_tokens(out, vocab_size=50257)
    with pytest.raises(token_file.StaleTokensError, match="max id 50256.*vocab_size is 50000"):
        token_file.load_tokens(out, vocab_size=50000)

    sidecar = token_file.sidecar_path(out)
    data[::7] = 60000  # out-of-vocabulary ids, same size: num_tokens still fits
    data.tofile(out)
    bad = tmp_path / "bad.bin"
    data.tofile(bad)
    token_file.sidecar_path(bad).write_text(json.dumps(meta | {"max_id": 60000}))
    with pytest.raises(token_file.StaleTokensError, match=r"bad\.bin.*max id 60000.*50257"):
        token_file.load_tokens(bad, vocab_size=50257)
    # A sidecar copied from the good file: its max_id is a lie only a full read can see.
    token_file.load_tokens(out, vocab_size=50257)  # trusted without verify_hash
    with pytest.raises(token_file.StaleTokensError, match="max_id is 50256.*largest id is 60000"):
        token_file.load_tokens(out, verify_hash=True)
    # An older sidecar without max_id: the max is computed from the file (one read).
    sidecar.write_text(json.dumps({k: v for k, v in meta.items() if k != "max_id"}))
    with pytest.raises(token_file.StaleTokensError, match="max id 60000"):
        token_file.load_tokens(out, vocab_size=50257)
    assert token_file.load_tokens(out).size == meta["num_tokens"]  # no vocab: nothing to check

    # make_source checks both files against model.vocab_size.
    from jaxllm.config import load_config

    good = tmp_path / "good.bin"
    _prepare(src, good)
    monkeypatch.setenv(sources.DATA_DIR_ENV, str(tmp_path))
    paths = ["--data.tokens.train_path=good.bin"]
    cfg = load_config(ROOT / "configs/tinystories.yaml", [*paths, "--data.tokens.val_path=bad.bin"])
    with pytest.raises(token_file.StaleTokensError, match="bad.bin"):
        sources.make_source(cfg)
    cfg = load_config(
        ROOT / "configs/tinystories.yaml", [*paths, "--data.tokens.val_path=good.bin"]
    )
    assert isinstance(sources.make_source(cfg), sources.TokenSource)
    # A file shorter than one window is refused when opened, naming it (not at the first eval).
    (short_meta,) = _prepare(_tinystories_v2(tmp_path / "short.txt", DOCS[:1]), tmp_path / "s.bin")
    n = short_meta["num_tokens"]
    assert n < meta["num_tokens"]
    short = [*paths, "--data.tokens.val_path=s.bin", f"--model.context_length={n}"]
    cfg = load_config(ROOT / "configs/tinystories.yaml", short)
    message = rf"val_path .*s.bin holds {n} tokens: a window needs model.context_length \+ 1"
    with pytest.raises(ValueError, match=message):
        sources.make_source(cfg)
