"""jaxllm.ops: the plan names one path per op family, and never changes one silently."""

import dataclasses
import subprocess
import sys

import pytest
from conftest import ROOT, tiny_config, tiny_model

from jaxllm.config import ConfigError, ExecutionConfig, load_config
from jaxllm.ops import plan_ops


def plan_of(backend, arch="gpt2", **overrides):
    """The plan of the tiny model with `overrides` (model or execution fields) on `backend`."""
    model = tiny_model(arch, **overrides)
    return plan_ops(model.cfg, model.execution, backend=backend)


def preset(**execution):
    """configs/gpt2_124m.yaml's (model, execution), execution fields replaced."""
    cfg = load_config(ROOT / "configs/gpt2_124m.yaml")
    return cfg.model, dataclasses.replace(cfg.execution, **execution)


def test_default_plan_is_all_xla():
    plan = plan_of("cpu")
    assert (plan.norm, plan.attention, plan.loss, plan.conv, plan.mlp) == ("xla",) * 5
    assert plan.describe() == "ops: norm=xla attention=xla decode=xla loss=xla conv=xla mlp=xla"


@pytest.mark.parametrize("hopper", [False, True])
def test_gpt2_benchmark_preset_on_gpu(monkeypatch, hopper):
    import pallas_kernels.common as tb

    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: hopper)  # whatever this machine is
    plan = plan_ops(*preset(), backend="gpu")
    assert (plan.norm, plan.attention, plan.loss, plan.conv, plan.mlp) == (
        "pallas_mgpu" if hopper else "pallas",
        "flash" if hopper else "cudnn",
        "pallas_mgpu" if hopper else "pallas",
        "pallas_mgpu" if hopper else "pallas",
        "pallas_mgpu" if hopper else "xla",
    )
    assert "(Pallas compiled)" in plan.describe()
    assert plan.notes == (() if hopper else (f"mlp_impl=pallas needs {tb.mosaic_gpu_refusal()}: "
                                             "the MLP runs on xla",))  # fmt: skip


def test_cudnn_needs_what_jax_checks_and_the_plan_says_so():
    """cuDNN's limits as jax checks them deep in the trace (an odd T raised NotImplementedError
    there, on an H200 with jax 0.11.2): the plan names them and the path that runs instead."""
    dpa = dict(attention_impl="dot_product_attention", compute_dtype="bfloat16")
    assert plan_of("gpu", **dpa).attention == "cudnn"
    for backend, overrides, missing in (
        ("cpu", {}, "a GPU and bfloat16 (backend cpu, bfloat16)"),
        ("gpu", {"compute_dtype": "float32"}, "a GPU and bfloat16 (backend gpu, float32)"),
        ("gpu", {"context_length": 17}, "an even model.context_length (got 17)"),
        ("gpu", {"d_model": 60, "n_heads": 6}, "a multiple of 8 up to 128 (got 10)"),
    ):
        p = plan_of(backend, **{**dpa, **overrides})
        assert p.attention == "xla", overrides
        assert "attention_impl=dot_product_attention (cuDNN) needs " in p.describe()
        assert missing in p.describe() and "attention runs on xla" in p.describe()
    assert plan_of("cpu", **dpa, kernels="pallas").attention == "pallas"  # the softmax kernel


def test_transformer_lm_rmsnorm_runs_the_pallas_kernel():
    """kernels: pallas puts the Llama model's RMSNorm (+ residual add) on its kernel too."""
    p = plan_of("gpu", "transformer_lm", kernels="pallas")
    assert (p.norm, p.attention, p.conv) == ("pallas",) * 3 and not p.notes
    assert p.describe().startswith("ops: norm=pallas attention=pallas")
    assert plan_of("gpu", "transformer_lm").norm == "xla"


def test_interpret_mode_is_named():
    p = plan_of("cpu", kernels="pallas")
    assert p.interpret and "(Pallas interpreted: no GPU)" in p.describe()


