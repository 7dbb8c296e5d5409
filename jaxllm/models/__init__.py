"""Language models: the decoder shell (decoder.py) and one file per architecture.

`build_model(cfg)` picks the class named by `cfg.arch`; a new architecture is one file here,
one entry in ARCHITECTURES and one literal in `ModelConfig.arch`.
"""

from __future__ import annotations

from jaxllm.config import ExecutionConfig, ModelConfig
from jaxllm.models.decoder import (
    Decoder,
    cache_batch_axis,
    init_kv_cache,
    stack_blocks,
    unstack_blocks,
)
from jaxllm.models.gpt2 import GPT2
from jaxllm.models.transformer_lm import TransformerLM

ARCHITECTURES: dict[str, type[Decoder]] = {"gpt2": GPT2, "transformer_lm": TransformerLM}

__all__ = [
    "ARCHITECTURES", "GPT2", "Decoder", "TransformerLM", "build_model", "cache_batch_axis",
    "init_kv_cache", "stack_blocks", "unstack_blocks",
]  # fmt: skip


def build_model(cfg: ModelConfig, execution: ExecutionConfig | None = None) -> Decoder:
    """The Decoder of architecture `cfg.arch`, computed as `execution` says (default: float32,
    XLA ops)."""
    return ARCHITECTURES[cfg.arch](cfg, execution or ExecutionConfig())
