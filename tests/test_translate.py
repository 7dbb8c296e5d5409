"""Machine translation end to end on CPU: a synthetic parallel corpus (a word-for-word mapping
with reordering) that the decoder-only model learns to BLEU > 90; outputs, files and resume."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from jaxllm.config import ConfigError, load_config
from jaxllm.data.sources import make_source
from jaxllm.train.loop import train

SRC_WORDS = "haus katze hund baum auto buch tisch stuhl vogel blume fisch brot".split()  # noqa: SIM905
TGT_WORDS = "house cat dog tree car book table chair bird flower fish bread".split()  # noqa: SIM905


def synthetic(n: int, seed: int) -> list[tuple[str, str]]:
    """German-ish source of 2-5 words; target = the word-for-word mapping with each adjacent
    pair of words swapped (so the model must reorder, not copy position by position)."""
    rng = random.Random(seed)
    lookup = dict(zip(SRC_WORDS, TGT_WORDS, strict=True))
    pairs = []
    for _ in range(n):
        src = [rng.choice(SRC_WORDS) for _ in range(rng.randint(2, 5))]
        tgt = [lookup[w] for w in src]
        for i in range(0, len(tgt) - 1, 2):
            tgt[i], tgt[i + 1] = tgt[i + 1], tgt[i]
        pairs.append((" ".join(src).capitalize() + ".", " ".join(tgt).capitalize() + "."))
    return pairs


def write_split(data_dir: Path, name: str, pairs) -> None:
    (data_dir / f"{name}.de").write_text("\n".join(s for s, _ in pairs) + "\n")
    (data_dir / f"{name}.en").write_text("\n".join(t for _, t in pairs) + "\n")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    data = tmp_path / "data" / "toy"
    data.mkdir(parents=True)
    write_split(data, "train", synthetic(3000, 0))
    write_split(data, "val", synthetic(100, 1))
    write_split(data, "test", synthetic(100, 2))
    monkeypatch.setenv("JAXLLM_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def toy_config(run_dir: Path, *extra: str):
    return load_config(
        ROOT / "configs/multi30k.yaml",
        [
            "--model.context_length=48",
            "--model.d_model=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--execution.dropout=0.0",
            "--model.vocab_size=512",
            "--execution.compute_dtype=float32",
            "--model.init_std=0.1",
            "--data.translation.train=[toy/train]",
            "--data.translation.valid=toy/val",
            "--data.translation.test=toy/test",
            "--data.translation.vocab_size=512",
            "--optim.lr=3e-3",
            "--optim.warmup_steps=20",
            "--train.batch_size=64",
            "--train.epochs=4",
            "--train.progress=false",
            f"--train.run_dir={run_dir}",
            *extra,
        ],
    )


@pytest.mark.slow
def test_synthetic_translation_reaches_bleu_90(corpus):
    run = corpus / "run"
    result = train(toy_config(run))
    assert result.bleu > 90, result.bleu
    epochs = sorted(run.glob("eval_results_epoch*.json"))
    assert len(epochs) == 4
    last = json.loads((run / "eval_results_epoch4.json").read_text())
    assert last["bleu"] == result.bleu and last["validation_loss"] == result.eval_loss
    assert last["bleu_signature"].startswith("nrefs:1|case:mixed")
    hyps = (run / last["hypotheses"]).read_text().splitlines()
    assert len(hyps) == 100
    assert (run / "tokenizer.json").is_file()

    # The module CLI re-scores the best checkpoint on the test split with the saved tokenizer,
    # dropping (and counting) a pair that does not fit the context, as training does.
    long_pair = ("Haus " * 40 + "katze.", "House " * 40 + "cat.")
    write_split(corpus / "data" / "toy", "test", [*synthetic(100, 2), long_pair])
    out = subprocess.run(
        [sys.executable, "-m", "jaxllm.translate", "--run-dir", str(run), "--split", "test",
         "--data.translation.beam_width=3"],
        capture_output=True, text=True, cwd=ROOT, env=_env(corpus),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "nrefs:1" in out.stdout and "on 100 test pairs" in out.stdout
    assert "test: dropped 1 of 101 pairs" in out.stderr
    bleu = float(out.stdout.split()[1])
    assert bleu > 90, out.stdout


def _env(corpus: Path) -> dict:
    import os

    return {**os.environ, "JAXLLM_DATA_DIR": str(corpus / "data")}


def test_source_masks_the_source_side_and_reuses_the_tokenizer(corpus):
    run = corpus / "run"
    cfg = toy_config(run)
    source = make_source(cfg)
    assert source.steps_per_epoch == 3000 // 64
    batch = source.train_batch(0)
    assert batch["inputs"].shape[1] % 16 == 0  # padded to pad_multiple
    tok = source.tokenizer
    for x, y in zip(batch["inputs"], batch["targets"], strict=True):
        n = int((y != -1).sum())
        eos_src = list(x).index(tok.eos_src_id)
        assert (y[:eos_src] == -1).all()  # no loss on the source or at <eos_src>'s input
        assert y[eos_src + n - 1] == tok.eos_tgt_id  # the loss ends with <eos_tgt>
    assert make_source(cfg).tokenizer.encode("Haus katze.") == tok.encode("Haus katze.")
    # the same epoch gives the same batches; the next epoch others
    again = make_source(cfg)
    assert (again.train_batch(5)["inputs"] == source.train_batch(5)["inputs"]).all()
    # a run dir's tokenizer trained from other settings or data is refused, not reused
    with pytest.raises(ValueError, match=r"tokenizer.json was trained from other .*vocab_size "
                       r"512 -> 400"):  # fmt: skip
        make_source(toy_config(run, "--data.translation.vocab_size=400"))
    write_split(corpus / "data" / "toy", "other", synthetic(3000, 7))
    with pytest.raises(ValueError, match=r"texts_sha256 "):
        make_source(toy_config(run, "--data.translation.train=[toy/other]"))


def test_padding_never_exceeds_the_context(corpus):
    # pad_multiple 100 would round every batch to 100 tokens; the model's context (48) caps it
    source = make_source(toy_config(corpus / "run_pad", "--data.translation.pad_multiple=100"))
    assert source.train_batch(0)["inputs"].shape[1] == 48
    assert all(b["inputs"].shape[1] == 48 for b in source.eval_batches())


def test_translation_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.epochs needs data with epochs"):
        load_config(ROOT / "configs/ar.yaml", ["--train.epochs=2", "--train.steps=null",
                                              "--train.eval_every=null"])  # fmt: skip
    with pytest.raises(ConfigError, match="exactly one of train.steps"):
        load_config(ROOT / "configs/multi30k.yaml", ["--train.steps=100"])
    with pytest.raises(ConfigError, match="model.vocab_size .* must be >= data.translation"):
        load_config(ROOT / "configs/multi30k.yaml", ["--model.vocab_size=5000"])


def test_misaligned_files_are_reported(corpus):
    data = corpus / "data" / "toy"
    (data / "val.en").write_text("only one line\n")
    with pytest.raises(ValueError, match=r"val.de has 100 lines, .*val.en has 1"):
        make_source(toy_config(corpus / "run"))


def test_each_batch_may_fill_the_context_after_its_own_prompts(monkeypatch):
    """A long source in one batch does not cut another batch's translations short: each batch
    is padded to its own longest prompt (rounded up to PAD_MULTIPLE) and may generate up to the
    context. Batch sizes below 1 are refused."""
    from types import SimpleNamespace

    from jaxllm import bleu

    calls = []

    def fake_generate(model, params, batch, max_new, sampling, pad_to):
        calls.append((len(batch), max(map(len, batch)), pad_to, max_new, sampling.vocab_limit))
        return [[5] for _ in batch]

    monkeypatch.setattr(bleu, "generate", fake_generate)
    tok = SimpleNamespace(encode=lambda s: [7] * len(s.split()), eos_src_id=0, eos_tgt_id=1,
                          decode=lambda ids: "x", vocab_size=50)  # fmt: skip
    model = SimpleNamespace(cfg=SimpleNamespace(context_length=40, vocab_size=64))
    sources = ["w " * 30, "w " * 4, "w " * 5, "w " * 2]  # prompts of 31, 5, 6 and 3 tokens
    assert bleu.translate(model, None, tok, sources, batch_size=2) == ["x"] * 4
    # the short batch may write 32 tokens; a tokenizer of 50 ids: the model's 14 others are
    # never decoded (the tokenizer could not detokenize them: "ids outside [0, 50)")
    assert calls == [(2, 5, 8, 32, 50), (2, 31, 32, 8, 50)]
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        bleu.translate(model, None, tok, sources, batch_size=0)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--limit", "0"], "error: --limit must be >= 1, got 0"),  # checked first: no run dir
        (["--train.batch_size=0"], "train.batch_size must be > 0"),  # before any checkpoint
        (["--model.n_layers=2"], "--model.n_layers: a trained run's model is its checkpoint's"),
        (["--beam-width", "3"], "unknown key 'beam-width'"),
    ],
)
def test_cli_refuses_bad_settings_before_loading_a_checkpoint(tmp_path, capsys, args, message):
    from jaxllm import translate
    from jaxllm.config import save_config

    save_config(load_config(ROOT / "configs/multi30k.yaml"), tmp_path / "config.yaml")
    with pytest.raises(SystemExit) as e:  # the run dir holds no checkpoint
        translate.main(["--run-dir", str(tmp_path), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_hypothesis_files_keep_one_line_per_hypothesis():
    """A decoded newline token inside a hypothesis split it over two lines of the file."""
    from jaxllm.bleu import hypotheses_text

    text = hypotheses_text(["a cat.", "two\nlines", "cr\rhere", ""])
    assert text.split("\n")[:-1] == ["a cat.", "two lines", "cr here", ""]


def test_parallel_files_bom_lone_cr_and_bad_bytes(tmp_path):
    """A UTF-8 BOM is dropped from the first sentence, a lone CR stays inside its line, and
    bytes that are not UTF-8 are one error naming the file, line and byte."""
    from jaxllm.data.translation import load_parallel_files

    (tmp_path / "a.de").write_bytes("\ufeffZwei Hunde.\nein\rHaus.\n".encode())
    (tmp_path / "a.en").write_bytes(b"Two dogs.\na house.\n")
    assert load_parallel_files(tmp_path / "a.de", tmp_path / "a.en") == [
        ("Zwei Hunde.", "Two dogs."), ("ein\rHaus.", "a house."),
    ]  # fmt: skip
    (tmp_path / "b.de").write_bytes(b"gut\nschlecht \xff\n")
    with pytest.raises(ValueError, match=r"b.de is not UTF-8: line 2, byte 13"):
        load_parallel_files(tmp_path / "b.de", tmp_path / "a.en")
    (tmp_path / "c.de").write_bytes(b"\xef\xbb\xbfab\nc\xff\n")  # counted past the BOM too
    with pytest.raises(ValueError, match=r"c.de is not UTF-8: line 2, byte 7"):
        load_parallel_files(tmp_path / "c.de", tmp_path / "a.en")


def test_length_penalty_is_bounded():
    """A large alpha would overflow ((5 + len) / 6) ** alpha: refused in the settings."""
    from jaxllm.generate import BeamSearch

    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearch(length_penalty=1000.0)
    with pytest.raises(ConfigError, match="length_penalty"):
        load_config(ROOT / "configs/multi30k.yaml", ["--data.translation.length_penalty=11"])


def test_a_truncated_tokenizer_file_is_one_error(tmp_path):
    """A cut tokenizer.json is one ValueError naming the file (tokenizers raises a bare
    `Exception: EOF while parsing`)."""
    from jaxllm.data.translation import TranslationTokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    with pytest.raises(ValueError, match=r"tokenizer.json is not a readable tokenizer file"):
        TranslationTokenizer.load(tmp_path / "tokenizer.json")
