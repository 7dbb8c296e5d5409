"""jaxllm.runs: a trained run dir -> (config, params, step), in either block layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ExecutionConfig, load_config
from jaxllm.models import build_model
from jaxllm.runs import load_run
from jaxllm.train.loop import ResumeConfigError, train


def _ar(run_dir, *overrides):
    tiny = ["--model.n_layers=2", "--data.associative_recall.num_train=64", "--train.steps=3",
            "--train.eval_every=3", "--train.batch_size=8", "--optim.warmup_steps=1"]  # fmt: skip
    return load_config("configs/ar.yaml", [*tiny, f"--train.run_dir={run_dir}", *overrides])


def test_load_run_gives_either_block_layout_and_the_same_function(tmp_path):
    train(_ar(tmp_path, "--train.progress=false"))
    cfg, unrolled, step = load_run(tmp_path)
    scanned_cfg, stacked, _ = load_run(tmp_path, overrides=["--execution.scan_layers=true"])
    assert step == 3 and scanned_cfg.execution.scan_layers and not cfg.execution.scan_layers
    assert {"h0", "h1"} <= set(unrolled["params"]) and "blocks" in stacked["params"]
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 9), 0, cfg.model.vocab_size)
    a = build_model(cfg.model, cfg.execution).apply(unrolled, tokens)
    b = build_model(cfg.model, ExecutionConfig(scan_layers=True)).apply(stacked, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(Exception, match="model"):  # the model comes from the checkpoint
        load_run(tmp_path, overrides=["--model.n_layers=3"])


def test_a_resume_in_the_other_block_layout_is_refused_naming_the_flag(tmp_path):
    train(_ar(tmp_path, "--train.progress=false"))
    again = _ar(tmp_path, "--train.steps=4", "--execution.scan_layers=true",
                "--train.allow_config_change=true")  # fmt: skip
    with pytest.raises(ResumeConfigError, match="resume with --execution.scan_layers=false"):
        train(again)
    assert jnp.isfinite(train(_ar(tmp_path, "--execution.kernels=xla")).eval_loss)
