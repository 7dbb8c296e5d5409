"""Where one decoder layer's time goes, next to where its FLOPs go: `python profile.py breakdown`.

One layer of the model (its real Block, real shapes: batch B, length T, the size's d_model,
heads and d_ff) is cut into pieces, each jitted and timed on its own, forward and forward +
backward (the VJP w.r.t. its inputs and parameters, one call):

  attention   qkv_proj               the fused q/k/v projection (layers.Linear, splits=3)
              rope                   transformer_lm: RoPE on q and k (functional.apply_rope)
              scores+mask+softmax    q k^T, the causal mask and the softmax, as functional.attention
              av                     probabilities x values
              out_proj               the output projection
  mlp         mlp                    the block's FeedForward / SwiGLU
  norm/other  norms+residuals        both pre-norms with their residual adds (the model fuses the
                                     add into the norm)

On the Pallas or cuDNN attention path the scores, softmax and AV are one kernel or one chain of
a kernel between einsums: they are timed together (ops.causal_attention) as `attention core`.
On the flash path without RoPE the model runs the projection and the kernels as one op
(ops.qkv_attention, one GEMM read in place); the pieces time them apart, the `layer` row as
the model runs them.
The whole Block, jitted as one function, is timed too: against the sum of the pieces it shows
what XLA's fusion across pieces saves.

FLOPs and bytes per piece are the sums of `jaxllm.profiling.flops.layer_ops` (forward);
forward + backward counts 3x both (backward = 2 x forward, as for the matmuls). Times are
medians of `harness.time_calls` (back-to-back calls, one device sync per sample).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm import functional as F
from jaxllm import ops
from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.layers import AttentionInputs, FeedForward, LayerNorm, Linear, SwiGLU
from jaxllm.models import gpt2, transformer_lm
from jaxllm.profiling.flops import layer_ops
from jaxllm.profiling.harness import (
    DTYPE_TAG,
    BadInput,
    append_jsonl,
    md_header,
    md_row,
    time_calls,
)

COMPONENTS = ("attention", "mlp", "norm/other")
# piece -> (component, the layer_ops names it computes)
PIECES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("attention", ("qkv_proj",)),
    "rope": ("attention", ("rope",)),
    "scores+mask+softmax": ("attention", ("scores", "mask", "softmax")),
    "av": ("attention", ("av",)),
    "attention core": ("attention", ("scores", "mask", "softmax", "av")),
    "out_proj": ("attention", ("out_proj",)),
    "mlp": ("mlp", ("mlp_up", "mlp_act", "mlp_down")),
    "norms+residuals": ("norm/other", ("norm1", "norm2", "residual1", "residual2")),
}


@dataclass(frozen=True)
class _Piece:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]


def _random(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _submodules(
    cfg: ModelConfig, ex: ExecutionConfig, plan: ops.OpPlan
) -> tuple[Any, Any, Linear, Linear]:
    """(norm, mlp, qkv, out) built as gpt2.Block / transformer_lm.Block build them (the tests
    check that the pieces chained give the Block's output)."""
    dtype = jnp.dtype(ex.compute_dtype)
    if cfg.arch == "gpt2":
        norm = LayerNorm(cfg.norm_eps, cfg.bias, plan.norm, dtype)
        mlp = FeedForward(cfg.ffn_dim, cfg.bias, ex.dropout, compute_dtype=dtype, path=plan.mlp)
    else:
        norm, mlp = (
            transformer_lm.rms_norm(cfg, ex, plan)(),
            SwiGLU(cfg.ffn_dim, compute_dtype=dtype),
        )
    qkv = Linear(3 * cfg.d_model, use_bias=cfg.qkv_bias, compute_dtype=dtype)
    return norm, mlp, qkv, Linear(cfg.d_model, use_bias=cfg.bias, compute_dtype=dtype)


def _functions(
    cfg: ModelConfig, ex: ExecutionConfig, batch: int, length: int
) -> dict[str, Callable[..., Any]]:
    """The layer's pieces as functions of (parameters, inputs), keyed by PIECES name (+
    "layer": the whole Block)."""
    b, t, d, n_heads = batch, length, cfg.d_model, cfg.n_heads
    dh = d // n_heads
    plan = ops.plan_ops(cfg, ex)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    block = {"gpt2": gpt2.Block, "transformer_lm": transformer_lm.Block}[cfg.arch](cfg, ex, plan)
    norm, mlp, qkv, out = _submodules(cfg, ex, plan)

    def norms(p1: Any, p2: Any, x: jax.Array, h: jax.Array, h2: jax.Array) -> tuple:
        """ln1 (with the previous block's residual add), then ln2 (with attention's)."""
        x, y1 = norm.apply({"params": p1}, x, residual=h)
        x, y2 = norm.apply({"params": p2}, x, residual=h2)
        return x, y1, y2

    def qkv_proj(pq: Any, y: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(a.reshape(b, t, n_heads, dh) for a in qkv.apply({"params": pq}, y, splits=3))

    def rope(q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        cos, sin = F.rope_angles(positions, dh, cfg.rope_theta)
        return F.apply_rope(q, cos, sin), F.apply_rope(k, cos, sin)

    def scores_softmax(q: jax.Array, k: jax.Array) -> jax.Array:
        """functional.attention's first half: (B, H, T, T) float32 probabilities."""
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scaled = jnp.where(F.attention_mask(t, t), scores * (1.0 / math.sqrt(dh)), F.MASK_VALUE)
        return F.softmax(scaled, axis=-1)

    def av(probs: jax.Array, v: jax.Array) -> jax.Array:
        """functional.attention's second half: (B, T, H, Dh)."""
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)

    return {
        "norms+residuals": norms, "qkv_proj": qkv_proj, "rope": rope,
        "scores+mask+softmax": scores_softmax, "av": av,
        "attention core": lambda q, k, v: ops.causal_attention(q, k, v, plan.attention),
        "out_proj": lambda po, o: out.apply({"params": po}, o.reshape(b, t, d)),
        "mlp": lambda pm, y: mlp.apply({"params": pm}, y),
        "layer": lambda pb, x, h: block.apply({"params": pb}, x, h, AttentionInputs(positions),
                                              None)[:2],
        "init": lambda key, x, h: block.init(key, x, h, AttentionInputs(positions), None),
    }  # fmt: skip


def build_pieces(
    cfg: ModelConfig, ex: ExecutionConfig, batch: int, length: int, seed: int = 0
) -> tuple[list[_Piece], _Piece]:
    """The layer's pieces, each with inputs made by running the pieces before it, and the whole
    Block as one piece. x (B, T, D) float32 residual stream, h (B, T, D) the previous block's
    branch output in the compute dtype, as in `Decoder.hidden`. On the Pallas or cuDNN
    attention path the scores, softmax and AV are one piece, `attention core`."""
    if cfg.short_conv:
        raise BadInput("breakdown does not cover model.short_conv")
    fn = _functions(cfg, ex, batch, length)
    dtype, shape = jnp.dtype(ex.compute_dtype), (batch, length, cfg.d_model)
    k_x, k_h, k_h2, k_p = jax.random.split(jax.random.PRNGKey(seed), 4)
    x, h = _random(k_x, shape, jnp.float32), _random(k_h, shape, dtype)
    h_attn = _random(k_h2, shape, dtype)  # stands in for the attention output in `norms`
    p = jax.jit(fn["init"])(k_p, x, h)["params"]  # one compile, not one per op
    split = ops.plan_ops(cfg, ex).attention == "xla"  # else one fused kernel or chain: not split
    rope = cfg.arch == "transformer_lm"

    @jax.jit
    def activations(p: Any, x: jax.Array, h: jax.Array, h_attn: jax.Array) -> dict:
        """Every piece's inputs, from the pieces before it (one compile for all of them)."""
        _, y1, y2 = fn["norms+residuals"](p["ln1"], p["ln2"], x, h, h_attn)
        q0, k0, v = fn["qkv_proj"](p["attn"]["qkv"], y1)
        q, k = fn["rope"](q0, k0) if rope else (q0, k0)
        probs = fn["scores+mask+softmax"](q, k) if split else None
        o = fn["av"](probs, v) if split else fn["attention core"](q, k, v)
        return dict(y1=y1, y2=y2, q0=q0, k0=k0, q=q, k=k, v=v, probs=probs, o=o)

    a = activations(p, x, h, h_attn)
    args = {
        "norms+residuals": (p["ln1"], p["ln2"], x, h, h_attn),
        "qkv_proj": (p["attn"]["qkv"], a["y1"]),
        "rope": (a["q0"], a["k0"]) if rope else None,
        "scores+mask+softmax": (a["q"], a["k"]) if split else None,
        "av": (a["probs"], a["v"]) if split else None,
        "attention core": None if split else (a["q"], a["k"], a["v"]),
        "out_proj": (p["attn"]["out"], a["o"]),
        "mlp": (p["mlp"], a["y2"]),
    }
    pieces = [_Piece(name, fn[name], xs) for name, xs in args.items() if xs is not None]
    return pieces, _Piece("layer", fn["layer"], (p, x, h))


def piece_costs(
    cfg: ModelConfig, ex: ExecutionConfig, batch: int, length: int, pieces: Sequence[str]
) -> dict:
    """{piece: (forward FLOPs, forward bytes)} from flops.layer_ops; every op of the layer
    goes to exactly one piece, so the FLOP shares add up to 100%."""
    layer = layer_ops(
        batch=batch, length=length, d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.ffn_dim,
        dtype_bytes=jnp.dtype(ex.compute_dtype).itemsize, arch=cfg.arch,
    )  # fmt: skip
    owner = {op: piece for piece in pieces for op in PIECES[piece][1]}
    costs = {piece: [0.0, 0.0] for piece in pieces}
    for op in layer:
        costs[owner[op.name]][0] += op.flops
        costs[owner[op.name]][1] += op.bytes
    return {k: tuple(v) for k, v in costs.items()}


def _forward_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """(args, cotangent) -> gradients w.r.t. every arg: the forward and the backward, one jit."""

    def f(args: tuple, cotangent: Any) -> Any:
        _, pull = jax.vjp(fn, *args)
        return pull(cotangent)

    return jax.jit(f)


def _time_piece(piece: _Piece, warmup: int, group: int, samples: int) -> tuple[float, float]:
    """(forward, forward + backward) median seconds per call; both compiled before any call,
    so that no timed call (--warmup 0 included) compiles."""
    fwd = jax.jit(piece.fn).lower(*piece.args).compile()
    out_shape = jax.eval_shape(piece.fn, *piece.args)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree_util.tree_leaves(out_shape))))
    cot = jax.tree_util.tree_map(lambda s: _random(next(keys), s.shape, s.dtype), out_shape)
    fb = _forward_backward(piece.fn).lower(piece.args, cot).compile()
    recipe = dict(warmup=warmup, group=group, samples=samples)
    t_fwd = time_calls(lambda: fwd(*piece.args), **recipe).median_s
    t_fb = time_calls(lambda: fb(piece.args, cot), **recipe).median_s
    return t_fwd, t_fb


