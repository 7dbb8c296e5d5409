"""Named-scope traces (profile.py trace, train.trace_steps), NVTX/nsys helpers, memory profiling
(profile.py memory) and block rematerialisation (execution.remat)."""

import gzip
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from jaxllm.config import ConfigError, load_config
from jaxllm.models import init_kv_cache
from jaxllm.profiling import memory, trace
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
    argv = ["trace", "--out", str(out), "--config", str(AR), "--warmup", "1", "--samples", "2",
            "--model.n_layers=2", "--train.batch_size=2", "--top", "5"]  # fmt: skip
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


def test_trace_out_of_memory_is_one_line(tmp_path, monkeypatch):
    def oom(*args, **kwargs):  # what XLA raised for GPT-2 124M traced on a 2-core CPU
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory allocating 58346532008 bytes.\nmore detail"
        )

    monkeypatch.setattr(trace, "trace_train_steps", oom)
    with pytest.raises(SystemExit) as e:
        profile_cli().main(["trace", "--out", str(tmp_path), "--config", str(AR)])
    assert str(e.value) == (
        "profile.py trace: out of memory (RESOURCE_EXHAUSTED: Out of memory allocating "
        "58346532008 bytes.); use a smaller model or batch (e.g. --config configs/ar.yaml)"
    )


def test_trace_cli_rejects_bad_overrides(tmp_path):
    with pytest.raises(SystemExit, match="model.n_layers must be > 0"):
        profile_cli().main(["trace", "--out", str(tmp_path), "--config", str(AR),
                            "--model.n_layers=0"])  # fmt: skip
    with pytest.raises(SystemExit):  # the kernels benchmark has no model to override
        profile_cli().main(["kernels", "--model.n_layers=2"])


def test_outputs_the_run_cannot_write_are_refused_before_it_measures(tmp_path):
    """A --jsonl in a missing directory or an --out that is a file: refused up front."""
    (tmp_path / "afile").write_text("x")
    cases = [
        (["bench", "--jsonl", str(tmp_path / "none" / "b.jsonl")], "no directory .*none"),
        (["bench", "--jsonl", str(tmp_path)], "is a directory"),
        (["trace", "--out", str(tmp_path / "afile" / "t"), "--config", str(AR)], "not a dir"),
        (["memory", "--out", str(tmp_path / "afile")], "afile is not a directory"),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit, match=says):
            profile_cli().main(argv)


def test_scope_of_and_hlo_scopes():
    f = trace.scope_of
    assert f("jit(train_step)/transpose(jvp(GPT2.loss))/block_3/attn/qkv/dot_general") == (
        "bwd/block_3/attn/qkv"
    )
    assert f("jit(train_step)/jvp(GPT2.loss)/block_0/attn/sdpa/bhqk,bkhd->bqhd/dot_general") == (
        "fwd/block_0/attn/sdpa"
    )
    assert f("jit(train_step)/optimizer/mul") == "optimizer"
    pallas = "jit(train_step)/transpose(jvp(GPT2.loss))/block_9/ln_2/add_layer_norm_bwd/pallas_call"
    assert f(pallas) == "bwd/block_9/ln_2"  # a Pallas call: its kernel name is not a scope
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
    assert s.span_ms_per_step is None  # no start times in these events
    assert trace.top_kernels(meta, steps=1) is None
    # with start times: 0-3000, 3500-4500 and 4000-4500 us span 4500 us, busy 4000 of them
    for e, ts in zip(kernels, (0, 3500, 4000, 0, 0), strict=True):
        e["ts"] = ts
    s = trace.top_kernels(meta + kernels, steps=2)
    assert (s.span_ms_per_step, s.idle_ms_per_step) == (2.25, 0.25)
    assert "the steps span 2.25 ms each, 0.25 ms of it with no kernel running" in (
        trace.format_summary(s, "gpu")
    )


