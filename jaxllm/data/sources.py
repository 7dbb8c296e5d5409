"""Batch sources for the training loop: `train_batch(step)` and `eval_batches()`.

A train batch is a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would: the data-sampler state is just the step number. A source with epochs
(translation) also has `steps_per_epoch`; a source may add its own measures to every evaluation
through `evaluate_extras` (translation: BLEU after each epoch).

Several processes (jaxllm/distributed.py): `train_batch(step, rows)` makes only rows
[start, stop) of the global batch, the process's share: the same examples as one process would
use, partitioned, so no example is read twice per step and the run computes the same thing on
any number of processes. The loop passes `rows` only when there are several processes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxllm.atomic_file import write_text_atomic
from jaxllm.bleu import hypotheses_text, score_translations
from jaxllm.config import Config, TranslationConfig
from jaxllm.data import associative_recall as ar
from jaxllm.data import translation as mt
from jaxllm.data.token_file import load_tokens, recorded_sha256

DATA_DIR_ENV = "JAXLLM_DATA_DIR"

Batch = dict[str, np.ndarray]


class BatchSource(Protocol):
    """What the training loop reads. A source may also offer `evaluate_extras(model, variables,
    ev, epoch, out) -> Extras | None`, called after every evaluation with its record (ev:
    step, loss, accuracy; epoch: None unless the run is trained by epochs; out: the run dir,
    None on all but the process that writes files)."""

    steps_per_epoch: int | None  # None: no epochs (train by steps)

    def train_batch(self, step: int) -> Batch: ...

    def eval_batches(self) -> Iterator[Batch]: ...


class Extras(NamedTuple):
    """A source's own measures of one evaluation."""

    record: dict[str, Any]  # more fields of the eval record in metrics.jsonl
    line: str  # appended to the evaluation's console line
    score: float  # lower is better: the best checkpoint is chosen by it, not by the eval loss


@dataclass
class RecallSource:
    train: ar.RecallSplit
    test: ar.RecallSplit
    batch_size: int
    seed: int
    steps_per_epoch = None

    def train_batch(self, step: int, rows: slice | None = None) -> Batch:
        return ar.train_batch(self.train, self.batch_size, step, self.seed, rows)

    def eval_batches(self) -> Iterator[Batch]:
        return ar.eval_batches(self.test, self.batch_size)


