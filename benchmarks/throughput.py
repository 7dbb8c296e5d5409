"""GPT-2 small training throughput (tokens/s, MFU) on one GPU: python benchmarks/throughput.py

Times the jitted train_step (forward, backward, AdamW) on random tokens for each variant,
after warm-up, as the median over repeats of N back-to-back steps closed by a device sync.
MFU counts 6 * N_matmul_params + 12 * L * d * T FLOPs per token (forward + backward; PaLM's
appendix B formula; N excludes the position table, includes the tied LM head) against the
H100 SXM dense bf16 peak of 989 TFLOP/s.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import load_config
from jaxllm.models import build_model
from jaxllm.profiling.flops import train_flops_per_token
from jaxllm.train.optim import make_optimizer
from jaxllm.train.state import create_state, train_step

PEAK_BF16 = 989e12


def bench(cfg, batch: int, steps: int, repeats: int) -> dict:
    model = build_model(cfg.model)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (batch, cfg.model.context_length + 1))
    data = {
        "inputs": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
    }
    state = create_state(
        model, make_optimizer(cfg.optim, 10_000), jax.random.PRNGKey(0), data["inputs"]
    )
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    key = jax.random.PRNGKey(1)
    for _ in range(3):  # compile + warm-up
        state, m = train_step(state, data, key)
    jax.block_until_ready(m)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = train_step(state, data, key)
        jax.block_until_ready(m)
        times.append((time.perf_counter() - t0) / steps)
    step_s = statistics.median(times)
    tps = batch * cfg.model.context_length / step_s
    return {
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tps,
        "mfu": tps * train_flops_per_token(cfg.model, n_params) / PEAK_BF16,
        "loss": float(m["loss"]),
        "spread_ms": 1e3 * (max(times) - min(times)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt2_124m.yaml")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64, 96])
    p.add_argument("--attention", nargs="+", default=["dot_product_attention"])
    p.add_argument("--kernels", nargs="+", default=["pallas"], help="model.kernels")
    p.add_argument("--loss", nargs="+", default=["pallas"], help="model.loss_impl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    variants = itertools.product(args.batch, args.attention, args.kernels, args.loss)
    for b, attn, kern, loss in variants:
        cfg = load_config(
            args.config,
            [
                f"--train.batch_size={b}",
                f"--model.attention_impl={attn}",
                f"--model.kernels={kern}",
                f"--model.loss_impl={loss}",
            ],
        )
        try:
            r = bench(cfg, b, args.steps, args.repeats)
        except Exception as e:  # report OOM etc. in the table, keep going
            print(f"batch {b} {attn} {kern} {loss}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append((b, attn, kern, loss, r))
        print(f"batch {b} {attn} {kern} {loss}: {r}", flush=True)
    print("\n| batch | attention | kernels | loss | step ms | tokens/s | MFU | spread ms |")
    print("|---|---|---|---|---|---|---|---|")
    for b, attn, kern, loss, r in rows:
        print(
            f"| {b} | {attn} | {kern} | {loss} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {r['spread_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
