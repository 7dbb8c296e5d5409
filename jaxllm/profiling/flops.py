"""Analytic FLOPs and minimal bytes: training FLOPs per token (for MFU) and the per-op FLOP/IO
model of one decoder layer, which `roofline.py` turns into verdicts and plots.

Conventions (all counts are for one forward call unless a name says backward):
  FLOPs   a multiply-add is 2 FLOPs: an (M, K) x (K, N) matmul is 2 M K N, a bias add M N more.
          Elementwise ops count each arithmetic op on one element as 1, a transcendental (exp,
          tanh) and a select (`where`) included, as XLA's cost analysis does for selects.
          Per-row constants (a norm's rsqrt, a mean's divide) are left out: 1/D of the total.
  bytes   the minimal traffic of the op run alone: each input read once, each output written
          once, every tensor in the one dtype given (`dtype_bytes`). The repo's XLA path keeps
          scores and softmax in float32, and fused kernels skip round trips between ops (e.g.
          mask + softmax), so real traffic differs; this is the per-op floor.
  shapes  B batch, L length, D d_model, H heads, Dh = D / H, F d_ff, N = B L tokens.
Dense attention computes the whole L x L score matrix (the causal half is masked, not skipped),
so scores and AV count all of it; a causal flash kernel that skips masked blocks does about half.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from jaxllm.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# (left, right) zeros of each depthwise conv1d padding mode for kernel size k: the modes of
# pallas_kernels.reference.conv1d_padding (tests/test_roofline.py checks they agree; only
# jaxllm.ops imports pallas_kernels, as its docstring says).
CONV_PADDINGS = {
    "full": lambda k: (k - 1, k - 1),
    "causal": lambda k: (k - 1, 0),
    "same": lambda k: ((k - 1) // 2, k - 1 - (k - 1) // 2),
}

# FLOPs per element of the elementwise ops (see the functions that use them for the breakdown).
LAYER_NORM_FLOPS = 7  # sum (mean), subtract, square, sum (var), * rstd, * gamma, + beta
RMS_NORM_FLOPS = 4  # square, sum, * rstd, * gamma
MASK_FLOPS = 2  # * 1/sqrt(Dh), causal select
SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide
GELU_TANH_FLOPS = 9  # x*x*x (2), * 0.044715, + x, * sqrt(2/pi), tanh, + 1, * x, * 0.5
SWIGLU_ACT_FLOPS = 6  # silu(g) = g / (1 + exp(-g)): negate, exp, add, divide, multiply; * up
ROPE_FLOPS = 3  # per output element: x0 c - x1 s (or x0 s + x1 c): 2 multiplies, 1 add

# The ops of one layer by component (`component_of`); attention's projections grow as L, its
# score-sized ops as L^2 (`mha_flops`).
ATTENTION_LINEAR = ("qkv_proj", "rope", "out_proj")
ATTENTION_QUADRATIC = ("scores", "mask", "softmax", "av")
MLP_OPS = ("mlp_up", "mlp_act", "mlp_down")
OTHER_OPS = ("norm1", "norm2", "residual1", "residual2", "conv1d")


def train_flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Forward + backward FLOPs per token: 6 * N + 12 * L * d * T (PaLM, appendix B).

    N counts the parameters that take part in matmuls: all of them minus the lookup tables,
    GPT-2's position table and, with an untied head, the token table (the head matrix is a
    matmul; a tied head is counted once, as the table it shares). The second term is the
    attention score and value products (QK^T and PV), which have no parameters.
    """
    lookups = cfg.context_length * cfg.d_model if cfg.arch == "gpt2" else 0
    if not cfg.tie_embeddings:
        lookups += cfg.vocab_size * cfg.d_model
    return 6 * (n_params - lookups) + 12 * cfg.n_layers * cfg.d_model * cfg.context_length


@dataclass(frozen=True)
class OpCost:
    """One op's FLOPs and minimal bytes moved (both per call)."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP/byte."""
        return self.flops / self.bytes


