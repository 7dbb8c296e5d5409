"""AdamW with linear warm-up, cosine decay to `min_lr` at the last step, and grad clipping."""

from __future__ import annotations

import optax
from flax import traverse_util

from jaxllm.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """lr(step) for step = 0 .. total_steps - 1: 0 -> lr over `warmup_steps`, then a cosine
    down to `min_lr`, reached exactly at step total_steps - 1 (the last update); with
    warmup_steps = total_steps - 1 no step is left to decay and the last update is at lr."""
    if not 0 <= cfg.warmup_steps < total_steps:
        raise ValueError(f"warmup_steps must be in [0, {total_steps}), got {cfg.warmup_steps}")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(total_steps - 1, cfg.warmup_steps + 1),
        end_value=cfg.min_lr,
    )


def decay_mask(params: dict) -> dict:
    """True for the matrices of linear layers: norm scales, biases and embeddings are not
    decayed (decaying them pulls normalisation and token identity toward zero)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: k[-1] == "kernel" for k in flat})


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    mask = None if cfg.decay_norms_and_embeddings else decay_mask
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps),
        b1=cfg.beta1,
        b2=cfg.beta2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=mask,
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