@dataclass
class TokenSource:
    """Random windows of a token file for training; fixed evenly spaced windows for eval."""

    train: np.ndarray  # (N,) memmap
    val: np.ndarray  # (M,) memmap
    batch_size: int
    context_length: int
    eval_batches_count: int
    seed: int
    # What the files held when opened ({config key: the sidecar's tokens_sha256}): a checkpoint
    # records it, and a resume on other data is refused (jaxllm.train.loop).
    fingerprint: dict[str, str | None] | None = None
    steps_per_epoch = None

    def train_batch(self, step: int, rows: slice | None = None) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        x, y = get_batch(self.train, self.batch_size, self.context_length, rng, rows)
        return {"inputs": x, "targets": y}

    def eval_batches(self) -> Iterator[Batch]:
        for x, y in iter_eval_batches(
            self.val, self.batch_size, self.context_length, self.eval_batches_count
        ):
            yield {"inputs": x, "targets": y}


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
    tokens: np.ndarray,
    batch_size: int,
    context_length: int,
    rng: np.random.Generator,
    rows: slice | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Random windows: inputs (B, T) int32 and targets (B, T) int32 = inputs shifted by one.

    Window starts are uniform over every valid offset. `TokenSource` seeds rng with
    (seed, step), so a batch is a pure function of both and a resumed run needs no saved state.
    `rows`: read only those windows of the batch (one process's share; None: all B).
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    _check_batch_args(tokens, batch_size, context_length)
    starts = rng.integers(0, tokens.shape[0] - context_length, size=batch_size)
    return _windows(tokens, starts if rows is None else starts[rows], context_length)


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, context_length: int, num_batches: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """num_batches fixed (inputs, targets) batches, (B, T) int32, at evenly spaced offsets
    (arguments checked by the config and make_source)."""
    last_start = tokens.shape[0] - context_length - 1
    starts = np.linspace(0, last_start, batch_size * num_batches).round().astype(np.int64)
    return (
        _windows(tokens, starts[i : i + batch_size], context_length)
        for i in range(0, starts.size, batch_size)
    )


@dataclass(eq=False)  # hashed by identity: _epoch caches per source
class TranslationSource:
    """`src <eos_src> tgt <eos_tgt>` examples in length buckets (jaxllm.data.translation).

    Step s is batch s % steps_per_epoch of epoch s // steps_per_epoch; each epoch's bucketed
    batches are a pure function of (seed, epoch). Full batches only while training (one batch
    shape per padded length, so few recompiles); evaluation covers every validation pair."""

    tokenizer: mt.TranslationTokenizer
    train: list[mt.Example]
    valid: list[mt.Example]
    score_pairs: list[mt.Pair]  # scored with BLEU after every epoch
    cfg: TranslationConfig
    batch_size: int
    seed: int
    context_length: int  # the model's; batches are padded up to pad_multiple but never past it

    def __post_init__(self) -> None:
        if len(self.train) < self.batch_size:
            raise ValueError(
                f"{len(self.train)} training pairs is fewer than one batch "
                f"(train.batch_size {self.batch_size})"
            )
        self.steps_per_epoch = len(self.train) // self.batch_size

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one source per run; epochs are consecutive)
    def _epoch(self, epoch: int) -> list[np.ndarray]:
        lengths = [len(x) for x, _ in self.train]
        return mt.bucket_batches(lengths, self.batch_size, self.seed, epoch, drop_last=True)

    def _collate(self, examples: list[mt.Example], like: list[mt.Example] | None = None) -> Batch:
        """The examples padded to the batch `like`'s length (default: theirs)."""
        longest = max(len(x) for x, _ in like or examples)
        length = min(mt.padded_length(longest, self.cfg.pad_multiple), self.context_length)
        return mt.collate(examples, self.tokenizer.pad_id, length)

    def train_batch(self, step: int, rows: slice | None = None) -> Batch:
        epoch, i = divmod(step, self.steps_per_epoch)
        batch = [self.train[j] for j in self._epoch(epoch)[i]]
        # rows: one process's share, padded to the global batch's length (all agree on it)
        return self._collate(batch if rows is None else batch[rows], like=batch)

    def eval_batches(self) -> Iterator[Batch]:
        lengths = [len(x) for x, _ in self.valid]
        for idx in mt.bucket_batches(lengths, self.batch_size, 0, 0, shuffle=False):
            yield self._collate([self.valid[j] for j in idx])

    def evaluate_extras(
        self, model: Any, variables: Any, ev: dict, epoch: int | None, out: Path | None
    ) -> Extras | None:
        """After each epoch (None when the run is not trained by epochs): BLEU of the model's
        translations of `score_pairs`, the best checkpoint's measure (a translation model's
        BLEU keeps rising after its eval loss turns up). Into `out`: the hypotheses
        (hypotheses_epochE.txt) and the scores (eval_results_epochE.json)."""
        if epoch is None:
            return None
        scores, hyps = score_translations(
            model, variables, self.tokenizer, self.score_pairs, self.cfg, self.batch_size
        )
        if out is not None:
            hyp_file = out / f"hypotheses_epoch{epoch}.txt"
            result = {"epoch": epoch, "step": ev["step"], "validation_loss": ev["loss"]}
            result |= scores | {"hypotheses": hyp_file.name}
            write_text_atomic(hyp_file, hypotheses_text(hyps))
            write_text_atomic(out / f"eval_results_epoch{epoch}.json", json.dumps(result, indent=2))
        bleu = scores["bleu"]
        return Extras({"epoch": epoch, "bleu": bleu}, f"  BLEU {bleu:.2f} (epoch {epoch})", -bleu)


