"""jaxllm.parallel: mesh sizes, shardings, DP / FSDP / pipeline equivalence, sharded checkpoints.

The multi-device checks need 8 fake CPU devices, which XLA creates only if its flag is set
before jax is imported: they run in a subprocess (`_on_8_devices`) that imports this file and
calls one `_check_*` function, which prints its results as one JSON line for the test to judge.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ROOT, eqn_counts, pallas_kernel_names, tiny_run
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey

from jaxllm import distributed, parallel
from jaxllm.config import ConfigError, ParallelConfig, config_changes
from jaxllm.data.sources import make_source
from jaxllm.models import build_model, unstack_blocks
from jaxllm.runs import load_run
from jaxllm.train.checkpoint import Checkpointer
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state, loss_and_sums, train_step

TESTS = Path(__file__).resolve().parent


def _cfg(*overrides: str):
    """A tiny associative-recall run: d 32, 2 layers, context 9, batch 16, 4 steps."""
    return tiny_run(
        None,
        "--model.n_layers=2",
        # The key bias only shifts each softmax row: its gradient is float noise around 0,
        # which Adam scales up to full-size steps, different for every summation order.
        "--model.qkv_bias=false",
        "--model.vocab_size=16",
        "--model.context_length=9",
        "--data.associative_recall.vocab_size=16",
        "--data.associative_recall.num_pairs=4",
        "--data.associative_recall.num_test=48",
        "--train.steps=4",
        "--train.eval_every=4",
        "--train.log_every=1",
        "--optim.warmup_steps=1",
        *overrides,
    )


def _on_8_devices(check: str, *args: str) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false",
        "JAX_PLATFORMS": "cpu",
    }
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_parallel as t; "
        f"t.{check}(*sys.argv[1:])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- one device


def test_mesh_sizes_fill_and_refuse():
    def sizes(n, **kw):
        return tuple(parallel.mesh_sizes(ParallelConfig(**kw), n).values())  # data, fsdp, pipe

    assert sizes(1) == (1, 1, 1)
    assert sizes(8) == (8, 1, 1)
    assert sizes(8, fsdp=2) == (4, 2, 1)
    assert sizes(8, data=2, fsdp=-1) == (2, 4, 1)
    assert sizes(8, data=4, fsdp=2) == (4, 2, 1)
    assert sizes(8, pipeline=4) == (2, 1, 4)
    assert sizes(8, data=1, fsdp=2, pipeline=-1) == (1, 2, 4)
    with pytest.raises(ConfigError, match=r"data=3 x fsdp=2 x pipeline=1 needs 6 devices, but"):
        parallel.mesh_sizes(ParallelConfig(data=3, fsdp=2), 8)
    with pytest.raises(ConfigError, match=r"fixed sizes \(3\) must divide the device count \(8"):
        parallel.mesh_sizes(ParallelConfig(fsdp=3), 8)
    with pytest.raises(ConfigError, match=r"divisible by parallel.data x parallel.fsdp = 4 x 2"):
        parallel.check_batch(12, {"data": 4, "fsdp": 2})
    parallel.check_batch(16, {"data": 4, "fsdp": 2})
    stages = {"data": 2, "fsdp": 1, "pipeline": 4}
    parallel.check_batch(16, stages, 8)
    with pytest.raises(ConfigError, match=r"x parallel.microbatches = 2 x 1 x 16 = 32: each"):
        parallel.check_batch(16, stages, 16)
    parallel.check_batch(16, {**stages, "pipeline": 1}, 16)  # no stages: microbatches unused


def test_pipeline_needs_scanned_divisible_layers():
    cfg = _cfg("--model.n_layers=4", "--execution.scan_layers=true")
    model, ex = cfg.model, cfg.execution
    parallel.check_pipeline(model, ex, 4)
    parallel.check_pipeline(model, ex, 2)
    parallel.check_pipeline(_cfg().model, _cfg().execution, 1)  # one stage: anything goes
    unrolled = _cfg("--model.n_layers=4")
    with pytest.raises(ConfigError, match=r"pipeline=4 needs execution.scan_layers=true.*Set --"):
        parallel.check_pipeline(unrolled.model, unrolled.execution, 4)
    with pytest.raises(ConfigError, match=r"model.n_layers \(4\) must be divisible by parallel."):
        parallel.check_pipeline(model, ex, 3)
    parallel.check_pipeline(model, dataclasses.replace(ex, dropout=0.1), 4)  # keys per layer
    # Circular: 2 stages x 2 chunks of a layer, as many microbatches as stages at least.
    parallel.check_pipeline(model, ex, 2, virtual_stages=2)  # M unset: one per stage
    parallel.check_pipeline(model, ex, 2, virtual_stages=2, microbatches=3)
    with pytest.raises(ConfigError, match=r"pipeline \(2\) x parallel.virtual_stages \(3\): "):
        parallel.check_pipeline(model, ex, 2, virtual_stages=3)
    with pytest.raises(ConfigError, match=r"virtual_stages=2 needs parallel.microbatches >= "):
        parallel.check_pipeline(model, ex, 2, virtual_stages=2, microbatches=1)
    with pytest.raises(ConfigError, match=r"virtual_stages=2 needs pipeline stages.*Set paral"):
        parallel.check_pipeline(model, ex, 1, virtual_stages=2)
    assert parallel.n_microbatches(ParallelConfig(), 4) == 4  # default: one per stage
    assert parallel.n_microbatches(ParallelConfig(microbatches=8), 4) == 8


def test_stacked_block_leaves_shard_layers_over_stages_and_the_rest_over_fsdp():
    mesh = AbstractMesh((4, 1, 2), parallel.MESH_AXES)  # pipeline 4, data 1, fsdp 2
    blocks = (DictKey("params"), DictKey("blocks"), DictKey("block"), DictKey("kernel"))
    assert parallel.leaf_spec(blocks, (4, 32, 96), mesh) == P("pipeline", None, "fsdp")
    assert parallel.leaf_spec(blocks, (4, 7), mesh) == P("pipeline")  # 7: no fsdp split
    assert parallel.leaf_spec((DictKey("wte"),), (16, 32), mesh) == P(None, "fsdp")
    # Without stages the layer axis is never the fsdp one, even where it is the largest.
    flat = AbstractMesh((1, 1, 8), parallel.MESH_AXES)
    assert parallel.leaf_spec(blocks, (64, 16, 8), flat) == P(None, "fsdp", None)


def test_eval_rows_multiple_gives_the_training_layout():
    def multiple(pipeline, data, fsdp, microbatches=None):
        mesh = AbstractMesh((pipeline, data, fsdp), parallel.MESH_AXES)
        return parallel.eval_rows_multiple(mesh, microbatches)

    assert multiple(1, 1, 1) == 1
    assert multiple(1, 4, 2) == 8  # rows over data x fsdp
    assert multiple(4, 1, 2) == 8  # 4 microbatches (one per stage) of 2 shards, over 4 stages
    assert multiple(2, 2, 1, microbatches=3) == 12  # 2 shards x 3 microbatches, and 4 devices
    assert multiple(4, 1, 1, microbatches=8) == 8


def test_parallel_config_validation():
    assert _cfg().parallel == ParallelConfig(data=-1, fsdp=1, pipeline=1, microbatches=None)
    with pytest.raises(ConfigError, match=r"parallel.data must be >= 1 or -1 \(fill\), got 0"):
        _cfg("--parallel.data=0")
    with pytest.raises(ConfigError, match=r"parallel.fsdp must be >= -1, got -2"):
        _cfg("--parallel.fsdp=-2")
    with pytest.raises(ConfigError, match=r"parallel.pipeline must be >= 1 or -1 \(fill\)"):
        _cfg("--parallel.pipeline=0")
    with pytest.raises(ConfigError, match=r"parallel.microbatches must be >= 1, got 0"):
        _cfg("--parallel.microbatches=0")
    with pytest.raises(ConfigError, match=r"parallel.virtual_stages must be >= 1, got 0"):
        _cfg("--parallel.virtual_stages=0")
    with pytest.raises(
        ConfigError, match=r"at most one of parallel.data, parallel.fsdp, parallel.pipeline"
    ):
        _cfg("--parallel.fsdp=-1")
    with pytest.raises(ConfigError, match=r"train.batch_size \(16\) must be divisible .* = 6"):
        _cfg("--parallel.data=3", "--parallel.fsdp=2")
    # The layout does not change what a run computes: resuming on other devices is allowed.
    assert config_changes(_cfg(), _cfg("--parallel.data=8")) == []
    staged_args = ("--parallel.data=2", "--parallel.pipeline=4", "--parallel.microbatches=2")
    assert config_changes(_cfg(), _cfg(*staged_args)) == []
    # Like execution, the layout is how a run computes: free to change, with dropout too
    # (other masks); dropout and label smoothing themselves change the objective: refused.
    drop = ("--execution.dropout=0.1",)
    assert config_changes(_cfg(*drop), _cfg(*drop, "--parallel.data=4", "--parallel.fsdp=2")) == []
    assert config_changes(_cfg(*drop), _cfg("--execution.kernels=pallas")) == [
        "execution.dropout: 0.1 -> 0.0"
    ]


def test_param_spec_shards_largest_divisible_axis():
    assert parallel.param_spec((32, 96), 4) == P(None, "fsdp")
    assert parallel.param_spec((96, 32), 4) == P("fsdp", None)
    assert parallel.param_spec((30, 8), 4) == P(None, "fsdp")  # 30 does not divide
    assert parallel.param_spec((8, 8), 4) == P("fsdp", None)  # the first of equals
    assert parallel.param_spec((7,), 4) == P()  # nothing divides: replicated
    assert parallel.param_spec((), 4) == P()
    assert parallel.param_spec((32, 96), 1) == P()


def test_one_device_mesh_and_refusals():
    mesh = parallel.make_mesh(_cfg(), jax.devices()[:1])
    assert dict(mesh.shape) == {"pipeline": 1, "data": 1, "fsdp": 1}
    assert parallel.describe(mesh) == "parallel: mesh data=1 fsdp=1 over 1 cpu device"
    assert parallel.describe(mesh, 4) == (
        "parallel: mesh data=1 fsdp=1 (parallel.microbatches=4 unused: no pipeline stages) over "
        "1 cpu device"
    )
    with pytest.raises(ConfigError, match=r"needs 2 devices, but there are 1"):
        parallel.make_mesh(_cfg("--parallel.data=2"), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"parallel.virtual_stages=2 needs pipeline stages"):
        parallel.make_mesh(_cfg("--parallel.virtual_stages=2"), jax.devices()[:1])
    pallas = _cfg("--execution.kernels=pallas")
    model = build_model(pallas.model, pallas.execution)
    assert parallel.kernel_model(model, mesh) is model  # one device: Pallas runs as before
    assert model.plan.shard is None and "per shard" not in model.plan.describe()


# ----------------------------------------------------------------------------- 8 devices


def _state_and_batches(cfg, mesh, n=3):
    source = make_source(cfg)
    model = build_model(cfg.model, cfg.execution)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    example = jnp.asarray(source.train_batch(0)["inputs"])
    rng = jax.random.PRNGKey(0)
    state = parallel.create_sharded(lambda: create_state(model, tx, rng, example), mesh)
    return state, [source.train_batch(i) for i in range(n)]


def _eval_on(state, mesh) -> dict:
    """evaluate() with its default padding over 44 test examples (batches of 16, 16, 12): the
    rows of every batch its step saw, and whether each batch was split over the devices."""
    from jaxllm.train.loop import evaluate
    from jaxllm.train.state import eval_step

    seen = []

    def recording_step(state, batch):
        x = batch["inputs"]
        sharding = getattr(x, "sharding", None)  # None: a host array (no mesh)
        seen.append([int(x.shape[0]), sharding is not None and not sharding.is_fully_replicated])
        return eval_step(state, batch)

    source = make_source(_cfg("--data.associative_recall.num_test=44"))
    ev = evaluate(state, source, mesh, recording_step)
    return {"loss": ev["loss"], "accuracy": ev["accuracy"], "batches": seen}


def _check_dp_equivalence() -> None:
    """3 steps on 1 device vs data=8 and data=4 x fsdp=2: losses, grad norms, first-step
    gradients and final params; per-device state bytes (also of fsdp=8, not stepped)."""
    cfg = _cfg()
    single = parallel.make_mesh(cfg, jax.devices()[:1])
    init, batches = _state_and_batches(cfg, single)
    init = jax.device_get(init)  # on the host: each mesh below places it its own way
    out = {}
    for name, overrides, devices in [
        ("single", [], jax.devices()[:1]),
        ("data8", [], None),
        ("data4_fsdp2", ["--parallel.fsdp=2"], None),
    ]:
        mesh = parallel.make_mesh(_cfg(*overrides), devices)
        state = jax.device_put(init, parallel.state_shardings(init, mesh))
        sharded = [parallel.shard_batch(b, mesh) for b in batches]
        grads = jax.jit(jax.grad(lambda p, b, s=state: loss_and_sums(p, s.apply_fn, b, None)[0]))(
            state.params, sharded[0]
        )
        step = parallel.jit_train_step(train_step, state, mesh)
        losses, norms = [], []
        for b in sharded:
            state, m = step(state, b, jax.random.PRNGKey(1))
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
        out[name] = {
            "losses": losses,
            "norms": norms,
            "grads": [np.asarray(g).tolist() for g in jax.tree.leaves(jax.device_get(grads))],
            "params": [np.asarray(p).tolist() for p in jax.tree.leaves(jax.device_get(state))],
            "bytes": parallel.state_bytes_per_device(state),
            "eval": _eval_on(state, None if name == "single" else mesh),
            "apply": repr(parallel.mesh_apply(state.apply_fn, mesh)),
        }
    fsdp8 = parallel.make_mesh(_cfg("--parallel.data=1", "--parallel.fsdp=8"))
    out["fsdp8_bytes"] = parallel.state_bytes_per_device(
        jax.device_put(init, parallel.state_shardings(init, fsdp8))
    )
    print(json.dumps(out))


def _assert_trees_close(got, want, rtol, name):
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        # Relative to each array's scale: float32 sums in another order differ by ~1e-7 of it.
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)


@pytest.mark.slow  # an 8-device subprocess that trains
def test_data_and_fsdp_parallel_match_one_device():
    out = _on_8_devices("_check_dp_equivalence")
    ref = out.pop("single")
    for name in ("data8", "data4_fsdp2"):
        r = out[name]
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5, err_msg=name)
        _assert_trees_close(r["grads"], ref["grads"], 1e-5, name)
        _assert_trees_close(r["params"], ref["params"], 1e-5, name)  # params, moments, step
    # the unrolled blocks gather their weights one layer at a time too
    assert out["data4_fsdp2"]["apply"] == "MeshApply(GPT2, fsdp 2, gathered per layer)"
    # evaluate() on a mesh pads a partial batch (12 rows) to the data x fsdp layout by itself
    assert ref["eval"]["batches"] == [[16, False], [16, False], [12, False]]
    for name in ("data8", "data4_fsdp2"):
        assert out[name]["eval"]["batches"] == [[16, True]] * 3, name
        np.testing.assert_allclose(out[name]["eval"]["loss"], ref["eval"]["loss"], rtol=1e-5)
        assert out[name]["eval"]["accuracy"] == ref["eval"]["accuracy"]
    assert out["data8"]["bytes"] == ref["bytes"]  # replicated: every device holds it all
    # Almost every array divides by the fsdp size; the few that do not stay whole.
    assert 1.9 < ref["bytes"] / out["data4_fsdp2"]["bytes"] <= 2
    assert 7.0 < ref["bytes"] / out["fsdp8_bytes"] <= 8


def _recording(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx`, whose state also keeps the last gradients it was given: opt_state[0] (laid out
    like the parameters), so the real train step shows its gradients."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params), tx.init(params)

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state[1], params)
        return updates, (grads, inner)

    return optax.GradientTransformation(init, update)


def _while_collectives(hlo: str, op: str) -> tuple[list[str], list[str]]:
    """The result shapes of `op` instructions in a compiled HLO module: (inside while-loop
    bodies, or computations they call), (anywhere else)."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    inside = set(re.findall(r"body=%([\w.\-]+)", hlo))
    todo = list(inside)
    while todo:  # the computations a loop body calls run inside the loop too
        for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", "\n".join(comps[todo.pop()])):
            if callee not in inside:
                inside.add(callee)
                todo.append(callee)
    found = {True: [], False: []}
    for name, lines in comps.items():
        for line in lines:
            m = re.search(rf"= (\w+\[[\d,]*\])\S* {op}(?:-start)?\(", line)
            if m:
                found[name in inside].append(m.group(1))
    return found[True], found[False]


