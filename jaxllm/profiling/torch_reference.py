"""The jaxllm models rebuilt in PyTorch, timed side by side with ours (`profile.py bench --torch`).

Same architecture as `jaxllm.models`, module for module, parameter for parameter:
  gpt2            learned positions, pre-LayerNorm blocks, fused q/k/v, tanh GELU MLP, tied head
  transformer_lm  RoPE on adjacent pairs (CS336's layout), RMSNorm pre-norm, SwiGLU, no biases,
                  untied head
Attention is `F.scaled_dot_product_attention(is_causal=True)`, the loss a float32 cross-entropy.
`compute_dtype` bfloat16 runs under `torch.autocast` with float32 parameters, as ours keeps
float32 parameters and casts the matmul operands; float32 allows TF32 matmuls, as XLA does on
the GPU. `residual_dtype` bfloat16 keeps the residual stream in bf16 as ours does. The train
step is fused AdamW (weight decay on >= 2-D parameters) after global-norm clipping at 1.0, as
`jaxllm.train.optim`. `load_flax_params` copies our parameters in, so a test can check that
both compute the same function.

torch is an optional dependency (the GPU image has it): it is imported inside the functions
that need it, so that importing this module (and `profile.py bench` without --torch) works
without it.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np

from jaxllm.config import Config, ExecutionConfig, ModelConfig
from jaxllm.models import unstack_blocks
from jaxllm.profiling.harness import BadInput, is_oom, time_calls


class TorchUnavailableError(RuntimeError):
    """PyTorch (or, for GPU timing, CUDA) is missing."""


def require_torch(cuda: bool = True) -> Any:
    """The torch module; TorchUnavailableError with a one-line reason if it cannot be used."""
    try:
        import torch  # optional: see the module docstring
    except ImportError:
        raise TorchUnavailableError(
            "the PyTorch side-by-side needs torch (pip install torch); jaxllm does not depend "
            "on it, the GPU image has it"
        ) from None
    if cuda and not torch.cuda.is_available():
        raise TorchUnavailableError(
            "the PyTorch side-by-side needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    return torch


@functools.cache
def _blocks() -> SimpleNamespace:
    """The block's nn.Module classes, defined on first use (torch is optional). Attribute names
    follow the Flax parameter names (kernel -> weight)."""
    torch = require_torch(cuda=False)
    nn, F = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, d: int, eps: float) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # statistics in float32
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
            return y.to(x.dtype)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate adjacent pairs of x (B, T, H, Dh) by angles cos, sin (T, Dh/2)."""
        xf = x.float().unflatten(-1, (-1, 2))
        x0, x1 = xf[..., 0], xf[..., 1]
        c, s = cos[:, None, :], sin[:, None, :]  # broadcast over batch and heads
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            d = cfg.d_model
            self.qkv = nn.Linear(d, 3 * d, bias=cfg.qkv_bias)  # [W_q | W_k | W_v]
            self.out = nn.Linear(d, d, bias=cfg.bias)
            self.n_heads, self.rope = cfg.n_heads, cfg.arch == "transformer_lm"

        def forward(self, x: torch.Tensor, cos: Any, sin: Any) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = (a.view(b, t, self.n_heads, -1) for a in self.qkv(x).split(d, dim=-1))
            if self.rope:
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, H, T, Dh)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, d))

    class MLP(nn.Module):  # GPT-2: proj(gelu_tanh(fc(x)))
        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
            self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(F.gelu(self.fc(x), approximate="tanh"))

    class SwiGLU(nn.Module):  # w2(silu(w1 x) * w3 x)
        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            d, f = cfg.d_model, cfg.ffn_dim
            self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
            self.w2 = nn.Linear(f, d, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def norm(cfg: ModelConfig) -> nn.Module:
        if cfg.arch == "gpt2":
            return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
        return RMSNorm(cfg.d_model, cfg.norm_eps)

    class Block(nn.Module):
        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__()
            self.ln1, self.ln2 = norm(cfg), norm(cfg)
            self.attn = Attention(cfg)
            self.mlp = MLP(cfg) if cfg.arch == "gpt2" else SwiGLU(cfg)

        def forward(self, x: torch.Tensor, cos: Any, sin: Any) -> torch.Tensor:
            x = x + self.attn(self.ln1(x), cos, sin)
            return x + self.mlp(self.ln2(x))

    return SimpleNamespace(Block=Block, norm=norm)


@functools.cache
def _modules() -> SimpleNamespace:
    """The model's nn.Module class (h{i} -> blocks.{i}, embed -> wte, lm_head -> head)."""
    torch = require_torch(cuda=False)
    nn, F = torch.nn, torch.nn.functional
    Block, norm = _blocks().Block, _blocks().norm

    class LM(nn.Module):
        def __init__(self, cfg: ModelConfig, ex: ExecutionConfig) -> None:
            super().__init__()
            if cfg.short_conv:
                raise BadInput("the PyTorch reference has no model.short_conv")
            self.cfg, self.ex = cfg, ex
            d = cfg.d_model
            self.wte = nn.Embedding(cfg.vocab_size, d)
            self.wpe = nn.Embedding(cfg.context_length, d) if cfg.arch == "gpt2" else None
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = norm(cfg)
            self.head = None if cfg.tie_embeddings else nn.Linear(d, cfg.vocab_size, bias=False)
            dh = d // cfg.n_heads
            inv_freq = cfg.rope_theta ** (-torch.arange(0, dh, 2, dtype=torch.float32) / dh)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            for p in self.parameters():  # timing does not depend on the values
                if p.dim() >= 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
            """idx (B, T) -> logits (B, T, V); with targets (B, T), the mean loss (float32)."""
            pos = torch.arange(idx.shape[1], device=idx.device)
            x, cos, sin = self.wte(idx), None, None
            if self.wpe is not None:
                x = x + self.wpe(pos)
            else:
                angles = pos.float()[:, None] * self.inv_freq  # (T, Dh/2)
                cos, sin = angles.cos(), angles.sin()
            if self.ex.residual_dtype == "bfloat16":  # the stream, and so every add, in bf16
                x = x.to(torch.bfloat16)
            for block in self.blocks:
                x = block(x, cos, sin)
            return self.output(x, targets)

        def output(self, x: torch.Tensor, targets: torch.Tensor | None) -> Any:
            """The final norm, the LM head and (with targets) the loss: a region of its own
            for `compile_model(..., "regional")`."""
            x = self.ln_f(x)
            logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
            if targets is None:
                return logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return SimpleNamespace(LM=LM)


def build(cfg: ModelConfig, ex: ExecutionConfig) -> Any:
    """The PyTorch model of `cfg` run as `ex` (float32 parameters, on the CPU)."""
    return _modules().LM(cfg, ex)


def compile_model(model: Any, how: str) -> Any:
    """torch.compile `model` (static shapes), returning what to call in its place.

    how "model": the whole model, one graph (minutes of compilation for tens of layers). "regional":
    each block and the output (final norm, head, loss) compiled on their own; the blocks share
    one compiled graph, so compilation costs about one block, whatever the depth (PyTorch's
    regional compilation recipe); only the embedding lookup stays eager. `model` is changed in
    place either way, so its parameters and gradients are the ones being trained.
    """
    torch = require_torch(cuda=False)
    if how == "model":
        return torch.compile(model, dynamic=False)
    for block in model.blocks:
        block.compile(dynamic=False)
    model.output = torch.compile(model.output, dynamic=False)
    return model


def load_flax_params(model: Any, params: Any) -> None:
    """Copy a jaxllm Flax parameter tree into `model` (built from the same config): names map
    h{i} -> blocks.{i}, embed -> wte, lm_head -> head, kernel -> weight (transposed: Flax keeps
    (in, out), torch (out, in)), scale and embedding -> weight. A execution.scan_layers tree
    (blocks/block, stacked) is unstacked first."""
    torch = require_torch(cuda=False)
    if "blocks" in params:
        params = unstack_blocks(params)

    state = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        *mods, leaf_name = keys
        mods = [f"blocks.{m[1:]}" if m[0] == "h" and m[1:].isdigit() else m for m in mods]
        mods = [{"embed": "wte", "lm_head": "head"}.get(m, m) for m in mods]
        value = np.asarray(leaf, np.float32)
        if leaf_name == "kernel":
            value = value.T
        name = "bias" if leaf_name == "bias" else "weight"
        state[".".join([*mods, name])] = torch.tensor(value)  # a copy: jax arrays are read-only
    model.load_state_dict(state, strict=True)


def _calls(torch: Any, model: Any, x: Any, y: Any, compile_mode: str | None, device: str):
    """{mode: a call of it} on `model` (eager, or compiled as `compile_mode` says)."""
    fwd = compile_model(model, compile_mode) if compile_mode else model
    params = list(model.parameters())
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), fused=device == "cuda",
    )  # fmt: skip
    bf16 = model.ex.compute_dtype == "bfloat16"

    def autocast() -> Any:
        return torch.autocast(device, dtype=torch.bfloat16, enabled=bf16)

    def logits() -> None:
        with torch.no_grad(), autocast():
            fwd(x)

    def forward() -> None:
        with torch.no_grad(), autocast():
            fwd(x, y)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = fwd(x, y)
        loss.backward()

    def train_step() -> None:
        forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return {"logits": logits, "forward": forward, "forward_backward": forward_backward,
            "train_step": train_step}  # fmt: skip