def load_translation_split(tc: TranslationConfig, which: str) -> list[mt.Pair]:
    """The pairs of split `which` ("train", "valid" or "test") as the config names them."""
    names = {"train": tc.train, "valid": (tc.valid,), "test": (tc.test,)}[which]
    pairs: list[mt.Pair] = []
    for name in names:
        if tc.hf_dataset is not None:
            pairs += mt.load_hf_parallel(tc.hf_dataset, name, tc.src_lang, tc.tgt_lang)
        else:
            prefix = str(resolve_data_path(name))
            src, tgt = f"{prefix}.{tc.src_lang}", f"{prefix}.{tc.tgt_lang}"
            with _where_relative_paths_point(name):
                pairs += mt.load_parallel_files(src, tgt)
    return pairs


def translation_tokenizer(cfg: Config, train_pairs: list[mt.Pair]) -> mt.TranslationTokenizer:
    """The run dir's tokenizer.json if it exists (resume, evaluation: same ids), else a BPE
    trained on the training pairs and saved there (by process 0 of several; the others wait
    for it and load it)."""
    if jax.process_count() == 1:
        return _run_dir_tokenizer(cfg, train_pairs)
    tok = _run_dir_tokenizer(cfg, train_pairs) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("jaxllm-translation-tokenizer")
    return tok or _run_dir_tokenizer(cfg, [])


def _tokenizer_origin(cfg: Config, texts: list[str]) -> dict[str, Any]:
    """What a run dir's tokenizer was trained from: its settings and a hash of its texts."""
    tc = cfg.data.translation
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    return {"vocab_size": tc.vocab_size, "texts": len(texts), "texts_sha256": digest}


def _run_dir_tokenizer(cfg: Config, train_pairs: list[mt.Pair]) -> mt.TranslationTokenizer:
    """The run dir's tokenizer, refused where it was trained from other settings or texts
    than `train_pairs` (none: evaluation, nothing to compare); else one trained and saved,
    with what it was trained from beside it (tokenizer.origin.json)."""
    tc = cfg.data.translation
    path = Path(cfg.train.run_dir) / "tokenizer.json"
    origin_path = path.with_name("tokenizer.origin.json")
    texts = [s for pair in train_pairs for s in pair]
    if path.is_file():
        tok = mt.TranslationTokenizer.load(path)
        if (tok.src_lang, tok.tgt_lang) != (tc.src_lang, tc.tgt_lang):
            raise ValueError(
                f"{path} is a {tok.src_lang}->{tok.tgt_lang} tokenizer; the config asks for "
                f"{tc.src_lang}->{tc.tgt_lang}"
            )
        if texts and origin_path.is_file():  # older run dirs have no record: nothing to check
            was, now = json.loads(origin_path.read_text()), _tokenizer_origin(cfg, texts)
            diff = [f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v]
            if diff:
                raise ValueError(
                    f"{path} was trained from other settings or data ({'; '.join(diff)}): "
                    "its ids would not match this run's. Choose another --train.run_dir, or "
                    "delete the tokenizer (and any checkpoints that use its ids) to train anew"
                )
        return tok
    if not texts:
        raise FileNotFoundError(f"{path} not found: the run dir has no translation tokenizer")
    tok = mt.TranslationTokenizer.train(texts, tc.vocab_size, tc.src_lang, tc.tgt_lang)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(origin_path, json.dumps(_tokenizer_origin(cfg, texts), indent=2))
    tok.save(path)  # after its record: a tokenizer file never lacks one
    return tok