def matmul(
    name: str, m: int, k: int, n: int, s: int, *, groups: int = 1, bias: bool = False
) -> OpCost:
    """`groups` independent (m, k) x (k, n) products (+ a bias of n per product row); s bytes
    per element. FLOPs 2 m k n (+ m n); bytes (m k + k n + m n (+ n)) s, per group."""
    flops = groups * (2 * m * k * n + (m * n if bias else 0))
    nbytes = groups * (m * k + k * n + m * n + (n if bias else 0)) * s
    return OpCost(name, float(flops), float(nbytes))


def elementwise(
    name: str, n: int, flops_per_element: float, n_in: int, n_out: int, s: int, extra: int = 0
) -> OpCost:
    """An op over n elements reading n_in and writing n_out tensors of n elements (s bytes
    each), plus `extra` bytes of small operands (a norm's gamma, RoPE's tables)."""
    return OpCost(name, float(n * flops_per_element), float((n_in + n_out) * n * s + extra))


def norm(name: str, rows: int, d: int, s: int, kind: str = "layer_norm") -> OpCost:
    """LayerNorm (gamma and beta) or RMSNorm (gamma) of `rows` rows of d."""
    if kind == "layer_norm":
        return elementwise(name, rows * d, LAYER_NORM_FLOPS, 1, 1, s, extra=2 * d * s)
    return elementwise(name, rows * d, RMS_NORM_FLOPS, 1, 1, s, extra=d * s)


def conv1d_padding(kernel: int, padding: str) -> tuple[int, int]:
    """(left, right) zeros a depthwise conv1d of kernel size K pads with in mode `padding`."""
    return CONV_PADDINGS[padding](kernel)


def conv1d_output_length(length: int, kernel: int, padding: str) -> int:
    """Output length of a depthwise conv1d: L + zeros - K + 1 ('full': L + K - 1, else L)."""
    return length + sum(conv1d_padding(kernel, padding)) - kernel + 1


def conv1d_bytes(
    *, batch: int, length: int, width: int, kernel: int, dtype_bytes: int, padding: str = "full"
) -> dict[str, float]:
    """Bytes of each tensor of a depthwise conv1d, each moved once: input, weights, bias, output."""
    b, d, s = batch, width, dtype_bytes
    out_len = conv1d_output_length(length, kernel, padding)
    return {
        "input": b * length * d * s,
        "weights": d * kernel * s,
        "bias": d * s,
        "output": b * out_len * d * s,
    }


def conv1d(
    *, batch: int, length: int, width: int, kernel: int, dtype_bytes: int, padding: str = "full"
) -> OpCost:
    """Depthwise conv1d u (B, L, D) * w (D, K) + b (D,) -> (B, Lo, D), zero padding `padding`.

    FLOPs B Lo D (2K + 1): K multiply-adds at 2 FLOPs each (multiplies by padding zeros
    included: the kernel does them) plus 1 bias add per output element. Counting exactly
    (K multiplies, K - 1 adds, 1 bias add) gives 2K, which is what XLA reports for the jnp
    shifted-sum reference; the convention here matches the matmuls' (2 per multiply-add, + bias).
    Bytes (B L D + D K + D + B Lo D) s: input, weights, bias, output, each once.
    """
    shape = dict(batch=batch, length=length, width=width, kernel=kernel)
    parts = conv1d_bytes(**shape, dtype_bytes=dtype_bytes, padding=padding)
    out_len = conv1d_output_length(length, kernel, padding)
    flops = batch * out_len * width * (2 * kernel + 1)
    return OpCost("conv1d", float(flops), float(sum(parts.values())))