def test_cudnn_attention_with_dropout_is_refused():
    with pytest.raises(ConfigError, match="has no attention dropout; set execution.dropout=0"):
        ExecutionConfig(attention_impl="dot_product_attention", dropout=0.1)


def test_fused_loss_takes_its_mosaic_lowering_on_hopper_and_says_so(monkeypatch):
    """The plan picks the Mosaic GPU cross-entropy kernel on a Hopper-class GPU
    for bfloat16 logits whose rows fit its shared memory; the plan names the path it took."""
    import pallas_kernels.common as tb

    cfg, ex = preset()
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: False)  # another GPU: Triton
    assert plan_ops(cfg, ex, backend="gpu").loss == "pallas"
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    p = plan_ops(cfg, ex, backend="gpu")
    assert p.loss == "pallas_mgpu" and "loss=pallas_mgpu (eval: pallas)" in p.describe()
    assert "(Pallas compiled)" in p.describe()
    assert plan_ops(cfg, ex, backend="cpu").loss == "pallas"  # interpreted: Triton
    # the Mosaic kernel takes bf16 only
    assert plan_ops(*preset(compute_dtype="float32"), backend="gpu").loss == "pallas"
    wide = dataclasses.replace(cfg, vocab_size=60_000)  # two padded rows per SM do not fit
    assert plan_ops(wide, ex, backend="gpu").loss == "pallas"
    assert plan_ops(*preset(loss_impl="xla"), backend="gpu").loss == "xla"
    # the user's override: Triton always; Mosaic GPU where it can run, else an error
    assert plan_ops(*preset(kernel_backend="triton"), backend="gpu").loss == "pallas"
    forced = dataclasses.replace(ex, kernel_backend="mosaic_gpu")
    assert plan_ops(cfg, forced, backend="gpu").loss == "pallas_mgpu"
    with pytest.raises(
        ConfigError,
        match=r"kernel_backend=mosaic_gpu needs, for the \w+ kernels, a GPU \(backend here",
    ):
        plan_ops(cfg, forced, backend="cpu")
    with pytest.raises(
        ConfigError,
        match=r"needs, for the loss kernels, a vocabulary of at most 54272 .*got 60000\)",
    ):
        plan_ops(wide, forced, backend="gpu")
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: False)
    with pytest.raises(
        ConfigError, match=r"needs, for the norm kernels, a GPU of compute capability 9.x or 10.x"
    ):
        plan_ops(cfg, forced, backend="gpu")


def test_kernel_backend_picks_every_pallas_kernels_lowering(monkeypatch):
    """On a Hopper-class GPU auto and kernel_backend=mosaic_gpu run the norms, the softmax and the
    conv on Mosaic GPU (the ops line says so); mosaic_gpu refuses widths its row kernels cannot
    tile, where auto takes Triton."""
    import pallas_kernels.common as tb

    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    cfg, ex = preset(attention_impl="xla")
    cfg = dataclasses.replace(cfg, short_conv=True)
    auto = plan_ops(cfg, ex, backend="gpu")
    assert (auto.norm, auto.attention, auto.conv) == ("pallas_mgpu",) * 3
    forced = plan_ops(cfg, dataclasses.replace(ex, kernel_backend="mosaic_gpu"), backend="gpu")
    assert forced == auto
    assert "norm=pallas_mgpu attention=pallas_mgpu" in forced.describe()
    triton = plan_ops(cfg, dataclasses.replace(ex, kernel_backend="triton"), backend="gpu")
    assert (triton.norm, triton.attention, triton.conv) == ("pallas",) * 3
    narrow = dataclasses.replace(cfg, d_model=96, n_heads=2)
    with pytest.raises(ConfigError, match=r"norm kernels, a hidden size D .* 128 .*\(got 96\)"):
        plan_ops(narrow, dataclasses.replace(ex, kernel_backend="mosaic_gpu"), backend="gpu")
    assert plan_ops(narrow, ex, backend="gpu").norm == "pallas"  # auto: Triton, no error
    # a float32 residual stream of 8192 does not fit its shared memory (the residual add's
    # backward): Triton; a bfloat16 one does
    wide = dataclasses.replace(cfg, d_model=8192, n_heads=64)
    assert plan_ops(wide, ex, backend="gpu").norm == "pallas"
    bf16 = dataclasses.replace(ex, residual_dtype="bfloat16")
    assert plan_ops(wide, bf16, backend="gpu").norm == "pallas_mgpu"