# Lines of the optimized HLO of `profile.py trace` on an H100 (GPT-2 124M preset), in their
# schedule order, blocks 0 and 1 of the forward;
# shortened: operand_layout_constraints and most of each backend_config dropped, the Triton IR
# cut. The ENTRY header is reduced to one parameter.
GPU_HLO = r"""
ENTRY %main.510 (state_step.1: s32[]) -> s32[] {
  %custom-call.207 = (bf16[16384,2304]{1,0}, s8[33554432]{0}) custom-call(%pallas_call.253.0, %wrapped_convert), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_0/attn/qkv/dot_general" scheduling_name="custom-call.207" stack_frame_id=148}, backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %cublas-lt-matmul.60 = (bf16[16384,768]{1,0}, s8[33554432]{0}) custom-call(%bitcast.9.0, %wrapped_convert.2, %wrapped_convert.3), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_0/attn/out/dot_general" scheduling_name="cublas-lt-matmul.60" stack_frame_id=208}, backend_config={"gemm_backend_config":{"epilogue":"BIAS"}}
  %pallas_call.256 = (f32[16384,768]{1,0}, bf16[16384,768]{1,0}, f32[16384]{0}, f32[16384]{0}) custom-call(%bitcast.5.0, %get-tuple-element.1.0, %state_params__h0____ln2____scale__.1, %state_params__h0____ln2____bias__.1), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_0/ln_2/add_layer_norm_fwd/pallas_call" scheduling_name="pallas_call.256" stack_frame_id=203}, backend_config={debug = false, grid_x = 1024 : i32, grid_y = 1 : i32, grid_z = 1 : i32, ir = "ML\EFR\0DMLIR24.0.0git\0...", name = "add_layer_norm_fwd", num_stages = 1 : i32, num_warps = 4 : i32}
  %loop_multiply_fusion.11 = bf16[16,1024,3072]{2,1,0} fusion(%get-tuple-element.2.0), kind=kLoop, calls=%fused_multiply.11, metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_0/mlp/mul" deduplicated_name="loop_multiply_fusion" scheduling_name="loop_multiply_fusion.11" stack_frame_id=35}
  %custom-call.208 = (bf16[16384,2304]{1,0}, s8[33554432]{0}) custom-call(%pallas_call.263.0, %wrapped_convert.8), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_1/attn/qkv/dot_general" scheduling_name="custom-call.208" stack_frame_id=148}, backend_config={"gemm_backend_config":{"epilogue":"DEFAULT"}}
  %cublas-lt-matmul.63 = (bf16[16384,768]{1,0}, s8[33554432]{0}) custom-call(%bitcast.15.0, %wrapped_convert.10, %wrapped_convert.11), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_1/attn/out/dot_general" scheduling_name="cublas-lt-matmul.63" stack_frame_id=208}, backend_config={"gemm_backend_config":{"epilogue":"BIAS"}}
  %pallas_call.266 = (f32[16384,768]{1,0}, bf16[16384,768]{1,0}, f32[16384]{0}, f32[16384]{0}) custom-call(%pallas_call.262.0, %get-tuple-element.5.0, %state_params__h1____ln2____scale__.1, %state_params__h1____ln2____bias__.1), custom_call_target="__gpu$xla.gpu.triton", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_1/ln_2/add_layer_norm_fwd/pallas_call" scheduling_name="pallas_call.266" stack_frame_id=203}, backend_config={debug = false, grid_x = 1024 : i32, grid_y = 1 : i32, grid_z = 1 : i32, ir = "ML\EFR\0DMLIR24.0.0git\0...", name = "add_layer_norm_fwd", num_stages = 1 : i32, num_warps = 4 : i32}
  ROOT %loop_multiply_fusion.10 = bf16[16,1024,3072]{2,1,0} fusion(%get-tuple-element.6.0), kind=kLoop, calls=%fused_multiply.10, metadata={op_name="jit(train_step)/jvp(GPT2.loss)/block_1/mlp/mul" deduplicated_name="loop_multiply_fusion" scheduling_name="loop_multiply_fusion.10" stack_frame_id=35}
}
"""  # noqa: E501
# The kernels those instructions launch on the GPU (names as in that run's trace), in order.
GEMM = "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_TNT"
GEMM_BIAS = "nvjet_sm90_tst_128x128_64x6_2x1_v_bz_bias_NNT"
LN, MUL = "add_layer_norm_fwd", "loop_multiply_fusion_11"
GPU_LAUNCHES = [
    (GEMM, "custom-call.207"), (GEMM_BIAS, "cublas-lt-matmul.60"),
    (LN, "pallas_call.256"), (MUL, "loop_multiply_fusion.11"),
    (GEMM, "custom-call.208"), (GEMM_BIAS, "cublas-lt-matmul.63"),
    (LN, "pallas_call.266"), (MUL, "loop_multiply_fusion.10"),
]  # fmt: skip