def filter_translation_pairs(
    pairs: list[mt.Pair], what: str, cfg: Config, tok: mt.TranslationTokenizer
) -> list[mt.Pair]:
    """The pairs within data.translation.max_words and the model's context, in order; the
    dropped ones are counted on stderr (training and scoring apply the same rule)."""
    tc = cfg.data.translation
    kept, dropped = mt.filter_pairs(pairs, tc.max_words, cfg.model.context_length, tok)
    if dropped and jax.process_index() == 0:  # one process prints
        rule = f"max_words {tc.max_words} or " if tc.max_words else ""
        print(
            f"{what}: dropped {dropped} of {len(pairs)} pairs longer than {rule}the context "
            f"({cfg.model.context_length} tokens)",
            file=sys.stderr,
        )
    if not kept:
        raise ValueError(f"{what}: no pair is left after the length filter")
    return kept


def make_translation_source(cfg: Config) -> TranslationSource:
    tc = cfg.data.translation
    train_pairs = load_translation_split(tc, "train")
    tok = translation_tokenizer(cfg, train_pairs)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tok.vocab_size} ids; model.vocab_size is {cfg.model.vocab_size}"
        )
    train = mt.encode_pairs(tok, filter_translation_pairs(train_pairs, "train", cfg, tok))
    valid_pairs = filter_translation_pairs(load_translation_split(tc, "valid"), "valid", cfg, tok)
    score_pairs = valid_pairs
    if tc.bleu_split == "test":
        score_pairs = filter_translation_pairs(load_translation_split(tc, "test"), "test", cfg, tok)
        score_pairs = score_pairs[: tc.test_limit]
    return TranslationSource(
        tok, train, mt.encode_pairs(tok, valid_pairs), score_pairs, tc,
        cfg.train.batch_size, cfg.train.seed, cfg.model.context_length,
    )  # fmt: skip


def resolve_data_path(path: str) -> Path:
    """Relative paths resolve against $JAXLLM_DATA_DIR when it is set, else the cwd."""
    p = Path(path).expanduser()
    base = os.environ.get(DATA_DIR_ENV)
    return p if p.is_absolute() or not base else Path(base) / p


@contextlib.contextmanager
def _where_relative_paths_point(path: str) -> Iterator[None]:
    """A data file not found under a relative name: say what the name was resolved against."""
    try:
        yield
    except FileNotFoundError as e:
        if Path(path).expanduser().is_absolute():
            raise
        base = os.environ.get(DATA_DIR_ENV)
        unset = f"the current directory {Path.cwd()}: ${DATA_DIR_ENV} is unset"
        against = f"${DATA_DIR_ENV}={base}" if base else unset
        hint = f"relative data paths resolve against {against}"
        if e.errno is not None:  # an OSError of the system: keep errno and filename
            raise FileNotFoundError(e.errno, f"{e.strerror} ({hint})", e.filename) from None
        raise FileNotFoundError(f"{e} ({hint})") from None


def make_source(cfg: Config) -> BatchSource:
    if cfg.data.kind == "translation":
        return make_translation_source(cfg)
    if cfg.data.kind == "associative_recall":
        train, test = ar.make_splits(cfg.data.associative_recall)
        return RecallSource(train, test, cfg.train.batch_size, cfg.train.seed)
    tc, vocab = cfg.data.tokens, cfg.model.vocab_size  # ids >= vocab: refused on open
    files, fingerprint = {}, {}
    for key in ("train_path", "val_path"):
        name = getattr(tc, key)
        path = resolve_data_path(name)
        with _where_relative_paths_point(name):
            files[key] = load_tokens(path, vocab_size=vocab)
        fingerprint[f"data.tokens.{key}"] = recorded_sha256(path)
        need = cfg.model.context_length + 1  # one window; checked now, not at the first eval
        if files[key].shape[0] < need:
            raise ValueError(
                f"data.tokens.{key} {path} holds {files[key].shape[0]} tokens: a window needs "
                f"model.context_length + 1 = {need} (use a longer file or a shorter context)"
            )
    train, val = files["train_path"], files["val_path"]
    return TokenSource(
        train,
        val,
        cfg.train.batch_size,
        cfg.model.context_length,
        cfg.train.eval_batches,
        cfg.train.seed,
        fingerprint,
    )
