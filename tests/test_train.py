"""Optimizer schedule, weight-decay mask, determinism, and an AR training smoke test."""

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, tiny_config, tiny_run

from jaxllm.config import Config, OptimConfig, load_config
from jaxllm.models import build_model
from jaxllm.train.loop import train
from jaxllm.train.optim import decay_mask, lr_schedule, make_optimizer
from jaxllm.train.state import create_state, train_step


def test_schedule_warmup_then_cosine_to_min_at_last_step():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    s = lr_schedule(cfg, 100)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(s(99)), 1e-4, rtol=1e-6)  # the last update
    mid = 10 + (99 - 10) / 2
    np.testing.assert_allclose(float(s(mid)), 1e-4 + 0.5 * (1e-3 - 1e-4), rtol=1e-5)
    values = np.array([float(s(i)) for i in range(10, 100)])
    assert np.all(np.diff(values) <= 1e-12)  # monotone decay after warm-up
    s0 = lr_schedule(OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0), 50)
    np.testing.assert_allclose([float(s0(0)), float(s0(49))], [1e-3, 0.0], atol=1e-9)


def test_decay_mask_only_matrices():
    cfg = load_config(ROOT / "configs" / "ar.yaml").model
    model = build_model(cfg)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    params = params["params"]
    flat = jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]
    decayed = {"/".join(k.key for k in path) for path, v in flat if v}
    assert "h0/attn/qkv/kernel" in decayed and "h1/mlp/proj/kernel" in decayed
    assert not any(("bias" in d or "scale" in d or "embedding" in d) for d in decayed)


def test_weight_decay_skips_norms_but_hits_matrices():
    params = {"w": {"kernel": jnp.ones((2, 2))}, "ln": {"scale": jnp.ones(2)}}
    tx = make_optimizer(
        OptimConfig(lr=1e-1, min_lr=1e-1, warmup_steps=0, weight_decay=0.5, grad_clip=0.0), 10
    )
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    upd, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(upd["w"]["kernel"]).max()) > 0  # decay moves matrices
    assert float(jnp.abs(upd["ln"]["scale"]).max()) == 0  # not norm scales


def test_train_step_deterministic():
    cfg = tiny_run(None)
    model = build_model(cfg.model, cfg.execution)
    batch = {"inputs": jnp.ones((4, 17), jnp.int32), "targets": jnp.full((4, 17), 20, jnp.int32)}

    def run():
        state = create_state(
            model, make_optimizer(cfg.optim, 10), jax.random.PRNGKey(0), batch["inputs"]
        )
        losses = []
        for _ in range(3):
            state, m = train_step(state, batch, jax.random.PRNGKey(1))
            losses.append(float(m["loss"]))
        return losses, state.params

    (l1, p1), (l2, p2) = run(), run()
    assert l1 == l2 and l1[-1] < l1[0]
    jax.tree_util.tree_map(np.testing.assert_array_equal, p1, p2)


def test_each_step_draws_its_own_dropout_masks():
    """train_step folds the step into the run's key: the same parameters, batch and key give
    another loss at another step (other masks) and the same loss at the same step."""
    cfg = tiny_run(None)
    model = build_model(cfg.model, dataclasses.replace(cfg.execution, dropout=0.5))
    batch = {"inputs": jnp.ones((4, 17), jnp.int32), "targets": jnp.full((4, 17), 20, jnp.int32)}
    state = create_state(
        model, make_optimizer(cfg.optim, 10), jax.random.PRNGKey(0), batch["inputs"]
    )
    key = jax.random.PRNGKey(1)

    def loss_at(step):  # on a copy: train_step donates its state
        fresh = jax.tree_util.tree_map(jnp.copy, state).replace(step=jnp.asarray(step))
        return float(train_step(fresh, batch, key)[1]["loss"])

    assert loss_at(3) == loss_at(3) != loss_at(4)


def test_ar_training_smoke(trained_tiny_run, tmp_path):
    """The loss falls, the log has the promised fields, and a rerun is bit-identical."""
    run, res = trained_tiny_run
    assert res.losses[-1] < res.losses[0] - 0.15
    assert 0.0 <= res.eval_accuracy <= 1.0 and np.isfinite(res.eval_loss)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "loss" in r and "split" not in r]
    assert {"step", "loss", "lr", "tokens_per_s", "wall_time", "grad_norm"} <= set(steps[0])
    assert [r["step"] for r in steps] == [5, 10, 15, 20]
    assert any(r.get("split") == "eval" for r in lines)
    assert train(tiny_run(tmp_path)).losses == res.losses