def _check_pipeline_and_fsdp_layers() -> None:
    """A 4-layer scanned model, 2 steps on 1 device vs pipeline=4 (4 devices), data=2 x
    pipeline=4 and data=2 x fsdp=4 (8): losses, gradients (of the real train step, recorded
    by its optimizer) and final params; where the fsdp all-gathers sit in the compiled step;
    per-device state bytes with fsdp 1 and 8; with dropout 0.1, pipeline=4 and data2_fsdp4's
    training losses (twice from one seed, once from another) and evaluation sums."""
    base = ["--model.n_layers=4", "--execution.scan_layers=true"]
    cfg = _cfg(*base)
    model = build_model(cfg.model, cfg.execution)
    batches = [make_source(cfg).train_batch(i) for i in range(2)]

    def create(tx):
        return create_state(model, tx, jax.random.PRNGKey(0), jnp.asarray(batches[0]["inputs"]))

    tx = make_optimizer(cfg.optim, cfg.train.steps)
    init = jax.device_get(jax.jit(lambda: create(_recording(tx)))())  # on the host
    out = {}
    for name, overrides, n in [
        ("single", [], 1),
        ("pipeline4", ["--parallel.pipeline=4"], 4),
        ("data2_pipeline4", ["--parallel.data=2", "--parallel.pipeline=4"], 8),
        ("data2_fsdp4", ["--parallel.fsdp=4"], 8),
        ("pipeline2_virtual2", ["--parallel.pipeline=2", "--parallel.virtual_stages=2"], 2),
    ]:
        c = _cfg(*base, *overrides)
        mesh = parallel.make_mesh(c, jax.devices()[:n])
        state = jax.device_put(init, parallel.state_shardings(init, mesh))
        sharded = [parallel.shard_batch(b, mesh) for b in batches]
        rng = jax.random.PRNGKey(1)
        micro, virtual = c.parallel.microbatches, c.parallel.virtual_stages
        step = parallel.jit_train_step(train_step, state, mesh, micro, virtual)
        step = step.lower(state, sharded[0], rng).compile()
        if name == "data2_fsdp4":
            out["all_gathers"] = _while_collectives(step.as_text(), "all-gather")
        if "pipeline" in name:  # the result shapes of the step's collectives
            out[f"{name}_collectives"] = {
                op: re.findall(rf"= (.*?) {op}(?:-start)?\(", step.as_text())
                for op in ("all-reduce", "all-to-all", "collective-permute")
            }
        losses, grads = [], []
        for b in sharded:
            state, m = step(state, b, rng)
            losses.append(float(m["loss"]))
            grads += [np.asarray(g).tolist() for g in jax.tree.leaves(state.opt_state[0])]
        out[name] = {
            "describe": parallel.describe(mesh, micro, virtual_stages=virtual),
            # rows split over data x stages at batch 16; at batch 6 (divisible by the 2
            # microbatches, valid) not over the 4 stages: the replicated layout, said so
            "describe_rows": [
                parallel.describe(mesh, m, batch_size=b) for m, b in ((4, 16), (2, 6))
            ],
            "apply": repr(parallel.mesh_apply(state.apply_fn, mesh, micro, virtual)),
            "losses": losses,
            "grads": grads,
            "params": [np.asarray(p).tolist() for p in jax.tree.leaves(state.params)],
            "qkv_spec": str(state.params["blocks"]["block"]["attn"]["qkv"]["kernel"].sharding.spec),
        }

    # Dropout 0.1, same initial params: the training loss (what train_step differentiates;
    # forward only, to compile fast) from seed 1 twice and seed 2 once, and the eval sums
    # (eval_step's, without dropout), one compiled program per mesh.
    def train_loss_and_eval(state, batch, rng):
        train = loss_and_sums(state.params, state.apply_fn, batch, rng)[0]
        return train, loss_and_sums(state.params, state.apply_fn, batch, None)[1]

    drop = [*base, "--execution.dropout=0.1"]
    dropped = _cfg(*drop)
    eval_init = init.replace(apply_fn=build_model(dropped.model, dropped.execution).apply)
    out["dropout_eval_single"] = jax.jit(train_loss_and_eval)(eval_init, batches[0], None)[1]
    for name, overrides, n in [
        ("pipeline4", ["--parallel.pipeline=4"], 4),
        ("data2_fsdp4", ["--parallel.fsdp=4"], 8),
        ("data2_fsdp4_unrolled", ["--parallel.fsdp=4", "--execution.scan_layers=false"], 8),
    ]:
        c = _cfg(*drop, *overrides)
        mesh = parallel.make_mesh(c, jax.devices()[:n])
        state = eval_init
        if not c.execution.scan_layers:  # the same weights as unrolled blocks
            unrolled = build_model(c.model, c.execution).apply
            state = state.replace(params=unstack_blocks(state.params), apply_fn=unrolled)
        state = jax.device_put(state, parallel.state_shardings(state, mesh))
        batch = parallel.shard_batch(batches[0], mesh)
        run = parallel.jit_eval_step(train_loss_and_eval, state, mesh, c.parallel.microbatches)
        runs = [run(state, batch, jax.random.PRNGKey(seed)) for seed in (1, 1, 2)]
        out[f"dropout_{name}"] = {
            "apply": repr(parallel.mesh_apply(state.apply_fn, mesh)),
            "losses": [float(loss) for loss, _ in runs],
            "eval": runs[0][1],
        }
    plain = jax.eval_shape(lambda: create(tx))  # shapes suffice to count the bytes
    for fsdp in (1, 8):
        c = _cfg(*base, "--parallel.data=1", f"--parallel.fsdp={fsdp}")
        shardings = parallel.state_shardings(plain, parallel.make_mesh(c, jax.devices()[:fsdp]))
        placed = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), plain, shardings
        )
        out[f"fsdp{fsdp}_bytes"] = parallel.state_bytes_per_device(placed)
    print(json.dumps(jax.tree.map(lambda x: np.asarray(x).tolist(), out)))


