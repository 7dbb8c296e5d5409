"""Runs that survive faults: one process per run dir, honest resume, never a
diverged checkpoint, one-line errors from the CLIs."""

import importlib.util
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, TINY_RUN, tiny_run

from jaxllm.models import build_model
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.loop import NonFiniteLossError, ResumeConfigError, train
from jaxllm.train.optim import make_optimizer
from jaxllm.train.run_lock import RunDirLock, RunDirLockedError
from jaxllm.train.state import create_state


def cli(script, *args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True, text=True, cwd=cwd, timeout=300,
    )  # fmt: skip


def test_a_locked_run_dir_is_refused_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirLockedError, match="pid"):
            train(tiny_run(tmp_path))
        out = cli("train.py", *TINY_RUN, f"--train.run_dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
    assert f"pid {os.getpid()}" in out.stderr
    assert not (tmp_path / "checkpoints").exists()  # the refused run wrote nothing


def test_resume_says_where_it_starts_and_counts_only_its_steps(finished_run, capsys):
    # As if killed after the step-10 save: drop the step-20 checkpoints.
    for d in ("checkpoints/20", "best/20"):
        shutil.rmtree(finished_run / d, ignore_errors=True)
    result = train(tiny_run(finished_run))
    assert f"resuming from step 10 ({finished_run / 'checkpoints/10'})" in capsys.readouterr().err
    assert (result.start_step, result.final_step) == (10, 20)
    assert Checkpointer(finished_run).latest_step() == 20


def test_resume_with_other_settings_is_refused_with_the_differences(finished_run):
    run = finished_run
    with pytest.raises(ResumeConfigError, match=r"model.n_heads: 4 -> 2; optim.lr: 0.001 -> 0.002"):
        train(tiny_run(run, "--optim.lr=2e-3", "--model.n_heads=2"))
    with pytest.raises(ResumeConfigError, match="run length: 20 -> 40 steps, which changes"):
        train(tiny_run(run, "--train.steps=40"))
    # How a run is watched may change; the explicit flag lets a changed run go on.
    train(tiny_run(run, "--train.log_every=10"))
    longer = train(tiny_run(run, "--train.steps=30", "--train.allow_config_change=true"))
    assert longer.start_step == 20 and longer.final_step == 30


def test_without_config_yaml_a_resume_checks_against_the_checkpoints_config(finished_run):
    """config.yaml gone: the newest checkpoint's recorded config is the reference then."""
    (finished_run / "config.yaml").unlink()
    with pytest.raises(ResumeConfigError, match=r"optim.lr: 0.001 -> 0.003"):
        train(tiny_run(finished_run, "--optim.lr=3e-3"))


def test_a_fresh_start_refuses_a_best_checkpoint_left_by_an_earlier_run(finished_run):
    """checkpoints/ emptied, best/ kept: a new run from step 0 would never replace the old best
    (orbax keeps only newer steps)."""
    shutil.rmtree(finished_run / "checkpoints")
    with pytest.raises(FileExistsError, match=r"best holds checkpoint 20 of an earlier run"):
        train(tiny_run(finished_run, "--optim.lr=3e-3"))


def test_an_impossible_run_dir_is_one_error_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    out = cli("train.py", *TINY_RUN, f"--train.run_dir={tmp_path / 'afile/run'}")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def _token_file(path, ids):
    """A valid token file + sidecar without the BPE files (what `prepare` writes)."""
    from jaxllm.data import token_file as tf

    out = tf.AtomicTokenFile(path)
    out.write(np.asarray(ids, np.uint16), 1)
    out.finish(dict(tf.IDENTITY))
    out.publish()


def test_a_resume_on_remade_token_files_is_refused(tmp_path):
    """`prepare` re-run over the same paths with other text: the checkpoint records the files'
    sha256, so a resume on other tokens is refused."""
    rng = np.random.default_rng(0)
    for name in ("train.bin", "val.bin"):
        _token_file(tmp_path / name, rng.integers(0, 64, 4000))
    args = ["--model.context_length=16", "--model.d_ff=64",
            "--model.n_heads=2", "--execution.dropout=0", "--execution.compute_dtype=float32",
            "--train.batch_size=4",
            "--train.eval_batches=1", f"--data.tokens.train_path={tmp_path / 'train.bin'}",
            f"--data.tokens.val_path={tmp_path / 'val.bin'}"]  # fmt: skip
    run = tmp_path / "run"
    cfg = lambda *extra: tiny_run(run, *args, *extra, preset="tinystories.yaml")  # noqa: E731
    train(cfg())
    train(cfg())  # the same files: resumes (nothing left to run)
    _token_file(tmp_path / "train.bin", rng.integers(0, 64, 4000))
    with pytest.raises(ResumeConfigError, match=r"data.tokens.train_path: sha256 \w{12}\.\.\."):
        train(cfg())
    assert train(cfg("--train.allow_config_change=true")).final_step == 20


def test_a_longer_run_with_a_constant_schedule_may_resume(tmp_path):
    flat = ["--optim.min_lr=1e-3", "--optim.warmup_steps=0"]  # lr constant: same schedule
    train(tiny_run(tmp_path, *flat))
    assert train(tiny_run(tmp_path, "--train.steps=30", *flat)).start_step == 20


def test_divergence_stops_at_the_first_bad_step_and_no_checkpoint_holds_it(tmp_path):
    args = ["--train.steps=40", "--optim.lr=1e6", "--optim.grad_clip=0", "--optim.warmup_steps=0",
            "--train.checkpoint_every=1", "--train.log_every=50"]  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"non-finite at step \d+"):
        train(tiny_run(tmp_path, *args))
    cfg = tiny_run(tmp_path, *args)
    model = build_model(cfg.model, cfg.execution)
    template = create_state(
        model, make_optimizer(cfg.optim, 40), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)
    )
    ckpt = Checkpointer(tmp_path)
    steps = ckpt.latest.all_steps()
    assert steps and max(steps) < 50  # stopped at once, not at the next log step (50)
    for step in steps:  # every checkpoint that exists is finite
        state, _ = ckpt.restore(template, step=step)
        leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
        assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    ckpt.close()


