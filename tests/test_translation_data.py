import re

import numpy as np
import pytest

from jaxllm.data import translation as tr
from jaxllm.functional import IGNORE

# A tiny De-En corpus (Multi30k-like captions), with umlauts and ß.
PAIRS = [
    ("Ein Mann fährt Fahrrad auf der Straße.", "A man rides a bike on the street."),
    ("Zwei Mädchen spielen im Schnee.", "Two girls play in the snow."),
    ("Ein Hund läuft über eine grüne Wiese.", "A dog runs across a green meadow."),
    ("Eine Frau trägt einen großen Hut.", "A woman wears a big hat."),
    ("Kinder hören einem Straßenmusiker zu.", "Children listen to a street musician."),
    ("Ein älterer Mann schläft auf einer Bank.", "An older man sleeps on a bench."),
]
TEXTS = [s for pair in PAIRS for s in pair] * 4


@pytest.fixture(scope="module")
def tok():
    return tr.TranslationTokenizer.train(TEXTS, vocab_size=400)


def _write(path, lines, end="\n"):
    path.write_text(end.join(lines) + end, encoding="utf-8")
    return path


# --- loading ---------------------------------------------------------------------------------


def test_load_parallel_files(tmp_path):
    de = _write(tmp_path / "train.de", [s for s, _ in PAIRS], end="\r\n")  # CRLF is stripped
    en = _write(tmp_path / "train.en", ["  " + t + " \t" for _, t in PAIRS])
    assert tr.load_parallel_files(de, en) == PAIRS
    de.write_text("\n".join(s for s, _ in PAIRS) + "\n\n \n")  # blank lines at the end: no pairs
    assert tr.load_parallel_files(de, en) == PAIRS


def test_line_separator_inside_sentence_is_not_a_line_break(tmp_path):
    de = _write(tmp_path / "a.de", ["eins\u2028zwei", "drei"])
    en = _write(tmp_path / "a.en", ["one two", "three"])
    assert tr.load_parallel_files(de, en) == [("eins\u2028zwei", "one two"), ("drei", "three")]


def test_misaligned_files(tmp_path):
    de = _write(tmp_path / "train.de", ["a"] * 100)
    en = _write(tmp_path / "train.en", ["b"] * 99)
    with pytest.raises(ValueError, match=r"train\.de has 100 lines, .*train\.en has 99"):
        tr.load_parallel_files(de, en)


def test_missing_and_empty_files(tmp_path):
    en = _write(tmp_path / "train.en", ["b"])
    with pytest.raises(FileNotFoundError, match=r"nope\.de"):
        tr.load_parallel_files(tmp_path / "nope.de", en)
    (tmp_path / "train.de").write_text("")
    with pytest.raises(ValueError, match=r"train\.de is empty"):
        tr.load_parallel_files(tmp_path / "train.de", en)


def test_empty_lines_are_refused_with_line_numbers(tmp_path):
    de = _write(tmp_path / "x.de", ["a", "", "c", "  ", "e", "f", "", "", "", "", "k"])
    en = _write(tmp_path / "x.en", ["a", "b", "", "d", "e", "f", "g", "h", "i", "j", "k"])
    with pytest.raises(ValueError) as e:
        tr.load_parallel_files(de, en)
    msg = str(e.value)
    assert "x.de has 6 empty lines (line 2, 4, 7, 8, 9, ...)" in msg
    assert "x.en has 1 empty lines (line 3)" in msg


def test_hf_loader_with_fake_loader():
    calls = []

    def fake(dataset_id, split):
        calls.append((dataset_id, split))
        return [{"de": s + " ", "en": t, "id": i} for i, (s, t) in enumerate(PAIRS)]

    pairs = tr.load_hf_parallel("bbaaaa/iwslt14-de-en-preprocess", "validation", loader=fake)
    assert pairs == PAIRS
    assert calls == [("bbaaaa/iwslt14-de-en-preprocess", "validation")]
    flipped = tr.load_hf_parallel("x", "train", src_key="en", tgt_key="de", loader=fake)
    assert flipped[0] == (PAIRS[0][1], PAIRS[0][0])


def test_hf_loader_errors():
    with pytest.raises(KeyError, match=r"row 1 has no key \['en'\]"):
        tr.load_hf_parallel("x", "train", loader=lambda d, s: [{"de": "a", "en": "b"}, {"de": "c"}])
    with pytest.raises(ValueError, match="1 rows with an empty side"):
        tr.load_hf_parallel("x", "train", loader=lambda d, s: [{"de": "a", "en": " "}])
    with pytest.raises(ValueError, match="no rows"):
        tr.load_hf_parallel("x", "train", loader=lambda d, s: [])


def test_hf_loader_without_datasets_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ImportError, match=r"pip install 'jaxllm\[datasets\]'"):
        tr.load_hf_parallel("bbaaaa/iwslt14-de-en-preprocess", "train")