def test_kernel_backend_needs_a_pallas_kernel_and_bf16_for_the_mosaic_loss():
    with pytest.raises(ConfigError, match="triton picks .* needs execution.kernels=pallas or"):
        ExecutionConfig(kernel_backend="triton")
    with pytest.raises(
        ConfigError, match="kernel_backend=mosaic_gpu runs the fused loss in bfloat16"
    ):
        ExecutionConfig(loss_impl="pallas", kernel_backend="mosaic_gpu")
    ex = ExecutionConfig(loss_impl="pallas", kernel_backend="mosaic_gpu", compute_dtype="bfloat16")
    assert ex.kernel_backend == "mosaic_gpu"
    assert (
        ExecutionConfig(kernels="pallas", kernel_backend="mosaic_gpu").kernel_backend
        == "mosaic_gpu"
    )


def test_mosaic_loss_path_lowers_for_cuda(monkeypatch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import ops

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2100, 16)), jnp.float32)
    t, wt = jnp.arange(8), jnp.full((8,), 1 / 8)

    def loss(x, w):
        return ops.linear_cross_entropy(x, w, t, wt, jnp.bfloat16, "pallas_mgpu")[0]

    low = jax.jit(jax.grad(loss, (0, 1))).trace(x, w).lower(lowering_platforms=("cuda",))
    # padded to 17 x 128
    assert "mosaic_gpu" in low.as_text() and "2176" in low.as_text()