def test_divergence_before_any_checkpoint_says_so(tmp_path):
    args = ["--train.steps=40", "--optim.lr=1e6", "--optim.grad_clip=0", "--optim.warmup_steps=0",
            "--train.checkpoint_every=0"]  # fmt: skip
    with pytest.raises(NonFiniteLossError, match="No checkpoint was saved before it"):
        train(tiny_run(tmp_path, *args))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--data.kind=tokens", "--model.vocab_size=50257", *TINY_RUN],
            "token file not found",
        ),  # fmt: skip
        (["--config", "BAD_YAML"], "is not valid YAML"),
        *(  # more of the same path (each a process): in the slow run
            pytest.param(args, message, marks=pytest.mark.slow)
            for args, message in [
                (["--optim.grad_clip=nan"], "optim.grad_clip must be a finite number"),
                (["--train.run_dir="], "train.run_dir must be a non-empty string"),
                (["--train.seed=-1"], "train.seed must be >= 0"),
            ]
        ),
    ],
)
def test_train_cli_errors_are_one_line(tmp_path, args, message):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n")
    args = [str(bad_yaml) if a == "BAD_YAML" else a for a in args]
    out = cli("train.py", f"--train.run_dir={tmp_path / 'r'}", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and message in out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("datasets") is not None,
    reason="the optional `datasets` extra is installed: the preset would go to the hub",
)
def test_a_missing_optional_extra_is_one_line(tmp_path):
    """The IWSLT14 preset reads the hub through `datasets`, an optional extra."""
    out = cli("train.py", "--config", str(ROOT / "configs/iwslt14.yaml"),
              f"--train.run_dir={tmp_path}", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pip install" in out.stderr and "datasets" in out.stderr


@pytest.mark.slow  # five train.py / generate.py processes
def test_resuming_a_changed_model_is_one_line(finished_run):
    run = [*TINY_RUN, f"--train.run_dir={finished_run}"]
    out = cli("train.py", *run, "--model.d_model=16")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "model.d_model: 32 -> 16" in out.stderr
    out = cli("train.py", *run, "--train.resume=false")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "already holds checkpoints" in out.stderr
    out = cli("train.py", *run)  # finished
    assert out.returncode == 0 and "done: ran 0 steps (20 -> 20)" in out.stdout
    assert "train loss - |" in out.stdout  # no step ran: no train loss, not "nan"
    out = cli("generate.py", "--run-dir", str(finished_run), "--prompt", "x")  # not a text model
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "trained on data.kind=associative_recall, not GPT-2-tokenized text" in out.stderr
    (finished_run / "config.yaml").write_text("model:\n  old_field: 1\n")  # another version's
    out = cli("train.py", *run)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "config.yaml (the run's saved config): unknown key(s) ['old_field']" in out.stderr


def test_generate_cli_errors_are_one_line(tmp_path):
    out = cli("generate.py", "--run-dir", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0")
    assert out.returncode == 2 and "--max-new-tokens must be >= 1" in out.stderr
    out = cli("generate.py", "--run-dir", str(tmp_path), "--prompt", "x")
    assert out.returncode == 2 and "not a train.py run dir" in out.stderr
    assert "Traceback" not in out.stderr


class _CorruptAt:
    """A batch source whose train batch at `step` holds ids beyond the vocabulary."""

    def __init__(self, source, step, bad_id):
        self.source, self.step, self.bad_id = source, step, bad_id
        self.steps_per_epoch = source.steps_per_epoch

    def train_batch(self, step):
        batch = dict(self.source.train_batch(step))
        if step == self.step:
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][0, ::3] = self.bad_id
        return batch

    def eval_batches(self):
        return self.source.eval_batches()


def test_out_of_vocabulary_ids_inside_jit_stop_the_run_naming_the_batch(tmp_path):
    from jaxllm.data.sources import make_source
    from jaxllm.train.state import BadTokenIdsError

    cfg = tiny_run(tmp_path, "--train.checkpoint_every=1")
    source = _CorruptAt(make_source(cfg), step=6, bad_id=1000)
    with pytest.raises(BadTokenIdsError, match=r"train batch at step 7 holds 6 token ids"):
        train(cfg, source)
    assert max(Checkpointer(tmp_path).latest.all_steps()) <= 7
