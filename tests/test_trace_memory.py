"""Named-scope traces (profile.py trace, train.trace_steps), NVTX/nsys helpers, memory profiling
(profile.py memory) and block rematerialisation (model.remat)."""

import dataclasses
import gzip
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from jaxllm.config import ConfigError, load_config
from jaxllm.models import build_model, init_kv_cache
from jaxllm.profiling import trace
from jaxllm.train.loop import check_resume, train

ROOT = Path(__file__).resolve().parents[1]
AR = ROOT / "configs" / "ar.yaml"


def profile_cli():
    """profile.py as a module (not named `profile`: that name is the standard library's)."""
    spec = importlib.util.spec_from_file_location("profile_cli", ROOT / "profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile_dir(log_dir: Path) -> Path:
    (run,) = list((log_dir / "plugins" / "profile").iterdir())
    return run


# ----------------------------------------------------------------------------- profile.py trace


def test_trace_cli_writes_a_trace_with_the_scope_names(tmp_path, capsys):
    out = tmp_path / "t"
    argv = ["trace", "--out", str(out), "--config", str(AR), "--warmup", "1", "--steps", "2",
            "--set", "model.n_layers=2", "--train.batch_size=2", "--top", "5"]  # fmt: skip
    assert profile_cli().main(argv) == 0
    text = capsys.readouterr().out
    run = profile_dir(out / "trace")
    xplane = next(run.glob("*.xplane.pb")).read_bytes()
    for scope in (b"block_0/attn/qkv", b"block_1/attn/sdpa", b"block_0/mlp", b"block_1/ln_2",
                  b"loss", b"optimizer", b"embed"):  # fmt: skip
        assert scope in xplane, scope
    with gzip.open(run / "perfetto_trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert "train" in names  # the StepTraceAnnotation of each traced step
    hlo = (out / "step.hlo.txt").read_text()
    assert "block_1/mlp" in hlo and "optimizer" in hlo
    # On the CPU there are no GPU kernels: the table says so and lists host XLA ops.
    assert "no device kernel events" in text and "host XLA ops" in text
    assert "| ms/step |" in text and "tensorboard --logdir" in text
    assert "bwd/block_*/mlp" in text  # time per scope, blocks merged


def test_trace_cli_rejects_bad_overrides(tmp_path):
    with pytest.raises(SystemExit, match="model.n_layers must be > 0"):
        profile_cli().main(["trace", "--out", str(tmp_path), "--config", str(AR),
                            "--model.n_layers=0"])  # fmt: skip
    with pytest.raises(SystemExit):  # other subcommands take no trailing overrides
        profile_cli().main(["roofline", "--model.n_layers=2"])


def test_scope_of_and_hlo_scopes():
    f = trace.scope_of
    assert f("jit(train_step)/transpose(jvp(GPT2.loss))/block_3/attn/qkv/dot_general") == (
        "bwd/block_3/attn/qkv"
    )
    assert f("jit(train_step)/jvp(GPT2.loss)/block_0/attn/sdpa/bhqk,bkhd->bqhd/dot_general") == (
        "fwd/block_0/attn/sdpa"
    )
    assert f("jit(train_step)/optimizer/mul") == "optimizer"
    remat = ("jit(train_step)/transpose(jvp(GPT2.loss))/block_1/jvp(GPT2.loss)/block_1/"
             "checkpoint/rematted_computation/attn/qkv/dot_general")  # fmt: skip
    assert f(remat) == "recompute/block_1/attn/qkv"
    hlo = """
%fused_computation.3 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %mul.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(f)/optimizer/mul"}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %fusion.3 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation.3
}
"""
    assert trace.hlo_scopes(hlo)["fusion.3"] == "optimizer"  # from the fused computation


def test_top_kernels_counts_only_gpu_stream_kernels():
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    kernels = [
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 3000, "args": {"hlo_op": "f.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 1000, "args": {"hlo_op": "f.1"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_fusion", "dur": 500, "args": {}},
        {"ph": "X", "pid": 1, "tid": 8, "name": "f.1", "dur": 4000},  # an op range, not a kernel
        {"ph": "X", "pid": 2, "tid": 1, "name": "host", "dur": 9000},
    ]
    s = trace.top_kernels(meta + kernels, steps=2, scopes={"f.1": "bwd/block_0/mlp"})
    assert s.source == "device"
    assert [(r.name, r.ms_per_step, r.calls_per_step, r.scope) for r in s.rows] == [
        ("gemm", 2.0, 1.0, "bwd/block_0/mlp"),
        ("loop_fusion", 0.25, 0.5, "(no scope)"),
    ]
    assert s.total_ms_per_step == 2.25
    assert trace.top_kernels(meta, steps=1) is None


# ----------------------------------------------------------------------------- NVTX, nsys


def test_nsys_missing_is_one_clear_error(tmp_path):
    with pytest.raises(trace.NsysError, match="not on the PATH.*profile.py trace --out"):
        trace.run_nsys(tmp_path, [], nsys="no-such-nsys-binary")
    with pytest.raises(SystemExit, match="profile.py nsys: .*not on the PATH"):
        profile_cli().main(["nsys", "--out", str(tmp_path), "--nsys-bin", "no-such-nsys"])


def test_nsys_commands():
    profile, stats = trace.nsys_commands("nsys", "OUT", ["--steps=3", "--model.n_layers=2"])
    assert profile[:3] == ["nsys", "profile", "--trace=cuda,nvtx"]
    assert profile[-6:] == ["trace", "--nvtx", "--out", "OUT", "--steps=3", "--model.n_layers=2"]
    assert [c for c in stats if "--filter-nvtx=forward" in c]
    assert all(c[-1] == "OUT/report.nsys-rep" for c in stats)


def test_nvtx_phases_run_separately(tmp_path):
    cfg = load_config(AR, ["--model.n_layers=1", "--train.batch_size=2"])
    res = trace.trace_train_steps(cfg, tmp_path, warmup=1, steps=1, nvtx=True)
    assert set(res.phase_ms) == set(trace.PHASES) and min(res.phase_ms.values()) > 0
    assert res.trace_dir is None  # no jax.profiler trace: nsys owns CUPTI
    hlo = res.hlo_path.read_text()
    assert all(f"jit_{p}" in hlo for p in trace.PHASES)
    with trace.annotate("outside a trace"):  # a no-op range without a profiler attached
        pass


# ----------------------------------------------------------------------------- train.trace_steps


def test_train_trace_steps_writes_a_trace_in_the_run_dir(tmp_path):
    cfg = load_config(
        AR,
        [
            "--data.associative_recall.num_train=64", "--data.associative_recall.num_test=16",
            "--train.batch_size=8", "--train.steps=6", "--train.eval_every=6",
            "--train.eval_batches=1", "--optim.warmup_steps=1", "--train.progress=false",
            "--train.trace_steps=[3,5]", f"--train.run_dir={tmp_path}", "--model.n_layers=1",
        ],
    )  # fmt: skip
    train(cfg)
    run = profile_dir(tmp_path / "trace")
    xplane = next(run.glob("*.xplane.pb")).read_bytes()
    assert b"optimizer" in xplane and b"block_0/attn" in xplane
    with gzip.open(run / "perfetto_trace.json.gz") as f:
        steps = [e for e in json.load(f)["traceEvents"] if e.get("name") == "train"]
    assert len(steps) == 2  # updates 3 and 4
    log = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    said = [r["message"] for r in log if r.get("event") == "trace"]
    assert said[0].startswith("trace: recording steps 3..4") and "wrote steps 3..4" in said[1]


def test_trace_steps_validation_and_resume():
    ok = load_config(AR, ["--train.trace_steps=[10,13]"])
    assert ok.train.trace_steps == (10, 13)
    for bad, msg in (
        ("[0,3]", "1 <= start < end"),
        ("[5,5]", "1 <= start < end"),
        ("[1,2,3]", "two steps"),
        ("[1,999999]", "train.steps \\+ 1"),
        ("7", "non-empty list"),
    ):
        with pytest.raises(ConfigError, match=f"train.trace_steps.*{msg}"):
            load_config(AR, [f"--train.trace_steps={bad}"])
    with pytest.raises(ConfigError, match="model.remat must be one of \\['none', 'block'\\]"):
        load_config(AR, ["--model.remat=full"])
    base = load_config(AR)
    check_resume(base, ok, 1, 1)  # tracing changes nothing a run computes: resume allowed


# ----------------------------------------------------------------------------- remat


def _params_loss_and_grads(cfg):
    """Parameters, the training-mode loss (dropout on) and its gradient, traced (no jit)."""
    model = build_model(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]

    def loss(p):
        rngs = {"dropout": jax.random.PRNGKey(2)}  # the recomputed forward redraws the same mask
        return model.apply({"params": p}, tokens, targets, False, rngs=rngs, method="loss")[0]

    return params, *jax.value_and_grad(loss)(params)


def test_remat_gives_the_same_loss_and_gradients(arch):
    # One block (remat is per block). Training mode either way (deterministic=False is static
    # under jax.checkpoint); dropout masks on gpt2 only (random bits are slow to compile).
    cfg = tiny_config(arch, dropout=0.1 if arch == "gpt2" else 0.0, n_layers=1)
    both = jax.jit(lambda: [_params_loss_and_grads(c) for c in (cfg, dataclasses.replace(
        cfg, remat="block"))])()  # fmt: skip
    (p0, l0, g0), (p1, l1, g1) = both
    # Same parameter tree (h0, h1, ...): checkpoints load either way.
    assert jax.tree.structure(p0) == jax.tree.structure(p1)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g0, g1)


def test_remat_decodes_with_the_kv_cache_as_without(arch):
    cfg = tiny_config(arch, n_layers=1)
    model, rematted = build_model(cfg), build_model(dataclasses.replace(cfg, remat="block"))
    tokens = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)

    @jax.jit
    def decode_both(params):  # one program per model: prefill, then one cached step
        return [decode(m, params) for m in (model, rematted)]

    def decode(m, params):
        cache = init_kv_cache(cfg, 1, 8)
        logits, cache = m.apply(params, tokens, cache, 0, method="decode")
        step, _ = m.apply(params, jnp.array([[9]]), cache, 5, method="decode")
        return logits, step

    plain, remat = decode_both(params)

    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- profile.py memory


