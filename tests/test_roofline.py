"""The FLOP/IO model and roofline (jaxllm/profiling/flops.py, roofline.py) and the CS229S conv1d
question: hand counts, XLA's own cost analysis, verdicts, the CLI.

What XLA's count differs in, for the elementwise ops (CPU, float32): it reports transcendentals
(exp, tanh, rsqrt) apart from "flops", so ours is compared with their sum; it leaves out nothing
else for GELU, SwiGLU, RoPE, the mask and the residual add (exact), adds per-row constants to
the norms and softmax (within 1/D, 1%), and counts LayerNorm's mean subtraction twice
(`F.layer_norm` writes it in both of its fusions: 8 FLOPs per element against our 7). Its
"bytes accessed" sums every kernel it launches, so for ops it splits into several kernels
(softmax, norms) it exceeds our minimal bytes; for one matmul or one fused elementwise op it is
equal.
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxllm import functional as F
from jaxllm.config import ModelConfig
from jaxllm.profiling import flops, roofline
from jaxllm.profiling.roofline import HARDWARE, OpCost, component_of, layer_ops, verdict

ROOT = Path(__file__).resolve().parents[1]
B, T, D, H, FF = 2, 16, 32, 4, 64  # small layer for XLA's cost analysis
DH, N = D // H, B * T


def xla_cost(f, *args) -> dict[str, float]:
    """XLA's cost analysis of jit(f); a dict, or a list of one dict on some jax versions."""
    cost = jax.jit(f).lower(*args).compile().cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "transcendentals")}


def ops_by_name(arch: str, **kw) -> dict[str, OpCost]:
    ops = layer_ops(
        batch=B, length=T, d_model=D, n_heads=H, d_ff=FF, dtype_bytes=4, arch=arch, **kw
    )
    return {op.name: op for op in ops}


def x(*shape: int) -> jax.Array:
    return jnp.ones(shape, jnp.float32)


def load_cli():
    """profile.py as a module of another name: imported as `profile` it would hand back the
    standard library's module (its shadowing block)."""
    spec = importlib.util.spec_from_file_location("profile_cli", ROOT / "profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- hand counts
def test_hand_counted_small_cases():
    mm = flops.matmul("mm", 2, 3, 4, 4)  # (2, 3) x (3, 4) float32
    assert mm.flops == 2 * 2 * 3 * 4
    assert mm.bytes == (6 + 12 + 8) * 4
    assert flops.matmul("mm", 2, 3, 4, 4, bias=True).flops == 48 + 2 * 4
    sm = flops.elementwise("softmax", 2 * 3, flops.SOFTMAX_FLOPS, 1, 1, 4)  # 2x3 float32
    assert sm.bytes == 2 * 24
    assert sm.flops == 5 * 6
    conv = flops.conv1d(batch=1, length=4, width=2, kernel=3, dtype_bytes=4, padding="full")
    assert conv.flops == 6 * 2 * 7  # Lo = 4 + 2 outputs per channel, 2K + 1 each
    assert conv.bytes == (4 * 2 + 2 * 3 + 2 + 6 * 2) * 4  # input, weights, bias, output
    assert OpCost("x", 10.0, 4.0).intensity == 2.5


def test_layer_ops_names_order_and_components():
    gpt2 = ["norm1", "qkv_proj", "scores", "mask", "softmax", "av", "out_proj", "residual1",
            "norm2", "mlp_up", "mlp_act", "mlp_down", "residual2"]  # fmt: skip
    assert list(ops_by_name("gpt2")) == gpt2
    assert list(ops_by_name("transformer_lm")) == gpt2[:2] + ["rope"] + gpt2[2:]
    assert list(ops_by_name("gpt2", conv_kernel=3))[:3] == ["norm1", "conv1d", "qkv_proj"]
    comps = {name: component_of(name) for name in ops_by_name("transformer_lm", conv_kernel=3)}
    assert {k for k, v in comps.items() if v == "attention"} == {
        "qkv_proj", "rope", "scores", "mask", "softmax", "av", "out_proj"}  # fmt: skip
    assert {k for k, v in comps.items() if v == "mlp"} == {"mlp_up", "mlp_act", "mlp_down"}
    assert set(comps.values()) == {"attention", "mlp", "norm/other"}
    with pytest.raises(ValueError, match="allowed: qkv_proj"):
        component_of("lm_head")


def test_layer_matmuls_agree_with_the_training_flops_formula():
    """3x the forward matmul FLOPs (forward + backward) per token is train_flops_per_token's
    6 N + 12 L d T for one layer without biases (transformer_lm, SwiGLU's three matrices); its
    untied token table is a lookup, left out of N."""
    d, f, t = 64, 96, 32
    cfg = ModelConfig(arch="transformer_lm", d_model=d, n_heads=4, n_layers=1, context_length=t,
                      d_ff=f, bias=False, qkv_bias=False, tie_embeddings=False)  # fmt: skip
    ops = layer_ops(batch=3, length=t, d_model=d, n_heads=4, d_ff=f, dtype_bytes=2,
                    arch="transformer_lm")  # fmt: skip
    mm = sum(op.flops for op in ops if op.name in ("qkv_proj", "scores", "av", "out_proj",
                                                   "mlp_up", "mlp_down"))  # fmt: skip
    table = cfg.vocab_size * d
    assert 3 * mm / (3 * t) == flops.train_flops_per_token(cfg, 4 * d * d + 3 * d * f + table)


# ----------------------------------------------------------------------------- against XLA
def test_matmul_ops_match_xla_exactly():
    g, t = ops_by_name("gpt2"), ops_by_name("transformer_lm")
    cases = [  # (our op, function, args, bytes compared too)
        (g["qkv_proj"], lambda a, w, b: a @ w + b, (x(N, D), x(D, 3 * D), x(3 * D)), False),
        (t["qkv_proj"], lambda a, w: a @ w, (x(N, D), x(D, 3 * D)), True),
        (g["out_proj"], lambda a, w, b: a @ w + b, (x(N, D), x(D, D), x(D)), False),
        (g["mlp_up"], lambda a, w, b: a @ w + b, (x(N, D), x(D, FF), x(FF)), False),
        (t["mlp_up"], lambda a, w: a @ w, (x(N, D), x(D, 2 * FF)), True),  # [W1 | W3]
        (g["mlp_down"], lambda a, w, b: a @ w + b, (x(N, FF), x(FF, D), x(D)), False),
        # head-major q, k, v: one batched dot (the model's (B, T, H, Dh) layout adds
        # transposes on XLA:CPU, which then count in its bytes)
        (g["scores"], lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k),
         (x(B, H, T, DH), x(B, H, T, DH)), True),
        (g["av"], lambda p, v: jnp.einsum("bhqk,bhkd->bhqd", p, v),
         (x(B, H, T, T), x(B, H, T, DH)), True),
    ]  # fmt: skip
    for op, f, args, check_bytes in cases:
        cost = xla_cost(f, *args)
        assert op.flops == cost["flops"], op.name
        if check_bytes:  # one kernel: XLA's bytes are its operands and result, as ours
            assert op.bytes == cost["bytes accessed"], op.name