def run_breakdown(
    cfg: ModelConfig, ex: ExecutionConfig, size: str, batch: int, length: int, *,
    warmup: int = 3, group: int = 10, samples: int = 5,
) -> list[dict[str, Any]]:  # fmt: skip
    """Time every piece of one layer of `cfg` at (batch, length), forward and forward+backward
    (3x the forward's FLOPs and bytes), then the whole layer: one record per piece and
    direction, with the roofline plot's keys (name, flops, bytes, seconds)."""
    pieces, layer = build_pieces(cfg, ex, batch, length)
    costs = piece_costs(cfg, ex, batch, length, [p.name for p in pieces])
    costs["layer"] = tuple(map(sum, zip(*costs.values(), strict=True)))
    tag = f"breakdown {size} T{length} {DTYPE_TAG[ex.compute_dtype]}"
    records = []
    for piece in [*pieces, layer]:
        label = f"{PIECES[piece.name][0]}/{piece.name}" if piece is not layer else "layer"
        flops, nbytes = costs[piece.name]
        times = _time_piece(piece, warmup, group, samples)
        for (direction, mult), seconds in zip(DIRECTIONS.items(), times, strict=True):
            records.append({
                "name": f"{tag} {direction} {label}", "flops": mult * flops,
                "bytes": mult * nbytes, "seconds": seconds, "dtype": ex.compute_dtype,
                "size": size, "arch": cfg.arch, "batch": batch, "context": length,
                "direction": direction, "piece": label, "device": jax.devices()[0].device_kind,
            })  # fmt: skip
    jax.clear_caches()
    return records


