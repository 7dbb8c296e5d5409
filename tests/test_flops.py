from jaxllm.config import ModelConfig
from jaxllm.profiling.flops import train_flops_per_token


def test_gpt2_small_flops_per_token():
    cfg = ModelConfig()  # GPT-2 small, T = 1024
    n = 124_439_808
    expected = 6 * (n - 1024 * 768) + 12 * 12 * 768 * 1024
    assert train_flops_per_token(cfg, n) == expected
    # ~0.85 GFLOP per token: 6 * 123.65M + 113.2M
    assert 0.85e9 < expected < 0.86e9