def test_elementwise_ops_against_xla():
    g, t = ops_by_name("gpt2"), ops_by_name("transformer_lm")
    cos, sin = x(1, T, DH // 2), 2 * x(1, T, DH // 2)  # equal ones would let XLA factor
    mask = F.attention_mask(T, T)
    cases = [  # (our op, function, args, allowed relative excess of XLA's count over ours)
        (g["residual1"], lambda a, b: a + b, (x(N, D), x(N, D)), 0.0),
        (g["mlp_act"], F.gelu, (x(N, FF),), 0.0),
        (t["mlp_act"], lambda a, b: jax.nn.silu(a) * b, (x(N, FF), x(N, FF)), 0.0),
        (g["mask"], lambda s: jnp.where(mask, s * 0.125, F.MASK_VALUE), (x(B, H, T, T),), 0.0),
        (t["rope"], lambda q, k, c, s: (F.apply_rope(q, c, s), F.apply_rope(k, c, s)),
         (x(B, T, H, DH), x(B, T, H, DH), cos, sin), 0.0),
        (g["softmax"], lambda s: F.softmax(s, -1), (x(B, H, T, T),), 1 / T),
        (t["norm1"], lambda a, s: F.rms_norm(a, s), (x(N, D), x(D)), 2 / D),
        (g["norm1"], lambda a, s, b: F.layer_norm(a, s, b), (x(N, D), x(D), x(D)), 1 / 7 + 2 / D),
    ]  # fmt: skip
    for op, f, args, excess in cases:
        cost = xla_cost(f, *args)
        theirs = cost["flops"] + cost["transcendentals"]
        assert op.flops <= theirs <= op.flops * (1 + excess) + 1e-9, (op.name, theirs, op.flops)
        assert cost["bytes accessed"] >= op.bytes, op.name  # ours is the floor
    for op, f, args in ((g["residual1"], lambda a, b: a + b, (x(N, D), x(N, D))),
                        (g["mlp_act"], F.gelu, (x(N, FF),))):  # fmt: skip
        assert xla_cost(f, *args)["bytes accessed"] == op.bytes, op.name  # one fused kernel


def test_conv1d_against_xla_and_the_kernel_padding():
    from pallas_kernels.reference import conv1d_padding

    for k in range(1, 8):
        for mode in flops.CONV_PADDINGS:
            assert flops.conv1d_padding(k, mode) == conv1d_padding(k, mode), (k, mode)
    u, w, b = x(2, 40, 8), x(8, 3), x(8)
    for mode in ("full", "causal", "same"):
        op = flops.conv1d(batch=2, length=40, width=8, kernel=3, dtype_bytes=4, padding=mode)
        out = F.depthwise_conv1d(u, w, b, mode)
        assert out.shape[1] == flops.conv1d_output_length(40, 3, mode)
        # XLA counts the jnp shifted sum exactly (2K per output); we count 2 per multiply-add
        # plus the bias add (2K + 1)
        assert op.flops * 6 / 7 == xla_cost(lambda u, w, b, m=mode: F.depthwise_conv1d(u, w, b, m),
                                             u, w, b)["flops"]  # fmt: skip


# ----------------------------------------------------------------------------- verdicts
def test_conv_question_is_memory_bound_on_t4():
    op = flops.conv1d(batch=1, length=8192, width=8192, kernel=3, dtype_bytes=2, padding="full")
    t4 = HARDWARE["T4"]
    assert op.flops == 8194 * 8192 * 7
    assert op.bytes == (8192 * 8192 + 8192 * 3 + 8192 + 8194 * 8192) * 2
    assert op.intensity == pytest.approx(1.75, abs=1e-3)
    assert t4.ridge("float16") == pytest.approx(65e12 / 320e9)
    assert verdict(op, t4, "float16") == "memory-bound"
    with pytest.raises(ValueError, match="no bfloat16 peak; allowed: float16, float32"):
        verdict(op, t4, "bfloat16")


def test_big_matmul_is_compute_bound_on_h100():
    op = flops.matmul("mm", 8192, 8192, 8192, 2)
    assert op.intensity == pytest.approx(8192 / 3)
    assert HARDWARE["H100"].ridge("bfloat16") == pytest.approx(989.4 / 3.35)
    assert verdict(op, HARDWARE["H100"], "bfloat16") == "compute-bound"
    assert verdict(op, HARDWARE["H100"], "float32") == "compute-bound"


def test_mha_scaling_and_crossover():
    lin, quad = flops.mha_flops(batch=4, length=1024, d_model=768, n_heads=12)
    lin2, quad2 = flops.mha_flops(batch=4, length=2048, d_model=768, n_heads=12)
    assert lin2 == 2 * lin and quad2 == 4 * quad
    d, h = 768, 12  # linear: 8 d^2 + 4 d (matmuls + biases); quadratic: 4 d + 7 H per L^2
    cross = flops.mha_crossover_length(d_model=d, n_heads=h)
    assert cross == pytest.approx((8 * d * d + 4 * d) / (4 * d + 7 * h))
    lin, quad = flops.mha_flops(batch=1, length=round(cross), d_model=d, n_heads=h)
    assert quad / lin == pytest.approx(1, abs=1e-3)


# ----------------------------------------------------------------------------- measured rows
def test_measured_rows_of_both_schemas(tmp_path):
    from jaxllm.profiling import kernel_bench

    # kernel_cost assumes the bench's conv padding
    assert kernel_bench.CONV_MODE == "same"
    kernel_row = {"kernel": "softmax", "direction": "fwd", "shape": "8x12x1024x1024",
                  "dtype": "bfloat16", "config": "default", "ms": 0.5, "gbps": 800.0}  # fmt: skip
    p = roofline.measured_from_row(kernel_row)
    n = 8 * 12 * 1024 * 1024
    assert (p.flops, p.bytes, p.seconds, p.dtype) == (7 * n, 2 * n * 2, 0.5e-3, "bfloat16")
    conv_bwd = {**kernel_row, "kernel": "conv1d", "direction": "bwd", "shape": "1x64x8x3"}
    assert roofline.measured_from_row(conv_bwd).bytes == (3 * 64 * 8 + 2 * 8 * 3 + 8) * 2
    # every kernel `profile.py kernels` times has a cost model
    rms = {**kernel_row, "kernel": "rms_norm", "shape": "16384x768"}
    assert roofline.measured_from_row(rms).flops == 4 * 16384 * 768  # square, sum, 2 multiplies
    rms_bwd = roofline.measured_from_row({**rms, "direction": "bwd"})
    assert rms_bwd.bytes == 3 * 16384 * 768 * 2 + 2 * 768 * 2 + 4 * 16384
    kernels = {c.kernel for c in kernel_bench.norm_cases()} | {"softmax", "conv1d"}
    for kernel in kernels:
        assert roofline.measured_from_row({**rms, "kernel": kernel, "shape": {
            "softmax": "1x1x8x8", "conv1d": "1x8x8x3"}.get(kernel, "8x8")}), kernel  # fmt: skip
    bench_row = {"name": "mlp_up", "flops": 2e9, "bytes": 4e6, "seconds": 1e-3}
    assert roofline.measured_from_row(bench_row) == roofline.Measured("mlp_up", 2e9, 4e6, 1e-3)
    for bad in ({"step": 1, "loss": 2.0}, {**bench_row, "seconds": 0}, [1, 2],
                {**kernel_row, "kernel": "gemm"}, {**kernel_row, "dtype": "int8"}):  # fmt: skip
        assert roofline.measured_from_row(bad) is None, bad
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join([json.dumps(kernel_row), json.dumps(bench_row), "not json", ""]))
    points, skipped, total = roofline.load_measured([path])
    assert (len(points), skipped, total) == (2, 1, 3)
    with pytest.raises(ValueError, match="cannot read measurements file"):
        roofline.load_measured([tmp_path / "missing.jsonl"])