# --- filtering -------------------------------------------------------------------------------


def test_filter_by_words():
    pairs = [("a b", "c"), ("a b c", "d e"), ("a", "b c d e")]  # 3, 5, 5 words
    kept, dropped = tr.filter_pairs(pairs, max_words=5)  # strictly fewer than 5
    assert kept == [("a b", "c")] and dropped == 2
    assert tr.filter_pairs(pairs) == (pairs, 0)


def test_filter_by_tokens(tok):
    lengths = [len(tok.encode(s)) + len(tok.encode(t)) + 2 for s, t in PAIRS]
    limit = sorted(lengths)[2]
    kept, dropped = tr.filter_pairs(PAIRS, max_tokens=limit, tokenizer=tok)
    assert kept == [p for p, n in zip(PAIRS, lengths, strict=True) if n <= limit]
    assert dropped == sum(n > limit for n in lengths) > 0
    both, n = tr.filter_pairs(PAIRS, max_words=10, max_tokens=limit, tokenizer=tok)
    assert both == [p for p in kept if len(p[0].split()) + len(p[1].split()) < 10]
    assert n == len(PAIRS) - len(both)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        tr.filter_pairs(PAIRS, max_tokens=10)


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_specials(tok):
    assert (tok.eos_src_id, tok.eos_tgt_id, tok.pad_id) == (0, 1, 2)
    assert 256 + 3 < tok.vocab_size <= 400
    en = tr.TranslationTokenizer.train(TEXTS, 300, src_lang="en", tgt_lang="fr")
    assert en._tok.id_to_token(en.eos_src_id) == "<eos_en>"
    assert en._tok.id_to_token(en.eos_tgt_id) == "<eos_fr>"


def test_tokenizer_round_trip_and_save_load(tok, tmp_path):
    text = "Über die Brücke gehen ältere Frauen — mit Größe 42 € und „Grüßen“ 😀"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(" zwei  Leerzeichen\n")) == " zwei  Leerzeichen\n"
    # Special-token text in the data stays text: no id 0/1/2, and it round-trips.
    tricky = "a <pad> b <eos_en>"
    assert not {0, 1, 2} & set(tok.encode(tricky))
    assert tok.decode(tok.encode(tricky)) == tricky

    path = tmp_path / "run" / "tokenizer.json"
    tok.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temp file left
    again = tr.TranslationTokenizer.load(path)
    assert again.encode(text) == ids
    assert again.encode(tricky) == tok.encode(tricky)
    assert (again.src_lang, again.tgt_lang, again.vocab_size) == ("de", "en", tok.vocab_size)
    assert (again.eos_src_id, again.eos_tgt_id, again.pad_id) == (0, 1, 2)


def test_tokenizer_is_deterministic(tok, tmp_path):
    other = tr.TranslationTokenizer.train(TEXTS, vocab_size=400)
    tok.save(tmp_path / "a.json")
    other.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size must be >= 259"):
        tr.TranslationTokenizer.train(TEXTS, vocab_size=258)
    with pytest.raises(ValueError, match="no training texts"):
        tr.TranslationTokenizer.train([], vocab_size=300)
    with pytest.raises(ValueError, match="both 'de'"):
        tr.TranslationTokenizer.train(TEXTS, 300, src_lang="de", tgt_lang="de")
    with pytest.raises(FileNotFoundError, match="tok.json"):
        tr.TranslationTokenizer.load(tmp_path / "tok.json")


def test_decode_skips_specials_and_checks_range(tok):
    ids = tok.encode("Hallo")
    assert tok.decode([tok.eos_src_id, *ids, tok.eos_tgt_id, tok.pad_id]) == "Hallo"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([IGNORE])


# --- layout ----------------------------------------------------------------------------------


def test_encode_pair_layout_and_loss_mask(tok):
    src, tgt = PAIRS[0]
    s, t = tok.encode(src), tok.encode(tgt)
    inputs, targets = tr.encode_pair(tok, src, tgt)
    seq = s + [tok.eos_src_id] + t + [tok.eos_tgt_id]
    assert inputs.dtype == targets.dtype == np.int32
    assert inputs.tolist() == seq[:-1]
    # Exact mask: no loss where the next token is a source token or <eos_src>; loss on every
    # target token and on <eos_tgt>.
    assert targets.tolist() == [IGNORE] * len(s) + t + [tok.eos_tgt_id]
    assert inputs[len(s)] == tok.eos_src_id  # <eos_src> predicts the first target token
    assert tok.eos_src_id not in targets and tok.pad_id not in inputs
    assert [tuple(map(list, e)) for e in tr.encode_pairs(tok, PAIRS[:2])] == [
        tuple(map(list, tr.encode_pair(tok, a, b))) for a, b in PAIRS[:2]
    ]


# --- batching --------------------------------------------------------------------------------