@pytest.mark.slow  # an 8-device subprocess that trains
def test_pipeline_and_per_layer_fsdp_match_one_device():
    out = _on_8_devices("_check_pipeline_and_fsdp_layers")
    ref = out.pop("single")
    assert ref["apply"].startswith("<bound method Module.apply of GPT2(")  # unchanged path
    assert out["pipeline4"]["describe"] == (
        "parallel: mesh data=1 fsdp=1 pipeline=4 (4 microbatches, bubble 43%) over 4 cpu devices"
    )
    assert out["pipeline4"]["describe_rows"] == [
        "parallel: mesh data=1 fsdp=1 pipeline=4 (4 microbatches, bubble 43%, rows split over "
        "the stages) over 4 cpu devices",
        "parallel: mesh data=1 fsdp=1 pipeline=4 (2 microbatches, bubble 60%, rows replicated "
        "over the stages: batch 6 is not divisible by data x fsdp x pipeline = 4) over 4 cpu "
        "devices",
    ]
    assert out["data2_pipeline4"]["apply"] == "MeshApply(GPT2, pipeline 4 stages x 4 microbatches)"
    assert out["data2_pipeline4"]["qkv_spec"] == str(P("pipeline"))  # layers over stages
    assert out["data2_fsdp4"]["apply"] == "MeshApply(GPT2, fsdp 4, gathered per layer)"
    assert out["data2_fsdp4"]["qkv_spec"] == str(P(None, None, "fsdp"))
    assert out["pipeline2_virtual2"]["describe"] == (
        "parallel: mesh data=1 fsdp=1 pipeline=2 (2 microbatches, circular, 2 virtual stages, "
        "bubble 20%) over 2 cpu devices"
    )
    assert out["pipeline2_virtual2"]["apply"] == (
        "MeshApply(GPT2, pipeline 2 stages x 2 microbatches, 2 virtual stages)"
    )
    for name in ("pipeline4", "data2_pipeline4", "data2_fsdp4", "pipeline2_virtual2"):
        r = out[name]
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        _assert_trees_close(r["grads"], ref["grads"], 1e-5, name)  # both steps' gradients
        # Adam turns float noise in a gradient near 0 into a full-size step: looser.
        _assert_trees_close(r["params"], ref["params"], 1e-4, name)
    # Pipelines (16 rows, 9 tokens, d 32): no activation is summed or shuffled over devices;
    # rows travel point to point, at most one stage's chunk (pipeline4: 4 rows; 2 stages: 8)
    # at a time. Circular: the block weights (and their gradients) move by all-to-all.
    for name, most in (("pipeline4", 4), ("data2_pipeline4", 4), ("pipeline2_virtual2", 8)):
        c = out.pop(f"{name}_collectives")
        moved = c["all-to-all"]
        if "virtual" in name:  # weights only
            assert any(",32,96]" in r for r in moved), (name, moved)
            assert not any(",9,32]" in r for r in moved), (name, moved)
        else:
            assert not moved, (name, moved)
        assert not any(",9,32]" in r for r in c["all-reduce"]), (name, c["all-reduce"])
        rows = [int(n) for r in c["collective-permute"] for n in re.findall(r"\[(\d+),9,32\]", r)]
        assert rows and max(rows) <= most, (name, c["collective-permute"])
    # The block weights are gathered one layer at a time, inside the scanned loop: forward and
    # again in the backward (the qkv kernel: (32, 96) a layer, (4, 32, 96) stacked).
    looped, elsewhere = out["all_gathers"]
    assert sum("32,96]" in s for s in looped) >= 2, looped
    assert not any("4,32,96]" in s for s in looped + elsewhere), (looped, elsewhere)
    assert not any("32,96]" in s for s in elsewhere), elsewhere
    # Params + both Adam moments: every array of this model divides by 8 on a non-layer axis.
    assert 7.9 < out["fsdp1_bytes"] / out["fsdp8_bytes"] <= 8
    # Dropout 0.1: keys per layer (and microbatch) from the step's rng, on the per-layer paths.
    eval_ref = out.pop("dropout_eval_single")
    for name in ("pipeline4", "data2_fsdp4", "data2_fsdp4_unrolled"):
        r = out[f"dropout_{name}"]
        assert r["apply"] == out[name.removesuffix("_unrolled")]["apply"], r["apply"]
        same, again, other = r["losses"]
        assert same == again, (name, r["losses"])  # deterministic for one seed
        assert other != same, (name, r["losses"])  # the seed matters
        # Dropout 0: the first train step's loss (same params and batch).
        assert abs(same - ref["losses"][0]) > 1e-4, (name, same, ref["losses"][0])
        # Evaluation is deterministic: no dropout, the one-device sums.
        np.testing.assert_allclose(r["eval"]["loss_sum"], eval_ref["loss_sum"], rtol=1e-5)
        assert r["eval"]["count"] == eval_ref["count"]
        assert r["eval"]["correct"] == eval_ref["correct"], name