def layer_ops(
    *,
    batch: int,
    length: int,
    d_model: int,
    n_heads: int,
    d_ff: int,
    dtype_bytes: int,
    arch: str = "gpt2",
    conv_kernel: int = 0,
) -> list[OpCost]:
    """The ops of one decoder layer's forward pass, in execution order (pre-norm blocks).

    gpt2: LayerNorm, fused q/k/v projection with biases, GELU (tanh) MLP with biases.
    transformer_lm: RMSNorm, no biases, RoPE on q and k, SwiGLU (mlp_up is x [W1 | W3], its
    two matrices read with one read of x; mlp_down is W2). `conv_kernel` > 0 adds the optional
    short depthwise conv after norm1 (ModelConfig.short_conv; the model's padding is 'causal').
    Dropout is left out (evaluation, or rate 0). The shapes are a valid ModelConfig's.
    """
    b, t, d, h, f, s = batch, length, d_model, n_heads, d_ff, dtype_bytes
    n, dh = b * t, d // h
    gpt2 = arch == "gpt2"
    kind = "layer_norm" if gpt2 else "rms_norm"
    n_scores = b * h * t * t
    ops = [norm("norm1", n, d, s, kind)]
    if conv_kernel:
        ops.append(conv1d(batch=b, length=t, width=d, kernel=conv_kernel, dtype_bytes=s,
                          padding="causal"))  # fmt: skip
    ops.append(matmul("qkv_proj", n, d, 3 * d, s, bias=gpt2))
    if not gpt2:  # q and k in and out; the cos and sin tables (L, Dh/2) shared by all heads
        ops.append(elementwise("rope", 2 * n * d, ROPE_FLOPS, 1, 1, s, extra=t * dh * s))
    ops += [
        matmul("scores", t, dh, t, s, groups=b * h),  # q k^T per (batch, head)
        elementwise("mask", n_scores, MASK_FLOPS, 1, 1, s),  # causal mask from indices: no read
        elementwise("softmax", n_scores, SOFTMAX_FLOPS, 1, 1, s),
        matmul("av", t, t, dh, s, groups=b * h),  # probs v per (batch, head)
        matmul("out_proj", n, d, d, s, bias=gpt2),
        elementwise("residual1", n * d, 1, 2, 1, s),
        norm("norm2", n, d, s, kind),
    ]
    if gpt2:
        ops += [
            matmul("mlp_up", n, d, f, s, bias=True),
            elementwise("mlp_act", n * f, GELU_TANH_FLOPS, 1, 1, s),
        ]
    else:
        ops += [
            matmul("mlp_up", n, d, 2 * f, s),  # gate and up: reads g and u, writes silu(g) u
            elementwise("mlp_act", n * f, SWIGLU_ACT_FLOPS, 2, 1, s),
        ]
    ops += [matmul("mlp_down", n, f, d, s, bias=gpt2), elementwise("residual2", n * d, 1, 2, 1, s)]
    return ops


def component_of(op_name: str) -> str:
    """'attention', 'mlp' or 'norm/other' for an op name of `layer_ops`."""
    if op_name in ATTENTION_LINEAR or op_name in ATTENTION_QUADRATIC:
        return "attention"
    if op_name in MLP_OPS:
        return "mlp"
    if op_name in OTHER_OPS:
        return "norm/other"
    known = ATTENTION_LINEAR + ATTENTION_QUADRATIC + MLP_OPS + OTHER_OPS
    raise ValueError(f"unknown op name {op_name!r}; allowed: {', '.join(known)}")


def mha_flops(
    *, batch: int, length: int, d_model: int, n_heads: int, arch: str = "gpt2"
) -> tuple[float, float]:
    """(linear, quadratic) forward FLOPs of one attention block: the projections (and RoPE)
    grow as L, the score-sized ops (QK^T, mask, softmax, AV) as L^2."""
    ops = layer_ops(batch=batch, length=length, d_model=d_model, n_heads=n_heads,
                    d_ff=4 * d_model, dtype_bytes=2, arch=arch)  # fmt: skip
    linear = sum(op.flops for op in ops if op.name in ATTENTION_LINEAR)
    quadratic = sum(op.flops for op in ops if op.name in ATTENTION_QUADRATIC)
    return linear, quadratic