def test_model_loss_reaches_the_mosaic_kernel_when_planned(monkeypatch):
    """The plumbing model -> lm_loss -> ops -> pallas_kernels with loss=pallas_mgpu, traced and
    lowered for CUDA (what a Hopper GPU would compile; this CPU cannot run the kernel)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels.common as tb

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    model = tiny_model(
        loss_impl="pallas", compute_dtype="bfloat16", vocab_size=2100, attention_impl="xla"
    )  # cuDNN attention (auto's pick on a GPU) does not trace on a CPU
    assert model.plan.loss == "pallas_mgpu"
    tokens = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)  # no loss in init: no kernel runs

    def loss(p):
        return model.apply(p, tokens, tokens, method="loss")[0]

    text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    # padded to 17 x 128
    assert "cross_entropy_fwd_bwd_mgpu" in text and "2176" in text


def test_model_reaches_every_mosaic_kernel_when_planned(monkeypatch):
    """kernel_backend=mosaic_gpu: the model's norms, softmax and conv (forward and backward)
    and the MLP's dX GEMM with GELU's backward (mlp_impl=pallas) lower to their Mosaic GPU
    kernels for CUDA, at the context and (without Triton) at a shorter batch (whose 80 rows run
    XLA's MLP backward)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels.common as tb

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    model = tiny_model(kernels="pallas", kernel_backend="mosaic_gpu", compute_dtype="bfloat16",
                       d_model=128, n_heads=2, context_length=128, short_conv=True,
                       attention_impl="xla", mlp_impl="pallas")  # fmt: skip
    tokens = jnp.zeros((2, 128), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)

    def loss(p):
        return model.apply(p, tokens, tokens, method="loss")[0]

    text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    for op in ("add_layer_norm", "attention_softmax", "depthwise_conv1d"):
        assert f"{op}_fwd_mgpu" in text and f"{op}_bwd_mgpu" in text, op
    assert "matmul_gelu_mgpu" in text and "matmul_dgelu_mgpu" in text
    # a batch shorter than the context: without Triton the Mosaic softmax takes it padded
    monkeypatch.setattr(tb, "pltriton", None)
    short = jnp.zeros((2, 40), jnp.int32)

    def short_loss(p):
        return model.apply(p, short, short, method="loss")[0]

    text = jax.jit(jax.grad(short_loss)).trace(params).lower(lowering_platforms=("cuda",))
    assert "attention_softmax_bwd_mgpu" in text.as_text()
    assert "matmul_gelu_mgpu" not in text.as_text() and "matmul_dgelu_mgpu" not in text.as_text()


def test_flash_path_lowers_the_qkv_projection_and_kernels_as_one_op(monkeypatch):
    """attention_impl=pallas on Hopper (path flash): the model's attention lowers, forward and
    gradient, to the flash kernels through ops.qkv_attention (q, k, v read in place from the
    projection), with the same parameters as every other path."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels.common as tb
    from jaxllm import ops

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    calls, fused = [], ops.qkv_attention
    monkeypatch.setattr(ops, "qkv_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    kw = dict(compute_dtype="bfloat16", d_model=128, n_heads=2, context_length=128)
    model = tiny_model(attention_impl="pallas", **kw)
    assert model.plan.attention == "flash"
    tokens = jnp.zeros((2, 128), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    other = jax.eval_shape(
        tiny_model(attention_impl="xla", **kw).init, jax.random.PRNGKey(0), tokens
    )
    assert jax.tree.map(lambda a: (a.shape, a.dtype), params) == jax.tree.map(
        lambda a: (a.shape, a.dtype), other
    )

    def loss(p):
        return model.apply(p, tokens, tokens, method="loss")[0]

    text = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    for kernel in ("fwd", "dq", "dkv"):
        assert f"flash_attention_{kernel}_mgpu" in text
    assert calls  # the model's attention went through it


NO_TRITON = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # as in a jax that dropped the lowering
import jax.numpy as jnp
import jaxllm.ops, pallas_kernels
try:
    pallas_kernels.layer_norm(jnp.ones((2, 128)), jnp.ones(128), jnp.zeros(128), 1e-5)
except ValueError as e:
    print(e)
"""


def test_a_jax_without_the_triton_lowering_imports_the_library():
    """jax deprecates Pallas' Triton lowering: without it the library still imports, and asking
    for a Triton kernel says what is missing."""
    run = subprocess.run(
        [sys.executable, "-c", NO_TRITON], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "backend='triton' needs Pallas' Triton lowering, which jax" in run.stdout


def test_without_triton_the_plan_runs_mosaic_gpu_or_refuses(monkeypatch):
    """Without the Triton lowering a Hopper-class GPU runs the Pallas paths on Mosaic GPU,
    evaluation's loss included; a path neither lowering can run is refused at the plan, with a
    setting that would run."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels.common as tb
    from jaxllm import ops

    monkeypatch.setattr(tb, "pltriton", None)
    cfg, ex = preset()
    neither = r"kernels cannot run here \(Mosaic GPU needs a GPU .*; Triton needs Pallas' Triton"
    with pytest.raises(ConfigError, match=neither + r" lowering.*execution.kernels=xla"):
        plan_ops(cfg, ex, backend="cpu")
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    plan = plan_ops(cfg, ex, backend="gpu")
    assert (plan.norm, plan.loss) == ("pallas_mgpu",) * 2
    assert "loss=pallas_mgpu conv" in plan.describe()  # no "(eval: pallas)"
    with pytest.raises(ConfigError, match=r"loss kernels .*bfloat16 logits .*loss_impl=xla"):
        plan_ops(*preset(compute_dtype="float32", kernels="xla"), backend="gpu")
    softmax = dataclasses.replace(ex, attention_impl="xla")
    assert plan_ops(cfg, softmax, backend="gpu").attention == "pallas_mgpu"
    forced = dataclasses.replace(softmax, kernel_backend="mosaic_gpu")
    narrow = dataclasses.replace(cfg, d_model=96, n_heads=2)
    with pytest.raises(
        ConfigError, match=r"mosaic_gpu needs, .*norm kernels, .*; use execution.kernels=xla"
    ):
        plan_ops(narrow, forced, backend="gpu")
    with pytest.raises(ConfigError, match=r"kernel_backend=triton needs Pallas' Triton lowering.*"
                       r"kernel_backend=auto .*kernels=xla"):  # fmt: skip
        plan_ops(cfg, dataclasses.replace(ex, kernel_backend="triton"), backend="gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2100, 16)), jnp.float32)
    t, wt = jnp.arange(8), jnp.full((8,), 1 / 8)

    def loss(x, w):  # no gradient: evaluation
        return ops.linear_cross_entropy(x, w, t, wt, jnp.bfloat16, "pallas_mgpu")[0]

    text = jax.jit(loss).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "cross_entropy_fwd_bwd_mgpu" in text and "2176" in text


@pytest.mark.parametrize("triton", [True, False])
def test_mosaic_softmax_path_runs_a_ragged_batch_on_triton_or_padded(monkeypatch, triton):
    """The Mosaic softmax tiles keys by 128. A batch of T = 40 (a translation batch, say) runs
    Triton's softmax where jax has it (the ops line says so); without it, it goes in padded to
    128 and comes out as the unpadded softmax (the causal mask hides the padded keys). Values and
    gradients match the XLA path either way; the kernel is stood in by its reference (no GPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels
    import pallas_kernels.common as tb
    from jaxllm import ops

    if not triton:
        monkeypatch.setattr(tb, "pltriton", None)
    want_shape, want_backend = ((40, 40), "triton") if triton else ((128, 128), "mosaic_gpu")

    def stand_in(scores, mask, *, causal, scale, backend):
        assert scores.shape[-2:] == want_shape and backend == want_backend and causal
        return pallas_kernels.attention_softmax_ref(scores, mask, causal=True, scale=scale)

    monkeypatch.setattr(pallas_kernels, "attention_softmax", stand_in)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 40, 2, 8)), jnp.float32) for _ in range(3))

    def loss(path):
        return lambda q, k, v: jnp.sum(jnp.sin(ops.causal_attention(q, k, v, path)))

    for got, want in zip(
        jax.value_and_grad(loss("pallas_mgpu"), (0, 1, 2))(q, k, v),
        jax.value_and_grad(loss("xla"), (0, 1, 2))(q, k, v),
        strict=True,
    ):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    line = ops.OpPlan(attention="pallas_mgpu").describe()
    assert ("attention=pallas_mgpu (T % 128 > 0: pallas) decode" in line) == triton