def time_modes(
    cfg: Config,
    inputs: np.ndarray,
    targets: np.ndarray,
    modes: Sequence[str],
    *,
    compile_mode: str | None,
    warmup: int,
    samples: int,
    device: str = "cuda",
    group: int = 1,
) -> dict[str, list[float] | None]:
    """Per-call seconds (`samples` samples of `group` back-to-back calls each, as
    harness.time_calls) of each mode (as in jaxllm.profiling.bench) of the PyTorch model of
    `cfg`, eager (compile_mode None) or torch.compile'd (`compile_model`'s "regional" or
    "model"), on inputs, targets (B, T) ints; None for a mode that ran out of memory. The first
    warm-up calls compile."""
    torch = require_torch(cuda=device == "cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # XLA's default f32 matmul precision on GPU
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    if compile_mode:
        torch._dynamo.reset()  # no graphs or recompile budget left over from another config

    def sync(_: Any) -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out: dict[str, list[float] | None] = {m: None for m in modes}
    try:
        model = build(cfg.model, cfg.execution).to(device)
        # torch.tensor copies: arrays that come from jax are read-only
        x, y = (torch.tensor(a, dtype=torch.long, device=device) for a in (inputs, targets))
        calls = _calls(torch, model, x, y, compile_mode, device)
        for mode in modes:
            try:
                t = time_calls(calls[mode], warmup=warmup, group=group, samples=samples, sync=sync)
                out[mode] = list(t.samples)
            except Exception as e:
                if not is_oom(e):
                    raise
                model.zero_grad(set_to_none=True)  # drop what the failed call left
    except Exception as e:  # the model itself did not fit
        if not is_oom(e):
            raise
    finally:  # the model, its gradients and AdamW state are gone: hand their memory back
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return out