PIPE4 = ["--parallel.pipeline=4", "--execution.scan_layers=true", "--model.n_layers=4"]


def _check_fsdp_layout_and_refusals() -> None:
    out = {}
    cfg = _cfg("--parallel.fsdp=2")
    mesh = parallel.make_mesh(cfg)
    out["describe"] = parallel.describe(mesh)
    state, batches = _state_and_batches(cfg, mesh, 1)
    qkv = state.params["h0"]["attn"]["qkv"]["kernel"]
    mu = state.opt_state
    out["qkv"] = {
        "shape": list(qkv.shape),
        "spec": str(qkv.sharding.spec),
        "shards": sorted({tuple(s.data.shape) for s in qkv.addressable_shards}),
        "n_shards": len(qkv.addressable_shards),
    }
    # Adam's first moment of the same kernel: sharded like it.
    flat = jax.tree_util.tree_flatten_with_path(mu)[0]
    moment = [x for p, x in flat if "qkv" in jax.tree_util.keystr(p) and x.ndim == 2][0]
    out["moment_spec"] = str(moment.sharding.spec)
    batch = parallel.shard_batch(batches[0], mesh)
    out["batch_shards"] = sorted({tuple(s.data.shape) for s in batch["inputs"].addressable_shards})
    # bfloat16 compute: the Linear kernels are cast before they are gathered (half the bytes)
    bf16 = _cfg("--parallel.fsdp=2", "--execution.compute_dtype=bfloat16")
    bf16_state = state.replace(apply_fn=build_model(bf16.model, bf16.execution).apply)
    step = parallel.jit_train_step(train_step, bf16_state, mesh)
    jaxpr = str(jax.make_jaxpr(step)(bf16_state, batch, jax.random.PRNGKey(0)))
    out["gathered"] = sorted(set(re.findall(r"(\w+\[32,96\]) = sharding_constraint", jaxpr)))
    # What the backward keeps per layer on the per-layer gather path, without and with
    # execution.remat=block (jax.ad_checkpoint's list, one line per saved array)
    out["saved"] = {}
    for remat in ("none", "block"):
        c = _cfg("--parallel.fsdp=2", f"--execution.remat={remat}")
        apply = parallel.mesh_apply(build_model(c.model, c.execution).apply, mesh)
        listed = io.StringIO()
        with contextlib.redirect_stdout(listed):
            print_saved_residuals(
                lambda p, a=apply: loss_and_sums(p, a, batch, None)[0], state.params
            )
        lines = listed.getvalue().splitlines()  # the parameters themselves aside
        out["saved"][remat] = len([ln for ln in lines if "from the argument" not in ln])
    refused = {}
    for name, overrides in {
        "not_dividing": ["--parallel.data=2"],
        "fill_not_dividing": ["--parallel.fsdp=3"],
        "batch": ["--train.batch_size=12"],
        "pipeline_unscanned": ["--parallel.pipeline=4"],
        "pipeline_layers": ["--parallel.pipeline=4", "--execution.scan_layers=true"],  # 2 layers
        "pipeline_batch": [*PIPE4, "--parallel.data=2", "--parallel.microbatches=16"],
        "pipeline_dropout": [*PIPE4, "--execution.dropout=0.1"],
        "pipeline_conv": [*PIPE4, "--model.short_conv=true", "--execution.kernels=pallas"],
        "pipeline_ok": [*PIPE4, "--parallel.microbatches=8"],  # 16 rows = 2 x 8
    }.items():
        try:
            c = _cfg(*overrides)
            parallel.make_mesh(c)
            refused[name] = None
        except ConfigError as e:
            refused[name] = str(e)
    out["refused"] = refused
    print(json.dumps(out))