def test_loss_chunk_mib_reaches_the_kernel_and_needs_the_fused_loss():
    """execution.loss_chunk_mib sizes the fused loss's chunks of rows (the model's lm_loss passes
    it down: 512 rows x 640 float32 columns = 1.25 MiB -> two chunks of 256 rows at 1 MiB),
    changes nothing in the result, and is refused where no fused loss runs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.models.decoder import lm_loss
    from pallas_kernels.cross_entropy import LOGITS_CHUNK_BYTES

    assert ExecutionConfig.loss_chunk_mib == LOGITS_CHUNK_BYTES // 2**20  # one default, two places
    with pytest.raises(ConfigError, match="loss_chunk_mib=64 sizes .* needs execution.loss_impl"):
        ExecutionConfig(loss_chunk_mib=64)
    with pytest.raises(ConfigError, match="loss_chunk_mib"):
        ExecutionConfig(loss_impl="pallas", loss_chunk_mib=-1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 256, 16)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(600, 16)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 600, (2, 256)), jnp.int32)
    results = {}
    for mib in (1, 0):
        ex = ExecutionConfig(loss_impl="pallas", loss_chunk_mib=mib)
        fn = jax.value_and_grad(lambda x, ex=ex: lm_loss(x, head, targets, ex, "pallas")[0])
        results[mib] = fn(x)
        text = str(jax.make_jaxpr(fn)(x))
        assert ("f32[256,640]" in text) == (mib == 1) and ("f32[512,640]" in text) == (mib == 0)
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


def test_the_start_line_names_the_loss_chunks_the_kernel_takes():
    """A run whose fused loss splits a full batch says so (train.py echoes OpPlan.loss_chunks):
    512 rows x 640 float32 columns at 1 MiB take 2 chunks of 256 (the jaxpr check above), per
    device on a mesh, with the Mosaic kernel's wider padding; nothing where the rows go at once."""
    from types import SimpleNamespace

    from jaxllm.ops import KernelShard, OpPlan

    cfg = tiny_config(vocab_size=600)
    ex = ExecutionConfig(loss_impl="pallas", loss_chunk_mib=1)
    plan = OpPlan(loss="pallas")
    line = "loss: a full batch's {} rows per device in {} chunks of {} (execution.loss_chunk_mib 1)"
    assert plan.loss_chunks(cfg, ex, 512) == line.format(512, 2, 256)
    assert plan.loss_chunks(cfg, ex, 400) is None  # 1,000 KiB of logits: one chunk
    assert plan.loss_chunks(cfg, ExecutionConfig(loss_impl="pallas"), 512) is None
    assert OpPlan().loss_chunks(cfg, ex, 4096) is None  # XLA's loss: no chunks
    # bf16: both kernels pad 600 to 640 columns (800 rows = 1,000 KiB: one chunk; 900 take 2
    # chunks of 480, whole 32-row runs)
    bf16 = dataclasses.replace(ex, compute_dtype="bfloat16")
    for loss in ("pallas", "pallas_mgpu"):
        assert OpPlan(loss=loss).loss_chunks(cfg, bf16, 800) is None
        assert OpPlan(loss=loss).loss_chunks(cfg, bf16, 900) == line.format(900, 2, 480)
    # data 4 x fsdp 1 x pipeline 2: 8192 rows split 8 ways (1024 a device, 3 chunks of 352);
    # 4100 rows do not split 8 ways, so over data only (1025 a device), as the kernel call does;
    # data 2 x fsdp 2: 4 ways
    mesh = SimpleNamespace(shape={"data": 4, "fsdp": 1, "pipeline": 2})
    sharded = OpPlan(loss="pallas", shard=KernelShard(mesh, ("data", "fsdp", "pipeline")))
    assert sharded.shard.rows_per_device(8192) == 1024
    assert sharded.shard.rows_per_device(4100) == 1025
    assert sharded.loss_chunks(cfg, ex, 8192) == line.format(1024, 3, 352)
    fsdp = SimpleNamespace(shape={"data": 2, "fsdp": 2, "pipeline": 1})
    assert KernelShard(fsdp, ("data", "fsdp", "pipeline")).rows_per_device(8192) == 2048