# ----------------------------------------------------------------------------- output

DIRECTIONS = {"forward": 1, "forward+backward": 3}  # FLOPs and bytes relative to the forward's


def table(records: list[dict[str, Any]], direction: str) -> str:
    """Markdown: each piece, each component's subtotal, their sum, and the whole layer jitted
    as one function; time and FLOP shares are of the sum of the pieces."""
    mine = [r for r in records if r["direction"] == direction]
    pieces, (layer,) = mine[:-1], mine[-1:]
    total_s, total_f = sum(r["seconds"] for r in pieces), layer["flops"]

    def line(label: str, rows: list[dict[str, Any]]) -> str:
        seconds, flops = sum(r["seconds"] for r in rows), sum(r["flops"] for r in rows)
        shares = f"{100 * seconds / total_s:.1f}", f"{100 * flops / total_f:.1f}"
        return md_row([label, f"{1e3 * seconds:.3f}", *shares, f"{flops / seconds / 1e12:.3g}"])

    out = [md_header([f"component ({direction})", "time ms", "time share %", "FLOP share %",
                      "TFLOP/s"])]  # fmt: skip
    for comp in COMPONENTS:
        rows = [r for r in pieces if r["piece"].startswith(f"{comp}/")]
        out += [line(f"{comp}: {r['piece'][len(comp) + 1 :]}", [r]) for r in rows]
        if len(rows) > 1:
            out.append(line(f"**{comp} total**", rows))
    out += [line("sum of pieces", pieces), line("whole layer, one jit", [layer])]
    return "\n".join(out)