def mha_crossover_length(*, d_model: int, n_heads: int, arch: str = "gpt2") -> float:
    """The length at which the quadratic FLOPs equal the linear ones (any batch).

    Every count is a monomial, a L and b L^2, so a / b is their values at L = 1. With the
    matmuls alone (8 L D^2 against 4 L^2 D per sequence) it is 2 D; biases add to the linear
    part, mask and softmax (7 H L^2) to the quadratic one.
    """
    linear, quadratic = mha_flops(batch=1, length=1, d_model=d_model, n_heads=n_heads, arch=arch)
    return linear / quadratic


# Backward FLOPs per element of the benchmarked kernels (kernel_cost).
SOFTMAX_BWD_FLOPS = 5  # dx = scale * y * (dy - sum(dy y)): multiply, sum, subtract, 2 multiplies
# xhat = (x - mean) rstd (2), dxhat = dy gamma (1), dgamma += dy xhat (2), dbeta += dy (1),
# sums of dxhat and dxhat xhat (3), dx = rstd (dxhat - c1 - xhat c2) (4)
LAYER_NORM_BWD_FLOPS = 13
# xhat = x rstd (1), dxhat = dy gamma (1), dgamma += dy xhat (2), sum of dxhat xhat (2),
# dx = rstd (dxhat - xhat c) (3)
RMS_NORM_BWD_FLOPS = 9


def kernel_cost(kernel: str, direction: str, shape: tuple[int, ...], dtype_bytes: int) -> OpCost:
    """FLOPs and minimal bytes of one `profile.py kernels` case (jaxllm/profiling/kernel_bench.py).

    softmax (B, H, Tq, Tk): the fused scale + causal mask + softmax; layer_norm and rms_norm
    (rows, D); conv1d (B, L, D, K) with the bench's 'same' padding. Backward: read the saved
    input (or probabilities) and the output gradient, write the input gradient (+ parameter
    gradients).
    """
    s, name = dtype_bytes, f"{kernel} {direction} {'x'.join(map(str, shape))}"
    fwd = direction == "fwd"
    if kernel == "softmax" and len(shape) == 4:
        n = shape[0] * shape[1] * shape[2] * shape[3]
        if fwd:
            return elementwise(name, n, MASK_FLOPS + SOFTMAX_FLOPS, 1, 1, s)
        return elementwise(name, n, SOFTMAX_BWD_FLOPS, 2, 1, s)
    if kernel == "layer_norm" and len(shape) == 2:
        rows, d = shape
        if fwd:
            return norm(name, rows, d, s)
        # + gamma read, dgamma and dbeta written; + the saved mean and rstd (float32)
        return elementwise(name, rows * d, LAYER_NORM_BWD_FLOPS, 2, 1, s, 3 * d * s + 8 * rows)
    if kernel == "rms_norm" and len(shape) == 2:
        rows, d = shape
        if fwd:
            return norm(name, rows, d, s, "rms_norm")
        # + gamma read, dgamma written; + the saved rstd (float32)
        return elementwise(name, rows * d, RMS_NORM_BWD_FLOPS, 2, 1, s, 2 * d * s + 4 * rows)
    if kernel == "conv1d" and len(shape) == 4:
        b, t, d, k = shape
        fwd_cost = conv1d(batch=b, length=t, width=d, kernel=k, dtype_bytes=s, padding="same")
        if fwd:
            return replace(fwd_cost, name=name)
        out_len = conv1d_output_length(t, k, "same")
        # du: the correlation of g with the flipped filter (2K per element of du); dw: K
        # multiply-adds per element of g; db: 1 add per element of g.
        flops = b * d * (2 * k * t + (2 * k + 1) * out_len)
        nbytes = (b * d * (2 * t + out_len) + 2 * d * k + d) * s  # u, g, du; w, dw, db
        return OpCost(name, float(flops), float(nbytes))
    raise ValueError(
        f"no cost model for kernel {kernel!r} of shape {shape}; allowed: softmax (B, H, Tq, Tk), "
        "layer_norm or rms_norm (rows, D), conv1d (B, L, D, K)"
    )