def test_out_of_range_targets_give_the_same_loss_on_every_path():
    """A target outside [0, V) (-1, V): ce 1e30 and no hit on the XLA path as in the kernel (the
    XLA gather clamped -1 to the last column and gave NaN for V); weight 0 adds nothing,
    a weight makes the loss huge."""
    import jax.numpy as jnp
    import numpy as np

    from jaxllm import ops

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(130, 8)), jnp.float32)
    t = jnp.asarray([5, -1, 130], jnp.int32)
    for weights, huge in (([1.0, 0.0, 0.0], False), ([1.0, 0.0, 0.5], True)):
        outs = [ops.linear_cross_entropy(x, w, t, jnp.asarray(weights), jnp.float32, p)
                for p in ("xla", "pallas")]  # fmt: skip
        for loss, ce, hit in outs:
            assert np.isfinite(float(loss)) and (float(loss) > 1e29) == huge
            np.testing.assert_array_equal(np.asarray(ce[1:]), np.float32(1e30))
            assert not hit[1:].any()
        np.testing.assert_allclose(float(outs[0][0]), float(outs[1][0]), rtol=1e-5)
        np.testing.assert_allclose(float(outs[0][1][0]), float(outs[1][1][0]), rtol=1e-5)


def test_flash_attention_needs_hopper_bf16_and_its_head_dims_and_the_plan_says_so(monkeypatch):
    """attention_impl: pallas runs our flash attention where it can; elsewhere the plan names the
    missing piece and the path that runs instead. Dropout is refused when the config loads."""
    import pallas_kernels.common as tb

    flash = dict(attention_impl="pallas", compute_dtype="bfloat16", d_model=64, n_heads=1)
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    p = plan_of("gpu", **flash)
    assert p.attention == "flash" and not p.notes and "attention=flash" in p.describe()
    assert "(Pallas compiled)" in p.describe()
    for backend, overrides, missing in (
        ("cpu", {}, "needs a GPU (backend here: cpu)"),
        ("gpu", {"compute_dtype": "float32"}, "needs bfloat16 or float16 inputs"),
        ("gpu", {"n_heads": 2}, "needs a head dim in (64, 128) (got 32)"),
    ):
        p = plan_of(backend, **{**flash, **overrides})
        assert p.attention == "xla" and missing in p.describe() and "runs on xla" in p.describe()
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: False)
    p = plan_of("gpu", **flash, kernels="pallas")
    assert p.attention == "pallas" and "Hopper-class" in p.describe()
    with pytest.raises(ConfigError, match="attention_impl=pallas has no attention dropout"):
        ExecutionConfig(attention_impl="pallas", dropout=0.1)