# ----------------------------------------------------------------------------- the CLI
def test_cli_prints_the_table_and_writes_a_png(tmp_path, capsys):
    cli = load_cli()
    measured = tmp_path / "bench.jsonl"
    measured.write_text(
        json.dumps({"name": "qkv_proj", "flops": 1e9, "bytes": 1e6, "seconds": 2e-5}) + "\n"
        + json.dumps({"kernel": "layer_norm", "direction": "fwd", "shape": "4096x64",
                      "dtype": "float32", "ms": 0.01}) + "\n"
        + json.dumps({"loss": 1.0}) + "\n"
    )  # fmt: skip
    png = tmp_path / "roofline.png"
    args = ["roofline", "--train.batch_size=1", "--model.context_length=64", "--model.d_model=64",
            "--model.n_heads=4", "--peak-tflops", "700", "--png", str(png), "--measured",
            str(measured)]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "| qkv_proj | attention |" in out and "| mlp_down | mlp |" in out
    assert "| A100 | T4 | H100 | measured |" in out
    assert "quadratic = linear at L =" in out
    assert "measured: 2 points from 1 file(s); skipped 1 of 3 rows" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000


def test_cli_answers_the_conv_question(capsys):
    cli = load_cli()
    args = ["roofline", "--conv", "1,8192,8192,3", "--device", "t4", "--dtype", "float16"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for text in ("memory bandwidth      320.0 GB/s", "compute throughput    65.0 TFLOP/s",
                 "ridge point           203.1 FLOP/byte", "output length 8194",
                 "arithmetic intensity  1.750 FLOP/byte", "memory-bound"):  # fmt: skip
        assert text in out, text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model.context_length=0"], "model.context_length"),
        (["--device", "V100"], "invalid choice: 'V100'"),
        (["--device", "T4"], "NVIDIA T4 has no bfloat16 peak; allowed: float16, float32"),
        (["--model.arch=llama"], "model.arch"),
        (["--conv-padding", "valid"], "invalid choice: 'valid'"),
        (["--conv", "1,8,8"], "--conv takes B,L,D,K"),
        (["--png", "/nonexistent/r.png"], "no directory /nonexistent"),
        (["--peak-gbps", "-1"], "must be a finite number > 0"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(extra, message, capsys):
    with pytest.raises(SystemExit) as e:
        load_cli().main(["roofline", *extra])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and message in err, err


def test_streams_reference_moves_the_rows_traffic_and_stays_bounded():
    """The kernel table's '% streams' reference: an XLA elementwise step over as many arrays as
    the kernel reads, replacing as many as it writes, whose values do not drift when chained."""
    from jaxllm.profiling import kernel_bench

    with pytest.raises(ValueError, match="reads >= writes >= 1"):
        kernel_bench.streams_seconds((8, 128), jnp.float32, 1, 2)
    assert kernel_bench.streams_seconds((8, 128), jnp.bfloat16, 2, 1) > 0
    a, b = jax.random.normal(jax.random.key(0), (2, 8, 128), jnp.float32)
    state = (a, b)
    for _ in range(6):
        state = kernel_bench.streams_step(state, 1)
        assert float(jnp.max(jnp.abs(state[0]))) <= 2 * float(jnp.max(jnp.abs(a) + jnp.abs(b)))
        assert state[1] is b
    assert jnp.allclose(state[0], a, atol=1e-5)  # period 2
    (neg,) = kernel_bench.streams_step((a,), 1)
    assert jnp.array_equal(neg, -a)
    case = next(kernel_bench.norm_cases([(16, 128)], [jnp.float32]))  # LayerNorm forward first
    assert (case.array_shape, case.streams) == ((16, 128), (1, 1))
    row = kernel_bench.run_case(dataclasses.replace(case, configs=[]), copy_gbps=1.0, tune=False)
    assert row.streams_ms > 0
    line = kernel_bench.format_row(row)
    assert f"| {100 * row.streams_ms / row.ms:.0f} |" in line
    assert kernel_bench.HEADER.count("|") // 2 == line.count("|")
