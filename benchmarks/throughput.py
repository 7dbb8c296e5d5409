"""GPT-2 small training throughput (tokens/s, MFU) on one GPU: python benchmarks/throughput.py

Times the jitted train_step (forward, backward, AdamW) on random tokens for each variant,
after warm-up, as the median over repeats of N back-to-back steps closed by a device sync.
MFU counts 6 * N_matmul_params + 12 * L * d * T FLOPs per token (forward + backward; PaLM's
appendix B formula; N excludes the position table, includes the tied LM head) against the
H100 SXM dense bf16 peak of 989 TFLOP/s.
"""

from __future__ import annotations

from jaxllm.xla_flags import apply_default_xla_flags

apply_default_xla_flags()  # before jax is imported: XLA reads its flags then

import argparse
import itertools

import jax

from jaxllm.config import Config, ConfigError, load_config
from jaxllm.models import build_model
from jaxllm.profiling.flops import train_flops_per_token
from jaxllm.profiling.harness import make_state, random_batch, time_calls
from jaxllm.train.state import train_step

PEAK_BF16 = 989e12


def bench(cfg: Config, batch: int, steps: int, repeats: int) -> dict:
    data = random_batch(cfg, batch)
    state = make_state(cfg, data)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    key = jax.random.PRNGKey(1)
    holder = {"state": state}

    def step():
        holder["state"], metrics = train_step(holder["state"], data, key)
        return metrics

    timing = time_calls(step, group=steps, samples=repeats)
    tps = batch * cfg.model.context_length / timing.median_s
    return {
        "step_ms": 1e3 * timing.median_s,
        "tokens_per_s": tps,
        "mfu": tps * train_flops_per_token(cfg.model, n_params) / PEAK_BF16,
        "loss": float(step()["loss"]),
        "spread_ms": 1e3 * timing.spread_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/gpt2_124m.yaml")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64, 96])
    p.add_argument("--attention", nargs="+", default=["dot_product_attention"])
    p.add_argument("--kernels", nargs="+", default=["pallas"], help="execution.kernels")
    p.add_argument("--loss", nargs="+", default=["pallas"], help="execution.loss_impl")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if min(args.steps, args.repeats, *args.batch) < 1:
        p.error("--steps, --repeats and every --batch must be >= 1")
    rows = []
    variants = itertools.product(args.batch, args.attention, args.kernels, args.loss)
    configs = []
    for b, attn, kern, loss in variants:  # every variant checked before anything is timed
        overrides = [f"--train.batch_size={b}", f"--execution.attention_impl={attn}",
                     f"--execution.kernels={kern}", f"--execution.loss_impl={loss}"]  # fmt: skip
        try:
            configs.append(((b, attn, kern, loss), load_config(args.config, overrides)))
        except ConfigError as e:
            p.error(str(e))
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for (b, attn, kern, loss), cfg in configs:
        plan = build_model(cfg.model, cfg.execution).plan
        print(f"batch {b} {attn} {kern} {loss}: {plan.describe()}")
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
