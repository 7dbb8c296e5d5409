"""Text -> tokens -> TransformerLM training -> checkpoint -> generate.py, end to end on CPU."""

import os
import subprocess
import sys

import pytest
from conftest import BPE_DIR, ROOT, needs_bpe, tiny_run

from jaxllm.data.prepare import prepare_text_files
from jaxllm.plot import plot_run
from jaxllm.train.loop import train

STORY = (
    "Once upon a time there was a little cat named Tom. Tom liked to play in the sun. "
    "One day he saw a big red ball and ran after it. He was very happy.\n"
)


@pytest.mark.slow  # prepare, train to memorise, generate.py in a process
@needs_bpe
def test_tokens_train_generate(tmp_path, monkeypatch):
    text = tmp_path / "stories.txt"
    text.write_text("<|endoftext|>\n".join(STORY * (i % 3 + 1) for i in range(40)))
    prepare_text_files(
        [text],
        tmp_path / "train.bin",
        val_out_path=tmp_path / "val.bin",
        val_fraction=0.1,
        bpe_dir=BPE_DIR,
        workers=1,
    )
    monkeypatch.setenv("JAXLLM_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("JAXLLM_BPE_DIR", str(BPE_DIR))
    run = tmp_path / "run"
    cfg = tiny_run(
        run,
        "--model.d_ff=64",
        "--model.n_heads=2",
        "--model.context_length=32",
        "--execution.compute_dtype=float32",
        "--execution.dropout=0.0",
        "--execution.attention_impl=xla",
        "--train.batch_size=8",
        "--train.steps=60",
        "--train.eval_every=30",
        "--train.eval_batches=2",
        "--train.checkpoint_every=0",
        "--optim.warmup_steps=5",
        "--optim.lr=1e-2",
        "--data.tokens.train_path=train.bin",
        "--data.tokens.val_path=val.bin",
        preset="tinystories.yaml",
    )
    res = train(cfg)
    assert res.losses[-1] < 0.5 * res.losses[0]  # memorises the repeated story
    assert plot_run(run).is_file()
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "generate.py"),
            "--run-dir",
            str(run),
            "--prompt",
            "Once upon a time",
            "--prompt",  # the document separator typed in a prompt (tiktoken refuses it by default)
            "<|endoftext|>Once upon a time",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "JAXLLM_BPE_DIR": str(BPE_DIR)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time") and "there was" in out.stdout
    assert "\n<|endoftext|>Once upon a time" in out.stdout
    # config overrides as train.py takes them: the BPE files and how the model runs, not the
    # model itself (the checkpoint's)
    args = [sys.executable, str(ROOT / "generate.py"), "--run-dir", str(run), "--temperature=0",
            "--prompt", "Once upon a time", "--max-new-tokens", "12"]  # fmt: skip
    again = subprocess.run(
        [*args, f"--data.tokens.bpe_dir={BPE_DIR}", "--execution.scan_layers=true"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout.split("\n")[0] == out.stdout.split("\n")[0]
    fixed = subprocess.run([*args, "--model.n_layers=2"], capture_output=True, text=True)
    assert (
        fixed.returncode == 2 and "--model.n_layers: a trained run's model is its" in fixed.stderr
    )
    bad = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), "--run-dir", str(tmp_path), "--prompt", "x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not a train.py run dir" in bad.stderr