def test_memory_cli_on_the_tiny_size(tmp_path, capsys):
    jsonl = tmp_path / "m.jsonl"
    argv = ["memory", "--size", "tiny", "--contexts", "64", "--set", "model.n_layers=1",
            "--vocab=512", "--out", str(tmp_path), "--jsonl", str(jsonl),
            "--time-steps", "1"]  # fmt: skip
    assert profile_cli().main(argv) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| tiny | 64 |")]
    assert len(rows) == 2 and "saved x" in rows[1] and "time x" in rows[1]
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    none, block = sorted(recs, key=lambda r: r["remat"] != "none")
    assert none["status"] == block["status"] == "ok"
    assert 0 < block["saved_bytes"] < none["saved_bytes"]  # what remat is for
    assert none["train_xla_bytes"] > none["forward_xla_bytes"] > 0 and none["step_ms"] > 0
    assert (tmp_path / "memory_tiny.png").stat().st_size > 0
    for r in recs:
        assert Path(r["pprof"]).stat().st_size > 0
    with pytest.raises(SystemExit, match="--remat: unknown value"):
        profile_cli().main(["memory", "--size", "tiny", "--remat", "full"])
    with pytest.raises(SystemExit, match="--contexts must be in 1..128"):
        profile_cli().main(["memory", "--size", "tiny", "--contexts", "256"])