def test_auto_attention_takes_the_fastest_path_that_can_run(monkeypatch):
    """attention_impl: auto (the default) runs ours where it measured faster than cuDNN, else
    cuDNN, else the `kernels` path (also with dropout, which neither flash attention has); the
    ops line names the path, with no note (nothing asked for was refused)."""
    import pallas_kernels.common as tb

    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: True)
    assert ExecutionConfig().attention_impl == "auto"
    bf16 = dict(compute_dtype="bfloat16", d_model=128, n_heads=2)  # head dim 64
    for backend, overrides, path in (
        ("gpu", {"context_length": 512}, "flash"),
        ("gpu", {"context_length": 2050}, "cudnn"),  # past the measured range at head dim 64
        ("gpu", {"context_length": 2048, "n_heads": 1}, "flash"),  # head dim 128
        ("gpu", {"n_heads": 4}, "cudnn"),  # head dim 32: no flash kernel of ours
        ("gpu", {"n_heads": 4, "context_length": 17}, "xla"),  # cuDNN refuses an odd T
        ("gpu", {"compute_dtype": "float32"}, "xla"),
        ("gpu", {"dropout": 0.1}, "xla"),
        ("gpu", {"dropout": 0.1, "kernels": "pallas"}, "pallas"),
        ("cpu", {}, "xla"),
    ):
        p = plan_of(backend, "transformer_lm", **{**bf16, **overrides})
        assert p.attention == path and not p.notes, (overrides, p.describe())
        assert f"attention={path} " in p.describe()
    monkeypatch.setattr(tb, "mosaic_gpu_capable", lambda: False)  # not Hopper: cuDNN
    assert plan_of("gpu", "transformer_lm", **bf16, context_length=256).attention == "cudnn"


def test_a_run_dir_written_with_loss_backend_still_loads():
    """Earlier versions named execution.kernel_backend loss_backend (every config.yaml holds it)."""
    from jaxllm.config import from_dict

    ex = from_dict(ExecutionConfig, {"loss_impl": "pallas", "loss_backend": "triton"})
    assert ex.kernel_backend == "triton"