def gpu_trace(steps: int, hlo_op: bool) -> list[dict]:
    """A GPU-like Chrome trace: `steps` train steps of GPU_LAUNCHES on one stream, each kernel
    1 ms; with `hlo_op`, each event names its HLO instruction as XLA annotates launches."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
    ]
    events = []
    for n in range(steps * len(GPU_LAUNCHES)):
        kernel, op = GPU_LAUNCHES[n % len(GPU_LAUNCHES)]
        args = {"correlation_id": str(n)} | ({"hlo_op": op, "hlo_module": "jit_train_step"}
                                             if hlo_op else {})  # fmt: skip
        events.append({"ph": "X", "pid": 1, "tid": 7, "name": kernel, "ts": 10 * n,
                       "dur": 1000, "args": args})  # fmt: skip
    return meta + events


def test_gpu_kernel_scopes_from_hlo_op_and_from_kernel_names():
    hk = trace.HloKernels(GPU_HLO)
    expected = {  # kernel -> the scope of the instructions it ran for, blocks merged
        GEMM: "fwd/block_*/attn/qkv",
        GEMM_BIAS: "fwd/block_*/attn/out",
        LN: "fwd/block_*/ln_2",
        MUL: "fwd/block_*/mlp",
    }
    for hlo_op in (True, False):  # the robust path, then the kernel names and launch order
        s = trace.top_kernels(gpu_trace(2, hlo_op), steps=2, hlo=hk)
        assert {r.name: r.scope for r in s.rows} == expected, hlo_op
        assert {r.name: r.calls_per_step for r in s.rows} == {k: 2 for k in expected}
        assert dict(s.by_scope) == {v: 2.0 for v in expected.values()}  # ms per step
        how = dict(s.resolved)
        assert how == ({"hlo_op": 16} if hlo_op else {"kernel name": 8, "launch order": 8})
        assert ("hlo_op" in s.arg_keys) == hlo_op
    text = trace.format_summary(s, "gpu")
    assert "(no scope)" not in text and "scopes of the launches: launch order 8" in text


# ----------------------------------------------------------------------------- NVTX, nsys


def test_nsys_missing_is_one_clear_error(tmp_path):
    with pytest.raises(trace.NsysError, match="not on the PATH.*profile.py trace --out"):
        trace.run_nsys(tmp_path, [], nsys="no-such-nsys-binary")
    with pytest.raises(SystemExit, match="profile.py nsys: .*not on the PATH"):
        profile_cli().main(["nsys", "--out", str(tmp_path), "--nsys-bin", "no-such-nsys"])


def test_nsys_commands():
    profile, stats = trace.nsys_commands("nsys", "OUT", ["--samples=3", "--model.n_layers=2"])
    assert profile[:3] == ["nsys", "profile", "--trace=cuda,nvtx"]
    assert profile[-6:] == ["trace", "--nvtx", "--out", "OUT", "--samples=3", "--model.n_layers=2"]
    assert Path(profile[-7]).is_absolute() and Path(profile[-7]).is_file()  # from any cwd
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
    said = [(r["step"], r["message"]) for r in log if r.get("event") == "trace"]
    assert said[0][1].startswith("trace: recording steps 3..4") and "wrote steps 3..4" in said[1][1]
    # each record carries its step: a resume from an earlier checkpoint drops it (it stayed)
    assert [step for step, _ in said] == [3, 4]
    from jaxllm.train.metrics_log import truncate_metrics

    truncate_metrics(tmp_path / "metrics.jsonl", 2)
    left = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in left if r.get("event") == "trace"]


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
    with pytest.raises(ConfigError, match="execution.remat must be one of \\['none', 'block'\\]"):
        load_config(AR, ["--execution.remat=full"])
    base = load_config(AR)
    check_resume(base, ok, 1, 1)  # tracing changes nothing a run computes: resume allowed


# ----------------------------------------------------------------------------- remat


def _params_loss_and_grads(model):
    """Parameters, the training-mode loss (dropout on) and its gradient, traced (no jit)."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, model.cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]

    def loss(p):
        rngs = {"dropout": jax.random.PRNGKey(2)}  # the recomputed forward redraws the same mask
        return model.apply({"params": p}, tokens, targets, False, rngs=rngs, method="loss")[0]

    return params, *jax.value_and_grad(loss)(params)


