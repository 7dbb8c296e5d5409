"""Which implementation runs for each op family, decided in one place and said out loud.

`plan_ops(cfg, ex)` turns the execution config's switches (`kernels`, `attention_impl`, `loss_impl`,
`mlp_impl`) and the backend into an `OpPlan`: one named path per op family. Layers receive their
path from the plan and call the functions below; nothing else in the library imports
`pallas_kernels` (the kernel benchmark in `jaxllm.profiling.kernel_bench`, whose subject is the
kernels themselves, is the one exception). A switch that cannot apply is a `ConfigError`, when the
config is loaded (cuDNN or flash attention with dropout) or when the plan is made for the machine
(execution.kernel_backend=mosaic_gpu off Hopper, a Pallas path that neither lowering can run), or
a path the plan names (cuDNN needs a GPU, bf16, a head dim that is a multiple of 8 up to 128 and an
even context, our flash attention a Hopper-class GPU, 16-bit inputs and head dim 64 or 128:
elsewhere attention runs on the `kernels` path, and `OpPlan.describe()` says so); nothing falls
back silently. `attention_impl: auto` asks for no path: it takes the fastest that can run.

On a mesh of several devices (jaxllm.parallel) the plan also carries a `KernelShard`: every
Pallas call then runs once per shard of the batch, inside `jax.shard_map` (a Pallas kernel is a
custom call that XLA's partitioner cannot split: left to it, the operands are gathered whole
onto every device and the call runs replicated).

Paths ("pallas" is a Pallas kernel on the Triton lowering, "pallas_mgpu" the same op's Mosaic GPU
kernel: execution.kernel_backend picks; `auto` takes Mosaic GPU wherever its kernels can run):
  norm       xla | pallas[_mgpu]   LayerNorm (GPT-2) or RMSNorm (transformer_lm), each with the
                                   fused residual add on the Pallas path
  attention  xla | pallas[_mgpu]   training/eval attention: XLA's masked softmax, the Pallas
             | cudnn | flash       softmax between two XLA einsums (Mosaic GPU's runs a batch
                                   whose length is not a multiple of 128 on Triton, or padded
                                   without it), cuDNN flash attention, or
                                   ours (pallas_kernels.flash_attention, Mosaic GPU; without
                                   RoPE the model calls qkv_attention: the q/k/v projection
                                   and our kernels, reading its output in place, in one VJP)
  decode     xla                   attention over a KV cache (generation): always XLA
  loss       xla | pallas[_mgpu]   LM head + cross-entropy: logits then softmax_loss, or the
                                   fused Pallas kernel that never keeps the logits (its Mosaic
                                   GPU kernel needs bfloat16 rows that fit, see
                                   pallas_kernels.mosaic_loss_refusal; a loss without gradient,
                                   as in evaluation, runs the Triton forward kernel where jax
                                   has the Triton lowering)
  conv       xla | pallas[_mgpu]   depthwise conv1d
  mlp        xla | pallas_mgpu     GPT-2's GELU MLP: XLA's GEMMs and fusions, or Mosaic GPU
                                   kernels with GELU in the epilogues of the fc GEMM and of the
                                   backward's dX GEMM (pallas_kernels.matmul_gelu, matmul_dgelu;
                                   a call whose rows per device are not a multiple of 128 runs
                                   XLA's)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxllm import functional as F
from jaxllm.config import LOSS_CHUNK_MIB, ConfigError, ExecutionConfig, ModelConfig
from pallas_kernels.cross_entropy import OUT_OF_RANGE_CE, mark_out_of_range, targets_in_range

NormPath = Literal["xla", "pallas", "pallas_mgpu"]
AttentionPath = Literal["xla", "pallas", "pallas_mgpu", "cudnn", "flash"]
LossPath = Literal["xla", "pallas", "pallas_mgpu"]
ConvPath = Literal["xla", "pallas", "pallas_mgpu"]
MLPPath = Literal["xla", "pallas_mgpu"]
MLP_ROWS = 128  # the rows (batch x context, per device) the Mosaic GPU kernel's tiles divide


@dataclasses.dataclass(frozen=True)
class KernelShard:
    """Run each Pallas call per shard of the batch: `jax.shard_map` over `axes` of `mesh`, the
    leading (row) dimension of every batch-like operand split over them, weights whole.
    Decided by jaxllm.parallel (the one module that decides shardings)."""

    mesh: Mesh
    axes: tuple[str, ...]

    @property
    def ways(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    def describe(self) -> str:
        return f"Pallas per shard over {' x '.join(self.axes)} = {self.ways}"

    def row_axes(self, rows: int) -> tuple[str, ...]:
        """The axes `rows` leading rows split over: the longest leading run of `axes` whose
        product divides them (none: every device runs all rows)."""
        axes = self.axes
        while axes and rows % math.prod(self.mesh.shape[a] for a in axes):
            axes = axes[:-1]
        return axes

    def rows_per_device(self, rows: int) -> int:
        return rows // math.prod(self.mesh.shape[a] for a in self.row_axes(rows))


def _backend(path: str) -> str:
    """The `backend` argument of pallas_kernels for a Pallas path."""
    return "mosaic_gpu" if path == "pallas_mgpu" else "triton"


def _per_shard(
    shard: KernelShard | None,
    kernel: Callable[..., Any],
    args: Sequence[Any],
    batched: Sequence[bool],
    out_batched: Any,
) -> Any:
    """kernel(*args), under `shard` run by each device on its rows: the args flagged `batched`
    (leading dim = rows) are split over shard.axes, the others passed whole; outputs flagged in
    `out_batched` (same structure as kernel's output) come back row-split, the others must be
    the same on every device. Rows that do not split over all of shard.axes split over the
    longest leading run of them they do (data x fsdp when a pipeline mesh's rows stay replicated
    over the stages), else run whole on every device (a last evaluation batch)."""
    if shard is None:
        return kernel(*args)
    rows = next(a.shape[0] for a, b in zip(args, batched, strict=True) if b)
    axes = shard.row_axes(rows)
    split = P(axes) if axes else P()
    in_specs = tuple(split if b else P() for b in batched)
    out_specs = jax.tree.map(lambda b: split if b else P(), out_batched)
    # check_vma off: a pallas_call has no rule for jax's varying-across-devices types.
    run = jax.shard_map(
        kernel, mesh=shard.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    return run(*args)


@dataclasses.dataclass(frozen=True)
class OpPlan:
    norm: NormPath = "xla"
    attention: AttentionPath = "xla"
    loss: LossPath = "xla"
    conv: ConvPath = "xla"
    mlp: MLPPath = "xla"
    interpret: bool = False  # Pallas kernels run in interpret mode (no GPU): slow, for tests
    shard: KernelShard | None = None  # several devices: each Pallas call runs per batch shard
    notes: tuple[str, ...] = ()  # why a path differs from what the config asked for

    def describe(self) -> str:
        """One line for the start of a run, e.g. 'ops: norm=pallas attention=cudnn ...'."""
        triton = pallas_kernels.triton_refusal() is None
        # a batch whose length is not a multiple of 128 runs the Triton softmax where jax has it
        ragged = " (T % 128 > 0: pallas)" if triton and self.attention == "pallas_mgpu" else ""
        # a loss without gradient (evaluation) runs the Triton forward kernel where jax has it
        triton_eval = self.loss == "pallas_mgpu" and triton
        parts = [
            f"norm={self.norm}",
            f"attention={self.attention}{ragged}",
            "decode=xla",
            f"loss={self.loss}" + (" (eval: pallas)" if triton_eval else ""),
            f"conv={self.conv}",
            f"mlp={self.mlp}" + (f" (rows % {MLP_ROWS} > 0: xla)" if self.mlp != "xla" else ""),
        ]
        paths = (self.norm, self.attention, self.loss, self.conv, self.mlp)
        pallas = any(p.startswith("pallas") for p in paths) or self.attention == "flash"
        if pallas:
            parts.append("(Pallas interpreted: no GPU)" if self.interpret else "(Pallas compiled)")
        if pallas and self.shard is not None:
            parts.append(f"({self.shard.describe()})")
        return "ops: " + " ".join(parts) + "".join(f"; {n}" for n in self.notes)

    def loss_chunks(self, cfg: ModelConfig, ex: ExecutionConfig, rows: int) -> str | None:
        """A line for the start of a run whose fused loss splits a full batch's `rows` rows
        (batch x context, all devices) into chunks (execution.loss_chunk_mib), e.g. 'loss: a full
        batch's 98304 rows per device in 2 chunks of 49152 (execution.loss_chunk_mib 8192)'; None
        where each device's rows go at once or the loss is XLA's. (Shorter batches, e.g.
        translation's length buckets, may take fewer chunks.)"""
        if self.loss not in ("pallas", "pallas_mgpu"):
            return None
        rows = self.shard.rows_per_device(rows) if self.shard else rows
        per_chunk = pallas_kernels.head_chunk_rows(
            rows, cfg.vocab_size, ex.compute_dtype, ex.loss_chunk_mib * 2**20
        )
        if per_chunk >= rows:
            return None
        chunks = -(-rows // per_chunk)
        return (
            f"loss: a full batch's {rows} rows per device in {chunks} chunks of {per_chunk} "
            f"(execution.loss_chunk_mib {ex.loss_chunk_mib})"
        )


def _mosaic_refusal(family: str, cfg: ModelConfig, ex: ExecutionConfig, backend: str) -> str | None:
    """What `family`'s Mosaic GPU kernels need that this run lacks, as "needs ..." would end
    (None: they can run)."""
    if backend != "gpu":
        return f"a GPU (backend here: {backend})"
    if family == "loss":
        return pallas_kernels.mosaic_loss_refusal(cfg.vocab_size, ex.compute_dtype)
    if (refusal := pallas_kernels.mosaic_gpu_refusal()) is not None:
        return refusal
    if family == "norm":  # RMSNorm (transformer_lm) has gamma only
        param_bytes = 8 if cfg.arch == "gpt2" else 4
        return pallas_kernels.mosaic_norm_refusal(
            cfg.d_model, ex.residual_dtype, ex.compute_dtype, param_bytes
        )
    # rows are tiled in 128-column units: the keys (up to the context) or the channels
    name, width = (
        ("model.context_length", cfg.context_length)
        if family == "attention"
        else ("model.d_model", cfg.d_model)
    )
    return f"{name} a multiple of 128 (got {width})" if width % 128 else None


def _lowering(family: str, path: str, cfg: ModelConfig, ex: ExecutionConfig, backend: str) -> str:
    """A Pallas `path` on the lowering execution.kernel_backend picks: "pallas_mgpu" (Mosaic GPU;
    `auto` takes it wherever it can run: on an H200 each family's Mosaic kernels measured at least
    about as fast as their Triton ones, on an H100 the norms' and the loss's, benchmarks/RESULTS.md)
    or "pallas" (Triton); other paths as they are."""
    if path != "pallas":
        return path
    mosaic = None if ex.kernel_backend == "triton" else _mosaic_refusal(family, cfg, ex, backend)
    if ex.kernel_backend != "triton" and mosaic is None:
        return "pallas_mgpu"
    key = "execution.loss_impl" if family == "loss" else "execution.kernels"
    triton = pallas_kernels.triton_refusal()
    if ex.kernel_backend == "mosaic_gpu":
        other = "execution.kernel_backend=auto or triton" if triton is None else f"{key}=xla"
        raise ConfigError(
            f"execution.kernel_backend=mosaic_gpu needs, for the {family} kernels, {mosaic}; "
            f"use {other}"
        )
    if triton is None:
        return path
    if ex.kernel_backend == "triton":
        raise ConfigError(
            f"execution.kernel_backend=triton needs {triton}; use execution.kernel_backend=auto "
            f"(Mosaic GPU, on a Hopper-class GPU) or {key}=xla"
        )
    raise ConfigError(
        f"the Pallas {family} kernels cannot run here (Mosaic GPU needs {mosaic}; Triton needs "
        f"{triton}); use {key}=xla"
    )


def _flash_refusal(cfg: ModelConfig, ex: ExecutionConfig, backend: str) -> str | None:
    """What our flash attention needs that this run lacks (None: it can run)."""
    if backend != "gpu":
        return f"a GPU (backend here: {backend})"
    return pallas_kernels.flash_attention_refusal(cfg.d_model // cfg.n_heads, ex.compute_dtype)


def _cudnn_refusal(cfg: ModelConfig, ex: ExecutionConfig, backend: str) -> str | None:
    """What cuDNN's flash attention (jax.nn.dot_product_attention) needs that this run lacks, as
    jax checks it only deep in the trace (None: it can run)."""
    head_dim = cfg.d_model // cfg.n_heads
    if backend != "gpu" or ex.compute_dtype != "bfloat16":
        return f"a GPU and bfloat16 (backend {backend}, {ex.compute_dtype})"
    if head_dim % 8 or head_dim > 128:
        return f"a head dim that is a multiple of 8 up to 128 (got {head_dim})"
    if cfg.context_length % 2:
        return f"an even model.context_length (got {cfg.context_length})"
    return None


def _attention_path(
    cfg: ModelConfig, ex: ExecutionConfig, backend: str, notes: list[str]
) -> AttentionPath:
    """execution.attention_impl's path here (`auto`: ours where it measured faster than cuDNN,
    pallas_kernels.faster_than_cudnn, else cuDNN, else the `kernels` path); a note in `notes`
    where the one asked for cannot run."""

    def kernels() -> AttentionPath:  # XLA's softmax or the Pallas one
        return _lowering(
            "attention", "pallas" if ex.kernels == "pallas" else "xla", cfg, ex, backend
        )

    cudnn_refusal = _cudnn_refusal(cfg, ex, backend)
    flash_refusal = _flash_refusal(cfg, ex, backend)
    if ex.attention_impl == "auto":
        if ex.dropout > 0:  # the one path with attention dropout
            return kernels()
        faster = pallas_kernels.faster_than_cudnn(cfg.context_length, cfg.d_model // cfg.n_heads)
        if flash_refusal is None and faster:
            return "flash"
        return "cudnn" if cudnn_refusal is None else kernels()
    if ex.attention_impl == "dot_product_attention":
        if cudnn_refusal is None:
            return "cudnn"
        notes.append(
            f"attention_impl=dot_product_attention (cuDNN) needs {cudnn_refusal}: attention "
            f"runs on {kernels()}"
        )
    elif ex.attention_impl == "pallas":
        if flash_refusal is None:
            return "flash"
        notes.append(
            f"attention_impl=pallas (flash attention) needs {flash_refusal}: attention runs "
            f"on {kernels()}"
        )
    return kernels()


def _mlp_path(cfg: ModelConfig, ex: ExecutionConfig, backend: str, notes: list[str]) -> MLPPath:
    """execution.mlp_impl's path here; a note in `notes` where "pallas" cannot run."""
    if ex.mlp_impl == "xla":
        return "xla"
    if cfg.arch != "gpt2":
        refusal = f"GPT-2's GELU MLP (model.arch {cfg.arch} has SwiGLU)"
    elif backend != "gpu":
        refusal = f"a GPU (backend here: {backend})"
    else:
        refusal = pallas_kernels.matmul_gelu_refusal(cfg.d_model, cfg.ffn_dim, ex.compute_dtype)
    if refusal is None:
        return "pallas_mgpu"
    notes.append(f"mlp_impl=pallas needs {refusal}: the MLP runs on xla")
    return "xla"


def plan_ops(
    cfg: ModelConfig,
    ex: ExecutionConfig,
    *,
    backend: str | None = None,
    shard: KernelShard | None = None,
) -> OpPlan:
    """The op paths model `cfg` run as `ex` takes on `backend` (default: jax.default_backend());
    `shard`: how Pallas calls run on a mesh of several devices (kept only if a path is Pallas)."""
    backend = backend or jax.default_backend()
    notes: list[str] = []
    attention = _attention_path(cfg, ex, backend, notes)
    mlp = _mlp_path(cfg, ex, backend, notes)
    pallas = "pallas" in (ex.kernels, ex.loss_impl) or attention == "flash" or mlp != "xla"
    return OpPlan(
        norm=_lowering("norm", ex.kernels, cfg, ex, backend),  # LayerNorm and RMSNorm alike
        attention=attention,
        loss=_lowering("loss", ex.loss_impl, cfg, ex, backend),
        conv=_lowering("conv", ex.kernels, cfg, ex, backend),
        mlp=mlp,
        interpret=backend != "gpu",
        shard=shard if pallas else None,
        notes=tuple(notes),
    )


# ----------------------------------------------------------------------------- norms


def norm(
    x: jax.Array,
    h: jax.Array | None,
    scale: jax.Array,
    bias: jax.Array | None,
    eps: float,
    out_dtype: jnp.dtype,
    path: NormPath,
    shard: KernelShard | None = None,
    rms: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """LayerNorm (RMSNorm if `rms`: scale only) over the last dim of x (..., D), output in
    out_dtype. With h (a branch output to add first): (s = x + h in x's dtype, norm(s)), the
    pre-norm residual step, one kernel both ways on the Pallas path."""
    if path in ("pallas", "pallas_mgpu"):
        params = (scale,) if rms else (scale, jnp.zeros_like(scale) if bias is None else bias)
        rows = (x,) if h is None else (x, h)
        if rms:
            fn = pallas_kernels.rms_norm if h is None else pallas_kernels.add_rms_norm
        else:
            fn = pallas_kernels.layer_norm if h is None else pallas_kernels.add_layer_norm

        def kernel(*args: jax.Array) -> Any:
            return fn(*args, eps, out_dtype=out_dtype, backend=_backend(path))

        batched = (True,) * len(rows) + (False,) * len(params)
        out_batched = True if h is None else (True, True)
        return _per_shard(shard, kernel, (*rows, *params), batched, out_batched)
    s = x if h is None else x + h.astype(x.dtype)
    y = (F.rms_norm(s, scale, eps) if rms else F.layer_norm(s, scale, bias, eps)).astype(out_dtype)
    return y if h is None else (s, y)


# ----------------------------------------------------------------------------- attention


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    path: AttentionPath,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    shard: KernelShard | None = None,
) -> jax.Array:
    """Causal self-attention without a cache: q, k, v (B, T, H, Dh) -> (B, T, H, Dh), one T
    (decoding over a KV cache attends with F.attention and its own mask)."""
    if path == "cudnn":
        if dropout_rng is not None:  # the config forbids it; a direct caller may not
            raise ValueError("cuDNN attention has no dropout; use the xla or pallas path")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if path == "flash":
        if dropout_rng is not None:  # the config forbids it; a direct caller may not
            raise ValueError("flash attention has no dropout; use the xla or pallas path")

        def kernel(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return pallas_kernels.flash_attention(q, k, v)

        return _per_shard(shard, kernel, (q, k, v), (True,) * 3, True)
    if path in ("pallas", "pallas_mgpu"):

        def probs_fn(scores: jax.Array, scale: float) -> jax.Array:  # (B, H, T, T)
            def kernel(scores: jax.Array) -> jax.Array:
                # The Mosaic kernel tiles keys by 128. A batch of another length (a translation
                # batch, say) runs Triton's where jax has it: padded to a multiple of 128 for the
                # Mosaic one, the attention took 1.25-3.8x the time (H200, RESULTS.md); the ops
                # line says so. Without Triton it is padded: the causal mask hides the padding.
                t = scores.shape[-1]
                backend, pad = _backend(path), 0
                if path == "pallas_mgpu" and t % 128:
                    if pallas_kernels.triton_refusal() is None:
                        backend = "triton"
                    else:
                        pad = -t % 128
                        scores = jnp.pad(scores, ((0, 0), (0, 0), (0, pad), (0, pad)))
                probs = pallas_kernels.attention_softmax(
                    scores, None, causal=True, scale=scale, backend=backend
                )
                return probs[:, :, :t, :t] if pad else probs

            return _per_shard(shard, kernel, (scores,), (True,), True)

        return F.attention(q, k, v, None, dropout_rate, dropout_rng, probs_fn=probs_fn)
    mask = F.attention_mask(q.shape[1], k.shape[1])
    return F.attention(q, k, v, mask, dropout_rate, dropout_rng)


def qkv_attention(
    x: jax.Array, w: jax.Array, b: jax.Array | None, n_heads: int, shard: KernelShard | None = None
) -> jax.Array:
    """Causal self-attention of the fused q/k/v projection x @ w + b on the flash path: x
    (B, T, D), w (D, 3D) [W_q | W_k | W_v] in x's dtype, b (3D,) or None -> (B, T, D) (heads
    concatenated, before the output projection). One VJP for both: the kernels read q, k, v
    in place from the projection's (B, T, 3, H, Dh) output and write dk, dv into one array, so
    the backward is dq's and dk/dv's GEMMs with no copy, slice or sum of three dX GEMMs
    between (apart, as Linear(splits=3): 1.31 against 1.19 ms at GPT-2 batch 64 on an H200,
    benchmarks/RESULTS.md)."""
    return _qkv_attention(x, w, b, n_heads, shard)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _qkv_attention(x, w, b, n_heads, shard):
    return _qkv_attention_fwd(x, w, b, n_heads, shard)[0]


def _qkv_attention_fwd(x, w, b, n_heads, shard):
    with jax.named_scope("qkv"):
        y = jnp.dot(x, w) if b is None else jnp.dot(x, w) + b.astype(x.dtype)
        qkv = y.reshape(*x.shape[:-1], 3, n_heads, -1)  # (B, T, 3, H, Dh)
    with jax.named_scope("sdpa"):
        kernel = pallas_kernels.flash_attention_qkv
        o, lse = _per_shard(shard, kernel, (qkv,), (True,), (True, True))
    return o.reshape(x.shape), (x, w, b, qkv, o, lse)


def _qkv_attention_bwd(n_heads, shard, res, dy):
    x, w, b, qkv, o, lse = res
    with jax.named_scope("sdpa"):
        kernel = pallas_kernels.flash_attention_qkv_grad
        args = (qkv, o, lse, dy.reshape(o.shape))
        dq, dkv = _per_shard(shard, kernel, args, (True,) * 4, (True, True))
    with jax.named_scope("qkv"):
        d, rows = x.shape[-1], math.prod(x.shape[:-1])
        x2, dq2, dkv2 = x.reshape(rows, d), dq.reshape(rows, d), dkv.reshape(rows, 2 * d)
        dx = jnp.dot(dq2, w[:, :d].T) + jnp.dot(dkv2, w[:, d:].T)
        dw = jnp.concatenate([jnp.dot(x2.T, dq2), jnp.dot(x2.T, dkv2)], axis=1)
        db = None
        if b is not None:  # float32 sums, as Linear's bias gradient
            # k's is exactly 0: a key bias adds q_i . b_k to all of row i's scores, which the
            # softmax ignores (so no read of dk; its sum is rounding noise). v's is the sum of
            # dy: each row of P sums to 1 (the same read as dv's, of the unrounded values)
            sums = (dq2.sum(0, dtype=jnp.float32), jnp.zeros((d,), jnp.float32),
                    dy.reshape(rows, d).sum(0, dtype=jnp.float32))  # fmt: skip
            db = jnp.concatenate(sums).astype(b.dtype)
    return dx.reshape(x.shape), dw, db


_qkv_attention.defvjp(_qkv_attention_fwd, _qkv_attention_bwd)


# ----------------------------------------------------------------------------- loss, conv


def linear_cross_entropy(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    compute_dtype: jnp.dtype,
    path: LossPath,
    label_smoothing: float = 0.0,
    shard: KernelShard | None = None,
    chunk_mib: int = LOSS_CHUNK_MIB,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LM head + cross-entropy: x (N, D), w (V, D), targets, weights (N,) ->
    (sum_i w_i loss_i, ce (N,), hit (N,)); see `F.linear_cross_entropy`. `chunk_mib`: the
    fused kernel's logits per chunk of rows (execution.loss_chunk_mib; 0: all rows at once).
    A target outside [0, V) gives its row ce = OUT_OF_RANGE_CE (1e30: nothing at weight 0,
    loud with a weight) and no hit, on every path."""
    if path in ("pallas", "pallas_mgpu"):
        if label_smoothing:  # ExecutionConfig refuses this pairing; a direct caller gets it here
            raise ValueError("label smoothing needs the xla loss path: the fused kernel has none")
        backend = _backend(path)

        def kernel(x: jax.Array, w: jax.Array, t: jax.Array, wt: jax.Array) -> Any:
            loss, ce, hit = pallas_kernels.linear_cross_entropy(
                x, w, t, wt, compute_dtype, backend=backend, max_chunk_bytes=chunk_mib * 2**20
            )
            return loss[None], ce, hit  # (1,): one partial sum per shard, added up below

        args = (x, w, targets, weights)
        parts, ce, hit = _per_shard(shard, kernel, args, (True, False, True, True), (True,) * 3)
        return jnp.sum(parts), ce, hit
    ok = targets_in_range(targets, w.shape[0])
    safe = jnp.where(ok, targets.astype(jnp.int32), 0)  # XLA's gather would clamp or NaN
    loss, ce, hit = F.linear_cross_entropy(
        x, w, safe, jnp.where(ok, weights, 0), compute_dtype, label_smoothing
    )
    loss = loss + OUT_OF_RANGE_CE * jnp.sum(jnp.where(ok, 0, weights))  # as the kernel's sum
    return loss, *mark_out_of_range(ce, hit, ok)


def depthwise_conv1d(
    u: jax.Array,
    w: jax.Array,
    b: jax.Array,
    mode: str,
    path: Literal["xla", "pallas"],
    shard: KernelShard | None = None,
) -> jax.Array:
    """Per-channel conv over (B, L, D) with w (D, K), b (D,); see `F.depthwise_conv1d`."""
    if path in ("pallas", "pallas_mgpu"):

        def kernel(u: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
            return pallas_kernels.depthwise_conv1d(u, w, b, mode, backend=_backend(path))

        return _per_shard(shard, kernel, (u, w, b), (True, False, False), True)
    return F.depthwise_conv1d(u, w, b, mode)


def gelu_mlp(
    x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array,
    shard: KernelShard | None = None,
) -> jax.Array:  # fmt: skip
    """gelu(x @ w1 + b1) @ w2 on the Mosaic GPU path (mlp: pallas_mgpu): x (..., D), w1 (D, F),
    w2 (F, D) in x's dtype, b1 (F,) float32 or None. One kernel writes h = x w1 + b1 and gelu(h)
    (pallas_kernels.matmul_gelu), then cuBLAS's GEMM; the backward's dh = (dy w2^T) * gelu'(h)
    is one kernel (matmul_dgelu), db1 a float32 sum over the rows. Rows (per device) not a
    multiple of MLP_ROWS run XLA's ops."""
    return _gelu_mlp(x, w1, b1, w2, shard)


def _kernel_rows(shard: KernelShard | None, rows: int) -> bool:
    return (shard.rows_per_device(rows) if shard else rows) % MLP_ROWS == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gelu_mlp(x, w1, b1, w2, shard):
    return _gelu_mlp_fwd(x, w1, b1, w2, shard)[0]


def _gelu_mlp_fwd(x, w1, b1, w2, shard):
    rows, f = math.prod(x.shape[:-1]), w1.shape[1]
    x2 = x.reshape(rows, -1)
    b = jnp.zeros((f,), jnp.float32) if b1 is None else b1.astype(jnp.float32)
    if _kernel_rows(shard, rows):
        kernel = pallas_kernels.matmul_gelu
        h, a = _per_shard(shard, kernel, (x2, w1, b), (True, False, False), (True, True))
    else:
        h = jnp.dot(x2, w1) + b.astype(x.dtype)
        a = F.gelu(h)
    y = jnp.dot(a, w2)
    return y.reshape(*x.shape[:-1], -1), (x2, w1, b1, w2, h, a)


def _gelu_mlp_bwd(shard, res, dy):
    x2, w1, b1, w2, h, a = res
    dy2 = dy.reshape(h.shape[0], -1)
    if _kernel_rows(shard, h.shape[0]):
        args = (dy2, w2.T, h)
        dh = _per_shard(shard, pallas_kernels.matmul_dgelu, args, (True, False, True), True)
    else:
        dh = jax.vjp(F.gelu, h)[1](jnp.dot(dy2, w2.T))[0]
    db1 = None if b1 is None else jnp.sum(dh, axis=0, dtype=jnp.float32).astype(b1.dtype)
    dx = jnp.dot(dh, w1.T).reshape(*dy.shape[:-1], -1)
    return dx, jnp.dot(x2.T, dh), db1, jnp.dot(a.T, dy2)


_gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)
