"""Analytic training FLOPs of the language models (for MFU)."""

from __future__ import annotations

from jaxllm.config import ModelConfig


def train_flops_per_token(cfg: ModelConfig, n_params: int) -> float:
    """Forward + backward FLOPs per token: 6 * N + 12 * L * d * T (PaLM, appendix B).

    N counts the parameters that take part in matmuls: all of them minus GPT-2's position
    table (a lookup); a tied head is counted once, like the table it shares. The second term is
    the attention score and value products (QK^T and PV), which have no parameters.
    """
    n_matmul = n_params - (cfg.context_length * cfg.d_model if cfg.arch == "gpt2" else 0)
    return 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * cfg.context_length