def test_fsdp_shards_params_and_refuses_bad_meshes():
    out = _on_8_devices("_check_fsdp_layout_and_refusals")
    assert out["describe"] == (
        "parallel: mesh data=4 fsdp=2 (fsdp weights gathered per layer) over 8 cpu devices"
    )
    assert out["qkv"]["shape"] == [32, 96]
    assert out["qkv"]["spec"] == str(P(None, "fsdp"))
    assert out["qkv"]["shards"] == [[32, 48]] and out["qkv"]["n_shards"] == 8
    assert out["moment_spec"] == str(P(None, "fsdp"))
    assert out["batch_shards"] == [[2, 9]]  # 16 rows over 4 x 2 devices
    assert out["gathered"] == ["bf16[32,96]"], out["gathered"]  # the qkv kernel, never f32
    # remat=block: each of the 2 layers saves its inputs, not its activations
    assert out["saved"]["block"] < out["saved"]["none"] / 3, out["saved"]
    r = out["refused"]
    assert "mesh data=2 x fsdp=1 x pipeline=1 needs 2 devices, but there are 8" in r["not_dividing"]
    assert "fixed sizes (3) must divide the device count (8)" in r["fill_not_dividing"]
    assert "train.batch_size (12) must be divisible" in r["batch"]
    assert "parallel.pipeline=4 needs execution.scan_layers=true" in r["pipeline_unscanned"]
    assert "model.n_layers (2) must be divisible by parallel.pipeline (4)" in r["pipeline_layers"]
    assert "x parallel.microbatches = 2 x 1 x 16 = 32" in r["pipeline_batch"]
    assert r["pipeline_dropout"] is None
    assert "with model.short_conv=true needs execution.kernels=xla" in r["pipeline_conv"]
    assert r["pipeline_ok"] is None


