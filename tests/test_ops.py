"""jaxllm.ops: the plan names one path per op family, and never changes one silently."""

import dataclasses

import pytest
from conftest import tiny_config

from jaxllm.config import ConfigError, load_config
from jaxllm.ops import plan_ops


def test_default_plan_is_all_xla():
    plan = plan_ops(tiny_config(), backend="cpu")
    assert (plan.norm, plan.attention, plan.loss, plan.conv) == ("xla",) * 4
    assert plan.describe() == "ops: norm=xla attention=xla decode=xla loss=xla conv=xla"


def test_gpt2_benchmark_preset_on_gpu():
    cfg = load_config("configs/gpt2_124m.yaml").model
    plan = plan_ops(cfg, backend="gpu")
    assert (plan.norm, plan.attention, plan.loss, plan.conv) == (
        "pallas",
        "cudnn",
        "pallas",
        "pallas",
    )
    assert not plan.notes and "(Pallas compiled)" in plan.describe()


def test_cudnn_needs_gpu_and_bf16_and_the_plan_says_so():
    cfg = tiny_config(attention_impl="dot_product_attention", compute_dtype="bfloat16")
    assert plan_ops(cfg, backend="gpu").attention == "cudnn"
    for backend, c in (("cpu", cfg), ("gpu", dataclasses.replace(cfg, compute_dtype="float32"))):
        plan = plan_ops(c, backend=backend)
        assert plan.attention == "xla"
        assert "needs a GPU and bfloat16 for cuDNN" in plan.describe()
    pallas = dataclasses.replace(cfg, kernels="pallas")
    assert plan_ops(pallas, backend="cpu").attention == "pallas"  # the softmax kernel instead


def test_transformer_lm_rmsnorm_runs_the_pallas_kernel():
    """kernels: pallas puts the Llama model's RMSNorm (+ residual add) on its kernel too."""
    plan = plan_ops(tiny_config("transformer_lm", kernels="pallas"), backend="gpu")
    assert (plan.norm, plan.attention, plan.conv) == ("pallas",) * 3 and not plan.notes
    assert plan.describe().startswith("ops: norm=pallas attention=pallas")
    assert plan_ops(tiny_config("transformer_lm"), backend="gpu").norm == "xla"


def test_interpret_mode_is_named():
    plan = plan_ops(tiny_config(kernels="pallas"), backend="cpu")
    assert plan.interpret and "(Pallas interpreted: no GPU)" in plan.describe()


def test_cudnn_attention_with_dropout_is_refused():
    with pytest.raises(ConfigError, match="has no attention dropout; set model.dropout=0"):
        tiny_config(attention_impl="dot_product_attention", dropout=0.1)
    with pytest.raises(ConfigError, match="dot_product_attention has no attention dropout"):
        load_config("configs/gpt2_124m.yaml", ["--model.dropout=0.1"])