def test_remat_gives_the_same_loss_and_gradients(arch):
    # One block (remat is per block). Training mode either way (deterministic=False is static
    # under jax.checkpoint); dropout masks on gpt2 only (random bits are slow to compile).
    kw = dict(dropout=0.1 if arch == "gpt2" else 0.0, n_layers=1)
    models = tiny_model(arch, **kw), tiny_model(arch, **kw, remat="block")
    both = jax.jit(lambda: [_params_loss_and_grads(m) for m in models])()
    (p0, l0, g0), (p1, l1, g1) = both
    # Same parameter tree (h0, h1, ...): checkpoints load either way.
    assert jax.tree.structure(p0) == jax.tree.structure(p1)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g0, g1)


def test_remat_decodes_with_the_kv_cache_as_without(arch):
    model, rematted = tiny_model(arch, n_layers=1), tiny_model(arch, n_layers=1, remat="block")
    tokens = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)

    @jax.jit
    def decode_both(params):  # one program per model: prefill, then one cached step
        return [decode(m, params) for m in (model, rematted)]

    def decode(m, params):
        cache = init_kv_cache(m, 1, 8)
        logits, cache = m.apply(params, tokens, cache, 0, method="decode")
        step, _ = m.apply(params, jnp.array([[9]]), cache, 5, method="decode")
        return logits, step

    plain, remat = decode_both(params)

    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- profile.py memory


def test_memory_cli_on_the_tiny_size(tmp_path, capsys):
    jsonl = tmp_path / "m.jsonl"
    argv = ["memory", "--size", "tiny", "--contexts", "64", "--model.n_layers=1",
            "--model.vocab_size=512", "--out", str(tmp_path), "--jsonl", str(jsonl),
            "--samples", "1"]  # fmt: skip
    assert profile_cli().main(argv) == 0
    captured = capsys.readouterr()
    text = captured.out
    rows = [line for line in text.splitlines() if line.startswith("| tiny | 64 |")]
    assert len(rows) == 2 and "saved x" in rows[1] and "time x" in rows[1]
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    none, block = sorted(recs, key=lambda r: r["remat"] != "none")
    assert none["status"] == block["status"] == "ok"
    assert 0 < block["saved_bytes"] < none["saved_bytes"]  # what remat is for
    assert none["train_xla_bytes"] > none["forward_xla_bytes"] > 0 and none["step_ms"] > 0
    # Each program compiled once; progress and every config's wall time on stderr.
    compiled = [k for k in none["phase_s"] if k.startswith("compiled")]
    assert compiled == [f"compiled {p}" for p in ("init", "forward", "AdamW state", "train step")]
    assert none["wall_s"] >= sum(none["phase_s"].values()) - 0.01
    assert "memory tiny_T64_float32_remat-none: compiled train step in" in captured.err
    assert "memory [2/2] tiny_T64_float32_remat-block: ok," in captured.err
    assert (tmp_path / "memory_tiny.png").stat().st_size > 0
    for r in recs:
        assert Path(r["pprof"]).stat().st_size > 0
    with pytest.raises(SystemExit):  # argparse: "argument --remats: ['full']; allowed: ..."
        profile_cli().main(["memory", "--size", "tiny", "--remats", "full"])
    with pytest.raises(SystemExit, match="--contexts must be in 1..128"):
        profile_cli().main(["memory", "--size", "tiny", "--contexts", "256"])
    with pytest.raises(SystemExit, match="--contexts must be in 1..192"):  # the override's limit
        profile_cli().main(["memory", "--size", "tiny", "--contexts", "256",
                            "--model.context_length=192"])  # fmt: skip


def test_memory_child_that_fails_says_why(tmp_path):
    bad = {"size": "tiny", "context": 32, "remat": "none",
           "overrides": ["--model.n_layers=0", "--model.vocab_size=512"]}  # fmt: skip
    rec = memory.measure_in_child(bad, tmp_path, 1)
    assert rec["status"] == "failed (exit 1)" and "n_layers" in rec["error"]
    assert rec["process_s"] > 0