def report(cfg: ModelConfig, ex: ExecutionConfig, records: list[dict[str, Any]]) -> str:
    """The text of `profile.py breakdown`: a header, the two tables, the per-model totals."""
    c, r = cfg, records[0]
    head = (
        f"breakdown: one {c.arch} layer, batch {r['batch']}, length {r['context']}, d_model "
        f"{c.d_model}, {c.n_heads} heads, d_ff {c.ffn_dim}, {ex.compute_dtype}, "
        f"{ops.plan_ops(c, ex).describe()}; device {r['device']}\n"
        "times: median per call, each piece jitted alone; FLOPs: flops.layer_ops (forward; "
        "forward+backward = 3x)"
    )
    fwd, fb = (r["seconds"] for r in records if r["piece"] == "layer")
    per_model = (
        f"x {c.n_layers} layers (whole layer): forward {1e3 * c.n_layers * fwd:.2f} ms, "
        f"forward+backward {1e3 * c.n_layers * fb:.2f} ms (blocks only: no embeddings, LM head "
        "or loss)"
    )
    return "\n\n".join([head, *(table(records, d) for d in DIRECTIONS), per_model])


def run(
    cfg: ModelConfig, ex: ExecutionConfig, size: str, batch: int, length: int, *,
    warmup: int = 3, group: int = 10, samples: int = 5, jsonl_path: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run the breakdown, print the report, append the JSON rows to `jsonl_path`."""
    if length > cfg.context_length:
        raise BadInput(f"--context {length} exceeds size {size}'s context {cfg.context_length}; "
                         "raise it with --model.context_length=N")  # fmt: skip
    records = run_breakdown(
        cfg, ex, size, batch, length, warmup=warmup, group=group, samples=samples
    )
    print(report(cfg, ex, records), flush=True)
    append_jsonl(jsonl_path, records)
    return records
