"""Language models. `build_model(cfg)` picks the class named by `cfg.arch`."""

from __future__ import annotations

import flax.linen as nn

from jaxllm.config import ModelConfig
from jaxllm.models.gpt2 import GPT2
from jaxllm.models.interface import init_kv_cache
from jaxllm.models.transformer_lm import TransformerLM

__all__ = ["GPT2", "TransformerLM", "build_model", "init_kv_cache"]


def build_model(cfg: ModelConfig) -> nn.Module:
    cfg.validate()
    return {"gpt2": GPT2, "transformer_lm": TransformerLM}[cfg.arch](cfg)
