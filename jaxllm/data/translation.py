"""Machine translation data for a decoder-only model: parallel text -> token ids -> batches.

One example is the single sequence `src <eos_src> tgt <eos_tgt>` (CMU 11-868 llmsys hw2: De->En
with `<eos_de>`, `<eos_en>`). The model reads it left to right; the loss covers only the target
tokens and `<eos_tgt>`, so it learns p(tgt | src) and never spends capacity on modelling German.
At test time the prompt is `src <eos_src>` and decoding stops at `<eos_tgt>`.

    pairs = load_parallel_files("train.de", "train.en")
    pairs, dropped = filter_pairs(pairs, max_words=40)
    tok = TranslationTokenizer.train([s for p in pairs for s in p], vocab_size=10_000)
    examples = encode_pairs(tok, pairs)                    # [(inputs, targets)]
    for idx in bucket_batches([len(x) for x, _ in examples], 128, seed=0, epoch=0):
        batch = collate([examples[i] for i in idx], tok.pad_id, length=...)
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxllm.atomic_file import write_text_atomic
from jaxllm.functional import IGNORE  # target id of positions that carry no loss

Pair = tuple[str, str]  # (source sentence, target sentence)
Example = tuple[np.ndarray, np.ndarray]  # (inputs, targets), each (L - 1,) int32

# --------------------------------------------------------------------------------------------
# Loading


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"parallel text file not found: {path}")
    data = path.read_bytes()
    try:  # bytes: no newline translation (a lone "\r" stays text); -sig: a leading BOM goes
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # -sig counts from after a BOM
        at = e.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        line = data.count(b"\n", 0, at) + 1
        raise ValueError(f"{path} is not UTF-8: line {line}, byte {at}: {e.reason}") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    # Split on "\n" only: str.splitlines() also splits on U+2028, U+0085, ..., which can occur
    # inside a sentence and would shift every later line out of alignment.
    lines = [line.strip() for line in text.split("\n")]  # strip() also drops CRLF's "\r"
    while not lines[-1]:
        lines.pop()  # blank lines at the end of the file (the final newline, and more)
    return lines


def load_parallel_files(src_path: str | os.PathLike, tgt_path: str | os.PathLike) -> list[Pair]:
    """Aligned UTF-8 files, one sentence a line -> [(src, tgt)], each side stripped.

    Blank lines at the end of a file are ignored (Multi30k's train.de ends in one); empty lines
    before that are refused, never skipped: they usually mean the files went out of step.
    """
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    src, tgt = _read_lines(src_path), _read_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(
            f"{src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}: not a parallel corpus"
        )
    problems = []
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        empty = [i + 1 for i, line in enumerate(lines) if not line]
        if empty:
            first = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
            problems.append(f"{path} has {len(empty)} empty lines (line {first})")
    if problems:
        raise ValueError("; ".join(problems) + "; remove those pairs from both files")
    return list(zip(src, tgt, strict=True))


def _hf_translation_rows(dataset_id: str, split: str) -> Iterable[dict]:
    try:
        import datasets  # optional (jaxllm[datasets]): only hub data needs it
    except ImportError as e:
        raise ImportError(
            "loading from the Hugging Face hub needs `datasets`: pip install 'jaxllm[datasets]'"
        ) from e
    return datasets.load_dataset(dataset_id, split=split)["translation"]


def load_hf_parallel(
    dataset_id: str,
    split: str,
    src_key: str = "de",
    tgt_key: str = "en",
    loader: Callable[[str, str], Iterable[dict]] | None = None,
) -> list[Pair]:
    """Rows {src_key: str, tgt_key: str, ...} of a hub dataset -> [(src, tgt)], each stripped.

    Default: `datasets.load_dataset(dataset_id, split=split)["translation"]`, the course's
    'bbaaaa/iwslt14-de-en-preprocess'. `loader(dataset_id, split)` replaces it (tests, mirrors).
    """
    rows = (loader or _hf_translation_rows)(dataset_id, split)
    pairs, empty = [], []
    for i, row in enumerate(rows):
        missing = [k for k in (src_key, tgt_key) if k not in row]
        if missing:
            raise KeyError(
                f"{dataset_id}[{split}] row {i} has no key {missing} (keys: {sorted(row)})"
            )
        src, tgt = str(row[src_key]).strip(), str(row[tgt_key]).strip()
        if not src or not tgt:
            empty.append(i)
        pairs.append((src, tgt))
    if not pairs:
        raise ValueError(f"{dataset_id}[{split}] has no rows")
    if empty:
        raise ValueError(
            f"{dataset_id}[{split}] has {len(empty)} rows with an empty side "
            f"(rows {empty[:5]}); filter them out before training"
        )
    return pairs


# --------------------------------------------------------------------------------------------
# Tokenizer


class TranslationTokenizer:
    """Byte-level BPE (Hugging Face `tokenizers`) shared by both languages, plus three special
    tokens at ids 0, 1, 2: `<eos_{src}>`, `<eos_{tgt}>`, `<pad>`.

    Byte-level means every string encodes (no unknown token) and decode(encode(s)) == s.
    Text that happens to contain "<pad>" etc. is encoded as plain text, never as the special id,
    so user data cannot inject an end-of-sequence.
    """

    def __init__(self, tokenizer: Tokenizer, src_lang: str, tgt_lang: str):
        self._tok = tokenizer
        self._tok.encode_special_tokens = True  # specials only ever come from our own code
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        names = _special_tokens(src_lang, tgt_lang)
        ids = [tokenizer.token_to_id(name) for name in names]
        if ids != [0, 1, 2]:
            raise ValueError(f"expected special tokens {names} at ids [0, 1, 2], found {ids}")
        self.eos_src_id, self.eos_tgt_id, self.pad_id = ids

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        src_lang: str = "de",
        tgt_lang: str = "en",
        min_frequency: int = 2,
    ) -> TranslationTokenizer:
        """Learn BPE merges on `texts` (pass sentences of both sides); deterministic for the
        same texts. The learned vocabulary may stay below `vocab_size` on a small corpus."""
        specials = _special_tokens(src_lang, tgt_lang)
        if vocab_size < 256 + len(specials):
            raise ValueError(
                f"vocab_size must be >= {256 + len(specials)} (256 bytes + {len(specials)} "
                f"special tokens), got {vocab_size}"
            )
        texts = list(texts)
        if not texts:
            raise ValueError("no training texts for the tokenizer")
        tok = Tokenizer(models.BPE())
        # No prefix space: "Hallo" and " Hallo" stay different, so decoding is exact.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,  # 2, as ByteLevelBPETokenizer (the course) uses
            special_tokens=specials,  # first, so they get ids 0, 1, 2
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, src_lang, tgt_lang)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer as one JSON file (the standard `tokenizers` format), atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self._tok.to_str(pretty=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> TranslationTokenizer:
        """Read a file written by `save`; the languages come back from the special tokens."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception (e.g. EOF)
            raise ValueError(
                f"{path} is not a readable tokenizer file ({e}); delete it and the run retrains "
                "it from the same data"
            ) from None
        src, tgt = (tok.id_to_token(i) for i in (0, 1))
        if not (src and tgt and src.startswith("<eos_") and tgt.startswith("<eos_")):
            raise ValueError(f"{path}: ids 0, 1 are {src!r}, {tgt!r}, not <eos_xx> tokens")
        return cls(tok, src[5:-1], tgt[5:-1])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Same as [encode(t) for t in texts], in parallel (Rust threads)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; special tokens (eos, pad) are dropped."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids outside [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=True)


def _special_tokens(src_lang: str, tgt_lang: str) -> list[str]:
    for lang in (src_lang, tgt_lang):
        if not lang or not lang.isalnum():
            raise ValueError(f"language code must be non-empty letters/digits, got {lang!r}")
    if src_lang == tgt_lang:
        raise ValueError(f"source and target language are both {src_lang!r}")
    return [f"<eos_{src_lang}>", f"<eos_{tgt_lang}>", "<pad>"]


# --------------------------------------------------------------------------------------------
# Layout: src <eos_src> tgt <eos_tgt>


def _layout(src_ids: list[int], tgt_ids: list[int], tok: TranslationTokenizer) -> Example:
    seq = np.array(src_ids + [tok.eos_src_id] + tgt_ids + [tok.eos_tgt_id], np.int32)  # (L,)
    inputs, targets = seq[:-1], seq[1:].copy()  # (L - 1,) each: position i predicts seq[i + 1]
    # Targets at positions 0 .. len(src) - 1 are source tokens or <eos_src>: no loss there.
    # Position len(src) reads <eos_src> and predicts the first target token: loss.
    targets[: len(src_ids)] = IGNORE
    return inputs, targets


def encode_pair(tok: TranslationTokenizer, src: str, tgt: str) -> Example:
    """One training example: (inputs, targets), both (L - 1,) int32 with L = layout length;
    targets are IGNORE wherever the next token is a source token or <eos_src>."""
    return _layout(tok.encode(src), tok.encode(tgt), tok)


def encode_pairs(tok: TranslationTokenizer, pairs: Sequence[Pair]) -> list[Example]:
    """encode_pair over many pairs, tokenizing in batches (fast on 100k+ pairs)."""
    src_ids = tok.encode_batch([s for s, _ in pairs])
    tgt_ids = tok.encode_batch([t for _, t in pairs])
    return [_layout(s, t, tok) for s, t in zip(src_ids, tgt_ids, strict=True)]


def filter_pairs(
    pairs: Sequence[Pair],
    max_words: int | None = None,
    max_tokens: int | None = None,
    tokenizer: TranslationTokenizer | None = None,
) -> tuple[list[Pair], int]:
    """Keep pairs that are short enough; returns (kept, number dropped), for the caller to print.

    max_words: the course's rule, len(src.split()) + len(tgt.split()) < max_words (hw2: 40).
    max_tokens: the whole layout `src <eos_src> tgt <eos_tgt>` has <= max_tokens tokens
    (the model's context length; needs `tokenizer`).
    """
    if max_tokens is not None and tokenizer is None:
        raise ValueError("filtering on max_tokens needs the tokenizer")
    n_src = n_tgt = [0] * len(pairs)
    if max_tokens is not None:
        n_src = [len(ids) for ids in tokenizer.encode_batch([s for s, _ in pairs])]
        n_tgt = [len(ids) for ids in tokenizer.encode_batch([t for _, t in pairs])]
    kept = []
    for (src, tgt), a, b in zip(pairs, n_src, n_tgt, strict=True):
        if max_words is not None and len(src.split()) + len(tgt.split()) >= max_words:
            continue
        if max_tokens is not None and a + b + 2 > max_tokens:  # + <eos_src>, <eos_tgt>
            continue
        kept.append((src, tgt))
    return kept, len(pairs) - len(kept)


# --------------------------------------------------------------------------------------------
# Batching


def bucket_batches(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    pool_batches: int = 100,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """Batches of example indices with similar lengths, so little of each batch is padding.

    Shuffle, cut into pools of `pool_batches` batches, sort each pool by length, cut it into
    batches, shuffle the batch order. Sorting only within a pool keeps batches random from
    epoch to epoch. A pure function of (seed, epoch): a resumed run sees the same batches.
    Every index appears exactly once, unless drop_last drops the one short batch.
    shuffle=False (evaluation): pools in index order, batches in pool order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if pool_batches < 1:
        raise ValueError(f"pool_batches must be >= 1, got {pool_batches}")
    lengths = np.asarray(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    pool = batch_size * pool_batches  # a multiple of batch_size: only the last batch is short
    batches = []
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def padded_length(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (>= 1): few distinct shapes, few XLA recompiles."""
    return -(-n // multiple) * multiple


def collate(
    examples: Sequence[Example], pad_id: int, length: int | None = None
) -> dict[str, np.ndarray]:
    """Right-pad examples into {"inputs", "targets"}: (B, T) int32 each, T = `length` or the
    longest example. Inputs are padded with pad_id, targets with IGNORE (no loss)."""
    if not examples:
        raise ValueError("collate needs at least one example")
    longest = max(len(x) for x, _ in examples)
    T = longest if length is None else length
    if longest > T:
        raise ValueError(f"length {length} is shorter than the longest example ({longest})")
    inputs = np.full((len(examples), T), pad_id, np.int32)  # (B, T)
    targets = np.full((len(examples), T), IGNORE, np.int32)  # (B, T)
    for b, (x, y) in enumerate(examples):
        if len(x) != len(y):
            raise ValueError(f"example {b}: {len(x)} inputs but {len(y)} targets")
        inputs[b, : len(x)], targets[b, : len(y)] = x, y
    return {"inputs": inputs, "targets": targets}
