"""jaxllm: a small, readable JAX/Pallas stack for small language models."""