def _check_pallas_on_mesh() -> None:
    """A 2-layer scanned model with every Pallas kernel (interpreted) and the fused loss, 2
    steps on 1 device vs data=8 (the model's own apply), data=2 x fsdp=4 (per-layer gather) and
    data=4 x pipeline=2: losses, grad norms, final params; the plan's line; how many shard_maps
    the data=8 step's program holds; an evaluation batch of 12 rows (does not split over 8:
    the kernels run whole on every device) against the one-device sums. The depthwise conv
    (model.short_conv, refused under a pipeline) and the MLP's GELU backward alone: value and
    gradients per shard."""
    from jaxllm import ops
    from jaxllm.train.state import eval_step

    base = [
        "--execution.scan_layers=true",
        "--execution.kernels=pallas",
        "--execution.loss_impl=pallas",
    ]
    cfg = _cfg(*base)
    single = parallel.make_mesh(cfg, jax.devices()[:1])
    init, batches = _state_and_batches(cfg, single, 2)
    init = jax.device_get(init)
    odd = {k: v[:12] for k, v in batches[0].items()}
    out = {}
    for name, overrides, n in [
        ("single", [], 1),
        ("data8", [], 8),
        ("data2_fsdp4", ["--parallel.fsdp=4"], 8),
        ("data4_pipeline2", ["--parallel.data=4", "--parallel.pipeline=2"], 8),
    ]:
        c = _cfg(*base, *overrides)
        mesh = parallel.make_mesh(c, jax.devices()[:n])
        state = jax.device_put(init, parallel.state_shardings(init, mesh))
        sharded = [parallel.shard_batch(b, mesh) for b in batches]
        step = parallel.jit_train_step(train_step, state, mesh, c.parallel.microbatches)
        rng = jax.random.PRNGKey(1)
        if name in ("single", "data8"):
            jaxpr = jax.make_jaxpr(step)(state, sharded[0], rng)
            out[f"{name}_shard_maps"] = eqn_counts(jaxpr, lambda e: e.primitive.name)["shard_map"]
            out[f"{name}_kernels"] = pallas_kernel_names(jaxpr)
        sums = parallel.jit_eval_step(eval_step, state, mesh)(
            state, parallel.shard_batch(odd, mesh)
        )
        losses, norms = [], []
        for b in sharded:
            state, m = step(state, b, rng)
            losses.append(float(m["loss"]))
            norms.append(float(m["grad_norm"]))
        out[name] = {
            "ops": parallel.kernel_model(build_model(c.model, c.execution), mesh).plan.describe(),
            "losses": losses,
            "norms": norms,
            "params": [np.asarray(p).tolist() for p in jax.tree.leaves(state.params)],
            "eval": jax.tree.map(lambda x: np.asarray(x).tolist(), sums),
        }
    u, w, b = (
        jax.random.normal(jax.random.PRNGKey(i), s)
        for i, s in enumerate([(16, 9, 8), (8, 3), (8,)])
    )

    def conv_loss(u, w, b, shard):
        y = ops.depthwise_conv1d(u, w, b, "causal", "pallas", shard)
        return jnp.sum(jnp.sin(y)), y

    shard = ops.KernelShard(parallel.make_mesh(_cfg()), parallel.BATCH_AXES)
    for name, sh in [("conv_single", None), ("conv_sharded", shard)]:
        grad = jax.jit(jax.grad(conv_loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
        out[name] = [np.asarray(x).tolist() for x in jax.tree.leaves(grad(u, w, b, sh))]

    # GELU in the MLP's GEMMs (mlp_impl=pallas), the kernels stood in by their references: per
    # shard, 128 of the 1024 rows a device, against one call
    import pallas_kernels

    mlp_rows = set()

    def gelu_fwd(x, w, b):
        mlp_rows.add(x.shape[0])
        return pallas_kernels.matmul_gelu_ref(x, w, b)

    def dgelu(dy, w, h):
        mlp_rows.add(h.shape[0])
        return pallas_kernels.matmul_dgelu_ref(dy, w, h)

    pallas_kernels.matmul_gelu, pallas_kernels.matmul_dgelu = gelu_fwd, dgelu
    x, w1, b1, w2 = (
        jax.random.normal(jax.random.PRNGKey(5 + i), s)
        for i, s in enumerate([(1024, 64), (64, 32), (32,), (32, 64)])
    )

    def mlp_loss(x, w1, b1, w2, shard):
        return jnp.sum(jnp.sin(ops.gelu_mlp(x, w1, b1, w2, shard)))

    for name, sh in [("mlp_single", None), ("mlp_sharded", shard)]:
        grad = jax.jit(jax.grad(mlp_loss, argnums=(0, 1, 2, 3)), static_argnums=4)
        out[name] = [np.asarray(x).tolist() for x in grad(x, w1, b1, w2, sh)]
    out["mlp_rows"] = sorted(mlp_rows)

    # data 4 x pipeline 2: 4 rows do not split over 8 devices, so a kernel call splits them over
    # data (4 ways) and is replicated over the stages, not run whole on every device
    staged = Mesh(np.array(jax.devices()).reshape(4, 1, 2), parallel.ROW_AXES)
    seen = []

    def kernel(x):
        seen.append(x.shape)
        return jnp.sin(x)

    def split_loss(x):
        return jnp.sum(ops._per_shard(ops.KernelShard(staged, parallel.ROW_AXES), kernel, (x,),
                                      (True,), True))  # fmt: skip

    x = jnp.arange(12.0).reshape(4, 3)
    grad = jax.grad(split_loss)(x)  # through the shard_map's transpose over the stages
    err = float(jnp.max(jnp.abs(grad - jnp.cos(x))))
    out["prefix_split"] = {"rows_seen": [s[0] for s in seen], "grad_err": err}
    # this process holds both stages of every row: its rows are the whole batch, once
    rows = distributed.process_rows(staged, 16)
    out["process_rows"] = [rows.start, rows.stop]
    print(json.dumps(out))


@pytest.mark.slow  # an 8-device subprocess that trains
def test_pallas_kernels_run_per_batch_shard_and_match_one_device():
    out = _on_8_devices("_check_pallas_on_mesh")
    ref = out.pop("single")
    assert "per shard" not in ref["ops"], ref["ops"]
    # The scan body's 2 norms and softmax, ln_f and the loss, forward and backward: each kernel
    # call a shard_map of its own on the mesh, none on one device.
    assert out.pop("single_shard_maps") == 0
    assert out.pop("data8_shard_maps") >= 5
    # the same kernels run on the mesh as on one device, the fused loss among them
    kernels = out.pop("single_kernels")
    assert out.pop("data8_kernels") == kernels and kernels["cross_entropy_fwd_bwd"] == 1, kernels
    assert {"add_layer_norm_fwd", "add_layer_norm_bwd", "attention_softmax_bwd"} <= set(kernels)
    _assert_trees_close(out.pop("conv_sharded"), out.pop("conv_single"), 1e-6, "conv")
    _assert_trees_close(out.pop("mlp_sharded"), out.pop("mlp_single"), 1e-5, "mlp")
    assert out.pop("mlp_rows") == [128, 1024]  # the MLP's kernels ran per shard
    split = out.pop("prefix_split")
    assert set(split["rows_seen"]) == {1} and split["grad_err"] < 1e-6, split  # 4 rows / data 4
    assert out.pop("process_rows") == [0, 16]
    for name, r in out.items():
        # Rows over every axis (pipeline has size 1 without stages: no collective over it).
        assert r["ops"].endswith("(Pallas per shard over data x fsdp x pipeline = 8)"), r["ops"]
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(r["norms"], ref["norms"], rtol=1e-5, err_msg=name)
        _assert_trees_close(r["params"], ref["params"], 1e-5, name)
        np.testing.assert_allclose(r["eval"]["loss_sum"], ref["eval"]["loss_sum"], rtol=1e-5)
        assert r["eval"]["correct"] == ref["eval"]["correct"], name


# train.py's loop on pipeline=4 x fsdp=2; 44 test examples: the last evaluation batch (12 rows)
# is padded to 16 (parallel.eval_rows_multiple = 8) and runs pipelined like the others.
STAGED = [*PIPE4, "--parallel.data=1", "--parallel.fsdp=2", "--data.associative_recall.num_test=44"]


def _check_train_and_save(run_dir: str) -> None:
    """train.py's loop on 8 devices (STAGED), saving its checkpoints."""
    from jaxllm.train.loop import train

    result = train(_cfg(*STAGED, f"--train.run_dir={run_dir}"))
    print(json.dumps({"losses": result.losses, "eval_loss": result.eval_loss}))


@pytest.mark.slow  # an 8-device subprocess that trains
def test_save_on_8_devices_restore_on_one(tmp_path):
    from jaxllm.train.loop import evaluate, train

    run_dir = tmp_path / "run"
    out = _on_8_devices("_check_train_and_save", str(run_dir))
    assert len(out["losses"]) == 4 and all(np.isfinite(out["losses"]))
    # the same run on this process's one device: the layout changes no loss
    one = [a for a in STAGED if not a.startswith("--parallel.")]
    single = train(_cfg(*one, f"--train.run_dir={tmp_path / 'one'}"))
    np.testing.assert_allclose(out["losses"], single.losses, rtol=1e-5)
    start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["parallel"] == (
        "parallel: mesh data=1 fsdp=2 pipeline=4 (4 microbatches, bubble 43%, rows split over "
        "the stages) (fsdp weights gathered per step) over 8 cpu devices"
    )
    assert start["state_bytes_per_device"] > 0

    cfg = _cfg(*STAGED, f"--train.run_dir={run_dir}")
    model = build_model(cfg.model, cfg.execution)
    tx = make_optimizer(cfg.optim, 4)
    state = create_state(model, tx, jax.random.PRNGKey(0), jnp.zeros((1, 9), jnp.int32))
    ckpt = Checkpointer(run_dir)
    # Restore verifies every array against the sha256 taken from the sharded arrays at save
    # time: equal checksums mean the same bytes as on the 8 devices.
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older checkpoint
        restored, meta = ckpt.restore(state)
    ckpt.close()
    assert meta["step"] == 4 and int(restored.step) == 4
    assert (
        len(meta["checksums"]["arrays"])
        == len(jax.tree.leaves(restored.opt_state)) + len(jax.tree.leaves(restored.params)) + 1
    )
    _, variables, step = load_run(run_dir)  # generate.py's path
    assert step == 4
    loaded, want = jax.tree.leaves(variables["params"]), jax.tree.leaves(restored.params)
    for a, b in zip(loaded, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The run's last evaluation (pipelined batches, the partial last one padded) is the
    # one-device evaluation of its checkpoint.
    ev = evaluate(restored, make_source(cfg))
    np.testing.assert_allclose(out["eval_loss"], ev["loss"], rtol=1e-5)