@pytest.mark.slow  # a full batch of 2176 rows through the interpreted fused loss
def test_a_run_names_its_loss_chunks(tmp_path, capsys):
    """A run whose fused loss splits a full batch says how, on the console and in the start
    record (128 x 17 rows of 128 float32 columns = 1.06 MiB at a 1 MiB budget: 2 chunks)."""
    cfg = tiny_run(tmp_path)
    cfg = dataclasses.replace(
        cfg,
        execution=dataclasses.replace(cfg.execution, loss_impl="pallas", loss_chunk_mib=1),
        train=dataclasses.replace(cfg.train, batch_size=128, steps=1, eval_every=100),
        optim=dataclasses.replace(cfg.optim, warmup_steps=0),
    )
    train(cfg)
    line = (
        "loss: a full batch's 2176 rows per device in 2 chunks of 1088 (execution.loss_chunk_mib 1)"
    )
    assert line in "".join(capsys.readouterr())  # (tqdm's write: stdout)
    start = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert start["loss_chunks"] == line


def test_cli_rejects_bad_override(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--model.n_layer=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "'n_layer' is not in model" in out.stderr and "Traceback" not in out.stderr


def test_default_config_is_valid_and_frozen():
    cfg = Config()  # validated on construction
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 5
    assert hash(cfg) == hash(Config())  # hashable: a jit static argument


@pytest.mark.slow  # the preset as it is: 2500 steps
def test_ar_preset_reaches_90_percent(tmp_path):
    """The README's main job: the 2-layer preset solves associative recall (>= 90%)."""
    cfg = load_config(
        ROOT / "configs" / "ar.yaml", ["--train.progress=false", f"--train.run_dir={tmp_path}"]
    )
    assert train(cfg).eval_accuracy >= 0.9


def _tiny_state_and_batch():
    model = build_model(tiny_config(n_layers=1))
    x = jnp.ones((2, 8), jnp.int32)
    tx = make_optimizer(OptimConfig(warmup_steps=0), 10)
    return create_state(model, tx, jax.random.PRNGKey(0), x), {"inputs": x, "targets": x}


def test_steps_count_out_of_range_ids_under_jit():
    """Inside jit the model cannot raise: ids >= vocab gave a NaN loss, targets < -1 a finite
    wrong one. The steps count them (metrics["bad_ids"]) so the loop can stop with a message."""
    from jaxllm.train.state import BadTokenIdsError, eval_step, raise_for_bad_ids

    state, clean = _tiny_state_and_batch()
    assert state.vocab_size == 61
    x, y = clean["inputs"], clean["targets"]
    cases = [  # (batch, bad ids in it)
        (clean, 0),
        ({"inputs": x.at[0, 3].set(61), "targets": y}, 1),  # id == vocab_size
        ({"inputs": x.at[:, 0].set(-1), "targets": y.at[1, 2].set(61)}, 3),
        ({"inputs": x, "targets": y.at[0, :3].set(-5).at[1, 0].set(-1)}, 3),  # -1 is IGNORE
    ]
    for batch, n_bad in cases:
        assert int(eval_step(state, batch)["bad_ids"]) == n_bad
        copy = jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), state)  # donated
        _, metrics = train_step(copy, batch, jax.random.PRNGKey(1))
        assert metrics["bad_ids"].dtype == jnp.int32 and int(metrics["bad_ids"]) == n_bad
    raise_for_bad_ids(0, step=5, where="train", vocab_size=61)  # nothing to report
    with pytest.raises(BadTokenIdsError, match=r"step 5.*3 token ids.*\[0, 60\]") as err:
        raise_for_bad_ids(jnp.int32(3), step=5, where="train", vocab_size=61)
    assert isinstance(err.value, ValueError)


def test_eval_padding_rows_add_nothing():
    """evaluate pads each batch with IGNORE rows (to the mesh's row multiple): the sums, so the
    loss and accuracy, are those of the unpadded batches, a partial last batch included."""
    from jaxllm.data.sources import make_source
    from jaxllm.parallel import pad_rows
    from jaxllm.train.loop import evaluate

    cfg = tiny_run(None, "--train.batch_size=48", "--data.associative_recall.num_test=128")
    source = make_source(cfg)  # 128 test examples: batches of 48, 48, 32
    sizes = [b["inputs"].shape[0] for b in source.eval_batches()]
    assert sizes == [48, 48, 32]
    model = build_model(cfg.model, cfg.execution)
    tx = make_optimizer(cfg.optim, 40)
    first = next(iter(source.eval_batches()))
    state = create_state(model, tx, jax.random.PRNGKey(3), jnp.asarray(first["inputs"]))
    plain = evaluate(state, source)
    for multiple in (7, 64):
        padded = evaluate(state, source, rows_multiple=multiple)
        # rtol: other batch shapes, other GEMM tilings on a GPU (2.5e-6 seen on an H100)
        np.testing.assert_allclose(padded["loss"], plain["loss"], rtol=2e-5)
        assert padded["accuracy"] == plain["accuracy"]
    out = pad_rows(first, 7)
    assert out["inputs"].shape[0] == 49 and (out["targets"][48] == -1).all()
    np.testing.assert_array_equal(out["inputs"][:48], first["inputs"])
    assert pad_rows(first, 16)["inputs"].shape[0] == 48  # already a multiple: unchanged
    with pytest.raises(ValueError, match="'inputs' and 'targets' only"):
        pad_rows({**first, "mask": first["inputs"]}, 7)