def _skewed_lengths(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(3.0, 0.6, n).astype(int) + 4, 256)  # long right tail


def test_bucket_batches_cover_every_index_once():
    lengths = _skewed_lengths()
    batches = tr.bucket_batches(lengths, 32, seed=0, epoch=0, pool_batches=8)
    idx = np.concatenate(batches)
    assert sorted(idx.tolist()) == list(range(len(lengths)))
    assert all(len(b) == 32 for b in batches if len(b) != len(lengths) % 32)
    assert sum(len(b) < 32 for b in batches) == 1  # 2000 % 32 = 16: one short batch
    dropped = tr.bucket_batches(lengths, 32, seed=0, epoch=0, pool_batches=8, drop_last=True)
    assert all(len(b) == 32 for b in dropped) and len(dropped) == len(lengths) // 32


def test_bucket_batches_deterministic_per_seed_and_epoch():
    lengths = _skewed_lengths()

    def run(seed, epoch):
        return [b.tolist() for b in tr.bucket_batches(lengths, 32, seed=seed, epoch=epoch)]

    assert run(0, 3) == run(0, 3)
    assert run(0, 3) != run(0, 4)
    assert run(0, 3) != run(1, 3)
    unshuffled = tr.bucket_batches(lengths, 32, seed=0, epoch=0, shuffle=False)
    assert [b.tolist() for b in unshuffled] == [
        b.tolist() for b in tr.bucket_batches(lengths, 32, seed=5, epoch=9, shuffle=False)
    ]


def padding_fraction(lengths, batches, multiple=1):
    """Fraction of the (B, T) slots of all batches that are padding (T rounded to `multiple`)."""
    lengths = np.asarray(lengths)
    real = sum(int(lengths[b].sum()) for b in batches)
    total = sum(len(b) * tr.padded_length(int(lengths[b].max()), multiple) for b in batches)
    return 1.0 - real / total if total else 0.0


def test_bucketing_cuts_padding():
    lengths = _skewed_lengths()
    bucketed = tr.bucket_batches(lengths, 32, seed=0, epoch=0)
    order = np.random.default_rng(0).permutation(len(lengths))
    random_batches = [order[i : i + 32] for i in range(0, len(order), 32)]
    pad_bucketed = padding_fraction(lengths, bucketed)
    pad_random = padding_fraction(lengths, random_batches)
    assert pad_bucketed < 0.05 and pad_random > 0.4, (pad_bucketed, pad_random)
    assert padding_fraction(lengths, bucketed, multiple=16) >= pad_bucketed


def test_bucket_batches_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        tr.bucket_batches([3, 4], 0, seed=0, epoch=0)


def test_padded_length():
    assert [tr.padded_length(n, 16) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]


def test_collate(tok):
    examples = tr.encode_pairs(tok, PAIRS[:3])
    longest = max(len(x) for x, _ in examples)
    batch = tr.collate(examples, tok.pad_id)
    assert batch["inputs"].shape == batch["targets"].shape == (3, longest)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    for row, (x, y) in enumerate(examples):
        n = len(x)
        assert batch["inputs"][row, :n].tolist() == x.tolist()
        assert batch["targets"][row, :n].tolist() == y.tolist()
        assert (batch["inputs"][row, n:] == tok.pad_id).all()
        assert (batch["targets"][row, n:] == IGNORE).all()
    fixed = tr.collate(examples, tok.pad_id, length=tr.padded_length(longest, 32))
    assert fixed["inputs"].shape == (3, tr.padded_length(longest, 32))
    with pytest.raises(ValueError, match="shorter than the longest"):
        tr.collate(examples, tok.pad_id, length=longest - 1)
    with pytest.raises(ValueError, match="at least one"):
        tr.collate([], tok.pad_id)


def test_a_missing_relative_data_path_says_what_it_resolved_against(tmp_path, monkeypatch):
    from jaxllm.config import TranslationConfig
    from jaxllm.data.sources import DATA_DIR_ENV, load_translation_split

    tc = TranslationConfig(train=("nowhere/train",), valid="nowhere/valid", test="nowhere/test")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    hint = (
        rf"against the current directory {re.escape(str(tmp_path))}: \$JAXLLM_DATA_DIR is unset\)"
    )
    with pytest.raises(FileNotFoundError, match=rf"nowhere/valid.de \(relative .* resolve {hint}"):
        load_translation_split(tc, "valid")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "d"))
    with pytest.raises(FileNotFoundError, match=r"against \$JAXLLM_DATA_DIR=.*/d\)"):
        load_translation_split(tc, "valid")
    absolute = TranslationConfig(train=(str(tmp_path / "x"),), valid="v", test="t")
    with pytest.raises(FileNotFoundError) as e:  # an absolute path needs no hint
        load_translation_split(absolute, "train")
    assert "resolve against" not in str(e.value)
